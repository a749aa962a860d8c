"""CUDA graphs over compiled stages: one captured graph per (compiled callable, input shapes).

A decode step of a small model on a GPU is bound by launches, not by the GPU: each of a
compiled stage's few hundred kernels costs a few microseconds to launch from Python, more than
it runs. A CUDA graph replays all of them in one launch. :class:`GraphSet` captures, for each
compiled callable a stage calls with static shapes (a one-token step, a full round's verify,
a padded verify, a draft chain, a batch's one-token step at each batch size), one graph over
static input buffers, and replays it:

- **capture** (the first call of a shape): the inputs are copied into buffers the graph owns;
  the callable runs twice on a side stream (it compiles on the first run; capture needs its
  allocations warm), then once under ``torch.cuda.graph`` in one memory pool shared by every
  graph of the model (the graphs run one after another on one stream, so their scratch memory
  can be shared; the outputs each graph keeps are never freed, so no later capture reuses them).
  Running a stage again on the same inputs writes the same keys and values at the same cache
  positions, so the warm-up runs change nothing a later query reads.
- **replay**: the call's inputs are copied into the graph's buffers, the graph replays, and its
  outputs are cloned (the next replay of the same graph overwrites them; a caller may keep
  them, as the draft loop keeps each step's hidden state).

The KV cache buffers are graph inputs by address: a graph is keyed by their addresses too, so
a cache that was reallocated (a longer generation) gets graphs of its own; graphs of a cache
that was freed are dropped when the next graph is captured.

Why manual capture rather than ``torch.compile(mode="reduce-overhead")`` (CUDA graph trees):
trees re-check every static input's address and each pending output's liveness on every call,
and record a new graph for each new order of calls (a speculative round alternates draft, chain
and verify graphs); a manual graph replays with one copy per input and no bookkeeping. Both are
measured by ``tools/gpu_check.sh`` (docs/gpu.md); ``CompileOptions.cuda_graphs`` picks either.

A call of more than ``MAX_TOKENS`` tokens a row (a prompt) runs the compiled code without a
graph; shorter calls of a dynamically compiled callable (a verify of any draft length, a
batch's verify) get one graph per shape.

``capture`` is injectable so that the bookkeeping (static buffers, keys, clones, eviction) is
tested on a CPU with a stand-in that records the call and replays it by calling it again.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence

import torch
from torch.utils._pytree import tree_map

log = logging.getLogger(__name__)

# Graphs one model may hold; past it a new shape runs the compiled code without a graph (a
# decode has a handful of shapes: steps, a full round's verify, a chain, a batch's sizes).
MAX_GRAPHS = 64

# Calls of at most this many tokens a row get graphs (steps, verifies, a batch's rounds, short
# prompts); a longer call (a prompt) runs the compiled code: one graph per prompt length would
# cost a capture per prompt and keep its logits.
MAX_TOKENS = 16


def graph_tokens(args: Sequence[torch.Tensor]) -> int:
    """The token count of a stage call's inputs (dim 1 of its [B, S, ...] inputs)."""
    return max((a.shape[1] for a in args if a.dim() > 1), default=1)


# (fn, keys, values, static args) -> (replay, static outputs)
Capture = Callable[[Callable, list, list, list], tuple[Callable[[], None], object]]


def capture_cuda(pool) -> Capture:
    """The CUDA capture: warm-ups on a side stream, then ``torch.cuda.graph`` in ``pool``."""

    def capture(fn, keys, values, args):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # the first may compile; the second runs what capture runs
                fn(keys, values, *args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs = fn(keys, values, *args)
        return graph.replay, outputs

    return capture


class _Graph:
    __slots__ = ("cache", "args", "replay", "outputs")

    def __init__(self, cache, args, replay, outputs) -> None:
        self.cache = cache  # weakref to the cache's first key buffer
        self.args = args  # the static input buffers
        self.replay = replay
        self.outputs = outputs


class GraphSet:
    """Every CUDA graph of one compiled model (one shared memory pool), and their counts.

    ``graphset(fn, keys, values, args, mark=None)`` runs ``fn(keys, values, *args)`` through
    the graph captured for ``fn`` at these shapes and cache buffers (capturing it on first
    use) and returns clones of its outputs. ``mark(static_args)`` runs once before the first
    call of a capture (a batch's graphs mark dims dynamic there, as the plain call does).
    ``captures``, ``replays`` and ``plain_calls`` count what happened (tests assert them).
    """

    def __init__(self, capture: Capture | None = None, limit: int = MAX_GRAPHS) -> None:
        if capture is None:
            capture = capture_cuda(torch.cuda.graph_pool_handle())
        self._capture = capture
        self.limit = limit
        self.graphs: dict[tuple, _Graph] = {}
        self.captures = 0
        self.replays = 0
        self.plain_calls = 0
        self._memo: tuple[list, list, tuple] | None = None  # (keys, values, their addresses)
        self._warned = False
        self.failed: set[tuple] = set()  # keys whose capture raised: they run plain

    def _addresses(self, keys: list, values: list) -> tuple:
        memo = self._memo
        if memo is not None and memo[0] is keys and memo[1] is values:
            return memo[2]
        ptrs = tuple(t.data_ptr() for t in (*keys, *values))
        self._memo = (keys, values, ptrs)
        return ptrs

    def __call__(
        self,
        fn: Callable,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        args: Sequence[torch.Tensor],
        mark: Callable[[list[torch.Tensor]], None] | None = None,
    ):
        shapes = tuple((tuple(a.shape), a.dtype) for a in args)
        key = (id(fn), shapes, tuple(keys[0].shape), self._addresses(keys, values))
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._new(key, fn, keys, values, args, mark)
            if graph is None:
                self.plain_calls += 1
                contiguous = [a.clone(memory_format=torch.contiguous_format) for a in args]
                if mark is not None:
                    mark(contiguous)
                return fn(keys, values, *contiguous)
        for static, a in zip(graph.args, args, strict=True):
            static.copy_(a)
        graph.replay()
        self.replays += 1
        return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, graph.outputs)

    def _new(self, key, fn, keys, values, args, mark) -> _Graph | None:
        dead = [k for k, g in self.graphs.items() if g.cache() is None]
        for k in dead:  # graphs of a cache that is gone (reallocated)
            del self.graphs[k]
        if len(self.graphs) >= self.limit:
            if not self._warned:
                log.warning(
                    "CUDA graphs: %d captured, the most one model keeps; new shapes run "
                    "without a graph", self.limit,
                )  # fmt: skip
                self._warned = True
            return None
        if key in self.failed:
            return None
        static = [a.clone(memory_format=torch.contiguous_format) for a in args]
        if mark is not None:
            mark(static)
        try:
            replay, outputs = self._capture(fn, keys, values, static)
        except RuntimeError as error:  # the call still runs, without a graph
            self.failed.add(key)
            log.warning(
                "CUDA graphs: capturing %s at shapes %s failed (%s); it runs without a graph",
                getattr(fn, "__name__", fn), key[1], error,
            )  # fmt: skip
            return None
        graph = _Graph(weakref.ref(keys[0]), static, replay, outputs)
        self.graphs[key] = graph
        self.captures += 1
        log.debug("CUDA graph %d captured for %s", self.captures, getattr(fn, "__name__", fn))
        return graph
