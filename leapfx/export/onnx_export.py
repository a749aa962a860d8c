"""``export_onnx``: every stage of a SpeculativeModel as an ONNX model, plus a manifest.

Steps, per stage (``full``, ``draft``, ``verify``, EAGLE's ``target`` and ``head``, whichever
the recipe cut; M2R2's fast-stream ``draft``, which takes its round's scratch, is wrapped by
:mod:`~leapfx.export.fast_draft` instead of steps 1-2: the scratch in and out as tensors, the
slow cache read and not written):

1. *discover* which KV-cache layers the stage touches and which position input feeds each: one
   eager call on a few tokens over empty pasts, with a different token count per position input
   (a cache layer's present length then says which input fed it; ``lower.stage_signature``,
   shared with the compiled stages);
2. wrap the stage as an :class:`~leapfx.export.stage_module.ExportableStage` (tensors in,
   tensors out, masks built in the graph, the KV cache as whole static buffers written in
   place) and export it with ``torch.onnx.export(dynamo=True)`` with named dynamic axes:
   ``batch``, ``sequence`` (``input_ids``, and the EAGLE head's state per token), ``max_cache_len``
   (every cache buffer) and, for verify, ``hidden_sequence`` (``exit_hidden``) and
   ``remainder_sequence``; an input that shares its name with an output (the EAGLE head's
   ``hidden``) is exported as ``hidden_in`` (``stage_signature.onnx_input``);
3. :func:`~leapfx.export.onnx_optimize.optimize_model` rewrites the stage graph where
   onnxruntime does not (q|k|v and gate|up as one MatMul each, the cache writes as ScatterND of
   whole head rows): fewer and cheaper nodes per decoder layer, the same outputs;
4. for a fixed-length greedy draft (layerskip, no confidence threshold, ``num_speculations``
   d >= 2), ``draft_chain``: the optimized draft graph copied d times, each copy fed the
   argmax of the one before (:mod:`~leapfx.export.chain`): one session call drafts a round;
5. once every stage is written, :func:`~leapfx.export.onnx_files.share_weights` moves the
   weights of all stages into one external data file, ``weights.bin``, each distinct tensor
   stored once: the stages cut from one model share its layers, so an export is about as large
   as the model's weights (in the model's dtype), not once per stage;
6. ``onnx.checker.check_model`` on every stage file.

The exporter call and what is done to the files (steps 2's export, 3, 5 and 6) are
:mod:`~leapfx.export.onnx_files`'s, which the ``genai`` format shares; this module says what is
exported (each stage's wrapper, example inputs and dynamic axes) and writes the manifest.

Everything is written into a temporary directory beside the target and renamed into place at
the end, ``manifest.json`` last, so a failed or interrupted export never looks complete. An
exporter failure (an op ONNX cannot express) becomes one ValueError naming the stage.

Example::

    >>> sm = rewrite.apply(hf_model, "layerskip", exit_layer=2)
    >>> export_onnx(sm, "layerskip-onnx/")
    PosixPath('/.../layerskip-onnx')
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from .. import __version__
from ..files import move_into_place, temp_beside
from ..lower.chain import chain_length
from ..lower.manifest import FORMAT, FORMAT_VERSION, MANIFEST, is_export_dir, layer_ranges
from ..lower.stage_signature import (  # discovery, shared with the compiled stages
    MASK_INPUTS,  # noqa: F401
    POSITION_INPUTS,
    StageSignature,
    discover,
    example_generator,
    example_inputs,
    kv_shapes,
)
from ..modules.blocks import float_weights
from ..options import check_bool, check_int
from ..passes.capture import LAYER, ROLE
from . import onnx_files
from .chain import chain_outputs, unroll_draft
from .fast_draft import fast_draft_export, scratch_spec, takes_scratch
from .genai import genai_refusal, save_tokenizer, write_genai
from .onnx_files import WEIGHTS, check_file, optimize_file, share_weights
from .stage_module import ExportableStage

if TYPE_CHECKING:
    from ..runtime.model import SpeculativeModel

log = logging.getLogger(__name__)

MIN_OPSET = 18
# The default: opset 23 has RMSNormalization and RotaryEmbedding, so each decoder layer exports
# as about half the nodes it takes at 18, and onnxruntime pays a fixed cost per node (the
# counts and step times: docs/benchmarks.md, "Why the defaults"). opset=18 still exports for an
# older onnxruntime.
DEFAULT_OPSET = 23
# The newest opset checked end to end here (torch 2.13's exporter, onnxruntime 1.32; 1.23 is the
# oldest that loads it, and the onnx extra asks for it; 1.22 refuses opset 23). An older
# onnxruntime needs opset=18..21.
MAX_OPSET = 23
SUPPORTED_DTYPES = (torch.float32, torch.float16)
# "leapfx": the recipe's stages + manifest (OnnxModel); "genai": the model as one standard
# decoder that onnxruntime-genai and optimum load (leapfx.export.genai).
FORMATS = ("leapfx", "genai")

# Example sizes for tracing: >= 2 (torch.export specialises 0/1) and pairwise distinct; the
# positions start at "past" / "remainder_past" and end inside the "max_cache_len" buffers.
_EXAMPLE = {
    "batch": 2, "sequence": 3, "hidden_sequence": 4, "past": 5, "remainder_past": 6,
    "max_cache_len": 16,
}  # fmt: skip


def _decoder_layers(stage: fx.GraphModule) -> list[int]:
    return sorted(n.meta[LAYER] for n in stage.graph.nodes if n.meta.get(ROLE) == "layer")


def _dynamic_shapes(sig: StageSignature) -> tuple[dict[int, Any], ...]:
    dims = {
        "batch": torch.export.Dim("batch"),
        "sequence": torch.export.Dim("sequence"),
        "hidden_sequence": torch.export.Dim("hidden_sequence"),
        "max_cache_len": torch.export.Dim("max_cache_len"),
    }
    shapes: list[dict[int, Any]] = []
    for name in sig.tensor_inputs:
        if name in ("input_ids", "position_ids"):
            shapes.append({0: dims["batch"], 1: dims["sequence"]})
        elif name == "exit_hidden":
            shapes.append({0: dims["batch"], 1: dims["hidden_sequence"]})
        elif name == "hidden":  # EAGLE's head: h_{t-1} (or its own g) of every token
            shapes.append({0: dims["batch"], 1: dims["sequence"]})
        elif name == "prev_hidden":  # EAGLE's target: h of the position before the chunk
            shapes.append({0: dims["batch"]})
        else:  # remainder_position_ids: hidden_sequence + sequence, which a Dim cannot say;
            # a named axis string becomes Dim.DYNAMIC and keeps its name in the ONNX model.
            shapes.append({0: dims["batch"], 1: "remainder_sequence"})
    shapes += [{0: dims["batch"], 2: dims["max_cache_len"]}] * (2 * len(sig.cache_layers))
    return tuple(shapes)


def _export_stage(
    sm: SpeculativeModel,
    name: str,
    stage: fx.GraphModule,
    path: Path,
    opset: int,
    rewrites: dict[str, dict[str, int]],
    optimize: bool,
) -> StageSignature:
    if takes_scratch(stage):  # M2R2's draft: its round's scratch as tensors in and out
        module, args, shapes, sig = fast_draft_export(sm, stage)
        return _export_module(
            sm, name, module, args, shapes, sig, path, opset, rewrites, optimize
        )  # fmt: skip
    sig = discover(sm, name, stage)
    module = ExportableStage(
        stage,
        tensor_inputs=sig.tensor_inputs,
        groups={
            p: (POSITION_INPUTS[p][0], sig.groups.get(p, []))
            for p in POSITION_INPUTS
            if p in sig.tensor_inputs
        },
        cache_layers=sig.cache_layers,
        output_names=sig.outputs,
        layout=sm._layout,
    )
    # Only the wrapper's own flag: .eval() would recurse into the user's model.
    module.training = False
    batch = _EXAMPLE["batch"]
    tokens = {"input_ids": _EXAMPLE["sequence"], "exit_hidden": _EXAMPLE["hidden_sequence"]}
    pasts = {"position_ids": _EXAMPLE["past"], "remainder_position_ids": _EXAMPLE["remainder_past"]}
    inputs = example_inputs(sm, sig.tensor_inputs, batch, tokens, pasts)
    args = [inputs[n] for n in sig.tensor_inputs]
    param = next(sm.hf_model.parameters())
    kv = kv_shapes(sm)
    for layer in sig.cache_layers:
        h, d = kv[layer]
        shape = (batch, h, _EXAMPLE["max_cache_len"], d)
        gen = example_generator()
        args += [torch.randn(shape, generator=gen).to(param.device, param.dtype) for _ in range(2)]
    return _export_module(
        sm, name, module, tuple(args), (_dynamic_shapes(sig),), sig, path, opset, rewrites,
        optimize,
    )  # fmt: skip


def _export_module(
    sm, name: str, module, args: tuple, shapes: tuple, sig: StageSignature, path: Path,
    opset: int, rewrites: dict[str, dict[str, int]], optimize: bool,
):  # fmt: skip
    """``module`` (a stage with tensor-only inputs) exported, saved and optimized."""
    program = onnx_files.export_program(
        module, args, dynamic_shapes=shapes, input_names=sig.input_names,
        output_names=sig.output_names, opset=opset,
        refusal=f"stage {name!r} cannot be exported to ONNX",
    )  # fmt: skip
    onnx_files.save_program(program, path)
    if optimize:
        rewrites[name] = optimize_file(path, _rotary_positions(sm))
    return sig


def _rotary_positions(sm: SpeculativeModel) -> int | None:
    """The positions the exported rotary tables cover (``onnx_optimize.group_query_attention``):
    the model's ``max_position_embeddings`` or the recipe's ``max_cache_len``, the larger;
    None (no table, no rewrite) for a model whose config names neither, or with a sliding
    window (onnxruntime's window convention is not checked against ours)."""
    if sm._layout.window is not None:
        return None
    limits = [
        getattr(sm.config, "max_position_embeddings", None),
        getattr(sm.options, "max_cache_len", None),
    ]
    limits = [int(n) for n in limits if isinstance(n, int) and n > 0]
    return max(limits) if limits else None


# The stage of D greedy draft steps in one graph (``leapfx.export.chain``), exported where the
# schedule drafts a fixed number of tokens from the ``draft`` stage alone (``chain_length``:
# layerskip without a confidence threshold, as the compiled backend's ``CompiledChain``).
CHAIN_STAGE = "draft_chain"


def _export_chain(directory: Path, length: int, rewrites: dict[str, dict[str, int]]) -> None:
    """Write ``draft_chain.onnx`` beside ``draft.onnx``: ``length`` copies of the draft graph
    as exported and optimized (``chain.unroll_draft``), referring to the draft's weights file,
    which ``share_weights`` then collects with the others."""
    import onnx

    draft = onnx.load(str(directory / "draft.onnx"), load_external_data=False)
    onnx.save(unroll_draft(draft, length), str(directory / f"{CHAIN_STAGE}.onnx"))
    # every step is the draft graph, rewrites included
    rewrites[CHAIN_STAGE] = {k: length * v for k, v in rewrites.get("draft", {}).items()}


def _chain_spec(draft: dict, length: int, rewrites: dict[str, dict[str, int]]) -> dict:
    """The manifest entry of ``draft_chain``: the draft's layers, cache layers and position
    group, one token in, ``tokens`` and ``hidden`` out."""
    presents = [n for n in draft["outputs"] if n.startswith("present.")]
    return {
        **draft,
        "file": f"{CHAIN_STAGE}.onnx",
        "outputs": chain_outputs(presents, length),
        "rewrites": rewrites.get(CHAIN_STAGE, {}),
        # input_ids [batch, 1] at position_ids [batch, 1]: tokens [batch, length] (greedy:
        # each the argmax of the draft logits after the one before), hidden [batch, length, H]
        # (the draft's hidden of each token fed); the cache layers written at length positions
        "chain": {
            "stage": "draft",
            "length": length,
            "selection": "greedy",
            "cache": (
                "every step reads past_key_values.{i}.* and writes its position into "
                "present.{i}.*.step{s} (steps s < length - 1) or present.{i}.* (the last); "
                "bind the past and all presents of a slot to its one buffer: each step reads "
                "the positions the steps before it wrote there"
            ),
        },
    }


def _manifest(
    sm: SpeculativeModel,
    opset: int,
    signatures: dict[str, StageSignature],
    weights: dict,
    rewrites: dict[str, dict[str, int]],
    chain: int = 0,
) -> dict:
    config = sm.config
    gen = sm.hf_model.generation_config
    eos = gen.eos_token_id if gen.eos_token_id is not None else config.eos_token_id
    eos_ids = [] if eos is None else [int(eos)] if isinstance(eos, int) else [int(t) for t in eos]
    lay = sm._layout
    kv = kv_shapes(sm)
    stages = {}
    for name, sig in signatures.items():
        stage = sm.stages[name]
        layers = _decoder_layers(stage)
        stages[name] = {
            "file": f"{name}.onnx",
            "layers": layers,
            "layer_ranges": layer_ranges(layers),
            "cache_reads": sig.cache_layers,  # every attention reads its buffer ...
            "cache_writes": sig.written,  # ... and returns it with its positions written
            "position_groups": sig.groups,
            "inputs": sig.input_names,
            "outputs": sig.output_names,
            # leapfx.export.onnx_optimize's rewrites, counted (absent: exported as traced)
            "rewrites": rewrites.get(name, {}),
        }
        if takes_scratch(stage):  # M2R2's draft: the round's scratch in and out
            stages[name]["scratch"] = scratch_spec(stage, str(lay.dtype).removeprefix("torch."))
    if chain:
        stages[CHAIN_STAGE] = _chain_spec(stages["draft"], chain, rewrites)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "leapfx_version": __version__,
        "recipe": sm.recipe.name,
        "options": _jsonable(dataclasses.asdict(sm.options)),
        "lookahead": sm.recipe.lookahead,
        "model_type": config.model_type,
        "num_layers": config.num_hidden_layers,
        "exit_layer": sm.stages.exit_layer,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "eos_token_ids": eos_ids,
        "generation_config": json.loads(gen.to_json_string(use_diff=True)),
        "dtype": str(lay.dtype).removeprefix("torch."),
        "opset": opset,
        "attention": {
            "implementation": lay.impl,
            "layer_kinds": list(lay.kinds),
            "sliding_window": lay.window,
            "masks": "computed in the graph from position ids and past length",
            # GroupQueryAttention's rotary tables cover positions below this (absent: none)
            "rotary_positions": (
                _rotary_positions(sm)
                if any(r.get("group_query_attention") for r in rewrites.values())
                else None
            ),
        },
        "cache": {
            "slots": len(kv),
            "extra_slots": sm.recipe.extra_cache_layers,
            "num_kv_heads": [h for h, _ in kv],
            "head_dim": [d for _, d in kv],
            "layout": "[batch, kv_heads, max_cache_len, head_dim]; slot j holds position j",
            "update": (
                "in place: present.{i}.* is past_key_values.{i}.* with the stage's positions "
                "written; bind both to one buffer. Slots past a query's position are masked, "
                "so rolling back is moving a length. The positions of a call are consecutive "
                "and start at the slot's fill length; without one shared buffer, a present's "
                "slots past the call's last position are unspecified"
            ),
        },
        "weights": {
            "file": WEIGHTS,
            "dtype": str(lay.dtype).removeprefix("torch."),
            "bytes": weights["bytes"],
            "shared": "every stage's initializers point into this one file (ONNX external "
            "data); a tensor used by several stages is stored once",
        },
        "stages": stages,
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


def _require_onnx() -> None:
    try:
        import onnx  # noqa: F401
        import onnxscript  # noqa: F401  (torch's exporter translates through it)
    except ImportError:
        raise ImportError(
            "export_onnx needs onnx and onnxscript: pip install -e '.[onnx]' in leapfx's checkout"
        ) from None


def _check_options(sm: SpeculativeModel, path: Any, opset: Any, overwrite: Any) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path: {path!r} is invalid; allowed: a directory path (str or PathLike)")
    check_int("opset", opset, MIN_OPSET, MAX_OPSET)
    check_bool("overwrite", overwrite)
    if sm.hf_model.training:
        raise ValueError(
            "model: it is in training mode (dropout would be exported); call model.eval() first"
        )
    dtype = sm._layout.dtype
    if dtype not in SUPPORTED_DTYPES:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise ValueError(
            f"model: dtype {str(dtype).removeprefix('torch.')} cannot be exported (numpy and "
            f"onnxruntime's CPU provider have no kernels for it); allowed: {allowed}"
        )
    return Path(os.path.abspath(os.fspath(path)))


def _check_target(target: Path, overwrite: bool) -> None:
    if target.exists() or target.is_symlink():
        if not overwrite:
            raise ValueError(
                f"path: {str(target)!r} already exists; pass overwrite=True (--overwrite) to "
                "replace it, or choose another directory"
            )
        # Replacing means deleting: only a previous export or an empty directory qualifies.
        if not target.is_dir() or target.is_symlink():
            raise ValueError(f"path: {str(target)!r} exists and is not a directory")
        if any(target.iterdir()) and not is_export_dir(target):
            raise ValueError(
                f"path: {str(target)!r} is a non-empty directory that holds no leapfx export; "
                "refusing to overwrite it (remove it yourself or choose another directory)"
            )


def _make_parent(parent: Path) -> list[Path]:
    """Create ``parent`` and missing ancestors; returns those created (deepest last)."""
    missing = []
    p = parent
    while not p.exists():
        missing.append(p)
        p = p.parent
    if not p.is_dir():
        raise ValueError(f"path: {str(p)!r} is not a directory; cannot create an export under it")
    created = []
    try:
        for d in reversed(missing):
            d.mkdir()
            created.append(d)
    except OSError as exc:
        _remove_dirs(created)
        raise ValueError(
            f"path: cannot create directory {str(exc.filename)!r}: {exc.strerror}"
        ) from None
    return created


def _remove_dirs(created: list[Path]) -> None:
    for d in reversed(created):
        with contextlib.suppress(OSError):
            d.rmdir()


def export_onnx(
    sm: SpeculativeModel,
    path: str | os.PathLike,
    *,
    opset: int = DEFAULT_OPSET,
    overwrite: bool = False,
    optimize: bool = True,
    format: str = "leapfx",
    tokenizer: Any = None,
) -> Path:
    """Export every stage of ``sm`` to ``path`` (a new directory) and write its manifest.

    ``optimize``: rewrite each stage graph with ``leapfx.export.onnx_optimize`` (the same
    outputs from fewer nodes; False keeps the graphs as torch's exporter wrote them, e.g. to
    profile the difference).

    ``format``: ``"leapfx"`` (default) writes the recipe's stages and the manifest that
    ``OnnxModel`` and ``leapfx.deploy.Decoder`` run; ``"genai"`` writes the model (its ``full``
    stage) as one standard decoder with ``genai_config.json`` and ``config.json``, the folder
    onnxruntime-genai's ``Model`` and optimum's ``ORTModelForCausalLM`` load
    (:mod:`leapfx.export.genai`). ``tokenizer``: a transformers tokenizer or a folder holding
    ``tokenizer.json``, whose files are copied into the export (None: none).

    Returns the absolute path of the export. Raises ValueError for an existing target without
    ``overwrite``, an unwritable location or a stage the exporter cannot convert; in every case
    nothing is left behind.

    >>> export_onnx(sm, "out/layerskip-onnx", overwrite=True)
    """
    if format not in FORMATS:
        raise ValueError(f"format: {format!r} is invalid; allowed: {', '.join(map(repr, FORMATS))}")
    can = sm.recipe.capabilities  # the recipe's schedule in a manifest: asked, not name-checked
    if format == "genai":
        refusal = genai_refusal(sm) or (None if can.exportable else can.export_refusal)
        if refusal is not None:
            raise ValueError(f"format: 'genai' cannot export this model: {refusal}")
    else:
        refusal = can.refusal(sm.options)  # the recipe's, or its options' (swift's search)
        if refusal is not None:
            raise ValueError(f"recipe: {sm.recipe.name!r} cannot be exported to ONNX: {refusal}")
    _require_onnx()
    check_bool("optimize", optimize)
    target = _check_options(sm, path, opset, overwrite)
    _check_target(target, overwrite)
    created = _make_parent(target.parent)
    try:
        tmp = temp_beside(target, folder=True, suffix=".partial")
    except OSError as exc:
        _remove_dirs(created)
        raise ValueError(f"path: cannot write in {str(target.parent)!r}: {exc.strerror}") from None
    try:
        with float_weights(*sm.stages.modules.values()):  # a native GGUF model's blocks
            _write(sm, tmp, target, opset, overwrite, optimize, format, tokenizer)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_dirs(created)
        raise ValueError(f"path: cannot write the export to {str(target)!r}: {exc}") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_dirs(created)
        raise
    return target


def _write(sm, tmp: Path, target: Path, opset, overwrite, optimize, format, tokenizer) -> None:
    """The export written into ``tmp``, then moved to ``target`` (``export_onnx``'s body)."""
    if format == "genai":
        manifest = write_genai(sm, tmp, opset=opset, optimize=optimize, tokenizer=tokenizer)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        _replace(tmp, target, overwrite)
        return
    signatures = {}
    rewrites: dict[str, dict[str, int]] = {}
    for name, stage in sm.stages.modules.items():
        log.info("exporting stage %s", name)
        file = tmp / f"{name}.onnx"
        signatures[name] = _export_stage(sm, name, stage, file, opset, rewrites, optimize)
    chain = chain_length(sm)
    if chain:
        log.info("composing stage %s (%d draft steps)", CHAIN_STAGE, chain)
        _export_chain(tmp, chain, rewrites)
    files = [*signatures, CHAIN_STAGE] if chain else list(signatures)
    weights = share_weights(tmp, files)
    for name in files:
        check_file(tmp / f"{name}.onnx", name)
    manifest = _manifest(sm, opset, signatures, weights, rewrites, chain)
    if tokenizer is not None:  # text in, text out for leapfx.deploy.Decoder
        manifest["tokenizer"] = save_tokenizer(tokenizer, tmp)
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    _replace(tmp, target, overwrite)


def _replace(tmp: Path, target: Path, overwrite: bool) -> None:
    """Move the finished export into place; an old export is swapped out, then deleted."""
    _check_target(target, overwrite)  # again: something may have appeared meanwhile
    move_into_place(tmp, target)
