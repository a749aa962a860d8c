"""The draft chain: LayerSkip's d greedy draft steps as one executor call (``draft_chain``).

Each draft call pays a fixed cost that does not depend on the layers it runs (the runner around
it; for a compiled stage, dynamo's frame and guard checks and the C++ wrapper taking every
weight and cache buffer). Where a recipe's greedy rounds draft d tokens through the draft stage
alone (``Capabilities.has_chain``), one ``draft_chain`` executor runs the d steps in one call:
``CompiledChain`` (``inductor.py``), ``EagerChain`` (``cpu_kernels.py``), and the export's
unrolled ``draft_chain.onnx`` (``leapfx.export.chain``). ``chain_length(sm)`` says how many
steps; ``greedy_chain`` is the steps, written once for the compiled and the eager chain.
"""

from __future__ import annotations

import torch


def greedy_chain(step, input_ids: torch.Tensor, position_ids: torch.Tensor, length: int):
    """``length`` greedy draft steps: ``step(ids, positions)`` (a draft stage's outputs) fed
    ``input_ids`` at ``position_ids``, then each step the argmax of the one before at the next
    position (as ``schedules.draft``). Returns the draft tokens [1, length] and the exit hidden
    states of the tokens fed [1, length, H]: the chain executors' outputs."""
    tokens, hidden = [], []
    ids = input_ids
    for i in range(length):
        out = step(ids, position_ids + i)
        ids = out["logits"][:, -1].argmax(dim=-1, keepdim=True)
        tokens.append(ids)
        hidden.append(out["hidden"])
    return {"tokens": torch.cat(tokens, dim=1), "hidden": torch.cat(hidden, dim=1)}


def chain_length(sm) -> int:
    """The drafts of a ``draft_chain`` for ``sm``: d where its recipe's rounds draft d greedy
    tokens through the draft stage (``Capabilities.has_chain``: LayerSkip) and no confidence
    threshold cuts them short, else 0."""
    if not sm.recipe.capabilities.has_chain or "draft" not in sm.stages.modules:
        return 0
    if getattr(sm.options, "confidence_threshold", 0) > 0:
        return 0
    d = getattr(sm.options, "num_speculations", 0)
    return d if d >= 2 else 0
