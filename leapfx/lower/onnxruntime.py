"""``OnnxModel``: an ONNX export run by onnxruntime under the recipe's own schedule.

The schedules of ``leapfx.runtime`` call a StageRunner, which calls ``stages[name](**inputs)``
and ``runner.cache.crop(n)``. ``OnnxModel`` opens one onnxruntime session per exported stage
(its providers, threads, spinning and thread pool as asked) and puts each behind that interface
with the executors of ``ort_stages.py``: :class:`~leapfx.lower.ort_stages.OrtStage` (one
session, its cache layers bound in place to an :class:`~leapfx.lower.ort_stages.OrtKVCache`),
``OrtChainStage`` (the ``draft_chain``), ``OrtFastDraft`` (M2R2's draft) and ``SplitVerify``
(layerskip's verify as the draft stage and verify's upper part).

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
from ..runtime.decode import cache_length, decode
from ..runtime.generation import GenerateFrontEnd, GenerationSource
from ..runtime.metrics import DecodeMetrics
from ..runtime.runner import AttentionLayout, StageRunner
from ..runtime.schedules import DecodeRequest
from .manifest import read_manifest
from .ort_stages import (
    OrtChainStage,
    OrtFastDraft,
    OrtKVCache,
    OrtStage,
    SplitVerify,
    upper_stage,
)

if TYPE_CHECKING:
    from ..runtime.model import SpeculativeModel

log = logging.getLogger(__name__)

_NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}
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


def _load_errors() -> tuple[type[BaseException], ...]:
    """onnxruntime's exception types for a model it cannot load (an opset it does not know,
    an op it has no kernel for): not subclasses of any builtin error."""
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    names = ("Fail", "InvalidGraph", "NotImplemented", "InvalidArgument")
    return tuple(getattr(state, n) for n in names if hasattr(state, n))


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
            upper = upper_stage(self.path, m, upper_options, chosen)
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
