"""``leapfx.deploy.Decoder``: every exportable recipe decoded with onnxruntime, numpy and
tokenizers in a process where ``import torch`` (and transformers) fails.

Each recipe's export is written here (with torch), then one subprocess whose import system
refuses torch decodes them all; its tokens are compared with HF greedy (lossless recipes; a
divergence only at a measured float tie) or the eager stages (``early_exit``).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
pytest.importorskip("tokenizers")

from leapfx import rewrite  # noqa: E402
from leapfx.models import REFERENCE_MODEL  # noqa: E402
from tests.conftest import randomize_accelerator, tiny_model  # noqa: E402
from tests.greedy_check import assert_greedy_equal, hf_greedy  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NEW = 20
# (name, recipe, options): every recipe that exports, and a standard decoder folder
EXPORTS = [
    ("autoregressive", "autoregressive", {}),
    ("early_exit", "early_exit", {"exit_layer": 1}),
    ("layerskip", "layerskip", {"exit_layer": 1, "num_speculations": 3}),  # a draft_chain
    ("layerskip_dynamic", "layerskip", {"exit_layer": 1, "confidence_threshold": 0.3}),
    ("layerskip_lookup", "layerskip", {"exit_layer": 1, "num_speculations": 3, "lookup": True}),
    ("kangaroo", "kangaroo", {"exit_layer": 1, "max_draft_tokens": 4}),
    ("swift", "swift", {"skip_layers": (1,), "num_speculations": 3}),  # a fixed skip set
    ("eagle", "eagle", {"parts": None, "max_draft_tokens": 3}),  # its head and target stages
    # the fast stream (a randomised accelerator), its scratch passed from draft to draft, and
    # with fast_keys the slow slots a round's first draft chose
    ("m2r2", "m2r2", {"parts": None, "fast_layers": 1, "confidence_threshold": 0.02}),
    (
        "m2r2_topk",
        "m2r2",
        {"parts": None, "fast_layers": 1, "confidence_threshold": 0.02, "fast_keys": 2},
    ),
    ("lookup", "lookup", {}),
    ("auto", "auto", {}),
]
PROMPTS = [[5, 9, 2, 7, 5, 9, 2, 7, 5], [200, 3, 3, 3, 3, 3], [42]]
# m2r2's accelerator parameters at this scale: drafts whose stops a scratch that never grows
# would move (checked: one prompt's draft calls 34 -> 36)
M2R2_SCALE = 0.5

# Runs in the subprocess: torch and transformers cannot be imported there.
BLOCKED = """
import importlib.abc, json, sys

class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError(f"{name} is blocked: a deployment has no torch")

sys.meta_path.insert(0, Blocked())
try:
    import torch  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("torch imported")
from leapfx.deploy import Decoder

jobs, prompts, new = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
out = {}
for name, path, recipe in jobs:
    model = Decoder(path, threads=1, recipe=recipe)
    out[name] = []
    for p in prompts:
        out[name].append(model.generate(p, new))
        out.setdefault(name + ":each", []).append(model.last_stats)
    if name in ("layerskip", "eagle"):
        out[name + ":stats"] = model.last_stats
    if model.tokenizer is not None:
        out[name + ":text"] = model.generate_text("def f(x):", new)
assert "torch" not in sys.modules and "transformers" not in sys.modules
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def decoded(tmp_path_factory):
    """The tiny model, and what the torch-free subprocess decoded from each export.

    The recipes share stages (autoregressive, lookup and auto one ``full`` stage, layerskip's
    three settings all three): the suite's memo exports each distinct stage once
    (tests/onnx_memo.py, installed by conftest.py).
    """
    root = tmp_path_factory.mktemp("deploy")
    model = tiny_model("llama", layers=2, head_dim=16, vocab=259, seed=5, eos=257)
    tokenizer = str(REFERENCE_MODEL)  # a folder with tokenizer.json (vocab 259)
    jobs = []
    for name, recipe, options in EXPORTS:
        sm = rewrite.apply(model, recipe, **options)
        if recipe == "m2r2":
            randomize_accelerator(sm, scale=M2R2_SCALE)
        extra = {"tokenizer": tokenizer} if name == "autoregressive" else {}
        jobs.append((name, str(sm.export_onnx(root / name, **extra)), None))
    # the baselines on another recipe's export, and a standard decoder folder
    jobs.append(("ar_on_layerskip", jobs[2][1], "autoregressive"))
    genai = rewrite.apply(model, "autoregressive").export_onnx(
        root / "genai", format="genai", tokenizer=tokenizer
    )
    jobs.append(("genai", str(genai), None))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, "-c", BLOCKED, json.dumps(jobs), json.dumps(PROMPTS), str(NEW)],
        capture_output=True, text=True, timeout=600, env=env, cwd=str(ROOT),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return model, json.loads(result.stdout.strip().splitlines()[-1])


def truncated(model, layers: int):
    """The HF model cut after ``layers`` layers: the early-exit reference."""
    short = copy.deepcopy(model)
    short.model.layers = short.model.layers[:layers]
    short.config.num_hidden_layers = layers
    return short


@pytest.mark.parametrize(
    "name", [n for n, _, _ in EXPORTS if n != "early_exit"] + ["ar_on_layerskip", "genai"]
)
def test_lossless_recipes_match_hf_greedy(decoded, name):
    model, out = decoded
    for prompt, new in zip(PROMPTS, out[name], strict=True):
        ref = hf_greedy(model, torch.tensor([prompt]), NEW)
        assert_greedy_equal(model, torch.tensor([prompt + new]), ref, len(prompt))


def test_early_exit_matches_the_eager_stages(decoded):
    model, out = decoded
    eager = rewrite.apply(model, "early_exit", exit_layer=1)
    short = truncated(model, 1)
    for prompt, new in zip(PROMPTS, out["early_exit"], strict=True):
        ref = eager.generate(torch.tensor([prompt]), max_new_tokens=NEW)
        ours = torch.tensor([prompt + new])
        if not torch.equal(ours, ref):  # a divergence only at a tie of the truncated model
            expected = hf_greedy(short, torch.tensor([prompt]), NEW)
            assert_greedy_equal(short, ours, expected, len(prompt))


def test_layerskip_drafted_and_verified(decoded):
    _, out = decoded
    stats = out["layerskip:stats"]  # the last prompt's: a layerskip round drafts with the chain
    assert stats["verify_calls"] > 0 and stats["draft_calls"] > 0
    stats = out["eagle:stats"]  # EAGLE's head drafted, target verified
    assert stats["verify_calls"] > 0 and stats["draft_calls"] > 0


@pytest.mark.parametrize("name", ["m2r2", "m2r2_topk"])
def test_m2r2_drafts_as_the_eager_recipe(decoded, name):
    # Its confidence stop ends a round after a draft whose top probability is low, so the
    # draft calls count the drafts whose probabilities (read through the scratch) are the
    # eager stage's: the same calls, prompt by prompt.
    model, out = decoded
    options = next(o for n, _, o in EXPORTS if n == name)
    sm = rewrite.apply(model, "m2r2", **options)
    randomize_accelerator(sm, scale=M2R2_SCALE)
    calls = []
    for prompt, new in zip(PROMPTS, out[name], strict=True):
        eager = sm.generate(torch.tensor([prompt]), max_new_tokens=NEW)
        assert eager[0, len(prompt) :].tolist() == new
        m = sm.last_metrics
        calls.append({"draft_calls": m.draft_calls, "verify_calls": m.verify_calls})
    ours = [{k: s[k] for k in ("draft_calls", "verify_calls")} for s in out[name + ":each"]]
    assert ours == calls
    assert len({c["draft_calls"] for c in calls}) > 1  # the stop ended rounds at different drafts


def test_text_in_text_out(decoded):
    model, out = decoded
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(REFERENCE_MODEL))
    ids = tokenizer("def f(x):")["input_ids"]
    ref = hf_greedy(model, torch.tensor([ids]), NEW)[0, len(ids) :].tolist()
    expected = tokenizer.decode(ref, skip_special_tokens=True)
    assert out["autoregressive:text"] == expected
    assert out["genai:text"] == expected


def test_refusals(tmp_path):
    from leapfx.deploy import Decoder

    model = tiny_model("llama", layers=2)
    path = rewrite.apply(model, "autoregressive").export_onnx(tmp_path / "ar")
    with pytest.raises(ValueError, match="recipe: 'layerskip' cannot run on this autoregressive"):
        Decoder(path, recipe="layerskip")
    # (m2r2_exit: its per-layer exits are not exported; m2r2 exports and runs here)
    with pytest.raises(ValueError, match="recipe: 'm2r2_exit' has no torch-free schedule"):
        Decoder(path, recipe="m2r2_exit")
    with pytest.raises(ValueError, match="recipe: 'eagle' cannot run on this autoregressive"):
        Decoder(path, recipe="eagle")  # its head and target stages are not there
    with pytest.raises(ValueError, match="holds no tokenizer.json"):
        Decoder(path).generate_text("hi")
