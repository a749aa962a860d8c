"""Inductor lowering: every stage through ``torch.compile(fullgraph=True)`` over the static cache.

The eager stages write the KV cache at Python-int fill lengths and attend to the filled prefix,
so every call has new shapes. A compiled stage cannot: each new shape would be a recompile. So
:class:`CompiledStage` runs a stage as a pure tensor function in the gpt-fast style:

- keys/values are written *at the positions given as a tensor* (``index_copy_`` into the
  preallocated ``[B, H_kv, max_len, D]`` buffers of the shared :class:`StaticKVCache`), and
  attention reads the whole buffer;
- the mask is built in the graph from the query positions over all ``max_len`` key slots: slot
  ``j`` holds position ``j``, and query ``q`` sees it iff ``j <= q`` (and ``j > q - window``
  under a sliding window). Slots past a query, including stale ones left by rejected drafts,
  are masked; every slot ``<= q`` was written by a real token before any query reads it, since
  the schedules write positions in order and roll back only by lengths. (Layers with the CPU
  kernels attend through ``leapfx_cpu::attention`` instead, which reads each query's slots up
  to its position only: the same rule without reading the masked slots.)

So a stage has one shape per token count: the draft step and an autoregressive step always see
one token; prefill sees the prompt length (compiled once with a dynamic length) and verify sees
``c`` cached exit states plus the last draft. Kangaroo's dynamic drafting varies ``c``: verify is
compiled with ``c`` dynamic (``dynamic_verify=True``, the default) or once per ``c``
(``dynamic_verify=False``); ``leapfx bench --backend inductor`` measures both (see
docs/benchmarks.md).

The Python-int lengths of the cache are still kept (the schedules crop by them and the eager
stages write at them): after a call each cache layer advances by the tokens its group ran.

On CPU Inductor emits C++ (OpenMP); on a GPU, Triton, and every call of a few tokens replays a
CUDA graph captured once per compiled callable and shape (``cuda_graphs.py``; the cache's
buffers are static, so the graphs replay on them). Compiled decoding is token-identical to
eager decoding up to float rounding: attention over a masked full buffer sums in a different
order than attention over the filled prefix, so a near-tie between two logits may resolve
differently, exactly as it may between two eager builds of PyTorch.

``inductor.py`` holds the executors (``CompiledStage``, ``CompiledChain``) and the options
(``CompileOptions``); the functions they compile (``PureStage``, ``RowsStage``, ``ChainStage``)
and the caches HF attention writes through inside them (``SlotKVCache``, ``RowSlotKVCache``)
are ``pure_stage.py``'s; ``compile.py`` builds them for a model (``compile_stages``), with SpecEE's
per-layer segments from ``specee_segments.py``.

Example::

    >>> sm = rewrite.apply(hf_model, "layerskip", exit_layer=4, backend="inductor")
    >>> sm.generate(input_ids, max_new_tokens=64)      # first call compiles (warm-up)
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_map

from ..options import check_bool, check_choice
from ..runtime.cache import StaticKVCache
from .cuda_graphs import MAX_TOKENS, GraphSet, graph_tokens
from .pure_stage import ChainStage, PureStage, RowsStage
from .stage_signature import EAGLE_STAGES

VERIFY_SHAPES = ("dynamic", "padded")
MODES = ("default", "reduce-overhead", "max-autotune")
CUDA_GRAPHS = ("manual", "trees", "off")


@dataclass(frozen=True)
class CompileOptions:
    """How stages are compiled.

    ``mode``: Inductor's mode; None: ``default`` (``reduce-overhead`` sets ``cuda_graphs``
    to ``"trees"``).
    ``cuda_graphs`` (CUDA only): ``"manual"`` captures one graph per compiled callable and
    static input shapes and replays it (``cuda_graphs.GraphSet``); ``"trees"`` lets Inductor's
    CUDA graph trees do it (``mode="reduce-overhead"``); ``"off"``: none. None: ``"manual"``
    on CUDA (measured faster: docs/gpu.md), ``"off"`` elsewhere.
    ``verify_shapes``: how verify takes a varying number ``c`` of cached exit states:
    ``"dynamic"`` compiles it once with ``c`` symbolic (plus the ``c = 1`` case, which dynamo
    always specialises, and ``c`` = the maximum, a full round's verify, as a static graph of its
    own); ``"padded"`` pads ``c`` to the recipe's maximum draft count with dummy
    rows at positions past the real ones (masked for every real query, overwritten before any
    real query reads their slots) and compiles one static shape. None: ``"padded"`` where
    stages replay CUDA graphs (one graph for every verify), ``"dynamic"`` elsewhere.
    ``warmup``: compile every shape a decode uses when ``compile()`` is called, so that
    ``generate`` never compiles; False compiles each shape at its first use.
    """

    mode: str | None = None
    verify_shapes: str | None = None
    cuda_graphs: str | None = None
    warmup: bool = True
    # Multiply by transposed contiguous weight copies (see TransposedDecoderLayer): faster on
    # a CPU, one more copy of the projection weights in memory. None: on CPU only.
    transpose_weights: bool | None = None
    # Projections through the leapfx_cpu small-M kernels (leapfx.kernels.cpu: each weight read
    # once for all the rows of a verify pass). None: on a CPU with float32 weights when the
    # kernels build; True: require them; False: never. Implies transposed weight copies.
    cpu_kernels: bool | None = None
    # LayerSkip's greedy rounds draft their d tokens through one compiled call of d unrolled
    # draft steps (``CompiledChain``) instead of d calls: the same tokens, one call's overhead.
    draft_chain: bool = True
    # With warmup: also compile the graphs a batch (``input_ids`` [B, S], ragged rows) runs,
    # at one row and at two (which every larger batch shares). False: they compile on the
    # first batched call.
    batches: bool = False

    def validate(self) -> CompileOptions:
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(
                f"mode: {self.mode!r} is invalid; allowed: None, {', '.join(map(repr, MODES))}"
            )
        if self.verify_shapes is not None:
            check_choice("verify_shapes", self.verify_shapes, VERIFY_SHAPES)
        if self.cuda_graphs is not None:
            check_choice("cuda_graphs", self.cuda_graphs, CUDA_GRAPHS)
        if self.mode == "reduce-overhead" and self.cuda_graphs in ("manual", "off"):
            raise ValueError(
                f"cuda_graphs: {self.cuda_graphs!r} contradicts mode='reduce-overhead' (CUDA "
                "graph trees); allowed with it: None or 'trees'"
            )
        check_bool("warmup", self.warmup)
        allowed = "True, False or None (CPU only)"
        check_bool("transpose_weights", self.transpose_weights, none=True, allowed=allowed)
        allowed = "True, False or None (on a CPU with float32 weights when they build)"
        check_bool("cpu_kernels", self.cpu_kernels, none=True, allowed=allowed)
        check_bool("draft_chain", self.draft_chain)
        check_bool("batches", self.batches)
        return self


def inductor_options(options: CompileOptions, device: torch.device) -> dict:
    """``torch.compile`` options for a stage on ``device``.

    On a CPU, ``cpp_wrapper`` makes the graph's kernel calls in C++ rather than Python, and
    dynamo's guards on the stage's modules are skipped: both are fixed costs of every call that
    a one-token step pays in full (the step times: docs/benchmarks.md, "Why the defaults").
    The guards dropped are identity checks on the modules: the weights
    are still read at every call (they are graph inputs), so training the model in place after
    compiling is seen; replacing its modules is not (compile again).
    """
    opts: dict = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    mode = options.mode
    if graphs_kind(options, device) == "trees":
        opts["triton.cudagraphs"] = True
    if mode == "max-autotune":
        opts["max_autotune"] = True
    if device.type == "cpu":
        opts["cpp_wrapper"] = True
    return opts


def graphs_kind(options: CompileOptions, device: torch.device) -> str:
    """Which CUDA graphs the stages replay on ``device``: "manual", "trees" or "off"."""
    if device.type != "cuda":
        return "off"
    if options.mode == "reduce-overhead":
        return "trees"
    return options.cuda_graphs or "manual"


def verify_shapes_for(options: CompileOptions, device: torch.device) -> str:
    """``options.verify_shapes``, or its default on ``device`` (padded under manual graphs)."""
    if options.verify_shapes is not None:
        return options.verify_shapes
    return "padded" if graphs_kind(options, device) == "manual" else "dynamic"


def own_code(module: torch.nn.Module, name: str):
    """``module.forward`` as a bound method with a code object of its own.

    Dynamo keeps its compiled graphs on the code object, and with the module guards skipped
    (``inductor_options``) nothing else tells two stages' modules apart: every stage shares
    ``PureStage.forward``, so the draft step would run the full stage's graph. A private copy
    of the code per compiled callable gives each its own cache.
    """
    func = type(module).forward
    code = func.__code__.replace(co_name=f"forward_{name}")
    fresh = types.FunctionType(code, func.__globals__, code.co_name, func.__defaults__)
    return types.MethodType(fresh, module)


def _mark_tokens_dynamic(args: list[torch.Tensor]) -> None:
    """A chunk's token count (dim 1) is dynamic wherever it is more than one."""
    for t in args:
        if t.dim() > 1 and t.shape[1] > 1:
            torch._dynamo.maybe_mark_dynamic(t, 1)


class CompiledStage:
    """A stage executor running one stage through ``torch.compile`` (see the module docstring).

    Called like the eager stage (``input_ids``, ``position_ids``, ``masks``, ``cache`` ...); the
    runner's masks are ignored (built in the graph from the positions).

    ``max_hidden`` (verify only) is the most cached exit states a call passes: the recipe's
    maximum draft count, the size ``verify_shapes="padded"`` pads to.
    """

    builds_masks = True  # the StageRunner need not compute masks for it

    def __init__(
        self,
        name: str,
        pure: PureStage,
        *,
        options: CompileOptions,
        device: torch.device,
        max_hidden: int = 1,
        graphs: GraphSet | None = None,
        state_width: int | None = None,
    ) -> None:
        self.name = name
        self.pure = pure
        self.tensor_inputs = pure.tensor_inputs
        self.groups = pure.groups
        self.options = options
        self.max_hidden = max_hidden
        # EAGLE's target: the width D of its ``prev_hidden`` [B, 1, D] (see _widen)
        self.state_width = state_width
        self.compile_options = inductor_options(options, device)
        # The model's CUDA graphs (cuda_graphs.py; None: calls run the compiled code as is)
        self.graphs = graphs
        # Under graph trees a replay overwrites the outputs of the graph's last replay, which
        # a caller may still hold (the draft loop keeps each step's hidden state): copy them.
        self.clone_outputs = graphs_kind(options, device) == "trees"
        self._padded = name == "verify" and verify_shapes_for(options, device) == "padded"
        # One compiled callable per role: one-token steps (static) and prefill/verify chunks
        # (the token count marked dynamic; static when padded), each with its own dynamo cache.
        # A fresh options dict per call: torch.compile pops "guard_filter_fn" from the one it
        # is given, so a shared dict left the second callable with every guard on the stage's
        # modules (~2,400 on the reference model: 0.25 ms of a 2 ms verify call).
        opts = self.compile_options
        self._step = torch.compile(
            own_code(self.pure, f"{name}_step"), fullgraph=True, dynamic=False,
            options=dict(opts),
        )  # fmt: skip
        self._chunk = torch.compile(
            own_code(self.pure, f"{name}_chunk"),
            fullgraph=True,
            dynamic=False if self._padded else None,
            options=dict(opts),
        )
        # Dynamic verify: a full round's verify (c = max_hidden, nearly every LayerSkip round)
        # runs a static graph of its own, without the dynamic graph's per-call symbolic sizes
        # (on a CPU its wrapper turns ~30 of them into tensors every call); shorter rounds run
        # the dynamic one.
        self._rows: tuple | None = None  # a batch's graphs (_compile_rows), on first use
        self._round = None
        if name == "verify" and not self._padded and max_hidden > 1:
            self._round = torch.compile(
                own_code(self.pure, f"{name}_round"), fullgraph=True, dynamic=False,
                options=dict(opts),
            )  # fmt: skip

    def __call__(
        self, *, cache: StaticKVCache, masks=None, remainder_masks=None, **tensors: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        del masks, remainder_masks  # built inside the graph from the positions
        if self.state_width is not None:
            tensors = self._widen(tensors)
        if getattr(cache, "ragged", False):
            return self._call_rows(cache, tensors)
        counts = {
            layer: tensors[pos_name].shape[1]
            for pos_name, layers in self.groups.items()
            for layer in layers
        }
        room = cache.length + self.max_hidden + 1 if self._padded else 0
        # before the call: compiled kernels do not bounds-check
        ends = cache.reserve(counts, room=room)
        out = self._run(cache.keys, cache.values, tensors)
        cache.advance(ends)
        return out

    def _widen(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` with EAGLE's target's ``prev_hidden`` at the stage's state width: a
        schedule's zeros [B, 1, 1] (h before a prompt, ``eagle.EagleDrafter.prefill``) are
        broadcast to [B, 1, D], as the eager stage broadcasts them, so that a prefill and a
        decode step share one graph instead of compiling one for each width (the onnxruntime
        stage does the same, ``ort_stages.OrtStage``)."""
        state = tensors["prev_hidden"]
        if state.shape[-1] == self.state_width:
            return tensors
        return {**tensors, "prev_hidden": state.expand(-1, -1, self.state_width)}

    def _run(self, keys, values, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._padded and tensors["exit_hidden"].shape[1] > 1:
            return self._run_padded(keys, values, tensors)
        args = [tensors[n] for n in self.tensor_inputs]
        one_token = tensors["input_ids"].shape[1] == 1 and (
            "exit_hidden" not in tensors or tensors["exit_hidden"].shape[1] == 1
        )
        if one_token:
            return self._invoke(self._step, keys, values, args)
        if (
            self._round is not None
            and tensors["exit_hidden"].shape[1] == self.max_hidden
            and tensors["input_ids"].shape[1] == 1
        ):
            return self._invoke(self._round, keys, values, args)
        return self._invoke(self._chunk, keys, values, args, mark=_mark_tokens_dynamic)

    def _invoke(self, fn, keys, values, args, mark=None) -> dict[str, torch.Tensor]:
        """``fn(keys, values, *args)``: a graph replay where the stages have CUDA graphs and
        the call is short (``cuda_graphs.MAX_TOKENS``), else the compiled code itself on
        contiguous copies of ``args``; ``mark`` marks their dynamic dims first."""
        if self.graphs is not None and graph_tokens(args) <= MAX_TOKENS:
            return self.graphs(fn, keys, values, args, mark=mark)
        # Dynamo guards on strides (even of size-1 dims) and on whether a tensor is an
        # inference tensor; the schedules pass slices, fresh tensors and the user's prompt.
        # A contiguous copy made here (under the caller's inference mode) looks the same every
        # time, so one graph serves them all.
        args = [t.clone(memory_format=torch.contiguous_format) for t in args]
        if mark is not None:
            mark(args)
        return self._own(fn(keys, values, *args))

    def _own(self, out):
        """``out``, copied where the next call would overwrite it (graph trees)."""
        return tree_map(torch.clone, out) if self.clone_outputs else out

    def _call_rows(self, cache, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A batch's call over a ``RowKVCache``: each position input's tokens go to the cache
        columns from its layers' fill lengths on, row by row (where the eager stage's
        ``RowKVCache.update`` writes them), and the rows' lengths advance as there."""
        if self._rows is None:
            self._rows = self._compile_rows()
        device = cache.keys[0].device
        batch = tensors["input_ids"].shape[0]
        stage = self._rows[0]
        first = torch.tensor(cache.first, device=device)
        columns, counts = [], {}
        for pos_name in stage.positions:
            n = tensors[pos_name].shape[1]
            layers = self.groups.get(pos_name, ())
            if layers:
                starts = cache.rows[layers[0]]
                if any(cache.rows[layer] != starts for layer in layers):
                    raise RuntimeError(
                        f"{self.name}: the cache layers {layers} that {pos_name} positions hold "
                        f"different row lengths {[cache.rows[i] for i in layers]}"
                    )
                counts.update(dict.fromkeys(layers, n))
                cols = torch.tensor(starts, device=device)[:, None] + torch.arange(n, device=device)
            else:  # no cache layer reads it: the tokens' own columns, for its mask alone
                cols = tensors[pos_name] + first[:, None]
            columns.append(cols)
        ends = cache.reserve(counts)
        args = [first, *(tensors[n] for n in self.tensor_inputs), *columns]
        one_token = all(t.shape[1] == 1 for t in args if t.dim() > 1)

        def mark(args: list[torch.Tensor]) -> None:
            if batch > 1:  # one compiled graph for every batch size >= 2 (rows leave)
                for t in (*cache.keys, *cache.values, *args):
                    torch._dynamo.maybe_mark_dynamic(t, 0)
            if not one_token:
                _mark_tokens_dynamic(args[1:])

        fn = self._rows[1] if one_token else self._rows[2]
        if self.graphs is not None and graph_tokens(args[1:]) <= MAX_TOKENS:  # graph per shape
            out = self.graphs(fn, cache.keys, cache.values, args, mark=mark)
        else:
            args = [t.clone(memory_format=torch.contiguous_format) for t in args]
            mark(args)
            out = self._own(fn(cache.keys, cache.values, *args))
        cache.advance(ends)
        return out

    def warmup_rows(self, cache_for_rows, example: dict[str, torch.Tensor], chunks: bool) -> None:
        """Compile a batch's graphs: one-token steps (a verify over one exit state), and with
        ``chunks`` multi-token calls (prefill, verify; a verify over several exit states), at
        one row and at two rows (the graph every larger batch shares). ``cache_for_rows(B)``
        gives an empty ``RowKVCache`` of B rows; ``example`` as :meth:`warmup`'s."""
        ids, hidden = example["input_ids"], example["exit_hidden"]
        device = ids.device
        lengths = (1, 2) if chunks else (1,)
        if chunks and self.name in EAGLE_STAGES:
            # the first chunk graph specialises its length (a guard in the shifted state's
            # cat), the second length makes dynamo compile it dynamic (as in _warmup_inputs)
            lengths = (1, 2, 3)
        for batch in (1, 2):
            for n in lengths:
                pos = torch.arange(n + 1, device=device)[None].expand(batch, -1)
                states = hidden[:1, :1].expand(batch, n, -1)
                if "exit_hidden" in self.tensor_inputs:  # verify: n exit states, a last draft
                    tensors = {
                        "input_ids": ids[:1, :1].expand(batch, -1),
                        "position_ids": pos[:, n:],
                        "exit_hidden": states,
                        "remainder_position_ids": pos,
                    }
                else:
                    tensors = {"input_ids": ids[:1, :n].expand(batch, -1),
                               "position_ids": pos[:, :n]}  # fmt: skip
                if "hidden" in self.tensor_inputs:  # EAGLE's head: h_{t-1} of every token
                    tensors["hidden"] = states
                if "prev_hidden" in self.tensor_inputs:  # EAGLE's target: a row's h [B, 1, D]
                    tensors["prev_hidden"] = states[:, :1]  # (a prefill's zeros: _widen)
                self._call_rows(cache_for_rows(batch), tensors)

    def _compile_rows(self) -> tuple[RowsStage, object, object]:
        """The rows stage and its two compiled callables (one-token steps, chunks), made on a
        batch's first call: a model that never decodes a batch never compiles them."""
        stage = RowsStage(self.pure)
        opts = self.compile_options
        step = torch.compile(
            own_code(stage, f"{self.name}_rows_step"), fullgraph=True, options=dict(opts)
        )
        chunk = torch.compile(
            own_code(stage, f"{self.name}_rows_chunk"), fullgraph=True, options=dict(opts)
        )
        return stage, step, chunk

    def _run_padded(self, keys, values, tensors: dict[str, torch.Tensor]):
        # exit_hidden [1, c, H] -> [1, G, H]; remainder positions h..h+c-1, then the dummy
        # rows at h+c+1..h+G, then the last draft at h+c (the order verify joins them in).
        hidden = tensors["exit_hidden"]
        c, g = hidden.shape[1], self.max_hidden
        if c > g:
            raise ValueError(f"verify: {c} cached exit states exceed the maximum {g}")
        rem = tensors["remainder_position_ids"]  # [1, c + 1]
        pad = rem[:, -1:] + torch.arange(1, g - c + 1, device=rem.device)[None]
        padded = dict(tensors)
        padded["exit_hidden"] = torch.cat([hidden, hidden.new_zeros(1, g - c, hidden.shape[2])], 1)
        padded["remainder_position_ids"] = torch.cat([rem[:, :c], pad, rem[:, c:]], dim=1)
        out = self._invoke(self._chunk, keys, values, [padded[n] for n in self.tensor_inputs])
        logits = out["logits"]  # [1, G + 1, V]: keep the c real rows and the last one
        return {**out, "logits": torch.cat([logits[:, :c], logits[:, g:]], dim=1)}

    def warmup(self, cache: StaticKVCache, example: dict[str, torch.Tensor]) -> None:
        """Compile the shapes decoding uses, over ``cache`` (the model's own, compile_stages)."""
        for tensors in self._warmup_inputs(example):
            self._run(cache.keys, cache.values, tensors)

    def _warmup_inputs(self, example: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        ids, hidden = example["input_ids"], example.get("exit_hidden")
        device = ids.device

        def positions(n: int) -> torch.Tensor:
            return torch.arange(n, device=device)[None]

        if hidden is None:  # full / draft: one-token steps and prefill chunks
            return [{"input_ids": ids[:, :n], "position_ids": positions(n)} for n in (1, 2)]
        if self.name in EAGLE_STAGES:  # one-token steps and chunks, with the state input
            # Chunks at two lengths: the first chunk graph specialises its length (a guard in
            # the shifted state's cat), the second length makes dynamo compile it dynamic.
            width = hidden.shape[-1]
            calls = []
            for n in (1, 2, 3):
                call = {"input_ids": ids[:, :n], "position_ids": positions(n)}
                if "hidden" in self.tensor_inputs:  # head: h_{t-1} (or g) of every token
                    calls.append({**call, "hidden": hidden.new_zeros(1, n, width)})
                else:  # target: h_{start-1} (a prefill's [1, 1, 1] zeros are widened)
                    calls.append({**call, "prev_hidden": hidden.new_zeros(1, 1, width)})
            return calls
        # verify: one last draft over c = 1 and c = 2 cached exit states (c >= 2 is one
        # dynamic graph, or the padded one), and over c = max_hidden (a full round's graph).
        calls = []
        for c in sorted({1, min(2, self.max_hidden), self.max_hidden}):
            calls.append(
                {
                    "input_ids": ids[:, :1],
                    "position_ids": positions(c + 1)[:, c:],
                    "exit_hidden": hidden[:, :c],
                    "remainder_position_ids": positions(c + 1),
                }
            )
        return calls


class CompiledChain:
    """LayerSkip's d greedy draft steps as one compiled call (the runner's ``draft_chain``).

    Each draft call pays a fixed cost that does not depend on the layers it runs: dynamo's
    frame and guard checks, the C++ wrapper taking every weight and cache buffer as an input,
    the argmax and the runner around it. A chain of the d steps in one graph pays it once a
    round. The steps are the draft stage's own code, so the tokens, exit states and cache
    writes are those of d ``draft`` calls (tested bitwise); the schedule falls back to single
    steps where a round drafts fewer (the end of a generation) or samples.
    """

    builds_masks = True

    def __init__(self, draft: CompiledStage, length: int) -> None:
        if set(draft.tensor_inputs) != {"input_ids", "position_ids"}:
            raise ValueError(
                f"draft_chain: the draft stage takes {draft.tensor_inputs}; a chain feeds "
                "input_ids and position_ids only"
            )
        self.name = "draft_chain"
        self.chain_length = length
        self.groups = draft.groups
        self.pure = ChainStage(draft.pure, length)
        self._fn = torch.compile(
            own_code(self.pure, "draft_chain"), fullgraph=True, dynamic=False,
            options=dict(draft.compile_options),
        )  # fmt: skip
        self.graphs = draft.graphs
        self._own = draft._own

    def __call__(
        self, *, cache: StaticKVCache, input_ids: torch.Tensor, position_ids: torch.Tensor,
        masks=None,
    ) -> dict[str, torch.Tensor]:  # fmt: skip
        del masks
        layers = [layer for group in self.groups.values() for layer in group]
        ends = cache.reserve(dict.fromkeys(layers, self.chain_length))
        if self.graphs is not None:
            out = self.graphs(self._fn, cache.keys, cache.values, [input_ids, position_ids])
        else:
            contiguous = torch.contiguous_format  # one graph for every caller (see _invoke)
            out = self._own(self._fn(
                cache.keys, cache.values, input_ids.clone(memory_format=contiguous),
                position_ids.clone(memory_format=contiguous),
            ))  # fmt: skip
        cache.advance(ends)
        return out

    def warmup(self, cache: StaticKVCache, example: dict[str, torch.Tensor]) -> None:
        ids = example["input_ids"][:, :1].clone(memory_format=torch.contiguous_format)
        if self.graphs is not None:
            self.graphs(self._fn, cache.keys, cache.values, [ids, torch.zeros_like(ids)])
        else:
            self._fn(cache.keys, cache.values, ids, torch.zeros_like(ids))  # as __call__ does
