"""The ONNX ``draft_chain`` stage: D greedy draft steps in one onnxruntime call.

The chain is the draft graph copied D times (``leapfx.export.chain``), so its outputs and
cache writes must be the D draft calls' exactly, not merely close: the tests compare with
``torch.equal``. Exports are slow (seconds per stage): each model is exported once per module.
"""

from __future__ import annotations

import pytest
import torch

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from leapfx import rewrite  # noqa: E402
from leapfx.export import OnnxModel, OrtKVCache, export_onnx, read_manifest  # noqa: E402
from leapfx.export.chain import unroll_draft  # noqa: E402
from leapfx.export.onnx_export import chain_length  # noqa: E402
from leapfx.lower.ort_stages import OrtChainStage  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402
from tests.greedy_check import assert_greedy_equal, hf_greedy  # noqa: E402
from tests.test_export import random_config  # noqa: E402

D = 3  # num_speculations of the chained exports


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``get(arch, **options)``: (model, SpeculativeModel, path) of a layerskip export."""
    root = tmp_path_factory.mktemp("chain")
    cache: dict[tuple, tuple] = {}

    def get(arch: str = "llama", **options):
        key = (arch, *sorted(options.items()))
        if key not in cache:
            model = tiny_model(**random_config(arch))
            options = {"exit_layer": 1, "num_speculations": D, **options}
            sm = rewrite.apply(model, "layerskip", **options)
            cache[key] = (model, sm, export_onnx(sm, root / f"{len(cache)}-{arch}"))
        return cache[key]

    return get


def _prefilled(om: OnnxModel, prompt: torch.Tensor) -> OrtKVCache:
    """A cache with ``prompt`` run through the full stage (every slot filled to its length)."""
    cache = om._cache_for(prompt.shape[1] + 2 * D)
    positions = torch.arange(prompt.shape[1]).unsqueeze(0)
    om.stages["full"](input_ids=prompt, position_ids=positions, cache=cache)
    return cache


# llama: every layer rewritten as GroupQueryAttention; mistral: a sliding window, so the
# layers keep the traced attention and the cache writes as ScatterND.
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_chain_is_d_draft_calls(exported, arch):
    model, sm, path = exported(arch)
    om = OnnxModel(path, threads=1)
    chain, draft = om.stages["draft_chain"], om.stages["draft"]
    assert isinstance(chain, OrtChainStage) and chain.chain_length == D
    prompt = torch.tensor([[5, 9, 2, 7, 1, 3, 4]])
    start = prompt.shape[1]
    x = torch.tensor([[11]])
    for _ in range(2):  # the second call runs on the buffers bound by the first
        cache = _prefilled(om, prompt)
        tokens, hidden, token = [], [], x
        for i in range(D):
            out = draft(input_ids=token, position_ids=torch.tensor([[start + i]]), cache=cache)
            token = out["logits"][:, -1].argmax(dim=-1, keepdim=True)
            tokens.append(token)
            hidden.append(out["hidden"])
        steps = [cache.filled(layer) for layer in range(len(cache.keys))]
        lengths = list(cache.lengths)

        cache = _prefilled(om, prompt)
        out = chain(input_ids=x, position_ids=torch.tensor([[start]]), cache=cache, masks=None)
        assert out["tokens"].dtype == torch.int64 and out["tokens"].shape == (1, D)
        assert torch.equal(out["tokens"], torch.cat(tokens, dim=1))
        assert torch.equal(out["hidden"], torch.cat(hidden, dim=1))
        assert cache.lengths == lengths
        assert [cache.lengths[i] for i in chain.cache_layers] == [start + D] * len(
            chain.cache_layers
        )
        for layer, (keys, values) in enumerate(steps):
            ours = cache.filled(layer)
            assert torch.equal(torch.from_numpy(ours[0]), torch.from_numpy(keys)), layer
            assert torch.equal(torch.from_numpy(ours[1]), torch.from_numpy(values)), layer
    with pytest.raises(ValueError, match=r"position_ids: shape \[1, 2\] is invalid"):
        chain(input_ids=prompt[:, :2], position_ids=torch.tensor([[0, 1]]), cache=cache)


def test_generate_with_the_chain_is_greedy(exported):
    model, sm, path = exported("llama")
    with_chain = OnnxModel(path, threads=1)
    per_step = OnnxModel(path, threads=1)
    del per_step.stages["draft_chain"]
    calls = []
    chain = with_chain.stages["draft_chain"]

    def counted(**inputs):
        calls.append(inputs["position_ids"].item())
        return chain(**inputs)

    with_chain.stages["draft_chain"] = counted
    counted.chain_length = chain.chain_length
    for prompt in ([[5, 9, 2, 7, 1, 3]], [[1]], [[40, 2, 2, 2, 17, 9, 30, 30, 4, 5]]):
        prompt = torch.tensor(prompt)
        ours = with_chain.generate(prompt, max_new_tokens=24)
        assert torch.equal(ours, per_step.generate(prompt, max_new_tokens=24))
        assert_greedy_equal(model, ours, hf_greedy(model, prompt, 24), prompt.shape[1])
    assert calls, "the schedule never called draft_chain"
    # sampling and the baselines draft per step
    sampled = OnnxModel(path, threads=1)
    sampled.stages["draft_chain"] = type("NotCallable", (), {"chain_length": D})()
    sampled.generate(torch.tensor([[3, 4]]), max_new_tokens=8, do_sample=True)
    assert "draft_chain" not in OnnxModel(path, threads=1, recipe="early_exit").stages


def test_manifest_records_the_chain(exported):
    model, sm, path = exported("llama")
    manifest = read_manifest(path)
    spec, draft = manifest["stages"]["draft_chain"], manifest["stages"]["draft"]
    assert spec["file"] == "draft_chain.onnx" and (path / spec["file"]).is_file()
    chain = spec["chain"]
    assert (chain["stage"], chain["length"], chain["selection"]) == ("draft", D, "greedy")
    assert chain["cache"].startswith("every step reads past_key_values")
    for key in ("layers", "layer_ranges", "cache_reads", "cache_writes", "position_groups"):
        assert spec[key] == draft[key], key
    assert spec["inputs"] == draft["inputs"]
    presents = draft["outputs"][2:]
    steps = [f"{p}.step{i}" for i in range(D - 1) for p in presents]
    assert spec["outputs"] == ["tokens", "hidden", *presents, *steps]
    graph = onnx.load(str(path / spec["file"]), load_external_data=False).graph
    onnx.checker.check_model(str(path / spec["file"]))
    assert [i.name for i in graph.input] == spec["inputs"]
    assert [o.name for o in graph.output] == spec["outputs"]
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in [*graph.input, *graph.output]}  # fmt: skip
    assert dims["input_ids"] == dims["position_ids"] == ["batch", 1]
    assert dims["tokens"] == ["batch", D]
    assert dims["hidden"] == ["batch", D, model.config.hidden_size]
    # every step is the optimized draft graph: each layer's attention rewritten in every copy
    exit_layers = len(draft["layers"])
    gqa = sum(n.op_type == "GroupQueryAttention" for n in graph.node)
    assert gqa == D * exit_layers == spec["rewrites"]["group_query_attention"]
    assert spec["rewrites"] == {k: D * v for k, v in draft["rewrites"].items()}
    assert not any(n.op_type in ("Attention", "ScatterElements") for n in graph.node)
    # ... each reading the cache input and writing the step's own present (one buffer, bound)
    for node in graph.node:
        if node.op_type == "GroupQueryAttention":
            past, present = node.input[3], node.output[1]
            assert past.startswith("past_key_values.") and present.startswith("present.")
            assert present.split(".step")[0] == past.replace("past_key_values.", "present.")
    # the weights once: the chain's initializers are the draft's, in weights.bin
    draft_graph = onnx.load(str(path / draft["file"]), load_external_data=False).graph
    weights = {t.name for t in draft_graph.initializer if t.external_data}
    assert {t.name for t in graph.initializer if t.external_data} == weights
    assert sum(len(t.raw_data) for t in graph.initializer) < 4096  # the rest: small constants
    _, _, plain = exported("llama", confidence_threshold=0.5)  # same weights, no chain
    size = (path / "weights.bin").stat().st_size
    assert size == (plain / "weights.bin").stat().st_size


def test_no_chain_without_a_fixed_draft_length(exported):
    model, sm, path = exported("llama", confidence_threshold=0.5)
    manifest = read_manifest(path)
    assert "draft_chain" not in manifest["stages"]
    assert not (path / "draft_chain.onnx").exists()
    om = OnnxModel(path, threads=1)  # an export without the chain runs per-step drafts
    assert "draft_chain" not in om.stages
    prompt = torch.tensor([[5, 9, 2, 7, 1, 3]])
    assert_greedy_equal(
        model, om.generate(prompt, max_new_tokens=12), hf_greedy(model, prompt, 12), 6
    )
    model = tiny_model(layers=2)
    assert chain_length(rewrite.apply(model, "layerskip", exit_layer=1, num_speculations=4)) == 4
    assert chain_length(rewrite.apply(model, "layerskip", exit_layer=1, num_speculations=1)) == 0
    assert chain_length(rewrite.apply(model, "kangaroo", exit_layer=1)) == 0
    assert chain_length(rewrite.apply(model, "early_exit", exit_layer=1)) == 0


def test_unroll_refuses_what_is_not_a_draft_stage(exported):
    model, sm, path = exported("llama")
    verify = onnx.load(str(path / "verify.onnx"), load_external_data=False)
    with pytest.raises(ValueError, match="draft_chain: the draft stage cannot be unrolled"):
        unroll_draft(verify, D)
    draft = onnx.load(str(path / "draft.onnx"), load_external_data=False)
    with pytest.raises(ValueError, match="length: 1 is invalid"):
        unroll_draft(draft, 1)
