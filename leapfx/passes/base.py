"""Pass infrastructure: named graph passes with typed options, and a checked pipeline.

A pass is a frozen dataclass (its fields are its options) with a class-level ``name``, the facts
it ``requires`` and ``provides``, and one entry point ``run(gm) -> PassResult``. A
``PassPipeline`` orders its passes as a networkx DAG (an edge from the pass providing a fact to
every pass requiring it), so a missing prerequisite or a cycle is an error before any pass runs.
Running it lints and recompiles the graph after every pass, counts every rewrite, and re-raises
a failure with the names of the passes that already ran.

Example::

    >>> pipeline = PassPipeline([InsertExitHead(layer=2)])
    >>> gm = pipeline(capture(hf_model))
    >>> pipeline.counters
    {'insert-exit-head': 1}
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

import networkx as nx
from torch import fx

# Facts every captured graph has before any pass runs.
CAPTURED_FACTS = frozenset({"decoder-graph"})


M = TypeVar("M")


def owned(gm: fx.GraphModule, attr: str, kind: type[M], what: str, pass_name: str) -> M:
    """The ``kind`` module ``gm`` holds at ``attr``, which the pass ``pass_name`` inserted; a
    ValueError naming ``what`` and that pass where it holds none (``adapter_of``,
    ``eagle_head_of`` ...)."""
    module = getattr(gm, attr, None)
    if not isinstance(module, kind):
        raise ValueError(f"graph has no {what}; run {pass_name} first")
    return module


@dataclass(frozen=True)
class PassResult:
    """What a pass returns: the (possibly new) graph module and what it changed."""

    graph_module: fx.GraphModule
    modified: bool
    matches: int = 0


class PassError(RuntimeError):
    """A pass failed; the message names the pass and the passes that ran before it."""


class PassInputError(PassError, ValueError):
    """A pass refused its input (a ValueError inside it, e.g. a checkpoint that does not fit):
    still a ValueError for callers, with the pass context of a PassError."""


@dataclass(frozen=True)
class GraphPass:
    """Base of every leapfx pass. Subclasses are frozen dataclasses; fields are options."""

    name: ClassVar[str] = "graph-pass"
    requires: ClassVar[frozenset[str]] = frozenset()
    provides: ClassVar[frozenset[str]] = frozenset()

    def run(self, gm: fx.GraphModule) -> PassResult:  # pragma: no cover - abstract
        raise NotImplementedError

    def __str__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items())
        return f"{self.name}({opts})"


@dataclass
class PassPipeline:
    """An ordered, checked sequence of passes.

    The order is a topological order of the requires/provides DAG that keeps the given order
    wherever the DAG leaves a choice.
    """

    passes: Sequence[GraphPass]
    initial_facts: frozenset[str] = CAPTURED_FACTS
    counters: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.passes = self.order()

    def dag(self) -> nx.DiGraph:
        dag = nx.DiGraph()
        for i, p in enumerate(self.passes):
            dag.add_node(i, name=p.name)
        providers: dict[str, list[int]] = {}
        for i, p in enumerate(self.passes):
            for fact in p.provides:
                providers.setdefault(fact, []).append(i)
        for i, p in enumerate(self.passes):
            for fact in sorted(p.requires):
                if fact in self.initial_facts:
                    continue
                if fact not in providers:
                    available = sorted(self.initial_facts | set(providers))
                    raise ValueError(
                        f"pass {p.name!r} requires {fact!r}, which no pass in the pipeline "
                        f"provides (provided: {available})"
                    )
                for j in providers[fact]:
                    if j != i:
                        dag.add_edge(j, i, fact=fact)
        return dag

    def order(self) -> list[GraphPass]:
        dag = self.dag()
        if not nx.is_directed_acyclic_graph(dag):
            cycle = nx.find_cycle(dag)
            names = " -> ".join(self.passes[a].name for a, _ in cycle)
            raise ValueError(f"pass pipeline has a dependency cycle: {names}")
        order = nx.lexicographical_topological_sort(dag, key=lambda i: i)
        return [self.passes[i] for i in order]

    def __call__(self, gm: fx.GraphModule) -> fx.GraphModule:
        ran: list[str] = []
        for p in self.passes:
            try:
                result = p.run(gm)
                gm = result.graph_module
                gm.graph.lint()
                gm.recompile()
            except Exception as exc:
                before = ", ".join(ran) or "none"
                error = PassInputError if isinstance(exc, ValueError) else PassError
                raise error(f"pass {p} failed (passes run before it: {before}): {exc}") from exc
            ran.append(p.name)
            self.counters[p.name] = self.counters.get(p.name, 0) + result.matches
            facts = set(gm.meta.get("leapfx.facts", self.initial_facts))
            gm.meta["leapfx.facts"] = frozenset(facts | p.provides)
        return gm
