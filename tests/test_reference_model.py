"""The shipped reference model and adapter load and decode losslessly (no training, no bench)."""

from __future__ import annotations

import json

import pytest

from leapfx import rewrite
from leapfx.bench import REFERENCE_ADAPTER, bench_prompts
from leapfx.models import REFERENCE_MODEL, load_model
from tests.greedy_check import assert_greedy_equal, hf_greedy


@pytest.fixture(scope="module")
def reference():
    return load_model(None)


def test_reference_checkpoint_is_small_and_reported():
    size = sum(p.stat().st_size for p in REFERENCE_MODEL.rglob("*") if p.is_file())
    assert size <= 25 * 2**20
    report = json.loads((REFERENCE_MODEL / "reference_report.json").read_text())
    assert report["model"]["num_layers"] == 16 and report["model"]["dtype"] == "float16"


@pytest.mark.parametrize(
    ("recipe", "options"),
    [
        ("layerskip", {"exit_layer": 3, "num_speculations": 4}),
        ("kangaroo", {"adapter": str(REFERENCE_ADAPTER)}),
    ],
)
def test_reference_decodes_like_hf_greedy(reference, recipe, options):
    model, tokenizer = reference
    prompt = bench_prompts(tokenizer, count=1, num_tokens=32)[0]
    sm = rewrite.apply(model, recipe, **options)
    ours = sm.generate(prompt, max_new_tokens=48)
    assert_greedy_equal(model, ours, hf_greedy(model, prompt, 48), prompt.shape[1])
    assert sm.last_metrics.accepted_drafts > 0  # a trained model's drafts do get accepted
