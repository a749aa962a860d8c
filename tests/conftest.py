"""Shared fixtures: tiny random HF models of every supported architecture (no downloads)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import transformers
from hypothesis import HealthCheck, settings

settings.register_profile(
    "default",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"


def examples(default: int, thorough: int) -> int:
    """A property test's example budget: modest by default (the suite stays fast on a cold
    2-core machine), larger under ``HYPOTHESIS_PROFILE=thorough``. Every ``@settings`` of the
    suite takes its ``max_examples`` from here, so the profile reaches it (a bare number would
    override the profile); where no other thorough budget was chosen it is four times the
    default, at most the profile's 300 and never below the default."""
    return thorough if THOROUGH else default


# Tiny models gain nothing from intra-op threads, and on a shared 2-core machine OpenMP
# barriers under contention make each call ~20x slower.
torch.set_num_threads(1)
transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore", message=".*generation flags are not valid.*")

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma")

_CONFIGS = {
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "phi3": transformers.Phi3Config,
    "gemma": transformers.GemmaConfig,
}


def tiny_model(
    arch: str = "llama",
    *,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 8,
    vocab: int = 128,
    tie: bool = False,
    eos: int | None = None,
    sliding_window: int | None = None,
    seed: int = 0,
    attn: str = "sdpa",
    dtype: torch.dtype = torch.float32,
):
    """A randomly initialised tiny causal LM of ``arch`` (eval mode)."""
    hidden = heads * head_dim
    kwargs = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=0,
    )
    if arch == "phi3":
        kwargs.pop("head_dim")
    if arch in ("mistral", "phi3"):
        kwargs["sliding_window"] = sliding_window
    if arch == "qwen2" and sliding_window is not None:
        kwargs.update(use_sliding_window=True, sliding_window=sliding_window,
                      max_window_layers=layers // 2)  # fmt: skip
    config = _CONFIGS[arch](**kwargs)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    # Random init gives near-uniform logits; a sharper head makes float-noise ties rarer
    # (they are still detected and reported by the tests, never assumed away).
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model.to(dtype).eval()


MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def randomize_accelerator(sm, scale: float = 0.1, seed: int = 0) -> None:
    """Every parameter of an m2r2 model's accelerator random, as training would make it (the
    gate included: an untrained one multiplies the fast attention by zero), and the CPU
    kernels' packed copies rebuilt from them."""
    from leapfx.passes.accelerator import accelerator_of

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in accelerator_of(sm.graph_module).parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    if sm.cpu_kernels:
        sm.use_cpu_kernels()


def tiny_moe_model(
    arch: str = "olmoe",
    *,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 8,
    vocab: int = 128,
    experts: int = 4,
    top_k: int = 2,
    intermediate: int = 16,
    norm_topk_prob: bool = False,
    dense_layers: tuple[int, ...] = (),
    sliding_window: int | None = None,
    tie: bool = False,
    eos: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
):
    """A randomly initialised tiny Mixture-of-Experts causal LM of ``arch`` (eval mode).

    qwen2_moe has its sigmoid-gated shared expert; ``dense_layers`` are the qwen families'
    ``mlp_only_layers``; mixtral always renormalises the top-k (``norm_topk_prob`` ignored).
    ``sliding_window``: mixtral and qwen3_moe (every layer), ignored elsewhere.
    """
    hidden = heads * head_dim
    kwargs = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=0,
        num_experts_per_tok=top_k,
    )
    if arch == "mixtral":
        config = transformers.MixtralConfig(
            intermediate_size=intermediate, num_local_experts=experts,
            sliding_window=sliding_window, **kwargs,
        )  # fmt: skip
    elif arch == "olmoe":
        config = transformers.OlmoeConfig(
            intermediate_size=intermediate, num_experts=experts, norm_topk_prob=norm_topk_prob,
            **kwargs,
        )  # fmt: skip
    else:
        cls = transformers.Qwen2MoeConfig if arch == "qwen2_moe" else transformers.Qwen3MoeConfig
        extra = {"shared_expert_intermediate_size": 2 * intermediate} if arch == "qwen2_moe" else {}
        if arch == "qwen3_moe" and sliding_window is not None:
            extra.update(use_sliding_window=True, sliding_window=sliding_window)
        config = cls(
            moe_intermediate_size=intermediate, intermediate_size=3 * intermediate,
            num_experts=experts, norm_topk_prob=norm_topk_prob, mlp_only_layers=list(dense_layers),
            **extra, **kwargs,
        )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
        for layer in model.model.layers:
            # Routers start at zero in some families: random routers make routing matter.
            gate = getattr(getattr(layer, "mlp", None), "gate", None)
            if gate is not None and hasattr(gate, "weight") and gate.weight.dim() == 2:
                gate.weight.normal_(0.0, 0.5)
    return model.to(dtype).eval()


@pytest.fixture
def llama():
    return tiny_model("llama", layers=4)


@pytest.fixture(scope="session", autouse=True)
def onnx_stage_memo(tmp_path_factory):
    """Every ONNX export of the run exports each distinct stage once (``tests/onnx_memo.py``:
    a stage identical in code, weights and example inputs to one exported before, in this
    worker or another, is copied from that export's files; the rest of the export runs).
    ``LEAPFX_TEST_STAGE_MEMO=0`` exports every stage (to measure the memo, or to rule it out)."""
    from onnx_memo import StageMemo, shared_root

    if os.environ.get("LEAPFX_TEST_STAGE_MEMO") == "0":
        yield None
        return
    with StageMemo(shared_root(tmp_path_factory)).installed() as memo:
        yield memo


def _slow_first(items: list, workers: int) -> list:
    """Tests marked slow (Inductor compiles, the reference model: a minute or more each, cold)
    first, so that xdist's load balancing does not end with one worker running one of them
    alone while the other idles; the order is otherwise unchanged.

    Under xdist (``workers`` > 1) every worker must start on its share of them: xdist's load
    scheduling sends each worker a first chunk of consecutive tests (a quarter of its share),
    so slow tests at the front alone would all be the first worker's, one after another, the
    whole run's critical path. Each chunk starts with every ``workers``-th slow test instead."""
    slow = [item for item in items if "slow" in item.keywords]
    rest = [item for item in items if "slow" not in item.keywords]
    if workers < 2:
        return slow + rest
    chunk = max(len(items) // workers // 4, 2)  # xdist.scheduler.load: a node's first chunk
    ordered = []
    for w in range(workers):
        mine = slow[w::workers]
        take = max(chunk - len(mine), 0)
        ordered += mine + rest[:take]
        rest = rest[take:]
    return ordered + rest


def pytest_collection_modifyitems(config, items):
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    items[:] = _slow_first(items, workers)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
