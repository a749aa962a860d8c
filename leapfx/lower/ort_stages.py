"""The stage executors of an ONNX export: onnxruntime sessions behind the StageRunner interface.

The schedules of ``leapfx.runtime`` call a StageRunner, which calls ``stages[name](**inputs)``
and ``runner.cache.crop(n)``. This module puts onnxruntime sessions behind exactly that
interface; ``onnxruntime.py`` (:class:`~leapfx.lower.onnxruntime.OnnxModel`) opens an export's
sessions, wraps each in one of these and decodes with the recipe's schedule.

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
  eager stage does and feeding it to the session as tensors;
- :class:`SplitVerify` runs layerskip's verify as the draft stage and verify's upper part
  (:func:`upper_stage` opens that part's session).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..runtime.cache import LayerLengths
from .onnx_graph import remainder_graph
from .stage_signature import past_names, present_names, stage_input, step_present

# Output buffers an OrtStage keeps per input shape (decode calls: one-token steps, verify):
# at most this many shapes, each at most this large (a prefill's logits are not kept).
_MAX_BUFFERED_SHAPES = 64
_MAX_BUFFER_BYTES = 4 << 20


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


def upper_stage(path: Path, manifest: dict, options, providers) -> OrtStage | None:
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


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.detach().cpu().numpy())
