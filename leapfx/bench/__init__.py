"""Benchmarks: ``leapfx bench`` runs HF and leapfx systems side by side on one model.

The default model is the project's reference model, shipped in ``leapfx/assets/reference``
(trained by ``leapfx train-reference``; its model card is ``assets/reference/README.md``).
Prompts are the first tokens of held-out Python standard-library functions.
"""

from __future__ import annotations

from pathlib import Path

import torch

REFERENCE_MODEL = Path(__file__).resolve().parent.parent / "assets" / "reference"
REFERENCE_ADAPTER = REFERENCE_MODEL / "kangaroo_adapter"  # trained with sm.fit, see its model card


def load_model(path: str | Path | None = None, *, device: str = "cpu"):
    """Load a local HF checkpoint directory (float32 on CPU) and its tokenizer.

    Raises ValueError with one line for a missing directory, a directory that is no HF
    checkpoint, or an architecture leapfx does not support.
    """
    import transformers

    from ..passes.capture import check_supported

    path = Path(path) if path is not None else REFERENCE_MODEL
    if not path.is_dir():
        hint = " (the reference model is not shipped yet?)" if path == REFERENCE_MODEL else ""
        raise ValueError(f"--model: {str(path)!r} is not a directory{hint}")
    if not (path / "config.json").is_file():
        raise ValueError(f"--model: {str(path)!r} has no config.json; expected a HF checkpoint")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"--device: {device!r} is invalid ({exc})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device: {device!r} requested but no CUDA device is available")
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        model = transformers.AutoModelForCausalLM.from_config(config)  # architecture check first
        check_supported(model)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, local_files_only=True
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"--model: cannot load {str(path)!r}: {first}") from None
    return model.to(dev).eval(), tokenizer


def bench_prompts(tokenizer, *, count: int, num_tokens: int, device="cpu") -> list[torch.Tensor]:
    """The first ``num_tokens`` tokens of ``count`` held-out stdlib functions."""
    from ..train.data import held_out_prompts, stdlib_corpus

    if count < 1:
        raise ValueError(f"--prompts: {count} is invalid; allowed: an integer >= 1")
    if num_tokens < 2:
        raise ValueError(f"--prompt-tokens: {num_tokens} is invalid; allowed: an integer >= 2")
    prompts = held_out_prompts(tokenizer, stdlib_corpus(), num_tokens=num_tokens, count=count)
    return [torch.tensor([p.input_ids], device=device) for p in prompts]
