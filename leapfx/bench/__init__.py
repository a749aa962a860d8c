"""Benchmarks: ``leapfx bench`` runs HF and leapfx systems side by side on one model.

The default model is the project's reference model, shipped in ``leapfx/assets/reference``
(trained by ``leapfx train-reference``; its model card is ``assets/reference/README.md``).
``--model moe-reference`` is the shipped MoE reference model (``assets/moe-reference``, trained
by ``leapfx train-moe-reference``), with the rate-2 M2R2 parts the offload rows' ``m2r2``
prefetch policy uses beside it.
Prompts are the first tokens of held-out Python standard-library functions. ``--random-model
SIZE`` times a Llama-shaped model with random weights instead (``leapfx.bench.random_model``).
"""

from __future__ import annotations

from pathlib import Path

import torch

REFERENCE_MODEL = Path(__file__).resolve().parent.parent / "assets" / "reference"
REFERENCE_ADAPTER = REFERENCE_MODEL / "kangaroo_adapter"  # trained with sm.fit, see its model card
REFERENCE_M2R2 = REFERENCE_MODEL / "m2r2"  # the self-speculation drafter, `leapfx train-m2r2`
REFERENCE_M2R2_EXIT = REFERENCE_MODEL / "m2r2_exit"  # exit gates 4, 8, 12 + ARLA routers
REFERENCE_EAGLE = REFERENCE_MODEL / "eagle"  # EAGLE head parts: `leapfx train-eagle`
MOE_REFERENCE_MODEL = REFERENCE_MODEL.parent / "moe-reference"  # `leapfx train-moe-reference`
# Its rate-2 fast stream (`leapfx train-m2r2 --fast-layers 6`): the m2r2 prefetch policy's.
MOE_REFERENCE_M2R2 = MOE_REFERENCE_MODEL / "m2r2"
# Names --model takes besides a directory. A name wins over a folder of that name in the working
# directory (pass ./moe-reference for the folder).
MODEL_NAMES = {"reference": REFERENCE_MODEL, "moe-reference": MOE_REFERENCE_MODEL}

# --dtype: the model's weights and compute dtype.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def bench_device(device: str | torch.device) -> torch.device:
    """``--device`` as a torch.device; ValueError for a bad name or a missing CUDA device."""
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"--device: {device!r} is invalid ({exc})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device: {device!r} requested but no CUDA device is available")
    return dev


def bench_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``--dtype`` (a name of ``DTYPES`` or a torch dtype); None: float32 on a CPU, bfloat16
    on an accelerator."""
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"--dtype: {dtype!r} is invalid; allowed: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_model(path: str | Path | None = None, *, device: str = "cpu", dtype=None):
    """Load a local HF checkpoint directory and its tokenizer, in ``dtype`` (see
    :func:`bench_dtype`; default float32 on CPU, bfloat16 on a GPU).

    Raises ValueError with one line for a missing directory, a directory that is no HF
    checkpoint, or an architecture leapfx does not support.
    """
    import transformers

    from ..passes.capture import check_supported

    path = resolve_model(path)
    if not path.is_dir():
        shipped = path in MODEL_NAMES.values()
        hint = " (the reference model is not shipped yet?)" if shipped else ""
        raise ValueError(f"--model: {str(path)!r} is not a directory{hint}")
    if not (path / "config.json").is_file():
        raise ValueError(f"--model: {str(path)!r} has no config.json; expected a HF checkpoint")
    dev = bench_device(device)
    dtype = bench_dtype(dtype, dev)
    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        with torch.device("meta"):  # the architecture check first, no weights allocated
            check_supported(transformers.AutoModelForCausalLM.from_config(config))
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, local_files_only=True
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"--model: cannot load {str(path)!r}: {first}") from None
    return model.to(dev).eval(), tokenizer


def resolve_model(path: str | Path | None) -> Path:
    """``--model``: None is the reference model, a name of ``MODEL_NAMES`` a shipped model,
    anything else a directory."""
    if path is None:
        return REFERENCE_MODEL
    return MODEL_NAMES.get(str(path), Path(path))


def bench_prompts(tokenizer, *, count: int, num_tokens: int, device="cpu") -> list[torch.Tensor]:
    """The first ``num_tokens`` tokens of ``count`` held-out stdlib functions."""
    from ..train.data import held_out_prompts, stdlib_corpus

    if count < 1:
        raise ValueError(f"--prompts: {count} is invalid; allowed: an integer >= 1")
    if num_tokens < 2:
        raise ValueError(f"--prompt-tokens: {num_tokens} is invalid; allowed: an integer >= 2")
    prompts = held_out_prompts(tokenizer, stdlib_corpus(), num_tokens=num_tokens, count=count)
    return [torch.tensor([p.input_ids], device=device) for p in prompts]
