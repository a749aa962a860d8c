"""The offload's m2r2 prefetch run ahead of the slow pass (``M2R2Prefetcher``,
``leapfx_cpu::m2r2_predict``).

A decode step runs the whole rate-2 fast stream before slow layer 0 and issues every prefetch
at once. Checked here: a fast layer run ahead reads exactly the keys it read beside its slow
layer (so the predictions are today's); the op gives the torch stream's states and scores (to
1e-5) and its experts (an exact tie, shown within 1e-5, may order two differently) on tiny
random configs and on the shipped moe-reference with its shipped parts; offloaded decoding stays
token-identical to resident decoding; and every prefetch of a step comes before slow layer 0's
experts run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from leapfx import rewrite
from leapfx.kernels import cpu_m2r2
from leapfx.modules.m2r2 import AcceleratedLayer
from leapfx.offload import DEFAULT_PREFETCH_LEAD, OffloadOptions
from leapfx.passes.capture import ROLE, nodes_by_role
from leapfx.runtime.cache import StaticKVCache
from tests.conftest import tiny_moe_model
from tests.test_moe_prefetch import _perturb
from tests.test_offload import _generate as _resident

ROOT = Path(__file__).resolve().parents[1]
TIE = 1e-5

needs_op = pytest.mark.skipif(not cpu_m2r2.available(), reason="no C++ toolchain here")


def _randomize_norms(model: torch.nn.Module, seed: int = 1) -> None:
    """Norm weights away from their init (ones), so that folding and offsets matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)


def _offloaded(model, *, kernels: bool, slots=3, perturb: bool = True, **options):
    sm = rewrite.apply(
        model, "autoregressive", cpu_kernels=kernels,
        offload=OffloadOptions(slots=slots, prefetch="m2r2", **options),
    )  # fmt: skip
    if perturb:
        _perturb(sm.graph_module.m2r2_accelerator)  # an untrained stream predicts from h^0
    return sm


def _stream(sm):
    return sm.graph_module.leapfx_offload.m2r2_stream


def _reference(stream, embedding, rope, position_ids, cache):
    """The torch stream ahead of the slow pass: (states [F + 1, H], scores per target)."""
    p, states = embedding, [embedding]
    for layer in stream.layers:
        p = layer(p, rope, position_ids, cache, ahead=True)
        states.append(p)
    scores = [
        F.linear(states[i + 1].reshape(1, -1), pred._router_over_norm_weight())[0]
        for i, pred in zip(stream.sources, stream.predictors, strict=True)
    ]
    return torch.cat(states).reshape(len(states), -1), scores


def _check_ids(got: list[int], scores: torch.Tensor, k: int) -> int:
    """The op's top-k ``got`` against torch.topk on the reference ``scores``: equal, except
    where two experts' reference scores tie within TIE. Returns the ties seen."""
    want = torch.topk(scores, k).indices.tolist()
    ties = 0
    for a, b in zip(got, want, strict=True):
        if a != b:
            gap = abs(float(scores[a] - scores[b]))
            assert gap <= TIE, f"op picked {got}, torch {want} (scores differ by {gap:.2e})"
            ties += 1
    return ties


def _checked(stream, seen: dict) -> None:
    """Make ``stream`` compare the op with the torch stream on every decode step."""
    forward = stream.forward

    def run(embedding, rope, position_ids, cache):
        if embedding.shape[1] == 1:
            kernel = stream._kernel_for(embedding, cache)
            assert kernel is not None, "the op covers this model"
            ids, scores, states = kernel.predict(embedding, position_ids, cache)
            want_states, want_scores = _reference(stream, embedding, rope, position_ids, cache)
            torch.testing.assert_close(states, want_states, rtol=1e-5, atol=1e-5)
            for row, (got, want) in enumerate(zip(scores, want_scores, strict=True)):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                seen["ties"] += _check_ids(ids[row].tolist(), want, kernel.top_k)
            seen["steps"] += 1
        return forward(embedding, rope, position_ids, cache)

    stream.forward = run


def test_a_fast_layer_ahead_reads_what_it_read_beside_its_slow_layer():
    # Ahead of slow layer i (keys 0..n-1 cached) and beside it (it has written t = n) the
    # layer attends to the same keys: the same state (bit for bit without a window).
    model = tiny_moe_model("olmoe", layers=2, seed=1)
    host = model.model.layers[0]
    g = torch.Generator().manual_seed(0)
    for window in (None, 3):
        layer = AcceleratedLayer(host, index=0, heads=4, rank=4, window=window).eval()
        _perturb(layer)
        cache = StaticKVCache(num_layers=2, num_kv_heads=2, head_dim=8, max_len=16)
        n = 6
        kv = torch.randn(2, 1, 2, n + 1, 8, generator=g)  # keys, values of positions 0..n
        cache.update(kv[0, :, :, :n], kv[1, :, :, :n], 0)
        p = torch.randn(1, 1, 32, generator=g)
        positions = torch.tensor([[n]])
        rope = model.model.rotary_emb(p, positions)
        with torch.no_grad():
            ahead = layer(p, rope, positions, cache, ahead=True)
            cache.update(kv[0, :, :, n:], kv[1, :, :, n:], 0)  # slow layer 0 writes t = n
            beside = layer(p, rope, positions, cache)
        if window is None:
            assert torch.equal(ahead, beside)
        else:  # beside: the masked parallel path (the SDPA kernel differs), the same keys
            torch.testing.assert_close(ahead, beside, rtol=1e-6, atol=1e-6)


def test_one_node_before_slow_layer_0_predicts_every_moe_layer_from_2():
    model = tiny_moe_model("olmoe", layers=8, experts=8, top_k=2, seed=3)
    sm = _offloaded(model, kernels=False, perturb=False, tier="host")
    gm = sm.graph_module
    (node,) = nodes_by_role(gm, "prefetch")
    assert node.args[0].meta[ROLE] == "embed" and node.prev.meta[ROLE] == "rotary"
    assert node.meta["leapfx.prefetch_layers"] == [2, 3, 4, 5, 6, 7]
    stream = _stream(sm)
    assert stream.sources == [0, 0, 1, 1, 2, 2] and len(stream.layers) == 3
    assert not nodes_by_role(gm, "fast_stream")
    sm.offload.close()


@needs_op
@pytest.mark.parametrize(
    ("arch", "kw"),
    [
        ("olmoe", {}),
        ("olmoe", {"heads": 2}),  # full-width q/k norms over the kept heads' channels
        ("olmoe", {"clip": 0.5}),
        ("qwen3_moe", {}),  # per-head q/k norms
        ("qwen2_moe", {}),  # q/k/v biases, a shared expert
        ("mixtral", {}),
    ],
)
def test_op_computes_the_torch_stream(arch, kw, tmp_path):
    model = tiny_moe_model(arch, layers=8, experts=8, top_k=2, seed=5)
    if "clip" in kw:
        model.config.clip_qkv = kw["clip"]  # the layers' attention reads the shared config
    _randomize_norms(model)
    options = {}
    if "heads" in kw:  # parts trained with fewer query heads than the host has
        trained = rewrite.apply(model, "m2r2", fast_layers=4, heads=kw["heads"])
        trained.save_parts(tmp_path / "parts")
        options["m2r2_parts"] = tmp_path / "parts"
    sm = _offloaded(model, kernels=True, tier="host", **options)
    if "heads" in kw:
        assert len(_stream(sm).layers[0].q_heads) == kw["heads"]
    stream = _stream(sm)
    seen = {"steps": 0, "ties": 0}
    _checked(stream, seen)
    g = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        for n in (1, 7):
            sm.generate(torch.randint(1, 128, (1, n), generator=g), max_new_tokens=10)
    # a one-token prompt's prefill is one row too (an empty cache): 10 + 9 steps
    assert seen["steps"] == 19 and seen["ties"] == 0
    if "clip" in kw:
        assert stream._kernel.clip == 0.5
    sm.offload.close()


@needs_op
def test_op_predicts_the_torch_experts_on_moe_reference():
    # The shipped model and rate-2 parts, ~300 decode steps: the same experts as the torch
    # stream (an exact tie excepted, shown within 1e-5), the same tokens as resident decoding.
    from leapfx.models import load_model

    model = load_model("moe-reference")[0]
    parts = ROOT / "leapfx/assets/moe-reference/m2r2"
    sm = _offloaded(model, kernels=True, slots=0.25, perturb=False, m2r2_parts=parts)
    seen = {"steps": 0, "ties": 0}
    _checked(_stream(sm), seen)
    resident = rewrite.apply(model, "autoregressive", cpu_kernels=True)
    text = (ROOT / "leapfx/runtime/schedules.py").read_bytes()
    with torch.inference_mode():
        for i in range(4):
            prompt = torch.tensor([list(text[i * 500 : i * 500 + 48])])
            ours = sm.generate(prompt, max_new_tokens=76)
            assert torch.equal(ours, resident.generate(prompt, max_new_tokens=76))
    assert seen["steps"] == 4 * 75
    assert seen["ties"] <= 2, seen
    sm.offload.close()


@pytest.mark.parametrize("lead", [2, None], ids=["lead2", "at_once"])
@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "op"])
@pytest.mark.parametrize("delay", [0.0, 0.002], ids=["inline", "delayed"])
def test_offloaded_m2r2_decodes_like_resident(kernels, delay, lead):
    if kernels and not cpu_m2r2.available():
        pytest.skip("no C++ toolchain here")
    model = tiny_moe_model("olmoe", layers=6, experts=6, top_k=2, vocab=64, seed=7)
    prompt = torch.tensor([[5, 9, 2, 33, 1]])
    want, _ = _resident(model, "autoregressive", prompt, 16)
    sm = _offloaded(model, kernels=kernels, slots=2, poison=True, transfer_delay_s=delay,
                    prefetch_lead=lead)  # fmt: skip
    try:
        got = sm.generate(prompt, max_new_tokens=16)
    finally:
        sm.offload.close()
    assert torch.equal(got, want), f"offloaded {got.tolist()}\nresident  {want.tolist()}"
    assert (_stream(sm)._kernel not in (False, None)) == kernels
    report = sm.last_offload_report
    assert report.prefetch_precision is not None and 0 < report.prefetch_recall <= 1


def _step_order(lead: int | None) -> list[tuple[str, int]]:
    """A decode step's prefetch calls (layers 2..7) and layer runs on an 8-layer model."""
    if lead is None:  # every prefetch before slow layer 0
        return [("prefetch", t) for t in range(2, 8)] + [("run", i) for i in range(8)]
    order = [("prefetch", t) for t in range(2, 8) if t - lead < 0]  # due before layer 0
    for i in range(8):  # layer i's run, then (once its experts are placed) layer i + lead's
        order.append(("run", i))
        if 2 <= i + lead < 8:
            order.append(("prefetch", i + lead))
    return order


@pytest.mark.parametrize("lead", [None, 1, 2, 3])
@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "op"])
def test_a_step_predicts_before_slow_layer_0_and_loads_lead_layers_ahead(kernels, lead):
    if kernels and not cpu_m2r2.available():
        pytest.skip("no C++ toolchain here")
    model = tiny_moe_model("olmoe", layers=8, experts=8, top_k=2, seed=3)
    sm = _offloaded(model, kernels=kernels, tier="host", prefetch_lead=lead)
    runtime = sm.offload
    events: list[tuple[str, int]] = []
    prefetch, run, queue = runtime.prefetch_experts, runtime.run, runtime.queue_prefetches

    def record_prefetch(layer, candidates, **kw):
        events.append(("prefetch", layer))
        return prefetch(layer, candidates, **kw)

    def record_run(layer, *args):
        events.append(("run", layer))
        return run(layer, *args)

    def record_queue(predictions, **kw):
        events.append(("predict", len(predictions)))
        return queue(predictions, **kw)

    runtime.prefetch_experts, runtime.run = record_prefetch, record_run
    runtime.queue_prefetches = record_queue
    sm.generate(torch.tensor([[3, 1, 4, 1, 5]]), max_new_tokens=6)
    runtime.close()
    # the prefill predicts nothing (and drops what an earlier call left queued)
    assert events[:9] == [("predict", 0)] + [("run", i) for i in range(8)]
    steps = events[9:]
    assert len(steps) == 5 * 15  # then 5 decode steps: 6 predictions at once, 6 loads, 8 runs
    for i in range(5):
        step = steps[i * 15 : (i + 1) * 15]
        assert step == [("predict", 6)] + _step_order(lead)


@pytest.mark.parametrize("bad", ["0", "-1", "two", "1.5"])
def test_bench_refuses_a_bad_prefetch_lead(bad, capsys):
    from leapfx.cli import main

    argv = ["bench", "--model", "moe-reference", "--offload-slots", "0.5",
            "--offload-prefetch-lead", bad]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--offload-prefetch-lead: {bad!r} is invalid; allowed: an integer >= 1" in err


@pytest.mark.parametrize("lead", [None, 2])
def test_the_bench_rows_load_with_the_lead_asked_for(lead):
    from leapfx.bench.offload import offload_systems

    specs = offload_systems(0.5, exit_layer=1, prefetch_lead=lead)
    leads = {name: opts.prefetch_lead for name, (_, opts, _) in specs.items() if opts}
    assert leads and set(leads.values()) == {lead}
    default = offload_systems(0.5, exit_layer=1)["leapfx_offload_m2r2"][1].prefetch_lead
    assert default == DEFAULT_PREFETCH_LEAD == OffloadOptions().prefetch_lead


def test_the_bench_default_lead_is_the_runtime_default():
    from leapfx.bench.harness import BenchConfig
    from leapfx.cli import _prefetch_lead, build_parser

    given = build_parser().parse_args(["bench"]).offload_prefetch_lead
    assert _prefetch_lead(given) == BenchConfig().offload_prefetch_lead == DEFAULT_PREFETCH_LEAD
