"""onnxruntime-genai's rows in ``leapfx bench --backend onnxruntime``: decoded by its own
Generator from leapfx's standard decoder export, identical to HF greedy, skipped (with the
install command) without the package, and absent on the other backends."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from leapfx.bench import genai
from leapfx.bench.harness import BenchConfig
from leapfx.bench.systems import genai_systems
from tests.conftest import tiny_model

pytest.importorskip("onnxruntime", reason="needs the onnx extra")


def test_genai_rows_decode_identical_to_hf_greedy_on_the_bench_threads(tmp_path):
    pytest.importorskip("onnxruntime_genai", reason="needs the genai extra")
    model = tiny_model("llama", layers=2, vocab=100, eos=7, seed=3)
    config = BenchConfig(recipe="lookup", backend="onnxruntime", max_new_tokens=12, repeats=1)
    systems = genai_systems(model, config, str(tmp_path))
    assert [s.name for s in systems] == ["onnxruntime_genai", "onnxruntime_genai_ngram"]
    # [5, 6] ends at EOS (7), which genai leaves out of its sequence and the row puts back
    for prompt in (torch.tensor([[1, 2, 3, 4, 1, 2, 3]]), torch.tensor([[5, 6]])):
        hf = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                            do_sample=False)  # fmt: skip
        for system in systems:
            assert system.generate(prompt).tolist() == hf.tolist(), system.name
    session = json.loads((tmp_path / "onnxruntime_genai" / "genai_config.json").read_text())
    options = session["model"]["decoder"]["session_options"]
    assert options["intra_op_num_threads"] == torch.get_num_threads()


def test_genai_rows_skipped_without_the_package_and_off_other_backends(
    tmp_path, monkeypatch, caplog
):
    model = tiny_model("llama", layers=2, vocab=100)
    eager = BenchConfig(recipe="lookup", max_new_tokens=3, repeats=1)
    assert genai_systems(model, eager, str(tmp_path)) == []
    monkeypatch.setattr(genai, "available", lambda: False)
    config = BenchConfig(recipe="lookup", backend="onnxruntime", max_new_tokens=3, repeats=1)
    with caplog.at_level(logging.WARNING):
        assert genai_systems(model, config, str(tmp_path)) == []
    assert ".[genai]" in caplog.text and not any(tmp_path.iterdir())
