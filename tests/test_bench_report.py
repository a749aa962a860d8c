"""What ``leapfx bench`` leaves for a reader: bars kept apart from the report, and
``--markdown``, the results page written from the run instead of copied by hand."""

from __future__ import annotations

import contextlib
import io
import re

import pytest

from leapfx.bench.report import MARKDOWN_BEGIN, markdown_block, write_markdown
from leapfx.cli import main
from leapfx.train.data import byte_tokenizer
from tests.conftest import tiny_model

TINY_RUN = [
    "bench", "--recipe", "layerskip", "--prompts", "1", "--prompt-tokens", "8",
    "--max-new-tokens", "8",
    "--repeats", "1", "--warmup", "0", "--exit-layer", "2", "--num-speculations", "2",
    "--cpu-kernels", "off",
]  # fmt: skip
ROWS = ("hf_greedy", "leapfx_autoregressive", "leapfx_layerskip")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    tok = byte_tokenizer()
    tiny_model("llama", layers=4, vocab=len(tok), eos=tok.eos_token_id).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.split()[:1] and line.split()[0] in ROWS]


def test_no_bars_when_stderr_is_not_a_terminal(checkpoint, capsys):
    assert main([*TINY_RUN, "--model", str(checkpoint)]) == 0
    out, err = capsys.readouterr()
    assert "bench:" not in err and "\r" not in err and "\r" not in out
    assert len(_table_lines(out)) >= 3


def test_forced_bars_end_before_the_report_in_one_file(checkpoint):
    # `leapfx bench --progress > log 2>&1`: stdout and stderr are one file. The bars (stderr) come
    # first and the report (stdout) after them, every row on a line of its own.
    log = io.StringIO()
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        assert main([*TINY_RUN, "--model", str(checkpoint), "--progress"]) == 0
    text = log.getvalue()
    assert "bench:" in text  # the bar ran, on stderr
    report = text[text.rindex("bench:") :].split("\n", 1)[1]
    assert "\r" not in report
    rows = _table_lines(report)
    assert [r.split()[0] for r in rows] == [
        "hf_greedy", "leapfx_autoregressive", "leapfx_layerskip"
    ]  # fmt: skip
    assert all("x " in r for r in rows)  # tok/s and speedup columns intact on each line


def test_markdown_report_is_written_between_the_markers(checkpoint, tmp_path, capsys):
    page = tmp_path / "page.md"
    page.write_text(
        "# Results\n\nintro\n\n<!-- bench:begin -->\nan old table\n<!-- bench:end -->\n\nafter\n"
    )
    new = tmp_path / "results.md"
    argv = [*TINY_RUN, "--model", str(checkpoint), "--markdown", str(page), "--markdown", str(new)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    text = page.read_text()
    assert text.startswith("# Results\n\nintro\n\n<!-- bench:begin -->\nMeasured ")
    assert text.endswith("<!-- bench:end -->\n\nafter\n") and "an old table" not in text
    block = new.read_text()
    assert (
        block.strip()
        == text[text.index("<!-- bench:begin -->") : text.index("\n\nafter\n")].strip()
    )
    header = block.splitlines()[1]
    assert re.search(r"Measured \d{4}-\d\d-\d\d \d\d:\d\d UTC on .*cores", header), header
    assert all(f"{lib} " in header for lib in ("torch", "transformers", "onnxruntime"))
    command = "leapfx bench --recipe layerskip --prompts 1 "
    assert command in block and f"--markdown {new}" in block
    # The report in the page is what the bench printed, line for line.
    report = block.split("```text\n", 1)[1].split("\n```", 1)[0]
    assert report == printed.rstrip("\n")
    assert len(_table_lines(report)) >= 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["page.md", "results.md"]  # no temps


def test_markdown_target_without_markers_is_refused_before_running(checkpoint, tmp_path, capsys):
    page = tmp_path / "notes.md"
    page.write_text("# my notes\n")
    argv = [*TINY_RUN, "--model", str(checkpoint), "--markdown", str(page)]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert "--markdown:" in err and "<!-- bench:begin -->" in err and err.count("\n") == 1
    assert out == "" and page.read_text() == "# my notes\n"
    assert main([*argv[:-1], str(tmp_path / "nope" / "r.md")]) == 2
    assert "--markdown: the directory of" in capsys.readouterr().err


def test_markdown_block_fences_and_replaces_again(tmp_path):
    page = tmp_path / "p.md"
    write_markdown(page, markdown_block("a ``` b\n", command="leapfx bench"))
    first = page.read_text()
    assert "````text\na ``` b\n````" in first  # a fence longer than any backtick run inside
    write_markdown(page, markdown_block("second\n", command="leapfx bench --prompts 2"))
    second = page.read_text()
    assert second.count(MARKDOWN_BEGIN) == 1 and "second" in second and "a ``` b" not in second
