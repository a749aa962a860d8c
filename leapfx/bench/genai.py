"""onnxruntime-genai's rows in ``leapfx bench --backend onnxruntime``: the model exported as one
standard decoder (``sm.export_onnx(dir, format="genai")``) and decoded by onnxruntime-genai's
own ``Generator``, greedy, on the same prompts (as token ids) and token budget as every other
row, with the same thread count: ``onnxruntime_genai``, and ``onnxruntime_genai_ngram`` with
its n-gram speculation (prompt lookup in its terms). The full model decides every token, so
both rows are lossless up to float32 summation order, checked like the others.

Without the package (the ``genai`` extra) the rows are skipped with the install command logged.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import torch
from torch import nn

from .. import rewrite
from ..files import write_text_atomic

log = logging.getLogger(__name__)

INSTALL = "pip install -e '.[genai]' in leapfx's checkout (onnxruntime-genai)"
# its n-gram speculation: the longest n-gram matched and the drafts a round (HF's prompt lookup
# row drafts up to 10 tokens from matches of up to 3)
NGRAM_SIZE = 3
NGRAM_DRAFTS = 10


def available() -> bool:
    return importlib.util.find_spec("onnxruntime_genai") is not None


def export(model: nn.Module, directory: Path, threads: int) -> Path:
    """The model as onnxruntime-genai's decoder in ``directory``, its session on ``threads``
    intra-op threads (the bench's count: its ``genai_config.json`` says so)."""
    path = rewrite.apply(model, "autoregressive").export_onnx(
        directory, format="genai", overwrite=True
    )
    config_path = Path(path) / "genai_config.json"
    config = json.loads(config_path.read_text())
    config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = threads
    write_text_atomic(config_path, json.dumps(config, indent=2))
    return Path(path)


def greedy(path: Path, n: int, ngram: bool):
    """``run(prompt [1, S]) -> ids [1, S + new]``: onnxruntime-genai's greedy decode of at most
    ``n`` new tokens (its n-gram speculation with ``ngram``), stopping at EOS as HF does."""
    import numpy as np
    import onnxruntime_genai as og

    model = og.Model(str(path))

    def run(prompt: torch.Tensor) -> torch.Tensor:
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=prompt.shape[1] + n)
        if ngram:
            params.set_speculative_options(ngram_size=NGRAM_SIZE, max_draft_tokens=NGRAM_DRAFTS)
        generator = og.Generator(model, params)
        generator.append_tokens(prompt[0].cpu().numpy().astype(np.int32))
        while not generator.is_done():
            generator.generate_next_token()
        ids = [int(t) for t in generator.get_sequence(0)][: prompt.shape[1] + n]
        last = [int(t) for t in generator.get_next_tokens()]
        if len(ids) < prompt.shape[1] + n and last and last[-1] != ids[-1]:
            ids.append(last[-1])  # it stopped at EOS and left it out of the sequence; HF keeps it
        return torch.tensor([ids], device=prompt.device)

    return run
