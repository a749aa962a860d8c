"""InsertExitPredictors: SpecEE's exit-predictor nodes (sec. 4.3, Fig. 6) as a graph rewrite.

SpecEE decides per token whether it may leave the model after layer ``l``, from the features of
k = 4 speculative tokens and a small MLP per layer (``leapfx.modules.specee`` holds the
modules and the math: ``exit_features``, ``LayerExit``, ``SpecEEPredictors``). The
predictors are owned by the rewritten GraphModule (``gm.specee``), never by the user's model.

The speculative tokens come from the graph's draft head (``exit_logits``: an exit head or the
Kangaroo adapter after the first E layers), so the first layer with candidates is E - 1 and
predictor nodes are inserted after layers E-1..L-2. Graph after the pass::

    exit_logits -> speculative_tokens (top-k of the last position)          [k]
    layer_l -> specee_exit_l = specee.exit_l(layer_l, speculative_tokens, p_{l-1})
            -> exit_prob_l (getitem 0) [1], exit_p_l (getitem 1) [1, k]
    output["exit_probs"] = cat(exit_prob_{E-1}, ..., exit_prob_{L-2})       [L - E]

The host scheduler (``leapfx.runtime.specee``) runs these nodes only at the active layers of the
two-level schedule; each check is a device-to-host sync.

Example::

    >>> gm = InsertExitHead(layer=4).run(capture(hf_model)).graph_module
    >>> gm = InsertExitPredictors().run(gm).graph_module
    >>> len(gm.specee.exits)      # L - 1 MLPs
    15
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import fx

from ..modules.specee import NUM_SPECULATIVE_TOKENS, SpecEEPredictors
from .base import GraphPass, PassResult, owned
from .capture import LAYER, ROLE, layer_node, nodes_by_role, output_dict, set_output_dict
from .exit_head import exit_layer_of

PREDICTOR_MODULE = "specee"  # attribute of the rewritten GraphModule
FIRST_PREDICTED = "leapfx.first_predicted_layer"  # gm.meta: E - 1


def speculative_tokens(exit_logits: torch.Tensor, k: int = NUM_SPECULATIVE_TOKENS) -> torch.Tensor:
    """S: the top-k token ids of the draft head's last position: ``[B, S, V] -> [k]`` (B = 1)."""
    return exit_logits[0, -1].topk(k).indices  # [k]


def predictors_of(gm: fx.GraphModule) -> SpecEEPredictors:
    """The SpecEEPredictors a graph rewritten by InsertExitPredictors owns."""
    return owned(
        gm, PREDICTOR_MODULE, SpecEEPredictors, "SpecEE predictors", "InsertExitPredictors"
    )


@dataclass(frozen=True)
class InsertExitPredictors(GraphPass):
    """Insert an exit-check node after each layer E-1..L-2 (E: the draft head's layer)."""

    name: ClassVar[str] = "insert-exit-predictors"
    requires: ClassVar[frozenset[str]] = frozenset({"decoder-graph"})
    provides: ClassVar[frozenset[str]] = frozenset({"exit-predictors"})

    # The first predicted layer. None: E - 1 for the graph's exit head or adapter after E
    # layers. An EAGLE head (``eagle_logits``) drafts before the token's pass, so any layer can
    # be the first; its nodes follow the head's in the graph.
    first_layer: int | None = None

    def run(self, gm: fx.GraphModule) -> PassResult:
        if nodes_by_role(gm, "exit_check"):
            return PassResult(gm, modified=False, matches=0)
        outputs = dict(output_dict(gm))
        source_key = "eagle_logits" if "eagle_logits" in outputs else "exit_logits"
        if source_key not in outputs:
            raise ValueError(
                "drafter: the graph has no draft head to take speculative tokens from; insert "
                "an exit head, a Kangaroo adapter or an EAGLE head first"
            )
        num_layers = len(nodes_by_role(gm, "layer"))
        if self.first_layer is not None:
            e = self.first_layer + 1
        elif source_key == "exit_logits":
            e = exit_layer_of(gm)
        else:
            e = 1
        norm = gm.get_submodule(nodes_by_role(gm, "norm")[0].target)
        head = gm.get_submodule(nodes_by_role(gm, "head")[0].target)
        if head.weight.shape[0] < NUM_SPECULATIVE_TOKENS:
            raise ValueError(
                f"model: a vocabulary of {head.weight.shape[0]} tokens is too small for "
                f"{NUM_SPECULATIVE_TOKENS} speculative tokens; allowed: >= "
                f"{NUM_SPECULATIVE_TOKENS}"
            )
        device = head.weight.device
        gm.add_submodule(PREDICTOR_MODULE, SpecEEPredictors(num_layers, norm, head).to(device))
        gm.meta[FIRST_PREDICTED] = e - 1
        graph = gm.graph
        with graph.inserting_after(outputs[source_key]):
            cands = graph.call_function(speculative_tokens, (outputs[source_key],))
        cands.name = "speculative_tokens"
        cands.meta[ROLE] = "speculative_tokens"
        probs, p_prev, anchor = [], None, cands
        for i in range(e - 1, num_layers - 1):
            source = layer_node(gm, i)
            assert source is not None, "capture annotates every decoder layer"
            # After the layer and after the candidates (E - 1: the adapter follows the layer;
            # an EAGLE head's candidates come after the last layer: every check follows them).
            after = anchor if i == e - 1 or source_key == "eagle_logits" else source
            with graph.inserting_after(after):
                check = graph.call_module(f"{PREDICTOR_MODULE}.exits.{i}", (source, cands, p_prev))
            with graph.inserting_after(check):
                prob = graph.call_function(operator.getitem, (check, 0))
            with graph.inserting_after(prob):
                p = graph.call_function(operator.getitem, (check, 1))
            check.name, prob.name, p.name = f"exit_check_{i}", f"exit_prob_{i}", f"exit_p_{i}"
            for node, role in ((check, "exit_check"), (prob, "exit_prob"), (p, "exit_p")):
                node.meta[ROLE] = role
                node.meta[LAYER] = i
            probs.append(prob)
            p_prev, anchor = p, p
        out = next(n for n in graph.nodes if n.op == "output")
        with graph.inserting_before(out):
            joined = graph.call_function(torch.cat, (probs,))
        joined.name = "exit_probs"
        joined.meta[ROLE] = "exit_probs"
        outputs["exit_probs"] = joined
        set_output_dict(gm, outputs)
        return PassResult(gm, modified=True, matches=len(probs))
