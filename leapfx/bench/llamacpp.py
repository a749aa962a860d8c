"""llama.cpp beside leapfx in the bench: the ``llama_cpp`` and ``llama_cpp_lookup`` rows.

A CPU user with a GGUF file runs llama.cpp; these rows run it (llama-cpp-python, the extra
``llamacpp``) on the same file, with the same thread count, prompts (as token ids: the same
tokens, no second tokenization) and token budget, greedy, timed like every other row:

- ``llama_cpp``: ``Llama.generate`` at temperature 0 (top-1);
- ``llama_cpp_lookup``: the same with llama-cpp-python's prompt-lookup drafting
  (``LlamaPromptLookupDecoding``, n-gram matches in the text so far).

llama.cpp quantizes the activations of its block products to 8 bits (``ggml_vec_dot_q4_1_q8_1``):
not float math on the dequantized weights, so its tokens may differ from HF greedy's. The rows
are lossy in the report's terms: their agreement is reported, identity is not required.

Each prompt starts from an empty cache (``Llama.reset``): llama-cpp-python would otherwise
reuse the cached prefix of the previous call, which the repeated passes of a bench would hand
it for free. Without llama-cpp-python the rows are skipped and :data:`INSTALL` says how to get
it (a 10-20 minute source build).
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Callable

import torch

from .memory import resident_bytes

log = logging.getLogger(__name__)

INSTALL = (
    "pip install -e '.[llamacpp]' in leapfx's checkout (llama-cpp-python: a source build of "
    "10-20 minutes on a 2-core CPU)"
)
LOOKUP_TOKENS = 10  # LlamaPromptLookupDecoding's num_pred_tokens (its default)
CONTEXT = 4096  # llama.cpp's KV cache, in tokens: a prompt plus its budget must fit


def available() -> bool:
    """Whether llama-cpp-python is installed (nothing is imported)."""
    return importlib.util.find_spec("llama_cpp") is not None


def _default_factory(path: str, threads: int, lookup: bool):
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS) if lookup else None
    return llama_cpp.Llama(
        model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=CONTEXT,
        draft_model=draft, verbose=False,
    )  # fmt: skip


def version() -> str | None:
    try:
        from importlib.metadata import version as v

        return v("llama-cpp-python")
    except Exception:
        return None


def llama_cpp_runs(
    path: str,
    *,
    threads: int,
    max_new_tokens: int,
    eos: set[int],
    factory: Callable | None = None,
) -> list[tuple[str, Callable[[torch.Tensor], torch.Tensor], dict]]:
    """``(name, generate, info)`` for the two rows over GGUF file ``path``; ``generate(prompt
    [1, n]) -> [1, n + new]`` greedy, stopping after ``eos`` or ``max_new_tokens``. ``info``:
    the load (seconds, and again with the file in the page cache; resident memory it added).
    ``factory(path, threads, lookup) -> Llama``: for tests (default: llama-cpp-python)."""
    make = factory or _default_factory
    runs = []
    for name, lookup in (("llama_cpp", False), ("llama_cpp_lookup", True)):
        before = resident_bytes()
        start = time.perf_counter()
        llm = make(path, threads, lookup)
        seconds = time.perf_counter() - start
        grown = None if before is None else resident_bytes() - before
        start = time.perf_counter()
        again = make(path, threads, lookup)
        cached = time.perf_counter() - start
        del again
        info = {
            "llama_cpp_version": version(), "threads": threads,
            "load": {"seconds": seconds, "seconds_cached": cached, "resident_bytes": grown},
        }  # fmt: skip
        if lookup:
            info["lookup_tokens"] = LOOKUP_TOKENS
        runs.append((name, _generate(llm, max_new_tokens, eos), info))
    return runs


def _generate(llm, max_new_tokens: int, eos: set[int]) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(prompt: torch.Tensor) -> torch.Tensor:
        ids = prompt[0].tolist()
        if len(ids) + max_new_tokens > CONTEXT:
            raise ValueError(
                f"llama_cpp: a prompt of {len(ids)} tokens plus {max_new_tokens} new ones "
                f"exceeds its context of {CONTEXT} tokens"
            )
        llm.reset()  # from an empty cache, as every other row starts
        new = []
        for token in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            new.append(int(token))
            if token in eos or len(new) >= max_new_tokens:
                break
        return torch.tensor([ids + new], dtype=prompt.dtype)

    return run


def eos_ids(model) -> set[int]:
    """The token ids that end HF's greedy decoding of ``model`` (its generation config)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, list | tuple) else [eos])}


__all__ = ["INSTALL", "LOOKUP_TOKENS", "available", "eos_ids", "llama_cpp_runs", "version"]
