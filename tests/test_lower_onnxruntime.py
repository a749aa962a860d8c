"""lower(sm, "onnxruntime", export_dir=...): the stages exported and loaded in one call, the
same OnnxModel as exporting and opening the export by hand."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from leapfx import rewrite  # noqa: E402
from leapfx.export import OnnxModel  # noqa: E402
from leapfx.lower import lower  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402


def test_lower_onnxruntime_exports_and_loads(tmp_path):
    model = tiny_model("llama", layers=2)
    sm = rewrite.apply(model, "autoregressive")
    with pytest.raises(ValueError, match="mode: backend 'onnxruntime' does not take it"):
        lower(sm, "onnxruntime", export_dir=tmp_path / "x", mode="max-autotune")
    with pytest.raises(ValueError, match="export_dir: backend 'onnxruntime' exports"):
        lower(sm, "onnxruntime")
    assert not (tmp_path / "x").exists()  # refused before exporting anything
    om = lower(sm, "onnxruntime", export_dir=tmp_path / "ar", threads=1, overwrite=True)
    assert isinstance(om, OnnxModel) and om.threads == 1 and om.recipe == "autoregressive"
    assert (tmp_path / "ar" / "manifest.json").is_file()
    prompt = torch.randint(
        0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(0)
    )
    by_hand = OnnxModel(tmp_path / "ar", threads=1)
    assert torch.equal(
        om.generate(prompt, max_new_tokens=8), by_hand.generate(prompt, max_new_tokens=8)
    )
