"""SubsetDraftHead: a drafter's LM head over the N most frequent tokens (``draft_vocab=N``).

The token ranking is measured on the training data (``token_ranking``: every id of the
vocabulary, most frequent first, ties by id) and saved with the parts beside their own files
(``draft_vocab.safetensors``, ``leapfx.parts.draft_vocab``).

Parts written before the ranking existed have no such file and load as before; only asking
them for ``draft_vocab`` is refused. The whole ranking is saved, so any N can be chosen when the
parts are applied: N is a decoding option, not a trained one.

The pass replaces the module of the drafter's logits node (``role``: ``eagle_head`` of an EAGLE
head, ``adapter_head`` of Kangaroo's adapter, ``gate_head`` of M2R2's fast stream) with a
:class:`SubsetLMHead` of the ranking's first N ids; the verifying head (role ``head``) is
untouched, so decoding stays lossless (see the module's docstring for sampling). The ranking comes
from ``path`` (parts) when given, else from ``gm.meta[TOKEN_RANKING]`` (what ``fit`` measured);
without one the subset starts as ids 0..N-1, and ``fit`` installs the measured ranking
(``install_ranking``). With ``draft_vocab`` None the pass only records the parts' ranking, so
saving the parts again keeps it.

    >>> gm = SubsetDraftHead(role="eagle_head", draft_vocab=8192, path="parts/").run(gm)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import fx

from ..modules.draft_vocab import SubsetLMHead
from ..options import check_int
from ..parts.draft_vocab import RANKING_FILE, read_ranking
from .base import GraphPass, PassResult
from .capture import nodes_by_role

log = logging.getLogger(__name__)

SUBSET_MODULE = "draft_vocab_head"  # attribute of the rewritten GraphModule
TOKEN_RANKING = "leapfx.token_ranking"  # gm.meta: [V] int64, most frequent token first


def token_ranking(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Every id of a ``vocab_size`` vocabulary, most frequent in ``tokens`` first (ties: the
    lower id first): ``[V]`` int64.

    >>> token_ranking(torch.tensor([2, 2, 0]), 4).tolist()
    [2, 0, 1, 3]
    """
    counts = torch.bincount(tokens.reshape(-1).long().cpu(), minlength=vocab_size)
    if counts.numel() != vocab_size:
        raise ValueError(f"data: token ids reach {counts.numel() - 1}; vocab_size is {vocab_size}")
    return torch.sort(counts, descending=True, stable=True).indices


def ranking_of(gm: fx.GraphModule) -> torch.Tensor | None:
    """The token ranking recorded on ``gm`` (measured by ``fit`` or read from parts), or None."""
    return gm.meta.get(TOKEN_RANKING)


def subset_head_of(gm: fx.GraphModule) -> SubsetLMHead | None:
    """The SubsetLMHead of ``gm`` (``draft_vocab`` set), or None."""
    module = getattr(gm, SUBSET_MODULE, None)
    return module if isinstance(module, SubsetLMHead) else None


def install_ranking(gm: fx.GraphModule, ranking: torch.Tensor, lm_head) -> None:
    """Record ``ranking`` [V] on ``gm`` and, where it drafts over a subset, gather its rows."""
    gm.meta[TOKEN_RANKING] = ranking.long().cpu()
    subset = subset_head_of(gm)
    if subset is not None:
        subset.set_ranking(lm_head, ranking[: subset.draft_vocab])


@dataclass(frozen=True)
class SubsetDraftHead(GraphPass):
    """The drafter's logits (the node of role ``role``) over ``draft_vocab`` tokens only."""

    name: ClassVar[str] = "subset-draft-head"

    role: str  # the drafter's logits node: "eagle_head", "adapter_head" or "gate_head"
    draft_vocab: int | None
    path: str | None = None  # a parts directory that may hold a ranking

    def run(self, gm: fx.GraphModule) -> PassResult:
        nodes = nodes_by_role(gm, self.role)
        if len(nodes) != 1:
            raise ValueError(f"draft_vocab: the graph has {len(nodes)} {self.role!r} nodes; "
                             "allowed: exactly one (the drafter's LM head)")  # fmt: skip
        node = nodes[0]
        ranking = read_ranking(self.path) if self.path is not None else ranking_of(gm)
        if self.draft_vocab is None:
            if ranking is not None:
                gm.meta[TOKEN_RANKING] = ranking
            return PassResult(gm, modified=False, matches=0)
        head = gm.get_submodule(node.target)
        vocab = head.weight.shape[0]
        allowed = f"None (the full head) or an integer in 1..{vocab} (the vocabulary)"
        check_int("draft_vocab", self.draft_vocab, 1, vocab, allowed=allowed)
        if ranking is None and self.path is not None:
            raise ValueError(
                f"draft_vocab: {self.draft_vocab} needs a token ranking, and the parts "
                f"{self.path!r} hold none ({RANKING_FILE} is missing: parts saved before it "
                "existed); allowed: draft_vocab=None, or parts saved again after fit"
            )
        if ranking is None:
            log.info("draft_vocab=%d: no token ranking yet, ids 0..%d until fit measures one",
                     self.draft_vocab, self.draft_vocab - 1)  # fmt: skip
            ranking = torch.arange(vocab)
        else:
            if ranking.numel() != vocab:
                raise ValueError(
                    f"draft_vocab: the token ranking ranks {ranking.numel()} ids and this "
                    f"model's vocabulary has {vocab}; allowed: parts trained for this model"
                )
            gm.meta[TOKEN_RANKING] = ranking
        gm.add_submodule(SUBSET_MODULE, SubsetLMHead.from_head(head, ranking[: self.draft_vocab]))
        node.target = SUBSET_MODULE
        gm.graph.lint()
        gm.recompile()
        return PassResult(gm, modified=True, matches=1)
