"""``OnnxModel``: an ONNX export run by onnxruntime under the recipe's own schedule.

The schedules of ``leapfx.runtime`` call a StageRunner, which calls ``stages[name](**inputs)``
and ``runner.cache.crop(n)``. This module puts onnxruntime behind exactly that interface:

- :class:`OrtKVCache` holds keys/values as preallocated numpy arrays ``[B, H_kv, max_len, D]``
  per cache slot, each with its own fill length, and rolls back with ``crop`` in O(1) (moves
  lengths, copies nothing), like ``StaticKVCache``;
- :class:`OrtStage` is a stage executor: it feeds ``past_key_values.{i}.*`` as the filled prefix
  of each slot the stage touches (made contiguous for onnxruntime), runs the session, writes the
  new positions of each ``present.{i}.*`` back into the buffers and returns the stage's outputs
  as torch tensors (zero-copy views of onnxruntime's arrays). Masks are computed inside the ONNX
  graphs, so it ignores the runner's ``masks``.

The schedule (autoregressive, early exit, self-speculative, Kangaroo) is the one the recipe
registry gives for the manifest's recipe and options: the decode loops are not re-implemented.

Example::

    >>> model = OnnxModel("layerskip-onnx/")
    >>> out = model.generate(input_ids, max_new_tokens=32)   # == SpeculativeModel.generate
    >>> model.last_metrics.acceptance_rate
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..runtime.cache import SlotLengths
from ..runtime.decode import cache_length, check_prompt, decode, decode_request
from ..runtime.metrics import DecodeMetrics
from ..runtime.runner import AttentionLayout, StageRunner
from .manifest import read_manifest
from .stage_module import past_names, present_names

log = logging.getLogger(__name__)

_NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}
# Baseline schedules any export can run, and the stage each needs.
_BASELINE_STAGES = {"autoregressive": "full", "early_exit": "draft"}


class OrtKVCache(SlotLengths):
    """Numpy key/value buffers per cache slot with per-slot lengths and O(1) rollback.

    >>> cache = OrtKVCache([(2, 4), (2, 4)], max_len=16)
    >>> cache.write(0, np.zeros((1, 2, 3, 4), np.float32), np.zeros((1, 2, 3, 4), np.float32))
    >>> cache.lengths
    [3, 0]
    >>> cache.crop(2); cache.lengths
    [2, 0]
    """

    def __init__(
        self,
        shapes: Sequence[tuple[int, int]],
        max_len: int,
        *,
        batch_size: int = 1,
        dtype: Any = np.float32,
    ) -> None:
        self.max_len = max_len
        self.keys = [np.zeros((batch_size, h, max_len, d), dtype=dtype) for h, d in shapes]
        self.values = [np.zeros_like(k) for k in self.keys]
        self.lengths = [0] * len(self.keys)

    def past(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of the filled prefix, contiguous: [B, H_kv, length, D] each."""
        n = self.lengths[layer]
        return (
            np.ascontiguousarray(self.keys[layer][:, :, :n]),
            np.ascontiguousarray(self.values[layer][:, :, :n]),
        )

    def write(self, layer: int, present_keys: np.ndarray, present_values: np.ndarray) -> None:
        """Store a present (past + new, [B, H_kv, length + S, D]): only the new part is copied."""
        start, end = self.lengths[layer], present_keys.shape[2]
        assert end >= start, "a present is never shorter than the past it was fed"
        self.check_room(end)
        self.keys[layer][:, :, start:end] = present_keys[:, :, start:]
        self.values[layer][:, :, start:end] = present_values[:, :, start:]
        self.lengths[layer] = end


class OrtStage:
    """A stage executor over one onnxruntime session (see the module docstring)."""

    builds_masks = True  # the StageRunner need not compute masks for it

    def __init__(self, session, spec: dict[str, Any]) -> None:
        self.session = session
        self.cache_layers: list[int] = list(spec["cache_reads"])
        names = set(spec["inputs"])
        self.tensor_inputs = [n for n in spec["inputs"] if not n.startswith("past_key_values.")]
        self.outputs = [n for n in spec["outputs"] if not n.startswith("present.")]
        self.groups: dict[str, list[int]] = spec["position_groups"]
        self._output_names = self.outputs + [n for i in self.cache_layers for n in present_names(i)]
        assert all(n in names for i in self.cache_layers for n in past_names(i))

    def __call__(
        self,
        *,
        cache: OrtKVCache,
        masks: Any = None,
        remainder_masks: Any = None,
        **tensors: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        del masks, remainder_masks  # computed in the graph from positions and past lengths
        feed: dict[str, np.ndarray] = {}
        for name in self.tensor_inputs:
            feed[name] = _to_numpy(tensors[name])
        for layer in self.cache_layers:
            k_name, v_name = past_names(layer)
            feed[k_name], feed[v_name] = cache.past(layer)
        for positions, layers in self.groups.items():
            lengths = {cache.lengths[i] for i in layers}
            # Each group's mask is sized by one past length: the schedules keep them equal.
            assert len(lengths) == 1, f"{positions}: cache layers {layers} differ in length"
        results = self.session.run(self._output_names, feed)
        n = len(self.outputs)
        for j, layer in enumerate(self.cache_layers):
            cache.write(layer, results[n + 2 * j], results[n + 2 * j + 1])
        return {
            name: torch.from_numpy(a) for name, a in zip(self.outputs, results[:n], strict=True)
        }


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
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")
        count = ctypes.c_int(0)
        return (
            lib.cuInit(0) == 0
            and lib.cuDeviceGetCount(ctypes.byref(count)) == 0
            and (count.value > 0)
        )
    except OSError:
        return False


class OnnxModel:
    """A leapfx ONNX export, ready to ``generate`` with onnxruntime.

    Args:
        path: the export directory (``SpeculativeModel.export_onnx`` / ``leapfx export``).
        providers: onnxruntime execution providers; None picks :func:`default_providers`.
        threads: onnxruntime intra-op threads per session; None lets onnxruntime decide.
        recipe: whose schedule to run; None: the exported recipe's. ``"autoregressive"`` runs
            the baseline over the ``full`` stage and ``"early_exit"`` every token from the
            ``draft`` stage, so one export also serves the baselines a benchmark compares.

    Attributes:
        manifest: the export's manifest (dict).
        recipe: the recipe whose schedule ``generate`` runs.
        providers: the providers each session actually uses.
        last_metrics: ``DecodeMetrics`` of the latest ``generate`` call (None before one).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        providers: Sequence[str] | None = None,
        threads: int | None = None,
        recipe: str | None = None,
    ) -> None:
        try:
            import onnxruntime as ort
        except ImportError:
            raise ImportError(
                "OnnxModel needs onnxruntime: pip install 'leapfx[onnx]' (or 'leapfx[onnx-gpu]')"
            ) from None
        from ..rewrite import get_recipe

        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        m = self.manifest
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads: {threads!r} is invalid; allowed: an integer >= 1 or None")
        options = ort.SessionOptions()
        if threads is not None:
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
        chosen = list(providers) if providers is not None else default_providers()
        self.stages: dict[str, OrtStage] = {}
        for name, spec in m["stages"].items():
            file = self.path / spec["file"]
            if not file.is_file():
                raise ValueError(f"path: {str(file)!r} is missing; the export is incomplete")
            session = ort.InferenceSession(str(file), options, providers=chosen)
            self.stages[name] = OrtStage(session, spec)
        first = next(iter(self.stages.values()))
        self.providers: list[str] = first.session.get_providers()
        log.info("onnxruntime providers: %s", self.providers)

        self.recipe = m["recipe"] if recipe is None else recipe
        r = get_recipe(self.recipe)
        if self.recipe != m["recipe"]:
            needs = _BASELINE_STAGES.get(self.recipe)
            if needs is None or needs not in self.stages:
                allowed = [m["recipe"]]
                allowed += [
                    name for name, stage in _BASELINE_STAGES.items() if stage in self.stages
                ]
                raise ValueError(
                    f"recipe: {self.recipe!r} cannot run on this {m['recipe']} export; "
                    f"allowed: {', '.join(allowed)}"
                )
        # The options were validated when the model was rewritten; rebuilt as they were saved
        # (a baseline schedule takes the ones it shares, e.g. early_exit takes exit_layer).
        fields = {f.name for f in dataclasses.fields(r.options_type)}
        self.options = r.options_type(**{k: v for k, v in m["options"].items() if k in fields})
        self._schedule = r.schedule(self.options)
        self._lookahead = r.lookahead(self.options)
        self._generation_config = _generation_config(m["generation_config"])
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
            self._cache = OrtKVCache(self._kv_shapes, size, dtype=self._dtype)
        self._cache.reset()
        return self._cache

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int | None = None,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | list[int] | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Generate like ``SpeculativeModel.generate``: returns [1, prompt + new] token ids.

        Defaults (``max_new_tokens``, sampling, EOS) come from the exported model's generation
        config. Metrics land in ``self.last_metrics``.
        """
        check_prompt(input_ids, attention_mask, self.manifest["vocab_size"])
        prompt = input_ids.to(torch.long).cpu()
        sampling = {"do_sample": do_sample, "temperature": temperature, "top_k": top_k,
                    "top_p": top_p}  # fmt: skip
        if eos_token_id is None:
            eos_token_id = list(self.manifest["eos_token_ids"])
        request = decode_request(
            self._generation_config, prompt.shape[1], max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_id, sampling=sampling, generator=generator,
        )  # fmt: skip
        needed = prompt.shape[1] + request.max_new_tokens + self._lookahead
        runner = StageRunner(self.stages, self._cache_for(needed), self._layout)
        with torch.inference_mode():
            tokens, self.last_metrics = decode(
                self._schedule, runner, prompt, request, name=self.recipe,
                num_speculations=getattr(self.options, "num_speculations", 0),
            )  # fmt: skip
        new = torch.tensor([tokens], dtype=input_ids.dtype, device=input_ids.device)
        return torch.cat([input_ids, new], dim=1)

    def __repr__(self) -> str:
        return f"OnnxModel({str(self.path)!r}, recipe={self.recipe!r}, providers={self.providers})"


def _generation_config(saved: dict[str, Any]):
    from transformers import GenerationConfig

    return GenerationConfig.from_dict(dict(saved))
