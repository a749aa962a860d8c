"""What ``leapfx bench`` leaves for a reader: progress bars kept apart from the report."""

from __future__ import annotations

import contextlib
import io

import pytest

from leapfx.cli import main
from leapfx.train.data import byte_tokenizer
from tests.conftest import tiny_model

TINY_RUN = [
    "bench", "--prompts", "1", "--prompt-tokens", "8", "--max-new-tokens", "8",
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
