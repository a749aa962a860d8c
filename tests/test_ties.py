"""leapfx.bench.ties: where two greedy outputs part, and whether a float tie explains it."""

from __future__ import annotations

import pytest
import torch

from leapfx.bench.harness import Row
from leapfx.bench.report import identical
from leapfx.bench.ties import first_difference, tie_tolerance
from tests.conftest import tiny_model
from tests.greedy_check import hf_greedy


def test_tolerance_per_dtype():
    assert tie_tolerance(torch.float32) == tie_tolerance(torch.float64) == 1e-4
    assert tie_tolerance(torch.bfloat16) == 4 * 2.0**-7
    assert tie_tolerance(torch.float16) == 4 * 2.0**-10


def test_exact_tie_is_a_near_tie_and_a_clear_winner_is_not():
    model = tiny_model("llama", layers=2, seed=3)
    prompt = torch.tensor([[5, 17, 42, 9]])
    ref = hf_greedy(model, prompt, 6)
    t = prompt.shape[1] + 2
    with torch.no_grad():
        logits = model(ref[:, :t]).logits[0, -1]
    a = int(logits.argmax())
    b = int(logits.argsort()[0])  # the least likely token
    # Give token b the head row of a: at position t the two logits tie exactly.
    with torch.no_grad():
        model.lm_head.weight[b] = model.lm_head.weight[a]
    ours = ref.clone()
    ours[0, t] = b
    diff = first_difference(model, ours, ref, prompt.shape[1])
    assert diff["new_token"] == 2 and (diff["ours"], diff["reference"]) == (b, a)
    assert diff["logit_gap"] == 0.0 and diff["near_tie"] is True

    c = int(logits.argsort()[1])  # a different, clearly worse candidate
    ours[0, t] = c
    diff = first_difference(model, ours, ref, prompt.shape[1])
    assert diff["near_tie"] is False and diff["logit_gap"] > diff["tolerance"]
    assert first_difference(model, ref, ref, prompt.shape[1]) is None


def test_length_difference_is_never_a_tie():
    model = tiny_model("llama", layers=2)
    ref = hf_greedy(model, torch.tensor([[3, 4, 5]]), 5)
    diff = first_difference(model, ref[:, :-2], ref, 3)
    assert diff["new_token"] == 3 and diff["near_tie"] is False and diff["ours"] is None


def test_prompt_difference_is_refused():
    model = tiny_model("llama", layers=2)
    ref = hf_greedy(model, torch.tensor([[3, 4, 5]]), 2)
    ours = ref.clone()
    ours[0, 0] = 7
    with pytest.raises(ValueError, match="differ inside the prompt"):
        first_difference(model, ours, ref, 3)


def test_identical_cell():
    row = Row("x", 1.0, identical_prompts=2, prompts=2)
    assert identical(row) == "2/2"
    row = Row(
        "x",
        1.0,
        identical_prompts=1,
        prompts=4,
        differences=[{"near_tie": True}, {"near_tie": True}, {"near_tie": False}],
    )
    assert identical(row) == "1/4 (2 near-tie flips, 1 NOT a tie)"
    row.differences = [{"near_tie": True}]
    assert identical(row) == "1/4 (1 near-tie flip)"
