"""``OnnxModel``: an ONNX export run by onnxruntime under the recipe's own schedule.

The schedules of ``leapfx.runtime`` call a StageRunner, which calls ``stages[name](**inputs)``
and ``runner.cache.crop(n)``. This module puts onnxruntime behind exactly that interface:

- :class:`OrtKVCache` holds keys/values as preallocated buffers ``[B, H_kv, max_len, D]`` per
  cache layer (OrtValues: over numpy arrays on a CPU, in device memory on a GPU), each with its
  own fill length, and rolls back with ``crop`` in O(1) (moves lengths, copies nothing), like
  ``StaticKVCache``;
- :class:`OrtStage` is a stage executor over one session and an IO binding: each cache layer's
  ``past_key_values.{i}.*`` input and ``present.{i}.*`` output are bound to the layer's one
  buffer, so a call writes only its new positions in place (the export's ScatterND) and
  moves nothing else; the token ids and positions are bound per call, and the stage's own
  outputs (logits, hidden states: small) come back as torch tensors. Masks are computed inside
  the ONNX graphs from the positions, so it ignores the runner's ``masks``;
- :class:`OrtChainStage` runs an export's ``draft_chain`` (d greedy draft steps in one graph):
  the schedule calls it for a round of d greedy drafts instead of d draft calls;
- :class:`OrtFastDraft` runs M2R2's draft stage, taking the round's ``FastScratch`` as the
  eager stage does and feeding it to the session as tensors.

The schedule (autoregressive, early exit, self-speculative, Kangaroo, EAGLE, swift, M2R2,
prompt lookup) is the one the recipe registry gives for the manifest's recipe and options: the
decode loops are not re-implemented, and neither is ``generate``'s front end
(``runtime.generation.GenerateFrontEnd``, ``SpeculativeModel``'s).
``lower(sm, "onnxruntime", export_dir=...)`` (:func:`lower_onnxruntime`) exports a model and
opens its export in one call.

Example::

    >>> model = OnnxModel("layerskip-onnx/")
    >>> out = model.generate(input_ids, max_new_tokens=32)   # == SpeculativeModel.generate
    >>> model.last_metrics.acceptance_rate
"""

from __future__ import annotations

import ctypes
import dataclasses
import inspect
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import GenerationConfig

from ..options import check_bool
from ..recipes import get_recipe
from ..runtime.cache import LayerLengths
from ..runtime.decode import cache_length, decode
from ..runtime.generation import GenerateFrontEnd, GenerationSource
from ..runtime.metrics import DecodeMetrics
from ..runtime.runner import AttentionLayout, StageRunner
from ..runtime.schedules import DecodeRequest
from .manifest import read_manifest
from .onnx_graph import remainder_graph
from .stage_signature import past_names, present_names, stage_input, step_present

if TYPE_CHECKING:
    from ..runtime.model import SpeculativeModel

log = logging.getLogger(__name__)

_NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}
# Output buffers an OrtStage keeps per input shape (decode calls: one-token steps, verify):
# at most this many shapes, each at most this large (a prefill's logits are not kept).
_MAX_BUFFERED_SHAPES = 64
_MAX_BUFFER_BYTES = 4 << 20
# Baseline schedules any export can run, and the stage each needs.
# Prompt lookup verifies with the full stage, whose export takes any length at any position.
_BASELINE_STAGES = {"autoregressive": "full", "early_exit": "draft", "lookup": "full"}
THREAD_POOLS = ("shared", "session")
# The intra-op size of onnxruntime's process-wide thread pool once an OnnxModel switched this
# process to it (``thread_pool="shared"``). onnxruntime creates that pool once; from then on
# it refuses new sessions with pools of their own, so every later OnnxModel shares it.
_shared_pool_threads: int | None = None


def shared_pool_threads() -> int | None:
    """The size of onnxruntime's process-wide pool if an OnnxModel switched this process to it
    (``thread_pool="shared"``), else None."""
    return _shared_pool_threads


def _thread_pool(thread_pool: str | None, threads: int | None, *, switch: bool = True) -> bool:
    """Whether an OnnxModel's sessions run on the process-wide pool (switching the process to
    it on the first ``"shared"``, unless ``switch`` is False); ValueError for what cannot be."""
    global _shared_pool_threads
    if thread_pool is not None and thread_pool not in THREAD_POOLS:
        raise ValueError(
            f"thread_pool: {thread_pool!r} is invalid; allowed: None, "
            f"{', '.join(map(repr, THREAD_POOLS))}"
        )
    size = _shared_pool_threads
    if size is None:
        if thread_pool != "shared":
            return False
        if threads is None:
            raise ValueError(
                "thread_pool: 'shared' needs threads (the shared pool's size); allowed with "
                "threads=None: thread_pool=None or 'session'"
            )
        if switch:
            from onnxruntime.capi import _pybind_state

            _pybind_state.set_global_thread_pool_sizes(threads, 1)
            _shared_pool_threads = threads
        return True
    if thread_pool == "session":
        raise ValueError(
            f"thread_pool: 'session', but this process's onnxruntime runs every new session on "
            f"its shared pool of {size} threads (an earlier OnnxModel asked for "
            "thread_pool='shared'); allowed: thread_pool=None or 'shared'"
        )
    if threads is not None and threads != size:
        raise ValueError(
            f"threads: {threads} on this process's shared onnxruntime pool of {size} threads "
            f"(sized once, by the first OnnxModel with thread_pool='shared'); allowed: "
            f"threads={size} or None"
        )
    return True


class OrtKVCache(LayerLengths):
    """Key/value buffers per cache layer with per-layer lengths and O(1) rollback.

    ``keys[i]`` / ``values[i]`` are OrtValues ``[B, H_kv, max_len, D]`` on ``device``
    (``"cpu"``: views of numpy arrays; ``"cuda"``: device memory), zero-filled: a masked slot
    must hold finite numbers, since attention multiplies it by a zero weight.

    >>> cache = OrtKVCache([(2, 4), (2, 4)], max_len=16)
    >>> cache.lengths = [3, 3]; cache.crop(2); cache.lengths
    [2, 2]
    """

    def __init__(
        self,
        shapes: Sequence[tuple[int, int]],
        max_len: int,
        *,
        batch_size: int = 1,
        dtype: Any = np.float32,
        device: str = "cpu",
    ) -> None:
        import onnxruntime as ort

        self.max_len = max_len
        self.device = device

        def buffer(h: int, d: int):
            zeros = np.zeros((batch_size, h, max_len, d), dtype=dtype)
            if device == "cpu":
                return ort.OrtValue.ortvalue_from_numpy(zeros)  # shares the numpy memory
            return ort.OrtValue.ortvalue_from_numpy(zeros, device, 0)  # a device copy

        self.keys = [buffer(h, d) for h, d in shapes]
        self.values = [buffer(h, d) for h, d in shapes]
        self.lengths = [0] * len(self.keys)

    def filled(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Copies of cache layer ``layer``'s filled prefix [B, H_kv, length, D] (for inspection)."""
        n = self.lengths[layer]
        return self.keys[layer].numpy()[:, :, :n], self.values[layer].numpy()[:, :, :n]


class OrtStage:
    """A stage executor over one onnxruntime session (see the module docstring)."""

    builds_masks = True  # the StageRunner need not compute masks for it

    def __init__(self, session, spec: dict[str, Any]) -> None:
        self.session = session
        self.cache_layers: list[int] = list(spec["cache_reads"])
        # the layers whose present is bound too (M2R2's draft reads slow layers it does not write)
        self.cache_writes = set(spec.get("cache_writes", self.cache_layers))
        names = set(spec["inputs"])
        self.tensor_inputs = [n for n in spec["inputs"] if not n.startswith("past_key_values.")]
        # the stage's keyword for each (EAGLE's head: ``hidden`` is exported as ``hidden_in``)
        self.keywords = [stage_input(n) for n in self.tensor_inputs]
        # A state input of a fixed width (EAGLE's target's ``prev_hidden``, [B, 1, D]): a
        # schedule's zeros of width 1 (the state before a prompt) are broadcast to it.
        self.widths = {
            stage_input(i.name): i.shape[-1]
            for i in session.get_inputs()
            if i.name in self.tensor_inputs and len(i.shape) == 3 and isinstance(i.shape[-1], int)
        }
        self.outputs = [n for n in spec["outputs"] if not n.startswith("present.")]
        self.groups: dict[str, list[int]] = spec["position_groups"]
        assert all(n in names for i in self.cache_layers for n in past_names(i))
        provider = session.get_providers()[0]
        self.device = "cuda" if provider == "CUDAExecutionProvider" else "cpu"
        self._binding = None
        self._bound: OrtKVCache | None = None  # the cache whose buffers _binding holds
        # Per input shapes (decode calls: one-token steps, each verify length), host buffers
        # for the inputs and outputs, bound by pointer. A call of the shapes bound last copies
        # its inputs in and runs: no binding calls (each costs a few microseconds through
        # onnxruntime's Python layer; a draft step runs in ~0.2 ms). ``get_outputs()`` is
        # avoided too: it wraps every bound output, the cache's presents included (34
        # OrtValues a call on the reference model, 0.1 ms). CPU only: on a GPU the outputs
        # stay in device memory.
        self._slots: dict[tuple, tuple[list[np.ndarray], list[np.ndarray]]] = {}
        self._bound_key: tuple | None = None  # the shapes whose buffers _binding holds

    def _bind_cache(self, cache: OrtKVCache):
        """An IO binding with each cache layer's past input and present output on its one buffer."""
        if cache is not self._bound:
            io = self.session.io_binding()
            for layer in self.cache_layers:
                buffers = (cache.keys[layer], cache.values[layer])
                for past, present, buf in zip(
                    past_names(layer), present_names(layer), buffers, strict=True
                ):
                    io.bind_ortvalue_input(past, buf)
                    if layer not in self.cache_writes:
                        continue
                    for name in self._presents(present):
                        io.bind_ortvalue_output(name, buf)
            self._binding, self._bound, self._bound_key = io, cache, None
        return self._binding

    def __call__(
        self,
        *,
        cache: OrtKVCache,
        masks: Any = None,
        remainder_masks: Any = None,
        **tensors: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        del masks, remainder_masks  # computed in the graph from the positions
        counts = {
            layer: self._written(tensors[positions])
            for positions, layers in self.groups.items()
            for layer in layers
        }
        ends = cache.reserve(counts)  # before the call: ORT does not bounds-check
        io = self._bind_cache(cache)
        values = [self._input(tensors, name) for name in self.keywords]
        key = tuple((tuple(v.shape), v.dtype) for v in values)
        slot = self._slots.get(key) if self.device == "cpu" else None
        if slot is None:
            results = self._run_unbuffered(io, values)
        else:
            inputs, outputs = slot
            for buf, value in zip(inputs, values, strict=True):
                np.copyto(buf, _to_numpy(value))
            if self._bound_key != key:  # the binding holds another shape's buffers
                for name, buf in zip(self.tensor_inputs, inputs, strict=True):
                    io.bind_input(name, "cpu", 0, buf.dtype, buf.shape, buf.ctypes.data)
                for name, buf in zip(self.outputs, outputs, strict=True):
                    io.bind_output(name, "cpu", 0, buf.dtype, buf.shape, buf.ctypes.data)
                self._bound_key = key
            self.session.run_with_iobinding(io)
            # Copies: the buffers are written again by the next call of this shape, and the
            # schedules keep outputs across calls (draft probabilities until verify).
            results = [buf.copy() for buf in outputs]
        cache.advance(ends)
        if slot is None:
            small = sum(r.nbytes for r in results) <= _MAX_BUFFER_BYTES  # decode, not prefill
            if self.device == "cpu" and small and len(self._slots) < _MAX_BUFFERED_SHAPES:
                self._slots[key] = (
                    [np.empty_like(_to_numpy(v)) for v in values],
                    [np.empty_like(r) for r in results],
                )
        return {name: torch.from_numpy(r) for name, r in zip(self.outputs, results, strict=True)}

    def _input(self, tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        value = tensors[name]
        width = self.widths.get(name)
        if width is not None and value.shape[-1] == 1 != width:
            return value.expand(*value.shape[:-1], width)  # zeros of width 1: the first state
        return value

    def _presents(self, present: str) -> list[str]:
        """The outputs bound, with the past input, to the buffer of ``present``'s cache layer."""
        return [present]

    def _written(self, positions: torch.Tensor) -> int:
        """Positions a call writes into each cache layer of the group that ``positions`` feeds."""
        return positions.shape[1]

    def _run_unbuffered(self, io, values: list[torch.Tensor]) -> list[np.ndarray]:
        """A call of input shapes without buffers yet (a prefill, a new verify length, any call
        on a GPU): inputs bound by pointer, outputs allocated by onnxruntime."""
        arrays = [_to_numpy(v) for v in values]
        for name, array in zip(self.tensor_inputs, arrays, strict=True):
            # by pointer, no copy: ``arrays`` outlives the run
            io.bind_input(name, "cpu", 0, array.dtype, array.shape, array.ctypes.data)
        for name in self.outputs:
            io.bind_output(name, self.device)
        self._bound_key = None  # bound to this call's arrays, which go away
        self.session.run_with_iobinding(io)
        # get_outputs: in binding order, the cache's presents first (bound once), then ours.
        return [v.numpy() for v in io.get_outputs()[-len(self.outputs) :]]


class OrtChainStage(OrtStage):
    """The ``draft_chain`` stage: ``chain_length`` greedy draft steps in one call
    (``leapfx.export.chain``).

    Called like the draft stage on one token (``input_ids`` and ``position_ids`` [1, 1]); returns
    ``tokens`` [1, D] int64 (each the argmax of the draft logits after the one before) and
    ``hidden`` [1, D, H] (the draft's exit states of the D tokens fed: the first input and all
    tokens but the last), and writes the draft's cache layers at the D positions from
    ``position_ids``: what D draft calls do, in one session call. Each step's presents are
    outputs of their own (``present.{l}.key.step{i}``), bound with the layer's past and present
    to its one buffer: the steps write the cache in place, one after the other.
    """

    def __init__(self, session, spec: dict[str, Any]) -> None:
        super().__init__(session, spec)
        self.chain_length: int = int(spec["chain"]["length"])

    def _presents(self, present: str) -> list[str]:
        # every step writes its position into the layer's one buffer, where the next reads it
        return [*(step_present(present, i) for i in range(self.chain_length - 1)), present]

    def _written(self, positions: torch.Tensor) -> int:
        if positions.shape[1] != 1:
            raise ValueError(
                f"position_ids: shape {list(positions.shape)} is invalid for draft_chain; "
                "allowed: one token a row, [batch, 1]"
            )
        return self.chain_length


class OrtFastDraft(OrtStage):
    """M2R2's ``draft`` stage (``leapfx.export.fast_draft``): called as the eager stage is,
    with the round's ``FastScratch``; the scratch crosses into the session as tensors.

    A call feeds each fast layer's slot the round's earlier fast keys/values (``scratch.kv``,
    concatenated: ``fast_past.{i}.key`` / ``.value``, of length 0 at the round's first draft)
    beside the slow cache buffers (read only), and appends this draft's, the last column of
    ``fast_present.{i}.*``, to ``scratch.kv``, as the eager stage does. A ``fast_keys`` layer's
    choice of slow slots (``fast_present.{i}.top``, made by the round's first draft) is kept
    in ``scratch.exported`` and fed to the next draft. Returns ``logits`` and ``hidden``.
    """

    def __init__(self, session, spec: dict[str, Any]) -> None:
        super().__init__(session, spec)
        scratch = spec["scratch"]
        self.scratch_inputs: list[str] = list(scratch["inputs"])
        self.scratch_outputs: list[str] = list(scratch["outputs"])
        self.first = {
            name: (tuple(f["shape"]), getattr(torch, f["dtype"]))
            for name, f in scratch["first"].items()
        }

    def __call__(self, *, cache: OrtKVCache, scratch, **tensors: torch.Tensor):
        tensors.pop("masks", None)
        batch = tensors["input_ids"].shape[0]
        for name in self.scratch_inputs:
            _, slot, kind = name.split(".")  # fast_past.{i}.key | .value | .top
            earlier = scratch.kv.get(int(slot), [])  # [(k, v)], each [B, h_kv, 1, D]
            if kind == "top":
                value = scratch.exported.get(name)
            elif earlier:
                value = torch.cat([e[kind == "value"] for e in earlier], dim=2)
            else:
                value = None
            if value is None:  # the round's first draft
                shape, dtype = self.first[name]
                value = torch.zeros(batch, *shape, dtype=dtype)
            tensors[name] = value
        out = super().__call__(cache=cache, **tensors)
        new: dict[int, dict[str, torch.Tensor]] = {}
        for past, name in zip(self.scratch_inputs, self.scratch_outputs, strict=True):
            _, slot, kind = name.split(".")
            if kind == "top":
                scratch.exported[past] = out.pop(name)
            else:
                new.setdefault(int(slot), {})[kind] = out.pop(name)[:, :, -1:]
        for slot, kv in new.items():
            scratch.kv.setdefault(slot, []).append((kv["key"], kv["value"]))
        return out


class SplitVerify:
    """Verify as two calls: the draft stage on the new tokens, then verify's upper part.

    A verify call runs the round's new tokens (the last draft) through the layers below the exit
    and then every row through the layers from the exit up. The draft stage runs exactly those
    lower layers (same weights, same cache layers, same positions) and returns their exit states
    as ``hidden``; ``upper`` is the verify graph from the join of the exit states on
    (``onnx_graph.remainder_graph``). The outputs and cache writes are verify's.

    Why: onnxruntime prepacks each session's MatMul weights into the session's own buffers,
    so the lower layers' weights exist twice, once in the draft session and once in the verify
    session, and a round (d drafts, one verify) reads both copies plus the upper layers'. On
    the reference model that is 36 MB of float32 weights a round against 26 MB for a full
    step, more than a 32 MB L3 holds: the verify found its weights evicted by the drafts
    (1.49 full steps after 4 drafts against 1.26 back to back). Split, a round reads the lower
    layers from the draft session only (a round of 4 drafts and a verify 3.73 -> 3.20 ms, the
    same logits); the price is one more session call (~30 us) and the draft head's norm and
    logits on one row.
    """

    builds_masks = True

    def __init__(self, draft: OrtStage, upper: OrtStage) -> None:
        self.draft, self.upper = draft, upper
        self.device = upper.device

    def __call__(
        self,
        *,
        cache: OrtKVCache,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        exit_hidden: torch.Tensor,
        remainder_position_ids: torch.Tensor,
        masks: Any = None,
        remainder_masks: Any = None,
    ) -> dict[str, torch.Tensor]:
        del masks, remainder_masks  # computed in the graphs from the positions
        hidden = self.draft(cache=cache, input_ids=input_ids, position_ids=position_ids)["hidden"]
        rows = torch.cat([exit_hidden.to(hidden.dtype), hidden], dim=1)
        return self.upper(
            cache=cache, exit_hidden=rows, remainder_position_ids=remainder_position_ids
        )


def _upper_stage(path: Path, manifest: dict, options, providers) -> OrtStage | None:
    """verify's upper part as an OrtStage (see :class:`SplitVerify`), or None where the
    stages do not have the shapes it needs."""
    import onnx
    import onnxruntime as ort

    stages = manifest["stages"]
    if (
        "draft" not in stages
        or "verify" not in stages
        or "hidden" not in stages["draft"]["outputs"]
    ):
        return None
    spec, draft = stages["verify"], stages["draft"]
    lower = spec["position_groups"].get("position_ids", [])
    upper_layers = spec["position_groups"].get("remainder_position_ids", [])
    if (
        sorted(lower) != sorted(draft["position_groups"].get("position_ids", []))
        or not upper_layers
    ):
        return None
    upper = remainder_graph(onnx.load(str(path / spec["file"]), load_external_data=False), lower)
    if upper is None:
        return None
    outputs = [o.name for o in upper.graph.output]
    if [o for o in outputs if not o.startswith("present.")] != [
        o for o in spec["outputs"] if not o.startswith("present.")
    ]:
        return None
    # from memory: its weights are the export's own weights.bin, found through this folder
    options.add_session_config_entry(
        "session.model_external_initializers_file_folder_path", str(path)
    )
    session = ort.InferenceSession(upper.SerializeToString(), options, providers=providers)
    upper_spec = {
        "cache_reads": upper_layers,
        "position_groups": {"remainder_position_ids": upper_layers},
        "inputs": [i.name for i in upper.graph.input],
        "outputs": outputs,
    }
    return OrtStage(session, upper_spec)


def _load_errors() -> tuple[type[BaseException], ...]:
    """onnxruntime's exception types for a model it cannot load (an opset it does not know,
    an op it has no kernel for): not subclasses of any builtin error."""
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    names = ("Fail", "InvalidGraph", "NotImplemented", "InvalidArgument")
    return tuple(getattr(state, n) for n in names if hasattr(state, n))


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.detach().cpu().numpy())


def default_providers() -> list[str]:
    """CUDA execution provider when onnxruntime-gpu is installed and sees a GPU, else CPU."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    if "CUDAExecutionProvider" in available and _cuda_device_present():
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def _cuda_device_present() -> bool:
    # onnxruntime-gpu lists the CUDA provider whether or not a device exists; ask the driver.
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        count = ctypes.c_int(0)
        return (
            lib.cuInit(0) == 0
            and lib.cuDeviceGetCount(ctypes.byref(count)) == 0
            and (count.value > 0)
        )
    except OSError:
        return False


class OnnxModel(GenerateFrontEnd):
    """A leapfx ONNX export, ready to ``generate`` with onnxruntime.

    Args:
        path: the export directory (``SpeculativeModel.export_onnx`` / ``leapfx export``).
        providers: onnxruntime execution providers; None picks :func:`default_providers`.
        threads: onnxruntime intra-op threads per session; None lets onnxruntime decide.
        spin: whether onnxruntime's worker threads busy-wait for the next op within a call
            (they stop at the end of each call: ``session.force_spinning_stop``). With more
            than one thread, handing each small op to a sleeping worker costs more than the op.
            The stop at the end of a call matters as much: a schedule alternates sessions
            (draft, verify) and runs torch and Python work between calls, and workers left
            spinning after a call take the cores it needs (docs/benchmarks.md, "Why the
            defaults"). Off by default (``threads=None`` leaves the count to onnxruntime).
        recipe: whose schedule to run; None: the exported recipe's. ``"autoregressive"`` runs
            the baseline over the ``full`` stage and ``"early_exit"`` every token from the
            ``draft`` stage, so one export also serves the baselines a benchmark compares.
        split_verify: run layerskip's verify as the draft stage on the new tokens and then
            verify's upper part (:class:`SplitVerify`: one copy of the lower layers' packed
            weights in a round instead of two). False runs the exported verify graph as is.
            Which is faster depends on the CPU's cache: split wins where the two copies do not
            fit the last-level cache (`leapfx bench --onnx-split-verify auto` times both per
            export).
        thread_pool: where the sessions' intra-op threads live. ``"shared"``: switch this
            process's onnxruntime to one process-wide pool of ``threads`` threads, one set of
            workers for every stage (a decode alternates the draft and verify sessions: with a
            pool per session each call woke workers that had slept through the other
            session's calls). onnxruntime sizes that pool
            once and from then on refuses sessions with pools of their own, in this process,
            leapfx's or not: every later OnnxModel shares it (``threads`` must then be its size
            or None), and ``spin`` and a different ``verify_threads`` do not apply (its workers
            spin as onnxruntime's defaults say). For a process that decodes with leapfx only,
            e.g. ``leapfx bench``. ``"session"``: a pool per session, as ``threads`` and
            ``spin`` say. None (default): ``"session"``, or the shared pool once this process
            has switched to it.
        verify_threads: intra-op threads of verify's upper part (the split verify's second
            session); None: ``threads``. Its rows are d+1 tokens through the upper layers,
            where a draft or full step is one: more work per weight read, so it can use a core
            the one-token calls cannot. A value above 1 turns spinning on for that session
            only (handing each op's halves to a sleeping worker costs more than the op). Where
            verify is not split (``split_verify=False``, other recipes) it has no effect. Only
            with a core to spare: when another process keeps the second core busy, each op
            waits for its worker to be scheduled and verify costs 2-3 full steps instead of 1
            (measured; see docs/export.md), which is why it is not the default.

    Attributes:
        manifest: the export's manifest (dict).
        recipe: the recipe whose schedule ``generate`` runs.
        split_verify: whether verify runs split (asked for, and possible for this export).
        providers: the providers each session actually uses.
        last_metrics: ``DecodeMetrics`` of the latest ``generate`` call (None before one).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        providers: Sequence[str] | None = None,
        threads: int | None = None,
        spin: bool = False,
        recipe: str | None = None,
        split_verify: bool = True,
        verify_threads: int | None = None,
        thread_pool: str | None = None,
    ) -> None:
        try:
            import onnxruntime as ort
        except ImportError:
            raise ImportError(
                "OnnxModel needs onnxruntime: pip install -e '.[onnx]' in leapfx's checkout "
                "(or '.[onnx-gpu]')"
            ) from None
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        m = self.manifest
        for name, value in (("threads", threads), ("verify_threads", verify_threads)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}: {value!r} is invalid; allowed: an integer >= 1 or None")
        self.threads = threads
        self.verify_threads = threads if verify_threads is None else verify_threads
        check_bool("spin", spin)
        check_bool("split_verify", split_verify)
        # whether the sessions run on onnxruntime's process-wide pool (see ``thread_pool``);
        # everything checked before the process is switched to it
        if _thread_pool(thread_pool, threads, switch=False):
            size = _shared_pool_threads or threads
            if verify_threads is not None and verify_threads != size:
                raise ValueError(
                    f"verify_threads: {verify_threads} needs a pool of its own; on onnxruntime's "
                    f"shared pool of {size} threads every session has those (allowed: None or "
                    f"{size}, or thread_pool='session' in a process not switched to it)"
                )
        self.shared_threads = _thread_pool(thread_pool, threads)
        if self.shared_threads:
            self.threads = self.verify_threads = _shared_pool_threads

        def session_options(threads=threads, spin=spin, shared=self.shared_threads):
            options = ort.SessionOptions()
            if shared:  # the process's pool, its workers spinning as onnxruntime's defaults say
                options.use_per_session_threads = False
                return options
            if threads is not None:
                options.intra_op_num_threads = threads
                options.inter_op_num_threads = 1
            options.add_session_config_entry(
                "session.intra_op.allow_spinning", "1" if spin else "0"
            )
            if spin:  # between a call's ops only: an idle session's workers leave the cores
                options.add_session_config_entry("session.force_spinning_stop", "1")
            return options

        options = session_options()
        chosen = list(providers) if providers is not None else default_providers()
        load_errors = _load_errors()
        self.recipe = m["recipe"] if recipe is None else recipe
        self.stages: dict[str, OrtStage] = {}
        for name, spec in m["stages"].items():
            if "chain" in spec and self.recipe != m["recipe"]:
                continue  # drafts for the exported recipe's schedule only (not the baselines')
            file = self.path / spec["file"]
            if not file.is_file():
                raise ValueError(f"path: {str(file)!r} is missing; the export is incomplete")
            try:
                session = ort.InferenceSession(str(file), options, providers=chosen)
            except load_errors as exc:
                raise ValueError(
                    f"path: onnxruntime {ort.__version__} cannot load {str(file)!r} (opset "
                    f"{m.get('opset')}): {str(exc).splitlines()[0]}; upgrade onnxruntime or "
                    "export again with a lower opset (export_onnx(..., opset=18))"
                ) from exc
            stage_type = (
                OrtChainStage if "chain" in spec else OrtFastDraft if "scratch" in spec
                else OrtStage
            )  # fmt: skip
            self.stages[name] = stage_type(session, spec)
        first = next(iter(self.stages.values()))
        self.providers: list[str] = first.session.get_providers()
        log.info("onnxruntime providers: %s", self.providers)

        r = get_recipe(self.recipe)
        if self.recipe != m["recipe"]:
            # a baseline runs a stage on token runs: not M2R2's draft, which takes a scratch
            runs = {n for n, s in self.stages.items() if not isinstance(s, OrtFastDraft)}
            needs = _BASELINE_STAGES.get(self.recipe)
            if needs is None or needs not in runs:
                allowed = [m["recipe"]]
                allowed += [name for name, stage in _BASELINE_STAGES.items() if stage in runs]
                raise ValueError(
                    f"recipe: {self.recipe!r} cannot run on this {m['recipe']} export; "
                    f"allowed: {', '.join(allowed)}"
                )
        # The options were validated when the model was rewritten; rebuilt as they were saved
        # (a baseline schedule takes the ones it shares, e.g. early_exit takes exit_layer).
        fields = {f.name for f in dataclasses.fields(r.options_type)}
        self.options = r.options_type(**{k: v for k, v in m["options"].items() if k in fields})
        self._schedule = r.schedule(self.options)
        # A recipe whose draft stage is verify's lower part (its ``hidden``: the exit states
        # verify joins to the cached ones) says so (``Capabilities.split_verify``: layerskip's
        # exit-head drafts; Kangaroo's verify also runs the adapter on the last draft, and its
        # draft returns the adapter's states: not split).
        if split_verify and r.capabilities.split_verify:
            vt = self.verify_threads
            upper_options = session_options(vt, spin or (vt is not None and vt > 1))
            upper = _upper_stage(self.path, m, upper_options, chosen)
            if upper is not None:
                self.stages["verify"] = SplitVerify(self.stages["draft"], upper)
        # whether verify runs split (asked for, and the recipe's export has an upper part)
        self.split_verify = isinstance(self.stages.get("verify"), SplitVerify)
        self._lossless = r.lossless
        self._lookahead = r.lookahead(self.options)
        self._generation_config = _generation_config(m["generation_config"], m["eos_token_ids"])
        att = m["attention"]
        self._layout = AttentionLayout(
            impl=att["implementation"],
            kinds=tuple(att["layer_kinds"]),
            window=att["sliding_window"],
            dtype=getattr(torch, m["dtype"]),
            device=torch.device("cpu"),
        )
        cache = m["cache"]
        self._kv_shapes = list(zip(cache["num_kv_heads"], cache["head_dim"], strict=True))
        self._dtype = _NUMPY_DTYPES[m["dtype"]]
        self._cache: OrtKVCache | None = None
        self.last_metrics: DecodeMetrics | None = None

    def _cache_for(self, needed: int) -> OrtKVCache:
        size = cache_length(needed, getattr(self.options, "max_cache_len", None), self._lookahead)
        if self._cache is None or self._cache.max_len < size:
            device = next(iter(self.stages.values())).device
            self._cache = OrtKVCache(self._kv_shapes, size, dtype=self._dtype, device=device)
        self._cache.reset()
        return self._cache

    # generate: ``GenerateFrontEnd.generate``, SpeculativeModel's; the decode alone runs under
    # torch.inference_mode, so its output is an ordinary tensor
    _generate_in_inference_mode = False

    def _generation_source(self) -> GenerationSource:
        return GenerationSource(
            config=self._generation_config,
            vocab_size=self.manifest["vocab_size"],
            max_positions=self.manifest["attention"].get("rotary_positions"),
            recipe=self.recipe,
            lossless=self._lossless,
        )

    def _generate_prompt(self, input_ids: torch.Tensor) -> torch.Tensor:
        return input_ids.to(torch.long).cpu()

    def _generate_decode(
        self, prompt: torch.Tensor, request: DecodeRequest
    ) -> tuple[list[int], DecodeMetrics]:
        needed = prompt.shape[1] + request.max_new_tokens + self._lookahead
        limit = self.manifest["attention"].get("rotary_positions")
        if limit is not None and needed > limit:
            raise ValueError(
                f"max_new_tokens: the prompt plus max_new_tokens (and {self._lookahead} "
                f"lookahead positions) need {needed} positions but the export's rotary tables "
                f"cover {limit} (the model's max_position_embeddings); shorten the prompt or "
                "max_new_tokens"
            )
        runner = StageRunner(self.stages, self._cache_for(needed), self._layout)
        with torch.inference_mode():
            return decode(
                self._schedule, runner, prompt, request, name=self.recipe,
                num_speculations=getattr(self.options, "num_speculations", 0),
            )  # fmt: skip

    def __repr__(self) -> str:
        return f"OnnxModel({str(self.path)!r}, recipe={self.recipe!r}, providers={self.providers})"


def _generation_config(saved: dict[str, Any], eos_token_ids: list[int]):
    """The export's generation config; its EOS falls back to the model config's, as saved in
    the manifest's ``eos_token_ids`` (what the exported model stops at)."""
    config = GenerationConfig.from_dict(dict(saved))
    if config.eos_token_id is None and eos_token_ids:
        config.eos_token_id = list(eos_token_ids)
    return config


# sm.export_onnx's keywords that ``lower(sm, "onnxruntime", ...)`` passes on to the export.
EXPORT_OPTIONS = ("opset", "overwrite", "optimize")


def lower_onnxruntime(
    sm: SpeculativeModel, export_dir: str | os.PathLike | None = None, **options: Any
) -> OnnxModel:
    """``lower(sm, "onnxruntime", export_dir=dir, **options)``: ``sm``'s stages exported to
    ``dir`` (``sm.export_onnx``, with the options of :data:`EXPORT_OPTIONS`) and loaded as an
    :class:`OnnxModel` (with the others: its keywords). The options are checked before the
    export runs; ValueError names one it does not take."""
    loads = [
        p.name
        for p in inspect.signature(OnnxModel.__init__).parameters.values()
        if p.kind is p.KEYWORD_ONLY
    ]
    for name in options:
        if name not in EXPORT_OPTIONS and name not in loads:
            raise ValueError(
                f"{name}: backend 'onnxruntime' does not take it; allowed: export_dir, "
                f"{', '.join((*EXPORT_OPTIONS, *loads))}"
            )
    if export_dir is None:
        raise ValueError(
            "export_dir: backend 'onnxruntime' exports the stages there first; allowed: a "
            "directory path (an existing export is opened with OnnxModel(dir))"
        )
    export = {k: v for k, v in options.items() if k in EXPORT_OPTIONS}
    path = sm.export_onnx(export_dir, **export)
    return OnnxModel(path, **{k: v for k, v in options.items() if k not in EXPORT_OPTIONS})
