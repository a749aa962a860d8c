"""Mixture-of-Experts models: capture exposes routers and experts, and every recipe is lossless.

Hypothesis draws tiny random MoE configs of every supported family (mixtral, qwen2_moe with its
gated shared expert, qwen3_moe, olmoe), with and without ``norm_topk_prob``, top-1..3 of 2..6
experts, and dense ``mlp_only_layers`` in the qwen families. Float ties are detected and
reported (greedy_check), never assumed.
"""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leapfx import rewrite
from leapfx.passes.capture import LAYER, capture, layer_module, nodes_by_role
from leapfx.runtime.masks import masks_for
from tests.conftest import MOE_ARCHS, examples, tiny_moe_model
from tests.greedy_check import assert_greedy_equal, hf_greedy


@st.composite
def moe_specs(draw):
    arch = draw(st.sampled_from(MOE_ARCHS))
    layers = draw(st.integers(2, 5))
    experts = draw(st.integers(2, 6))
    spec = dict(
        arch=arch,
        layers=layers,
        heads=draw(st.sampled_from([2, 4])),
        kv_heads=draw(st.sampled_from([1, 2])),
        head_dim=draw(st.sampled_from([4, 8])),
        vocab=draw(st.integers(16, 200)),
        experts=experts,
        top_k=draw(st.integers(1, min(3, experts))),
        intermediate=draw(st.sampled_from([8, 16])),
        norm_topk_prob=draw(st.booleans()),
        tie=draw(st.booleans()),
        eos=draw(st.one_of(st.none(), st.integers(0, 15))),
        seed=draw(st.integers(0, 2**16)),
    )
    if arch in ("qwen2_moe", "qwen3_moe"):
        spec["dense_layers"] = tuple(draw(st.sets(st.integers(0, layers - 1), max_size=1)))
    if arch in ("mixtral", "qwen3_moe"):
        spec["sliding_window"] = draw(st.one_of(st.none(), st.integers(2, 12)))
    return spec


def _prompt(data, vocab: int) -> torch.Tensor:
    ids = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=24), label="prompt")
    return torch.tensor([ids])


def _full_masks(n: int) -> dict:
    return masks_for("sdpa", ["full_attention"], 0, n, window=None, dtype=torch.float32,
                     device=torch.device("cpu"), additive=True)  # fmt: skip


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_capture_exposes_router_and_experts_with_shared_weights(arch):
    dense = (1,) if arch.startswith("qwen") else ()
    model = tiny_moe_model(arch, layers=3, dense_layers=dense)
    gm = capture(model)
    moe_layers = [i for i in range(3) if i not in dense]
    routers, experts = nodes_by_role(gm, "router"), nodes_by_role(gm, "experts")
    assert [n.meta[LAYER] for n in routers] == moe_layers
    assert [n.meta[LAYER] for n in experts] == moe_layers
    assert [n.meta[LAYER] for n in nodes_by_role(gm, "layer")] == [0, 1, 2]
    for node in experts:
        # experts(hidden [T, H], top_k_index, top_k_weights): the ids come from the router.
        index, weights = node.args[1], node.args[2]
        assert index.args[1] == 2 and weights.args[1] == 1
        assert index.args[0].meta["leapfx.role"] == "router" == weights.args[0].meta["leapfx.role"]
        module = gm.get_submodule(node.target)
        hf = model.model.layers[node.meta[LAYER]].mlp.experts
        assert module is hf and module.gate_up_proj is hf.gate_up_proj  # by reference
    if arch == "qwen2_moe":
        assert len(nodes_by_role(gm, "shared_expert")) == 5 * len(moe_layers)
    # The layer's own modules stay reachable for passes that copy them (Kangaroo).
    assert layer_module(gm, 0).self_attn is model.model.layers[0].self_attn
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2]])
    ours = gm(ids, torch.arange(7)[None], _full_masks(7), None)["logits"]
    assert torch.equal(ours, model(ids, use_cache=False).logits)  # bitwise the HF forward


def test_stages_split_moe_layers_at_the_exit():
    model = tiny_moe_model("olmoe", layers=4)
    sm = rewrite.apply(model, "layerskip", exit_layer=2)
    draft_layers = {n.meta[LAYER] for n in sm.stages["draft"].graph.nodes if LAYER in n.meta}
    verify_experts = nodes_by_role(sm.stages["verify"], "experts")
    assert draft_layers == {0, 1}
    # verify runs the lower layers for the last draft token and the upper ones for all.
    assert sorted(n.meta[LAYER] for n in verify_experts) == [0, 1, 2, 3]


@settings(max_examples=examples(30, 120))
@given(spec=moe_specs(), data=st.data())
def test_autoregressive_identical_to_hf_on_moe(spec, data):
    model = tiny_moe_model(**spec)
    prompt = _prompt(data, spec["vocab"])
    max_new = data.draw(st.integers(1, 16), label="max_new_tokens")
    fuse = data.draw(st.booleans(), label="fuse_layers")
    sm = rewrite.apply(model, "autoregressive", fuse_layers=fuse)
    ours = sm.generate(prompt, max_new_tokens=max_new)
    ref = hf_greedy(model, prompt, max_new)
    # The same kernels in the same order as HF (prefill, then one token a step): no ties.
    assert torch.equal(ours, ref), f"ours {ours.tolist()}\nHF   {ref.tolist()}"


@settings(max_examples=examples(30, 120))
@given(spec=moe_specs(), data=st.data())
def test_speculative_recipes_lossless_on_moe(spec, data):
    model = tiny_moe_model(**spec)
    prompt = _prompt(data, spec["vocab"])
    max_new = data.draw(st.integers(1, 16), label="max_new_tokens")
    e = data.draw(st.integers(1, spec["layers"] - 1), label="exit_layer")
    recipe = data.draw(st.sampled_from(["layerskip", "kangaroo", "eagle"]), label="recipe")
    if recipe == "layerskip":
        d = data.draw(st.integers(1, 6), label="num_speculations")
        sm = rewrite.apply(model, recipe, exit_layer=e, num_speculations=d)
    elif recipe == "eagle":  # an untrained head (a copy of an MoE layer): drafts, rejected or not
        d = data.draw(st.integers(1, 6), label="max_draft_tokens")
        sm = rewrite.apply(model, recipe, max_draft_tokens=d, confidence_threshold=0.0)
    else:
        sm = rewrite.apply(model, recipe, exit_layer=e, confidence_threshold=0.0)
    ours = sm.generate(prompt, max_new_tokens=max_new)
    assert_greedy_equal(model, ours, hf_greedy(model, prompt, max_new), prompt.shape[1])


@settings(max_examples=examples(15, 60))
@given(spec=moe_specs(), data=st.data())
def test_early_exit_on_moe_is_the_truncated_model(spec, data):
    model = tiny_moe_model(**spec)
    prompt = _prompt(data, spec["vocab"])
    e = data.draw(st.integers(1, spec["layers"] - 1), label="exit_layer")
    max_new = data.draw(st.integers(1, 10), label="max_new_tokens")
    ours = rewrite.apply(model, "early_exit", exit_layer=e).generate(prompt, max_new_tokens=max_new)
    short = copy.deepcopy(model)
    short.model.layers = short.model.layers[:e]
    short.config.num_hidden_layers = e
    assert_greedy_equal(short, ours, hf_greedy(short, prompt, max_new), prompt.shape[1])


@settings(max_examples=examples(20, 80))
@given(spec=moe_specs(), data=st.data())
def test_layer_by_layer_recipes_on_moe(spec, data):
    """SpecEE's and M2R2's exit stages cut an MoE layer from its parts: SpecEE verified and
    m2r2_exit that never exits are HF greedy's decoding; qwen's dense layers mixed in."""
    model = tiny_moe_model(**spec)
    prompt = _prompt(data, spec["vocab"])
    max_new = data.draw(st.integers(1, 12), label="max_new_tokens")
    if data.draw(st.booleans(), label="specee"):
        drafter = data.draw(st.sampled_from(["eagle", "exit_head"]), label="drafter")
        e = data.draw(st.integers(1, spec["layers"] - 1), label="exit_layer")
        sm = rewrite.apply(model, "specee", verify=True, drafter=drafter, exit_layer=e)
        stages = [n for n in sm.stages.modules if n.startswith("layer_")]
        assert stages == [f"layer_{i}" for i in range(e, spec["layers"])]
    else:
        sm = rewrite.apply(model, "m2r2_exit", threshold=1.01)  # never exits
    ours = sm.generate(prompt, max_new_tokens=max_new)
    assert_greedy_equal(model, ours, hf_greedy(model, prompt, max_new), prompt.shape[1])


def test_unsupported_moe_family_is_refused_with_the_list():
    model = tiny_moe_model("olmoe", layers=2)
    model.config.model_type = "deepseek_v3"
    with pytest.raises(ValueError, match="olmoe.*qwen3_moe|mixtral"):
        rewrite.apply(model, "autoregressive")


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_attention_is_fused_bitwise(arch):
    model = tiny_moe_model(arch, layers=3, seed=2)
    if arch == "olmoe":
        model.config.clip_qkv = 0.05  # small enough to clamp: the in-place clamp path runs
    sm = rewrite.apply(model, "autoregressive")
    targets = [n.target for n in nodes_by_role(sm.graph_module, "attention")]
    assert targets == [f"leapfx_fused.attention_{i}" for i in range(3)]
    prompt = torch.tensor([[5, 3, 8, 1, 9, 2]])
    ours = sm.generate(prompt, max_new_tokens=12)
    assert torch.equal(ours, hf_greedy(model, prompt, 12))
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    logits = sm.stages["full"](ids, torch.arange(5)[None], _full_masks(5), None)["logits"]
    assert torch.equal(logits, model(ids, use_cache=False).logits)


def test_routing_stats_report_entropy_load_and_predictability():
    from leapfx.bench.routing import routing_stats

    model = tiny_moe_model("qwen3_moe", layers=4, experts=6, top_k=2, dense_layers=(1,))
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    stats = routing_stats(model, [ids])
    assert sorted(stats["layers"]) == ["0", "2", "3"] and stats["tokens"] == 40
    first = stats["layers"]["0"]
    assert 0 < first["entropy_bits"] <= first["entropy_max_bits"] + 1e-6
    assert abs(sum(first["load"]) - 1) < 1e-3 and first["load_max_over_mean"] >= 1
    assert first["next_gate"]["1"]["target_layer"] == 2  # the next MoE layer, past the dense
    assert first["next_gate"]["2"]["target_layer"] == 3
    assert 0 <= first["next_gate"]["1"]["precision"] <= 1
    assert "1" not in stats["layers"]["3"]["next_gate"]
    cache = first["cache"]["0.5"]  # 3 of 6 experts
    assert cache["slots"] == 3 and 0 <= cache["lru_hit_rate"] <= cache["optimal_hit_rate"] <= 1


def test_cache_hit_rates_lru_and_optimal_by_hand():
    from leapfx.bench.routing import cache_hit_rates

    cycle = torch.tensor([[0], [1], [2], [0], [1], [2]])
    # LRU with 2 slots always evicts what comes next: no hit. Optimal: t2 evicts 1 (next use 4,
    # 0's is 3), t3 hits 0, t4 evicts 0 (never used again, 2's next use is 5), t5 hits 2.
    assert cache_hit_rates(cycle, 2) == (0.0, 2 / 6)
    pair = torch.tensor([[0, 1], [1, 0], [2, 0]])  # a token's two experts both stay resident
    assert cache_hit_rates(pair, 2) == (3 / 6, 3 / 6)
    assert all(math.isnan(x) for x in cache_hit_rates(pair, 1))  # 2 experts, 1 slot


def _most_hits(rows: list[list[int]], slots: int, resident: frozenset = frozenset()) -> int:
    """Exhaustive search: the most hits any demand-only eviction gets."""
    if not rows:
        return 0
    row, rest = rows[0], rows[1:]
    hits = sum(e in resident for e in row)
    missing = [e for e in row if e not in resident]
    evictable = sorted(resident - set(row))
    need = max(0, len(resident) + len(missing) - slots)
    return hits + max(
        _most_hits(rest, slots, (resident - set(out)) | set(missing))
        for out in itertools.combinations(evictable, need)
    )


@settings(max_examples=examples(60, 240), deadline=None)
@given(
    rows=st.lists(
        st.lists(st.integers(0, 4), min_size=1, max_size=2, unique=True), min_size=1, max_size=8
    ),
    slots=st.integers(2, 3),
)
def test_cache_hit_rates_optimal_matches_exhaustive_search(rows, slots):
    from leapfx.bench.routing import cache_hit_rates, scored_hit_rate

    top = torch.tensor([row * 2 if len(row) == 1 else row for row in rows])  # [T, 2]
    lru, optimal = cache_hit_rates(top, slots)
    total = sum(len(row) for row in rows)
    assert optimal == _most_hits(rows, slots) / total
    assert lru <= optimal
    # Scored eviction: constant scores are LRU; minus each expert's next use after t is optimal.
    assert scored_hit_rate(top, slots, torch.zeros(len(rows), 5)) == lru
    later = torch.full((len(rows), 5), float(len(rows)))
    for t in range(len(rows) - 2, -1, -1):
        later[t] = later[t + 1]
        later[t, rows[t + 1]] = t + 1
    assert scored_hit_rate(top, slots, -later) == optimal


def test_moe_reference_trainer_runs_and_reports_routing(tmp_path):
    """A few steps of the MoE reference recipe on a tiny shape: the load-balancing term is in
    the loss, the model saves, and the report holds exits and routing; a second call resumes."""
    import json

    from leapfx.train.moe_reference import MoEReferenceSpec, train_moe_reference

    spec = MoEReferenceSpec(num_layers=2, hidden_size=32, intermediate_size=16, num_experts=4,
                            num_heads=2, num_kv_heads=1)  # fmt: skip
    kwargs = dict(minutes=2.0, spec=spec, batch_size=2, seq_len=32, eval_tokens=256,
                  progress=False)  # fmt: skip
    report = train_moe_reference(tmp_path, steps=2, **kwargs)
    assert report["training"]["steps"] == 2 and report["training"]["finished"]
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["aux_loss"] > 0 for r in records)
    assert set(report["exits"]) == {"1", "2"}
    layer = report["routing"]["layers"]["0"]
    assert abs(sum(layer["load"]) - 1) < 1e-3 and "1" in layer["next_gate"]
    assert (tmp_path / "model" / "moe_reference_report.json").exists()
    # The saved model captures and runs with offload.
    from transformers import AutoModelForCausalLM

    from leapfx.offload import OffloadOptions

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32).eval()
    sm = rewrite.apply(model, "layerskip", exit_layer=1, offload=OffloadOptions(slots=2))
    prompt = torch.tensor([[70, 71, 72]])
    assert torch.equal(sm.generate(prompt, max_new_tokens=6),
                       rewrite.apply(model, "layerskip", exit_layer=1).generate(
                           prompt, max_new_tokens=6))  # fmt: skip
    sm.offload.close()
    again = train_moe_reference(tmp_path, steps=2, **kwargs)  # resumes: nothing left to run
    assert again["training"]["steps"] == 2


def test_balance_loss_balances_each_layer_not_their_aggregate():
    """Two layers that each send every token to their own favourite expert: their aggregate
    load is even, so HF's loss over both at once is at its minimum, but each layer on its own
    is as unbalanced as it can be, and the reference trainer's term says so."""
    from types import SimpleNamespace

    from transformers.models.olmoe.modeling_olmoe import load_balancing_loss_func

    from leapfx.train.moe_reference import RouterLogits

    favourite = torch.full((8, 2), -20.0)
    first, second = favourite.clone(), favourite.clone()
    first[:, 0] = second[:, 1] = 20.0
    layers = [SimpleNamespace(mlp=SimpleNamespace(gate=torch.nn.Linear(1, 1))) for _ in range(2)]
    model = SimpleNamespace(config=SimpleNamespace(num_experts=2, num_experts_per_tok=1),
                            model=SimpleNamespace(layers=layers))  # fmt: skip
    routers = RouterLogits(model, coef=0.5)
    aggregate = load_balancing_loss_func((first, second), 2, 1)
    assert aggregate == pytest.approx(1.0, abs=1e-6)  # E * sum_e f_e P_e at its minimum, 1
    routers.logits += [first, second]
    assert routers.balance_loss().item() == pytest.approx(0.5 * 2.0, abs=1e-6)  # each: 2, the max
    assert routers.logits == []  # read and cleared
    routers.logits += [first, torch.zeros(8, 2)]  # a layer at the max (2), one uniform (1)
    assert routers.balance_loss().item() == pytest.approx(0.5 * (2.0 + 1.0) / 2, abs=1e-6)
    routers.remove()


def test_golden_moe_stage_text():
    """The stages of an MoE model: its parts, with qwen2_moe's shared expert and a dense layer,
    and the offloaded experts with next-gate prefetch nodes."""
    from leapfx.offload import OffloadOptions
    from tests.test_partition import _check_golden

    model = tiny_moe_model("qwen2_moe", layers=3, dense_layers=(1,))
    sm = rewrite.apply(model, "layerskip", exit_layer=1)
    _check_golden("layerskip_qwen2_moe", sm.stages.code())
    options = OffloadOptions(slots=2, prefetch="next_gate", tier="host")
    sm = rewrite.apply(model, "layerskip", exit_layer=1, offload=options)
    _check_golden("layerskip_qwen2_moe_offload_next_gate", sm.stages.code())
    sm.offload.close()
