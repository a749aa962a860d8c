"""The recipes whose stages export beside layerskip and kangaroo (``tests/test_export.py``),
decoded by ``OnnxModel`` under their own schedules, and the refusals of those that do not.

EAGLE: the ``target`` stage (every layer, and the head's cache slot from the true features)
takes the last hidden state of the position before its chunk (``prev_hidden``); the ``head``
stage takes a state per token (exported as ``hidden_in``: ONNX names a value once, and the
stage also returns ``hidden``). The tokens are the eager recipe's, and with them the same
rounds (accepted drafts per verify, calls) where no timing chooses them, on two tiny models
(``MODELS``). swift: the ``draft`` stage is the model without its fixed skip set (its kept
layers' cache slots only), verified by ``full``. m2r2: the ``draft`` stage (the fast stream)
takes its round's scratch as tensors (``fast_past.{i}.*`` in, ``fast_present.{i}.*`` out: the
fast keys, and with ``fast_keys`` the slow slots the round's first draft chose) beside the slow
cache it reads and does not write, verified by ``full``; its accelerator is randomised
(an untrained one multiplies its attention by a zero gate) on tied-embedding models, whose
drafts are accepted in some rounds and rejected in others. The torch-free
``leapfx.deploy.Decoder`` runs these recipes' exports in ``tests/test_deploy.py``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from leapfx import rewrite  # noqa: E402
from leapfx.export import OnnxModel, read_manifest  # noqa: E402
from leapfx.lower.ort_stages import OrtKVCache  # noqa: E402
from leapfx.modules.m2r2_scratch import FastScratch  # noqa: E402
from leapfx.runtime.cache import cache_for  # noqa: E402
from leapfx.runtime.runner import StageRunner  # noqa: E402
from tests.conftest import randomize_accelerator, tiny_model  # noqa: E402
from tests.greedy_check import assert_greedy_equal, hf_greedy  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [3], [1, 2, 3, 1, 2, 3, 1, 2]]
NEW = 20
# name -> (model, the recipe's options): the first exercises the GroupQueryAttention rewrite
# (head size 16), the confidence stop and prompt lookup first; the second a sliding window and
# the adaptive policy, whose rounds draft by prompt lookup, by the head or not at all as
# measured times say (so its rounds differ from run to run, its tokens never)
MODELS = {
    "llama": (dict(arch="llama", layers=3, head_dim=16), dict(max_draft_tokens=4, lookup=True)),
    "qwen2": (
        dict(arch="qwen2", layers=2, sliding_window=5),
        dict(max_draft_tokens=3, confidence_threshold=0.0, lookup=True, adaptive=True),
    ),
}


# swift at a fixed skip set: layers 1 and 2 of 4 skipped (d = 3), and the default set on a
# sliding-window model with prompt lookup first
SWIFT = {
    "swift-llama": (
        dict(arch="llama", layers=4, head_dim=16),
        dict(skip_layers=(1, 2), num_speculations=3),
    ),
    "swift-qwen2": (dict(arch="qwen2", layers=3, sliding_window=5), dict(lookup=True)),
}


# m2r2 (a randomised accelerator, tied embeddings): two fast layers of three, the second on a
# sliding-window model with the confidence stop; the third reads 2 slow keys a KV head
# (fast_keys: chosen by a round's first draft, or every visible one while at most 2 are)
M2R2 = {
    "m2r2-llama": (
        dict(arch="llama", layers=3, head_dim=16, tie=True),
        dict(fast_layers=2, num_speculations=3),
    ),
    "m2r2-qwen2": (
        dict(arch="qwen2", layers=3, sliding_window=5, tie=True),
        dict(fast_layers=2, num_speculations=4, confidence_threshold=0.1),
    ),
    "m2r2-topk": (
        dict(arch="qwen2", layers=3, sliding_window=5, tie=True),
        dict(fast_layers=1, num_speculations=3, fast_keys=2),
    ),
}
# the accelerator's random scale where the default (0.1) has every draft of this model kept
M2R2_SCALE = {"m2r2-topk": 0.3}


def _recipe(name: str) -> tuple[str, tuple[dict, dict]]:
    if name in SWIFT:
        return "swift", SWIFT[name]
    if name in M2R2:
        return "m2r2", M2R2[name]
    return "eagle", MODELS[name]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``get(name)``: (HF model, eager SpeculativeModel, OnnxModel of its export)."""
    root = tmp_path_factory.mktemp("recipes-onnx")
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            recipe, (spec, options) = _recipe(name)
            model = tiny_model(**spec)
            extra = {"parts": None} if recipe in ("eagle", "m2r2") else {}
            sm = rewrite.apply(model, recipe, **extra, **options)
            if recipe == "m2r2":
                randomize_accelerator(sm, scale=M2R2_SCALE.get(name, 0.1))
            path = sm.export_onnx(root / name)
            cache[name] = (model, sm, OnnxModel(path, threads=1))
        return cache[name]

    return get


def decode_both(model, sm, om, per_verify: list[int] | None = None) -> dict[str, int]:
    """Each prompt decoded by the eager model and its export: the same tokens (or a divergence
    at a float tie of the HF model), and where the same, the same rounds unless the adaptive
    policy's timings chose them. Returns the export's rounds per drafter, summed; extends
    ``per_verify`` with the export's tokens per verify."""
    rounds: dict[str, int] = {}
    for ids in PROMPTS:
        prompt = torch.tensor([ids])
        eager = sm.generate(prompt, max_new_tokens=NEW)
        ours = om.generate(prompt, max_new_tokens=NEW)
        if not torch.equal(ours, eager):  # a divergence only at a float tie of the HF model
            assert_greedy_equal(model, ours, hf_greedy(model, prompt, NEW), len(ids))
            continue
        m, e = om.last_metrics, sm.last_metrics
        if per_verify is not None:
            per_verify.extend(m.accepted_per_verify)
        for drafter, n in m.drafter_rounds.items():
            rounds[drafter] = rounds.get(drafter, 0) + n
        if getattr(sm.options, "adaptive", False):
            continue
        assert m.accepted_per_verify == e.accepted_per_verify
        assert (m.draft_calls, m.verify_calls, m.full_calls) == (
            e.draft_calls, e.verify_calls, e.full_calls,
        )  # fmt: skip
    return rounds


@pytest.mark.parametrize("name", list(MODELS))
def test_onnx_eagle_is_token_identical_to_eager(exported, name):
    model, sm, om = exported(name)
    assert om.recipe == "eagle" and sorted(om.stages) == ["head", "target"]
    rounds = decode_both(model, sm, om)
    assert rounds.get("eagle", 0) > 0  # the head drafted on ONNX
    assert rounds.get("lookup", 0) > 0  # and prompt lookup, verified by target


def test_eagle_manifest_names_the_state_inputs_and_the_head_slot(exported):
    model, sm, om = exported("llama")
    m = read_manifest(om.path)
    slot = model.config.num_hidden_layers  # the head's own cache slot, after the host's
    assert m["recipe"] == "eagle" and m["cache"]["extra_slots"] == 1
    assert m["cache"]["slots"] == slot + 1
    target, head = m["stages"]["target"], m["stages"]["head"]
    assert target["inputs"][:3] == ["input_ids", "position_ids", "prev_hidden"]
    assert target["outputs"][:2] == ["logits", "hidden"]
    assert target["cache_writes"] == [*range(slot), slot]  # the host's slots and the head's
    assert head["inputs"][:3] == ["input_ids", "position_ids", "hidden_in"]
    assert head["outputs"][:2] == ["logits", "hidden"]
    assert head["cache_writes"] == [slot] and head["layers"] == []
    assert head["rewrites"]["group_query_attention"] == 1  # the head's layer, as a host's
    import onnx

    dims = {
        i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
        for stage in ("target", "head")
        for i in onnx.load(str(om.path / f"{stage}.onnx"), load_external_data=False).graph.input
    }
    hidden = model.config.hidden_size
    assert dims["prev_hidden"] == ["batch", 1, hidden]
    assert dims["hidden_in"] == ["batch", "sequence", hidden]


def test_onnx_eagle_samples_and_refuses_the_missing_baseline(exported):
    model, _, om = exported("llama")
    g = torch.Generator().manual_seed(0)
    out = om.generate(torch.tensor([[3, 1, 4]]), max_new_tokens=12, do_sample=True, generator=g)
    assert out.shape == (1, 15) and int(out.max()) < model.config.vocab_size
    # an EAGLE export has no full stage: the autoregressive baseline needs one
    with pytest.raises(ValueError, match="'autoregressive' cannot run on this eagle export"):
        OnnxModel(om.path, recipe="autoregressive")


def test_genai_format_still_refuses_eagle(tmp_path):
    sm = rewrite.apply(tiny_model("llama", layers=2), "eagle", parts=None)
    with pytest.raises(ValueError, match="format: 'genai' cannot export this model"):
        sm.export_onnx(tmp_path / "genai", format="genai")
    assert not (tmp_path / "genai").exists()


@pytest.mark.parametrize("name", list(SWIFT))
def test_onnx_swift_at_a_fixed_skip_set_is_token_identical_to_eager(exported, name):
    model, sm, om = exported(name)
    assert om.recipe == "swift" and sorted(om.stages) == ["draft", "full"]
    skip = sm.options.skip_layers
    draft = om.manifest["stages"]["draft"]
    kept = [i for i in range(model.config.num_hidden_layers) if i not in skip]
    assert draft["layers"] == draft["cache_writes"] == kept  # the skipped layers' slots: none
    assert om.manifest["options"]["skip_layers"] == list(skip)
    assert decode_both(model, sm, om).get("swift", 0) > 0
    # the baseline on the same export
    base = OnnxModel(om.path, threads=1, recipe="autoregressive")
    prompt = torch.tensor([PROMPTS[0]])
    assert torch.equal(base.generate(prompt, max_new_tokens=8), hf_greedy(model, prompt, 8))


def test_onnx_auto_is_token_identical_to_eager(tmp_path):
    # auto's adaptive prompt lookup on its full stage (its rounds follow measured times: the
    # tokens alone are compared)
    model = tiny_model("llama", layers=2)
    sm = rewrite.apply(model, "auto", parts=None)
    assert sm.recipe.name == "auto"
    om = OnnxModel(sm.export_onnx(tmp_path / "auto"), threads=1)
    for ids in PROMPTS:
        prompt = torch.tensor([ids])
        eager = sm.generate(prompt, max_new_tokens=NEW)
        ours = om.generate(prompt, max_new_tokens=NEW)
        if not torch.equal(ours, eager):
            assert_greedy_equal(model, ours, hf_greedy(model, prompt, NEW), len(ids))


@pytest.mark.parametrize("name", list(M2R2))
def test_onnx_m2r2_is_token_identical_to_eager(exported, name):
    model, sm, om = exported(name)
    assert om.recipe == "m2r2" and sorted(om.stages) == ["draft", "full"]
    draft = om.manifest["stages"]["draft"]
    fast = list(range(sm.options.fast_layers))  # the fast layers read these slots' slow keys
    assert draft["cache_reads"] == draft["scratch"]["slots"] == fast
    assert draft["cache_writes"] == [] and draft["layers"] == []
    assert not [n for n in draft["outputs"] if n.startswith("present.")]
    scratch = ["fast_past.0.key", "fast_past.0.value"]
    if sm.options.fast_keys is not None:
        scratch.append("fast_past.0.top")  # the round's choice of slow slots
    assert draft["inputs"][2 : 2 + len(scratch)] == scratch
    assert draft["outputs"][2 : 2 + len(scratch)] == [
        n.replace("fast_past", "fast_present") for n in scratch
    ]
    per_verify: list[int] = []
    assert decode_both(model, sm, om, per_verify).get("m2r2", 0) > 0  # drafted on ONNX
    # drafts were kept (rounds of several tokens) and rejected (rounds of one)
    assert max(per_verify) > 1 and min(per_verify) == 1


@pytest.mark.parametrize("name", list(M2R2))
def test_onnx_m2r2_draft_reads_its_scratch_as_the_eager_draft(exported, name):
    """A round of three drafts over a cache whose slots past the round's start hold a rejected
    round's keys: each ONNX draft's logits and fast keys are the eager stage's, the scratch
    growing by one key a draft (with fast_keys, the slow slots the round's first draft chose
    are the eager draft's)."""
    model, sm, om = exported(name)
    prompt = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 1, 2]])
    start = 8  # slots 8 and 9 hold keys of tokens the round does not see
    eager = StageRunner(sm.stages.modules, cache_for(model, 32), sm._layout)
    ours = StageRunner(om.stages, OrtKVCache(om._kv_shapes, 32), om._layout)
    scratches = []
    for runner in (eager, ours):
        runner.full(prompt, 0)
        runner.cache.crop(start)
        scratch = FastScratch()
        logits = [runner.fast_draft(torch.tensor([[t]]), start + i, scratch) for i, t in
                  enumerate([7, 3, 4])]  # fmt: skip
        scratches.append((torch.cat(logits, dim=1), scratch))
    (want, e), (got, o) = scratches
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert sorted(o.kv) == sorted(e.kv) and all(len(o.kv[s]) == 3 for s in o.kv)
    for slot in e.kv:
        for (ek, ev), (ok, ov) in zip(e.kv[slot], o.kv[slot], strict=True):
            torch.testing.assert_close(ok, ek, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(ov, ev, rtol=1e-4, atol=1e-4)
    assert ours.cache.lengths[: len(o.kv)] == [start] * len(o.kv)  # the draft wrote no slot
    if sm.options.fast_keys is not None:  # 4 keys in the window, 2 chosen
        assert sorted(e.top) == sorted(e.kv)
        for slot, (positions, _, _) in e.top.items():
            assert torch.equal(o.exported[f"fast_past.{slot}.top"], positions)


def test_onnx_m2r2_samples_and_its_baselines(exported):
    model, _, om = exported("m2r2-llama")
    g = torch.Generator().manual_seed(0)
    out = om.generate(torch.tensor([[3, 1, 4]]), max_new_tokens=12, do_sample=True, generator=g)
    assert out.shape == (1, 15) and int(out.max()) < model.config.vocab_size
    base = OnnxModel(om.path, threads=1, recipe="autoregressive")  # the full stage
    prompt = torch.tensor([PROMPTS[0]])
    assert torch.equal(base.generate(prompt, max_new_tokens=8), hf_greedy(model, prompt, 8))
    # its draft is the fast stream, which takes a scratch: not an early-exit draft
    with pytest.raises(ValueError, match="'early_exit' cannot run on this m2r2 export; allowed"):
        OnnxModel(om.path, recipe="early_exit")


@pytest.mark.parametrize(
    ("recipe", "options", "match"),
    [
        ("swift", {"search": "online"}, "search: 'online' chooses the draft's skip set"),
        ("m2r2_exit", {}, "per-layer gates decide each token's exit"),
        ("specee", {"drafter": "exit_head", "exit_layer": 1}, "per-token exits"),
    ],
)
def test_the_recipes_that_do_not_export_say_why(tmp_path, recipe, options, match):
    sm = rewrite.apply(tiny_model("llama", layers=4), recipe, parts=None, **options)
    with pytest.raises(ValueError, match=f"recipe: '{recipe}' cannot be exported to ONNX: "):
        sm.export_onnx(tmp_path / "x")
    with pytest.raises(ValueError, match=match):
        sm.export_onnx(tmp_path / "x")
    assert not (tmp_path / "x").exists()
