"""The m2r2 and verify_union prefetch policies of the expert-offload runtime, M2R2's fast stream
on MoE hosts, and the offload rows of ``leapfx bench``.

Offloaded decoding stays token-identical to resident decoding under both policies (slots
poisoned, transfers delayed); the policies insert their nodes where the design says, load
trained parts, score their predictions, and refuse the recipes they cannot serve.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leapfx import rewrite
from leapfx.offload import OffloadOptions
from leapfx.passes.capture import LAYER, nodes_by_role
from leapfx.runtime.expert_prediction import predicted_layers
from tests.conftest import MOE_ARCHS, examples, tiny_moe_model
from tests.greedy_check import hf_greedy
from tests.test_offload import _generate as _run

SPECULATIVE = {
    "layerskip": {"exit_layer": 2, "num_speculations": 3},
    "kangaroo": {"exit_layer": 2, "confidence_threshold": 0.0},
}


def _perturb(module: torch.nn.Module, seed: int = 0) -> None:
    """Move trainable parts off their zero initialisation (an untrained fast stream is the
    identity, which would hide a wrong wiring)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))


@settings(max_examples=examples(6, 24), deadline=None)
@given(data=st.data())
def test_m2r2_and_verify_union_decode_like_resident(data):
    arch = data.draw(st.sampled_from(MOE_ARCHS), label="arch")
    experts = data.draw(st.integers(3, 6), label="experts")
    model = tiny_moe_model(
        arch, layers=6, experts=experts, top_k=2, vocab=64,
        dense_layers=(3,) if arch.startswith("qwen") and data.draw(st.booleans()) else (),
        seed=data.draw(st.integers(0, 999), label="seed"),
    )  # fmt: skip
    policy = data.draw(st.sampled_from(["m2r2", "verify_union"]), label="policy")
    recipe = "autoregressive"
    if policy == "verify_union":
        recipe = data.draw(st.sampled_from(sorted(SPECULATIVE)), label="recipe")
    options = OffloadOptions(
        slots=data.draw(st.integers(1, experts), label="slots"), prefetch=policy, poison=True,
        tier=data.draw(st.sampled_from(["disk", "host"]), label="tier"),
        transfer_delay_s=data.draw(st.sampled_from([0.0, 0.002]), label="delay"),
    )  # fmt: skip
    prompt = torch.tensor([data.draw(st.lists(st.integers(0, 63), min_size=1, max_size=10))])
    max_new = data.draw(st.integers(1, 12), label="max_new_tokens")
    sm = rewrite.apply(model, recipe, offload=options, **SPECULATIVE.get(recipe, {}))
    if policy == "m2r2":
        _perturb(sm.graph_module.m2r2_accelerator)
    try:
        ours = sm.generate(prompt, max_new_tokens=max_new)
    finally:
        sm.offload.close()
    resident, _ = _run(model, recipe, prompt, max_new, **SPECULATIVE.get(recipe, {}))
    assert torch.equal(ours, resident), f"offloaded {ours.tolist()}\nresident  {resident.tolist()}"
    for moved, allowed in sm.offload.counters.prefetch_calls:
        assert moved <= allowed
    for cache in sm.offload.caches.values():
        assert len(cache.slot_of) <= sm.offload.num_slots and not any(cache.pins)


def test_m2r2_stream_predicts_layers_2i_plus_2_and_3():
    model = tiny_moe_model("olmoe", layers=8, experts=8, top_k=2, seed=3)
    sm = rewrite.apply(model, "autoregressive", offload=OffloadOptions(slots=3, prefetch="m2r2"))
    gm = sm.graph_module
    # One node before slow layer 0 runs fast layers 0..2 from p^0 = the embedding (layer 3
    # would predict 8, 9: beyond the model); fast layer i's output predicts 2i+2 and 2i+3.
    (node,) = nodes_by_role(gm, "prefetch")
    assert node.args[0].meta["leapfx.role"] == "embed"
    stream = gm.get_submodule(node.target)
    assert [m.index for m in stream.layers] == [0, 1, 2]
    assert stream.layers == [gm.m2r2_accelerator.layers[str(i)] for i in range(3)]
    targets = {i: [] for i in range(3)}
    for i, t in zip(stream.sources, stream.targets, strict=True):
        targets[i].append(t)
    assert targets == {i: predicted_layers(i, 8) for i in (0, 1, 2)}
    sm.generate(torch.tensor([[3, 1, 4, 1, 5]]), max_new_tokens=12)
    report = sm.last_offload_report
    assert 0 < report.prefetch_precision <= 1 and 0 < report.prefetch_recall <= 1
    sm.offload.close()
    _, none = _run(model, "autoregressive", torch.tensor([[3, 1, 4, 1, 5]]), 12,
                   offload=OffloadOptions(slots=3))  # fmt: skip
    for layer in (0, 1):  # never predicted
        assert (
            report.hit_rate_per_layer[layer] == none.last_offload_report.hit_rate_per_layer[layer]
        )


def test_m2r2_prefetch_loads_rate_2_parts_and_refuses_others(tmp_path):
    model = tiny_moe_model("olmoe", layers=6, experts=6, top_k=2, seed=2)
    trained = rewrite.apply(model, "m2r2", fast_layers=3)  # rate 2 on 6 layers
    _perturb(trained.graph_module.m2r2_accelerator, seed=1)
    trained.save_parts(tmp_path / "rate2")
    options = OffloadOptions(slots=2, prefetch="m2r2", m2r2_parts=tmp_path / "rate2")
    sm = rewrite.apply(model, "autoregressive", offload=options)
    ours = sm.graph_module.m2r2_accelerator.state_dict()
    theirs = trained.graph_module.m2r2_accelerator.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    sm.offload.close()
    rewrite.apply(model, "m2r2", fast_layers=2).save_parts(tmp_path / "rate3")
    bad = OffloadOptions(slots=2, prefetch="m2r2", m2r2_parts=tmp_path / "rate3")
    with pytest.raises(ValueError, match="m2r2_parts.*gate N/2 = 3"):
        rewrite.apply(model, "autoregressive", offload=bad)


def test_m2r2_recipe_runs_on_moe_hosts_losslessly():
    """The accelerator on MoE layers (captured as parts), OLMoE's full-width q/k norms
    included: the fast stream is a drafter, so decoding stays HF greedy's."""
    for arch in ("olmoe", "qwen2_moe"):
        model = tiny_moe_model(arch, layers=4, experts=4, seed=5)
        sm = rewrite.apply(model, "m2r2", fast_layers=2)
        _perturb(sm.graph_module.m2r2_accelerator)
        prompt = torch.tensor([[7, 2, 9, 4]])
        out = sm.generate(prompt, max_new_tokens=16)
        assert torch.equal(out, hf_greedy(model, prompt, 16)), arch


def test_verify_union_accumulates_the_round_and_runs_in_draft_and_verify():
    model = tiny_moe_model("mixtral", layers=5, experts=8, top_k=2, seed=7)
    options = OffloadOptions(slots=4, prefetch="verify_union")
    sm = rewrite.apply(model, "layerskip", exit_layer=2, num_speculations=4, offload=options)
    nodes = nodes_by_role(sm.graph_module, "prefetch")
    assert sorted(n.meta["leapfx.prefetch_layer"] for n in nodes) == [2, 3, 4]
    assert all(n.meta[LAYER] == 1 for n in nodes)
    for stage in ("draft", "verify"):
        assert len(nodes_by_role(sm.stages[stage], "prefetch")) == 3
    runtime = sm.offload
    seen = []
    score = runtime._score

    def spy(layer, ids):
        if layer == 3 and layer in runtime._predicted:
            seen.append(len(runtime._predicted[layer]))
        score(layer, ids)

    runtime._score = spy
    sm.generate(torch.tensor([[1, 5, 2, 6, 3]]), max_new_tokens=16)
    # A verify pass is scored against the union of its round's predictions: more than the
    # top-2 of a single token in some round.
    assert max(seen) > 2
    report = sm.last_offload_report
    assert report.prefetch_precision is not None and report.prefetch_recall is not None
    runtime.close()


@pytest.mark.parametrize(
    ("recipe", "option", "extra"),
    [("layerskip", "num_speculations", {"exit_layer": 1}),
     ("kangaroo", "max_draft_tokens", {"exit_layer": 1}),
     ("m2r2", "num_speculations", {"fast_layers": 1}),
     ("eagle", "max_draft_tokens", {})],
)  # fmt: skip
def test_an_offloaded_recipe_drafts_what_the_slots_fit(recipe, option, extra):
    """Unset, the draft length falls to num_slots // top_k - 1 (at least 1) over an offloaded
    model; given, resident or already fitting, it stays; decoding stays HF greedy's."""
    model = tiny_moe_model("olmoe", layers=3, experts=8, top_k=2, vocab=64, seed=3)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])

    def drafts(slots=None, **kw):
        offload = None if slots is None else OffloadOptions(slots=slots, tier="host")
        sm = rewrite.apply(model, recipe, offload=offload, **extra, **kw)
        d = getattr(sm.options, option)
        if offload is not None:
            out = sm.generate(prompt, max_new_tokens=12)
            assert torch.equal(out, hf_greedy(model, prompt, 12))
            assert sm.last_metrics.num_speculations == d
            sm.offload.close()
        return d

    default = drafts()
    assert default >= 3
    assert drafts(slots=6) == 2  # 6 slots hold 3 tokens' top-2
    assert drafts(slots=4) == 1
    assert drafts(slots=1) == 1  # one draft at least
    assert drafts(slots=8) == 3
    assert drafts(slots=4, **{option: 5}) == 5  # the caller's choice stands
    if recipe != "layerskip":  # its option takes no None
        assert drafts(slots=4, **{option: None}) == 1  # None: unset (the parts' or default)


def test_a_fitting_draft_length_is_left_alone():
    model = tiny_moe_model("olmoe", layers=3, experts=16, top_k=2, vocab=64, seed=3)
    sm = rewrite.apply(model, "layerskip", exit_layer=1,
                       offload=OffloadOptions(slots=1.0, tier="host"))  # fmt: skip
    assert sm.options.num_speculations == 6  # 16 slots hold 8 tokens' top-2
    sm.offload.close()


def test_policies_refuse_the_recipes_they_cannot_serve(tmp_path):
    model = tiny_moe_model("olmoe", layers=4, experts=4)
    with pytest.raises(ValueError, match="verify_union"):
        rewrite.apply(model, "autoregressive", offload=OffloadOptions(prefetch="verify_union"))
    with pytest.raises(ValueError, match="'m2r2' runs its own fast stream"):
        rewrite.apply(model, "layerskip", exit_layer=1,
                      offload=OffloadOptions(prefetch="m2r2"))  # fmt: skip
    with pytest.raises(ValueError, match="m2r2_parts"):
        OffloadOptions(prefetch="next_gate", m2r2_parts=tmp_path).validate()
    with pytest.raises(ValueError, match="m2r2_parts"):
        OffloadOptions(prefetch="m2r2", m2r2_parts=3).validate()


def test_bench_offload_rows(tmp_path):
    from leapfx.bench.harness import BenchConfig, run_bench
    from leapfx.bench.offload import (
        OFFLOAD_ROWS,
        ORACLE_ROW,
        REUSE_ROWS,
        bench_table,
        plot_offload,
        summarize,
    )
    from tests.test_offload import random_probe

    model = tiny_moe_model("olmoe", layers=4, experts=6, top_k=2, vocab=64, seed=1)
    probe = random_probe(model).save(tmp_path / "probe.safetensors")
    prompts = [torch.tensor([[1, 2, 3, 4]]), torch.tensor([[9, 8, 7]])]
    config = BenchConfig(
        recipe="autoregressive", exit_layer=1, num_speculations=2, max_new_tokens=6,
        repeats=1, warmup=1, hf_baselines=False, offload_slots=0.5, offload_dir=str(tmp_path),
        offload_engine="thread", offload_reuse_probe=str(probe),
    )  # fmt: skip
    rows = {r.system: r for r in run_bench(model, prompts, config, progress=False)}
    assert set(OFFLOAD_ROWS) | set(REUSE_ROWS) | {ORACLE_ROW} <= set(rows)
    # the offloaded layerskip drafts what the slots fit (3 of 6 hold 1 token's top-2: d = 1),
    # not the resident rows' num_speculations=2; given, it drafts that
    assert rows["leapfx_offload_layerskip"].extra["num_speculations"] == 1
    given = dataclasses.replace(config, recipe="layerskip", warmup=0, offload_num_speculations=2)
    fixed = {r.system: r for r in run_bench(model, prompts, given, progress=False)}
    assert fixed["leapfx_offload_layerskip"].extra["num_speculations"] == 2
    assert fixed["leapfx_layerskip"].extra["num_speculations"] == 2
    for name in (*OFFLOAD_ROWS[1:], *REUSE_ROWS, ORACLE_ROW):
        row = rows[name]
        assert row.identical_to_greedy and row.extra["identical_to_resident"]
        o = row.extra["offload"]
        for key in ("hit_rate", "stall_ms_per_token", "bytes_per_token"):
            assert o[key] >= 0
        assert set(o["hit_rate_per_layer"]) == {"0", "1", "2", "3"}
        assert o["engine"] == "ThreadEngine"  # --offload-engine reaches every row's runtime
    # every row on the same compute: the CPU kernels (auto, float32 on a CPU) or none
    assert all(rows[name].extra["cpu_kernels"] for name in OFFLOAD_ROWS)
    assert rows["leapfx_offload_none"].extra["offload"]["prefetch_precision"] is None
    assert rows["leapfx_offload_m2r2"].extra["offload"]["prefetch_precision"] is not None
    oracle = rows[ORACLE_ROW].extra["offload"]  # replays the warm-up's routing: never wrong
    assert oracle["prefetch_precision"] == 1.0
    assert oracle["hit_rate"] >= rows["leapfx_offload_none"].extra["offload"]["hit_rate"]
    assert rows["leapfx_offload_m2r2_reuse"].extra["offload"]["prefetch_precision"] is not None
    # no warm-up: no oracle; no probe: no *_reuse rows
    without = dataclasses.replace(config, warmup=0, offload_dir=None, offload_reuse_probe=None)
    names = {r.system for r in run_bench(model, prompts, without, progress=False)}
    assert ORACLE_ROW not in names and not names & set(REUSE_ROWS)
    json.dumps([r.as_dict() for r in rows.values()])  # the --json rows serialise
    text = bench_table(list(rows.values()))
    assert "leapfx_offload_m2r2" in text and "vs none" in text
    assert all(name in text for name in REUSE_ROWS)
    sm = rewrite.apply(model, "autoregressive",
                       offload=OffloadOptions(slots=2, prefetch="next_gate"))  # fmt: skip
    sm.offload.trace = []
    sm.generate(prompts[0], max_new_tokens=8)
    trace = sm.offload.trace
    summary = summarize([sm.last_offload_report])
    rates, ready = summary["hit_rate_per_layer"], summary["ready_rate_per_layer"]
    assert set(ready) == set(rates) and all(ready[i] <= rates[i] for i in rates)
    path = plot_offload({"leapfx_offload_next_gate": trace}, {"next_gate": rates},
                        tmp_path / "t.png", window_tokens=2,
                        ready_rates={"next_gate": ready})  # fmt: skip
    assert path.stat().st_size > 0
    sm.offload.close()


def test_routing_oracle_replays_exact_prefetches_and_the_optimal_eviction():
    """Replays decode like resident; the prefetches are never wrong; the optimal eviction hits
    at least as often as LRU on the same decode (and more, on this one)."""
    from leapfx.bench.offload import RoutingOracle

    model = tiny_moe_model("olmoe", layers=3, experts=8, top_k=2, vocab=64, seed=4)
    prompt = torch.tensor([[5, 3, 9, 1]])
    resident = rewrite.apply(model, "autoregressive").generate(prompt, max_new_tokens=24)
    rates = {}
    for prefetch, evict in ((False, "policy"), (False, "optimal"), (True, "policy")):
        sm = rewrite.apply(model, "autoregressive",
                           offload=OffloadOptions(slots=3, tier="host", poison=True))  # fmt: skip
        oracle = RoutingOracle(sm, prefetch=prefetch, evict=evict)
        assert not oracle.recorded(prompt)
        for _ in range(2):  # record, then replay
            assert torch.equal(oracle.generate(prompt, max_new_tokens=24), resident)
        assert oracle.recorded(prompt)
        assert all(cache.victim_key is None for cache in sm.offload.caches.values())
        report = sm.last_offload_report
        rates[prefetch, evict] = report.hit_rate
        if prefetch:
            assert report.prefetch_precision == 1.0
        sm.offload.close()
    assert rates[False, "optimal"] > rates[False, "policy"]
    assert rates[True, "policy"] > rates[False, "policy"]
    with pytest.raises(ValueError, match="evict: 'belady' is invalid; allowed: 'policy'"):
        RoutingOracle(sm, evict="belady")


def test_moe_reference_name_resolves():
    from leapfx.models import MOE_REFERENCE_MODEL, REFERENCE_MODEL, resolve_model

    assert resolve_model("moe-reference") == MOE_REFERENCE_MODEL
    assert resolve_model(None) == REFERENCE_MODEL == resolve_model("reference")
    assert str(resolve_model("some/dir")) == "some/dir"


def test_routing_loss_trains_the_fast_stream_and_precision_is_scored(tmp_path):
    from leapfx.bench.routing import fast_stream_precision
    from leapfx.train.m2r2 import fit

    model = tiny_moe_model("olmoe", layers=6, experts=6, top_k=2, vocab=64, seed=4)
    sm = rewrite.apply(model, "m2r2", fast_layers=3)
    data = torch.randint(0, 64, (4000,), generator=torch.Generator().manual_seed(0))
    result = fit(sm, data, steps=3, batch_size=2, seq_len=16, route_weight=1.0, progress=False)
    assert all(torch.isfinite(torch.tensor(result.losses)))
    sm.save_parts(tmp_path / "parts")
    scores = fast_stream_precision(model, tmp_path / "parts", [data[:32][None]])
    # Fast layers 0 and 1 predict layers 2, 3 and 4, 5 (layer 2 would predict 6, 7: none).
    assert sorted(scores, key=int) == ["2", "3", "4", "5"]
    assert all(0 <= e["m2r2"] <= 1 and e["from_fast_layer"] == (int(L) - 2) // 2
               for L, e in scores.items())  # fmt: skip
    with pytest.raises(ValueError, match="route_weight"):
        fit(sm, data, steps=1, route_weight=-1.0)


def test_golden_stage_text_of_the_new_policies():
    """The fast-stream and prefetch nodes where the design puts them, as stage text."""
    from tests.test_partition import _check_golden

    model = tiny_moe_model("olmoe", layers=6, experts=4)
    sm = rewrite.apply(model, "autoregressive",
                       offload=OffloadOptions(slots=2, prefetch="m2r2", tier="host"))  # fmt: skip
    _check_golden("autoregressive_olmoe_offload_m2r2", sm.stages.code())
    sm.offload.close()
    options = OffloadOptions(slots=2, prefetch="verify_union", tier="host")
    sm = rewrite.apply(model, "layerskip", exit_layer=2, offload=options)
    _check_golden("layerskip_olmoe_offload_verify_union", sm.stages.code())
    sm.offload.close()


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["m2r2", "verify_union"])
def test_cuda_engine_new_policies_are_token_identical(policy):
    model = tiny_moe_model("olmoe", layers=6, experts=8, top_k=2).cuda()
    prompt = torch.tensor([[3, 1, 4, 1, 5]], device="cuda")
    recipe, opts = ("autoregressive", {}) if policy == "m2r2" else ("layerskip", {"exit_layer": 2})
    resident, _ = _run(model, recipe, prompt, 24, **opts)
    ours, sm = _run(model, recipe, prompt, 24, offload=OffloadOptions(slots=3, prefetch=policy),
                    **opts)  # fmt: skip
    assert type(sm.offload.engine).__name__ == "CudaEngine"
    assert torch.equal(ours, resident)
    assert sm.last_offload_report.prefetch_precision is not None


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_one_token_prediction_ranks_like_the_norm_and_softmax(arch):
    # A decode step's next-gate prediction skips the RMSNorm's reduction and the softmax (the
    # router over norm-weight * hidden ranks the experts the same way); several tokens, and a
    # norm that is not an RMSNorm, take the full path. Both hand prefetch the same ranking.
    from leapfx.offload.runtime import NextGatePrefetch

    class Record:
        def prefetch(self, target, scores, *, union=False):
            self.scores = scores

    model = tiny_moe_model(arch, seed=3)
    layer = model.model.layers[1]
    router = layer.mlp.gate
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        layer.post_attention_layernorm.weight.uniform_(0.5, 1.5, generator=g)
    fast, full = Record(), Record()
    pred = NextGatePrefetch(fast, 1, layer.post_attention_layernorm, router)
    assert pred._router_over_norm_weight() is not None
    plain = NextGatePrefetch(full, 1, torch.nn.LayerNorm(router.weight.shape[1]), router)
    assert plain._router_over_norm_weight() is None
    with torch.no_grad():
        for _ in range(20):
            hidden = 3 * torch.randn(1, 1, router.weight.shape[1], generator=g)
            pred(hidden)
            normed = layer.post_attention_layernorm(hidden).reshape(1, -1)
            probs = torch.softmax(torch.nn.functional.linear(normed, router.weight), -1)
            k = min(4, probs.shape[-1])
            assert torch.equal(
                torch.topk(fast.scores[0], k).indices, torch.topk(probs[0], k).indices
            )
            pred(hidden.expand(1, 3, -1))  # several tokens: the probabilities themselves
            torch.testing.assert_close(fast.scores, probs.expand(3, -1))
