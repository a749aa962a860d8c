"""``export_onnx(..., format="genai")``: the standard decoder folder, decoded by onnxruntime-genai
and optimum's ``ORTModelForCausalLM`` token-identical to HF greedy.

onnxruntime-genai is the ``genai`` extra (skipped without it). optimum-onnx pins
transformers < 4.58, which leapfx cannot run beside, so it is tested through another
interpreter: ``LEAPFX_OPTIMUM_PYTHON`` names one with ``optimum.onnxruntime`` (.ci/run builds
it); without it that test skips.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from leapfx import rewrite  # noqa: E402
from leapfx.cli import main  # noqa: E402
from leapfx.export import OnnxModel  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402
from tests.greedy_check import assert_greedy_equal, hf_greedy  # noqa: E402

EOS = 66
PROMPTS = [[5, 9, 2, 7, 100, 3], [1], [42, 42, 42, 42, 17, 8, 150, 3, 3, 9, 11]]


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    """A tiny random Llama (head size 16, grouped heads, an EOS) and its genai export."""
    model = tiny_model("llama", layers=2, head_dim=16, vocab=200, seed=3, eos=EOS)
    sm = rewrite.apply(model, "autoregressive")
    path = sm.export_onnx(tmp_path_factory.mktemp("genai") / "llama", format="genai")
    return model, path


def genai_greedy(path: Path, prompt: list[int], new: int, **speculative) -> list[int]:
    og = pytest.importorskip("onnxruntime_genai")
    model = og.Model(str(path))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + new)
    if speculative:
        params.set_speculative_options(**speculative)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array(prompt, dtype=np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    return [int(t) for t in generator.get_sequence(0)]


def assert_matches_hf(model, prompt: list[int], ours: list[int], new: int) -> None:
    """``ours`` == HF greedy, where onnxruntime-genai leaves a final EOS out of the sequence
    (HF keeps it); a divergence only at a measured float tie."""
    ref = hf_greedy(model, torch.tensor([prompt]), new)[0].tolist()
    eos = model.generation_config.eos_token_id
    if len(ours) == len(ref) - 1 and ref[-1] == eos:
        ours = [*ours, eos]
    assert_greedy_equal(model, torch.tensor([ours]), torch.tensor([ref]), len(prompt))


def test_genai_folder(tiny_export):
    model, path = tiny_export
    files = {p.name for p in path.iterdir()}
    assert {"model.onnx", "weights.bin", "genai_config.json", "config.json"} <= files
    assert {"generation_config.json", "manifest.json"} <= files
    config = json.loads((path / "genai_config.json").read_text())
    decoder = config["model"]["decoder"]
    graph = onnx.load(str(path / "model.onnx"), load_external_data=False).graph
    inputs = [i.name for i in graph.input]
    outputs = [o.name for o in graph.output]
    assert inputs[:3] == ["input_ids", "attention_mask", "position_ids"]
    assert inputs[3:5] == ["past_key_values.0.key", "past_key_values.0.value"]
    assert outputs[:3] == ["logits", "present.0.key", "present.0.value"]
    assert len(inputs) == 3 + 2 * model.config.num_hidden_layers
    assert decoder["inputs"]["past_key_names"] % 1 in inputs
    assert decoder["outputs"]["present_value_names"] % 1 in outputs
    assert decoder["head_size"] == 16 and decoder["num_key_value_heads"] == 2
    assert config["model"]["eos_token_id"] == EOS
    assert config["search"]["past_present_share_buffer"] is False
    dims = [d.dim_param for d in graph.input[1].type.tensor_type.shape.dim]
    assert dims == ["batch_size", "total_sequence_length"]
    present = [d.dim_param or d.dim_value for d in graph.output[1].type.tensor_type.shape.dim]
    assert present == ["batch_size", 2, "total_sequence_length", 16]
    with pytest.raises(ValueError, match="standard decoder export"):
        OnnxModel(path)


def test_left_padded_batch_matches_hf(tiny_export):
    """The graph's masks follow ``attention_mask``: a left-padded batch prefills and steps to
    the logits HF gives each row alone (plain onnxruntime, past and new concatenated)."""
    model, path = tiny_export
    session = ort.InferenceSession(str(path / "model.onnx"), providers=["CPUExecutionProvider"])
    rows = [[7, 8, 9, 10, 11], [3, 4]]
    width = max(map(len, rows))
    ids = np.array([[0] * (width - len(r)) + r for r in rows], dtype=np.int64)
    mask = np.array([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=np.int64)
    positions = np.clip(mask.cumsum(-1) - 1, 0, None)
    layers, heads, dim = model.config.num_hidden_layers, 2, 16
    feed = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
    for i in range(layers):
        for kind in ("key", "value"):
            feed[f"past_key_values.{i}.{kind}"] = np.zeros((2, heads, 0, dim), np.float32)
    names = [o.name for o in session.get_outputs()]
    out = dict(zip(names, session.run(None, feed), strict=True))
    step = np.array([[5], [6]], dtype=np.int64)
    feed = {
        "input_ids": step,
        "attention_mask": np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1),
        "position_ids": positions[:, -1:] + 1,
        **{n.replace("present.", "past_key_values."): v for n, v in out.items() if n != "logits"},
    }
    logits = session.run(["logits"], feed)[0]
    for b, row in enumerate(rows):
        with torch.no_grad():
            ref = model(torch.tensor([[*row, int(step[b, 0])]])).logits[0]
        assert np.abs(out["logits"][b, -1] - ref[-2].numpy()).max() < 1e-4
        assert np.abs(logits[b, -1] - ref[-1].numpy()).max() < 1e-4


def test_onnxruntime_genai_matches_hf_greedy(tiny_export):
    model, path = tiny_export
    for prompt in PROMPTS:
        assert_matches_hf(model, prompt, genai_greedy(path, prompt, 24), 24)


def test_onnxruntime_genai_ngram_speculation_matches_hf_greedy(tiny_export):
    """onnxruntime-genai's own n-gram drafting (prompt lookup, verified by the decoder over
    every drafted token) on the export: the same tokens."""
    model, path = tiny_export
    for prompt in [[5, 9, 2, 7, 5, 9, 2, 7, 5], *PROMPTS]:
        ours = genai_greedy(path, prompt, 24, ngram_size=2, max_draft_tokens=4)
        assert_matches_hf(model, prompt, ours, 24)


def test_optimum_matches_hf_greedy(tiny_export):
    """optimum's ``ORTModelForCausalLM.from_pretrained(dir).generate``, in its own interpreter."""
    model, path = tiny_export
    python = os.environ.get("LEAPFX_OPTIMUM_PYTHON")
    if not python:
        try:
            import optimum.onnxruntime  # noqa: F401
        except ImportError:
            pytest.skip("optimum.onnxruntime: set LEAPFX_OPTIMUM_PYTHON (see .ci/run)")
        python = sys.executable
    script = Path(__file__).with_name("optimum_generate.py")
    result = subprocess.run(
        [python, str(script), str(path), json.dumps(PROMPTS), "24"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    outputs = json.loads(result.stdout.strip().splitlines()[-1])
    for prompt, ours in zip(PROMPTS, outputs, strict=True):
        assert_matches_hf(model, prompt, ours, 24)


def test_reference_model_text_in_text_out(tmp_path, capsys):
    """``leapfx export --format genai`` on the shipped model: onnxruntime-genai's tokenizer
    reads the exported files and its greedy decode is HF's. (Its ``encode`` does not run the
    tokenizer.json post-processor that prepends HF's BOS: the prompt gets it here.)"""
    og = pytest.importorskip("onnxruntime_genai")
    from leapfx.models import load_model

    out = tmp_path / "reference-genai"
    assert main(["export", "--format", "genai", "--out", str(out)]) == 0
    assert "genai_config.json" in capsys.readouterr().out
    assert (out / "tokenizer.json").is_file()
    model, tokenizer = load_model(None)
    text = "def fibonacci(n):\n    "
    og_tokenizer = og.Tokenizer(og.Model(str(out)))
    ids = [int(t) for t in og_tokenizer.encode(text)]
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    prompt = [model.config.bos_token_id, *ids]
    tokens = genai_greedy(out, prompt, 40)
    assert_matches_hf(model, prompt, tokens, 40)
    assert og_tokenizer.decode(np.array(tokens[1:], dtype=np.int32)) == tokenizer.decode(tokens[1:])


def test_chat_template_travels(tmp_path):
    """The tokenizer's chat template reaches onnxruntime-genai's ``apply_chat_template``."""
    og = pytest.importorskip("onnxruntime_genai")
    from transformers import AutoTokenizer

    from leapfx.models import REFERENCE_MODEL

    tokenizer = AutoTokenizer.from_pretrained(str(REFERENCE_MODEL))
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    model = tiny_model("llama", layers=1, head_dim=16, vocab=259, eos=257)
    path = rewrite.apply(model, "autoregressive").export_onnx(
        tmp_path / "chat", format="genai", tokenizer=tokenizer
    )
    messages = [{"role": "user", "content": "Say hi."}]
    ours = og.Tokenizer(og.Model(str(path))).apply_chat_template(
        json.dumps(messages), add_generation_prompt=True
    )
    assert ours == tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_genai_refusals(tmp_path):
    model = tiny_model("llama", layers=2)
    with pytest.raises(ValueError, match="format: 'onnx' is invalid; allowed: 'leapfx', 'genai'"):
        rewrite.apply(model, "autoregressive").export_onnx(tmp_path / "a", format="onnx")
    with pytest.raises(ValueError, match="has no 'full' stage"):
        rewrite.apply(model, "early_exit", exit_layer=1).export_onnx(tmp_path / "b", format="genai")
    with pytest.raises(ValueError, match="tokenizer: 'x' holds no tokenizer.json"):
        rewrite.apply(model, "autoregressive").export_onnx(
            tmp_path / "c", format="genai", tokenizer="x"
        )
    assert not any(tmp_path.iterdir())
