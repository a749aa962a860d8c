"""Teacher forcing and the early-exit metrics: avg_layers, exit_histogram, agreement."""

from __future__ import annotations

import pytest
import torch

from leapfx import rewrite
from leapfx.bench.agreement import teacher_forced_agreement
from leapfx.runtime.metrics import DecodeMetrics
from leapfx.train.layerskip import exit_logits, run_decoder
from tests.conftest import tiny_model

PROMPT = torch.tensor([[3, 9, 4, 1, 7]])


def _greedy(model, n=12):
    with torch.inference_mode():
        return model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=n,
                              do_sample=False)  # fmt: skip


def test_metrics_layers_and_agreement():
    m = DecodeMetrics(schedule="x")
    assert m.avg_layers is None and m.agreement is None and m.exit_histogram == {}
    m.record_layers(2, tokens=3)
    m.record_layers(4)
    for agreed in (True, False, True, True):
        m.record_agreement(agreed)
    assert m.avg_layers == 2.5 and m.exit_histogram == {2: 3, 4: 1}
    assert m.agreement == 0.75
    d = m.as_dict()
    assert d["avg_layers"] == 2.5 and d["agreement"] == 0.75 and d["exit_histogram"] == {
        "2": 3, "4": 1}  # fmt: skip


def test_teacher_forcing_emits_the_teacher_and_counts_by_hand():
    model = tiny_model("llama", layers=4, seed=5)
    ref = _greedy(model)
    teacher = ref[0, PROMPT.shape[1] :]
    ee = rewrite.apply(model, "early_exit", exit_layer=1)
    out = ee.generate(PROMPT, teacher_tokens=teacher)
    assert torch.equal(out, ref)  # the teacher's tokens are emitted
    m = ee.last_metrics
    assert m.teacher_positions == teacher.numel() and m.avg_layers == 1.0
    # By hand: the exit head's argmax after one layer over the teacher-forced sequence.
    with torch.inference_mode():
        hidden = run_decoder(model, ref[:, :-1])  # hidden[i]: after layers 0..i
        own = exit_logits(model, hidden[0])[0, PROMPT.shape[1] - 1 :].argmax(-1)
    assert m.teacher_agreed == int((own == teacher).sum())
    result = teacher_forced_agreement(ee, [PROMPT], [ref])
    assert result.agreement == m.agreement and result.avg_layers == 1.0


def test_autoregressive_records_full_depth_and_no_agreement():
    model = tiny_model("llama", layers=4, seed=6)
    ref = _greedy(model)
    ee = rewrite.apply(model, "early_exit", exit_layer=3)
    ar = rewrite.apply(model, "autoregressive")
    ar.generate(PROMPT, max_new_tokens=12)
    assert ar.last_metrics.avg_layers == 4.0 and ar.last_metrics.agreement is None
    result = teacher_forced_agreement(ee, [PROMPT], [ref])
    assert 0.0 <= result.agreement <= 1.0 and result.positions == 12


def test_teacher_forcing_errors():
    model = tiny_model("llama", layers=4, seed=5)
    ee = rewrite.apply(model, "early_exit", exit_layer=1)
    with pytest.raises(ValueError, match="teacher_tokens: recipe 'layerskip' is lossless"):
        rewrite.apply(model, "layerskip").generate(PROMPT, teacher_tokens=[1, 2])
    with pytest.raises(ValueError, match=r"max_new_tokens: 5 is more than the 2 teacher_tokens"):
        ee.generate(PROMPT, teacher_tokens=[1, 2], max_new_tokens=5)
    with pytest.raises(ValueError, match=r"teacher_tokens: dtype torch.float32"):
        ee.generate(PROMPT, teacher_tokens=torch.ones(3))
    with pytest.raises(ValueError, match=r"teacher_tokens: shape \(2, 2\)"):
        ee.generate(PROMPT, teacher_tokens=torch.ones(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="allowed only with do_sample=False"):
        ee.generate(PROMPT, teacher_tokens=[1, 2], do_sample=True)
    with pytest.raises(ValueError, match="greedy_outputs: 0 outputs for 1 prompts"):
        teacher_forced_agreement(ee, [PROMPT], [])
