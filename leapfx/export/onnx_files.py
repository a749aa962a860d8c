"""The ONNX files an export writes: the exporter call, the file, leapfx's rewrites on it, one
weights file for all of them, the checker.

Both formats (``onnx_export``: the recipe's stages; ``genai``: one standard decoder) write
their models through these, in this order:

1. :func:`export_program`: ``torch.onnx.export(dynamo=True)`` of a tensor-only module, with
   HF's grouped-query SDPA kept grouped; the exporter's failure becomes one ValueError;
2. :func:`save_program`: the model with its weights in an external data file beside it;
3. :func:`optimize_file`: ``onnx_optimize.optimize_model`` applied to the saved file;
4. :func:`share_weights`: the weights of every file moved into one ``weights.bin``, each
   distinct tensor stored once;
5. :func:`check_file`: ``onnx.checker`` on each file.

Callers reach :func:`export_program` and :func:`save_program` through this module
(``onnx_files.export_program``): the tests' exporter memo (``tests/onnx_memo.py``) replaces
those two here. onnx is imported where it is used: it comes with the ``onnx`` extra.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import warnings
from pathlib import Path

import torch

from .onnx_optimize import optimize_model


@contextlib.contextmanager
def _grouped_query_sdpa():
    """While exporting, HF's ``sdpa`` attention passes grouped keys/values to SDPA as they are
    (``enable_gqa=True``) instead of repeating them per query head first.

    HF repeats them whenever a mask is given (it is, here: masks by position), which exports as
    an ``Expand`` of every layer's whole key and value buffers on every call; at opset 23 the
    exporter writes ``enable_gqa`` into ``Attention`` itself (reference model: 516 nodes per full
    step against 614; in onnxruntime a step 1.43 -> 1.35 ms, a verify call 2.04 -> 1.80 ms).
    HF reads this switch (``TRANSFORMERS_SDPA_FORCE_GQA``) from the environment at each call;
    it is restored afterwards, and nothing of the user's model changes.
    """
    name = "TRANSFORMERS_SDPA_FORCE_GQA"
    saved = os.environ.get(name)
    os.environ[name] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def export_program(
    module, args: tuple, *, dynamic_shapes, input_names: list[str], output_names: list[str],
    opset: int, refusal: str,
):  # fmt: skip
    """``torch.onnx.export`` (dynamo) of ``module`` on ``args``; the exporter's failure is a
    ValueError that starts ``export: {refusal}``."""
    try:
        with warnings.catch_warnings(), _grouped_query_sdpa():
            # The exporter warns about its own internals (axis renames, deprecated pytree
            # calls), nothing a user can act on; real failures arrive as exceptions.
            warnings.simplefilter("ignore")
            return torch.onnx.export(
                module,
                args,
                dynamic_shapes=dynamic_shapes,
                input_names=input_names,
                output_names=output_names,
                opset_version=opset,
                dynamo=True,
                verbose=False,
            )
    except torch.onnx.OnnxExporterError as exc:
        raise ValueError(f"export: {refusal}: {_summary(exc)}") from exc


def _summary(exc: BaseException) -> str:
    """The exporter's one-line reason: the line after '## Exception summary', else the first."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    line = lines[0] if lines else type(exc).__name__
    for i, text in enumerate(lines[:-1]):
        if text.startswith("## Exception summary"):
            line = lines[i + 1]
    # "<class 'torch.onnx._internal...DispatchError'>: ..." -> "DispatchError: ..."
    return re.sub(r"<class '(?:[\w]+\.)*(\w+)'>", r"\1", line)


def save_program(program, path: Path) -> None:
    # Weights in an external data file beside the model (``<stage>.onnx.data``), whatever the
    # model's size (protobuf stops at 2 GiB); share_weights merges the stages' files.
    program.save(path, external_data=True)


def optimize_file(path: Path, max_positions: int | None = None) -> dict[str, int]:
    """Apply ``onnx_optimize.optimize_model`` to the saved stage, weights included.

    The weights stay external (``share_weights`` collects them) and the exporter's small
    constants stay inline, where onnxruntime's shape inference reads them.
    """
    import onnx
    from onnx.external_data_helper import (
        load_external_data_for_model,
        set_external_data,
        uses_external_data,
    )

    model = onnx.load(str(path), load_external_data=False)
    external = {t.name for t in model.graph.initializer if uses_external_data(t)}
    load_external_data_for_model(model, str(path.parent))  # the rewrites regroup weights
    stats = optimize_model(model, external, max_positions=max_positions)
    data = f"{path.name}.data"
    (path.parent / data).unlink(missing_ok=True)  # written anew below
    for tensor in model.graph.initializer:
        if tensor.name in external:
            set_external_data(tensor, data)
    onnx.save(model, str(path))  # writes the tensors marked external into ``data``
    return stats


WEIGHTS = "weights.bin"
_ALIGN = 64  # byte alignment of each tensor in weights.bin (lets a reader map it directly)


def share_weights(directory: Path, stages: list[str]) -> dict[str, int]:
    """Move the external weights of ``<stage>.onnx`` for every stage into one ``weights.bin``.

    Tensors with equal bytes, element type and shape are stored once (the stages of one model
    hold the same layers); each model's initializers then point into ``weights.bin`` with
    offsets and lengths (ONNX external data), and the per-stage data files are deleted. The
    exporter's per-node debugging metadata is dropped on the way.
    Returns ``{"bytes": size of weights.bin, "tensors": distinct tensors, "references": ...}``.
    """
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    stored: dict[tuple, tuple[int, int]] = {}  # (digest, type, shape) -> (offset, length)
    references = 0
    sources: set[Path] = set()
    with open(directory / WEIGHTS, "wb") as out:
        for name in stages:
            path = directory / f"{name}.onnx"
            model = onnx.load(str(path), load_external_data=False)
            for node in model.graph.node:
                # The exporter's per-node debugging records (source stack traces, FX node
                # names): often larger than a small model's weights, of no use to a runtime.
                del node.metadata_props[:]
            for tensor in model.graph.initializer:
                if not uses_external_data(tensor):
                    continue
                info = ExternalDataInfo(tensor)
                source = directory / info.location
                sources.add(source)
                with open(source, "rb") as f:
                    f.seek(info.offset or 0)
                    data = f.read(info.length) if info.length else f.read()
                key = (hashlib.sha256(data).digest(), tensor.data_type, tuple(tensor.dims))
                if key not in stored:
                    out.write(b"\0" * (-out.tell() % _ALIGN))
                    stored[key] = (out.tell(), len(data))
                    out.write(data)
                offset, length = stored[key]
                del tensor.external_data[:]
                for k, v in (("location", WEIGHTS), ("offset", offset), ("length", length)):
                    entry = tensor.external_data.add()
                    entry.key, entry.value = k, str(v)
                references += 1
            onnx.save(model, str(path))
        size = out.tell()
    for source in sources - {directory / WEIGHTS}:
        source.unlink()
    return {"bytes": size, "tensors": len(stored), "references": references}


def check_file(path: Path, name: str) -> None:
    import onnx

    try:
        onnx.checker.check_model(str(path), full_check=False)
    except onnx.checker.ValidationError as exc:
        raise ValueError(f"export: stage {name!r} failed onnx.checker: {_summary(exc)}") from exc
