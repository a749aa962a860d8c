"""``leapfx export``: a recipe's stages to ONNX (+ manifest)."""

from __future__ import annotations

import argparse
import logging

from .common import RECIPE_NAMES, _adapter, _reference_defaults, add_flags, add_model

EXPORT_DTYPES = ("float32", "float16")  # leapfx export --dtype
EXPORT_FORMATS = ("leapfx", "genai")  # leapfx export --format (leapfx.export FORMATS)


def _export(args: argparse.Namespace) -> int:
    import torch
    import transformers

    from .. import rewrite
    from ..models import load_model

    # The CLI owns this process: HF's and the ONNX exporter's chatter would bury the result.
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    given = {"exit_layer": args.exit_layer, "num_speculations": args.num_speculations,
             "adapter": args.adapter}  # fmt: skip
    options = {name: value for name, value in given.items() if value is not None}
    if args.recipe is None:
        args.recipe = best_exportable(args.model, options)
        print(f"leapfx export: recipe {args.recipe} (the best exportable for this model; "
              "--recipe chooses another)")  # fmt: skip
    if args.recipe == "auto":
        # auto's lookup form: its adaptive prompt lookup, not a trained head it would find (the
        # quantized copy does not export, and the head's form may draft over a vocabulary
        # subset, which leapfx.deploy does not read; --recipe eagle exports the head:
        # docs/export.md)
        options["parts"] = None
    if args.model is None:
        # The shipped model exports what `leapfx bench` runs on it: layerskip at its measured
        # setting, kangaroo with its trained adapter. An explicit flag wins.
        shipped = dict(_reference_defaults()["recipes"].get(args.recipe, {}))
        if _adapter(args) is not None:
            shipped["adapter"] = _adapter(args)
        shipped = {k: v for k, v in shipped.items() if k not in options}
        if shipped:
            said = ", ".join(f"{k}={v}" for k, v in shipped.items())
            print(f"reference model: the shipped setting {said}")
        options.update(shipped)
    model, tokenizer = load_model(args.model)
    model = model.to(getattr(torch, args.dtype))
    sm = rewrite.apply(model, args.recipe, **options)
    if args.format == "genai":
        # the model itself, with its tokenizer: what onnxruntime-genai and optimum load
        path = sm.export_onnx(
            args.out, opset=args.opset, overwrite=args.overwrite, format="genai",
            tokenizer=tokenizer,
        )  # fmt: skip
        print(f"leapfx export: the full model as one decoder -> {path} (model.onnx, "
              "genai_config.json, config.json, tokenizer files)")  # fmt: skip
        return 0
    path = sm.export_onnx(
        args.out, opset=args.opset, overwrite=args.overwrite, tokenizer=tokenizer
    )  # with the tokenizer: leapfx.deploy.Decoder decodes text
    from ..lower.chain import chain_length  # the stages with a draft_chain.onnx

    names = [*sm.stages.modules, *(["draft_chain"] if chain_length(sm) else [])]
    stages = ", ".join(f"{name}.onnx" for name in names)
    print(f"leapfx export: {args.recipe} {sm.options} -> {path} ({stages}, manifest.json)")
    return 0


def best_exportable(model: str | None, options: dict) -> str:
    """``leapfx export``'s recipe when none is given: an adapter asks for ``kangaroo`` and an
    exit layer or draft count for ``layerskip``; the shipped reference model (trained for early
    exits) exports ``layerskip`` at its measured setting; any other model ``auto`` in its
    exportable form, adaptive prompt lookup, which needs no training and is never materially
    slower than plain decoding (layerskip's exits read nothing on a model not trained for them)."""
    if "adapter" in options:
        return "kangaroo"
    if model is None or "exit_layer" in options or "num_speculations" in options:
        return "layerskip"
    return "auto"


def add_parser(sub) -> None:
    export = sub.add_parser("export", help="export a recipe's stages to ONNX (+ manifest)")
    add_model(export)
    export.add_argument(
        "--recipe",
        default=None,
        choices=RECIPE_NAMES,
        metavar="RECIPE",
        help="the recipe to export; default: the best exportable for the model (layerskip for "
        "the shipped reference model or with --exit-layer, kangaroo with --adapter, else auto "
        "as adaptive prompt lookup); one of " + ", ".join(RECIPE_NAMES),
    )
    add_flags(export, {
        "--exit-layer": dict(type=int, default=None),
        "--num-speculations": dict(type=int, default=None),
        "--adapter": dict(default=None, help="kangaroo adapter dir"),
        "--out": dict(required=True, help="output directory (must not exist)"),
        "--format": dict(
            choices=EXPORT_FORMATS, default="leapfx",
            help="leapfx: the recipe's stages + manifest (OnnxModel, leapfx.deploy); genai: the "
            "model as one standard decoder + genai_config.json + tokenizer (onnxruntime-genai, "
            "optimum's ORTModelForCausalLM)",
        ),
        "--overwrite": dict(action="store_true", help="replace an existing export"),
        "--opset": dict(type=int, default=23, help="ONNX opset, 18..23 (23: fewer nodes, faster)"),
        "--dtype": dict(
            choices=EXPORT_DTYPES, default="float32",
            help="weights and compute dtype of the export (default float32: onnxruntime's CPU "
            "provider computes in float32; float16 halves the file)",
        ),
    })  # fmt: skip
    export.set_defaults(func=_export)
