"""A copy of a stage whose LM head reads the last position only: the prompt's prefill.

A prefill needs one row of logits, the next token's; the ``full`` stage runs the head over
every position it is given. On a model with a real vocabulary that is a large share of the
prefill: SmolLM2-135M's tied 49,152 x 576 head is a fifth of its FLOPs per position, and a
batch of long prompts pays it B x S times. ``head_at_last(gm)`` returns the stage with the
head's input cut to the last position (``hidden[:, -1:]``), so ``logits`` is [B, 1, V]; every
other output (EAGLE's hidden states, cache writes) is the stage's own. The head is the same
module, so the logits at that position are the same numbers.

It applies where the stage's ``logits`` is one module call on one tensor read by nothing else
(``lm_head(norm)``, the captured form); anything else (a soft-capped head, a head whose output
another node reads) gives None and the caller runs the stage as it is.

    >>> prefill = head_at_last(stages["full"])
    >>> prefill(**inputs)["logits"].shape        # [B, 1, V]
"""

from __future__ import annotations

import copy
import operator

from torch import fx

__all__ = ["head_at_last"]


def _head(graph: fx.Graph) -> fx.Node | None:
    output = next((n for n in graph.nodes if n.op == "output"), None)
    result = output.args[0] if output is not None and output.args else None
    head = result.get("logits") if isinstance(result, dict) else None
    if not isinstance(head, fx.Node) or head.op != "call_module":
        return None
    if len(head.args) != 1 or head.kwargs or not isinstance(head.args[0], fx.Node):
        return None
    return head if len(head.users) == 1 else None


def head_at_last(gm: fx.GraphModule) -> fx.GraphModule | None:
    """``gm`` with its LM head on the last position only (see the module docstring), sharing
    ``gm``'s modules and weights; None where the head is not a plain module call."""
    if not isinstance(gm, fx.GraphModule) or _head(gm.graph) is None:
        return None
    graph = fx.Graph()
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    nodes: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, nodes))
    head = _head(graph)
    with graph.inserting_before(head):
        last = graph.call_function(operator.getitem, (head.args[0], (slice(None), slice(-1, None))))
    head.args = (last,)
    graph.lint()
    return fx.GraphModule(gm, graph, class_name=type(gm).__name__)
