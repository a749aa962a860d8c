"""``export_onnx(sm, dir, format="genai")``: the model as one standard decoder that onnxruntime's
own runtimes load.

leapfx's own format (``format="leapfx"``) cuts a recipe into stages over static cache buffers
written in place, runnable by :class:`~leapfx.lower.onnxruntime.OnnxModel`. A deployment engineer
reaches for onnxruntime-genai (``onnxruntime_genai.Model(dir)``) or optimum's
``ORTModelForCausalLM.from_pretrained(dir)`` instead; both expect one decoder graph with the
names and shapes onnxruntime-genai's model builder writes, and a folder of HF files beside it.
This writer gives them that, from the recipe's ``full`` stage (every decoder layer; the model
itself, not the recipe's schedule):

    inputs   input_ids                   [batch_size, sequence_length] int64
             attention_mask              [batch_size, total_sequence_length] int64 (1 = token,
                                         0 = padding; total = past + sequence)
             position_ids                [batch_size, sequence_length] int64
             past_key_values.{i}.key     [batch_size, kv_heads, past_sequence_length, head_dim]
             past_key_values.{i}.value   (the same; past_sequence_length 0 on the first call)
    outputs  logits                      [batch_size, sequence_length, vocab]
             present.{i}.key / .value    [batch_size, kv_heads, total_sequence_length, head_dim]:
                                         past and new concatenated

That is the cache convention both consumers share: a zero-length past on the first call and
presents that grow (onnxruntime-genai's ``past_present_share_buffer: false``; optimum's only
one). The masks are built inside the graph from ``attention_mask``, HF's rule: query ``i`` of
a call (cache index ``past + i``) sees index ``j`` iff ``j <= past + i`` and
``attention_mask[b, j]`` is 1, within the sliding window where the layer has one, and always
itself (a padding query's output is never read; seeing itself keeps its softmax finite, so no
NaN reaches a real row). So left-padded batches decode as HF decodes them.

The folder::

    model.onnx            the decoder (its weights in weights.bin, ONNX external data)
    weights.bin
    genai_config.json     onnxruntime-genai's: file, input/output names, heads, search defaults
    config.json           the HF config (optimum reads the architecture from it)
    generation_config.json
    tokenizer.json, tokenizer_config.json, ...   when a tokenizer is given (with its chat
                          template: onnxruntime-genai's Tokenizer and apply_chat_template)
    manifest.json         leapfx's record (format "leapfx-genai"), written last

Example::

    >>> sm = rewrite.apply(hf_model, "autoregressive")
    >>> sm.export_onnx("model-genai/", format="genai", tokenizer=tokenizer)
    >>> import onnxruntime_genai as og
    >>> model = og.Model("model-genai/")
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .. import __version__
from ..lower.manifest import GENAI_FORMAT
from ..lower.stage_signature import (
    FunctionalKVCache,
    discover,
    kv_shapes,
    past_names,
    present_names,
)
from ..runtime.masks import _mask_of
from . import onnx_files
from .onnx_files import optimize_file, share_weights
from .stage_module import StageFunction

if TYPE_CHECKING:
    from ..runtime.model import SpeculativeModel

log = logging.getLogger(__name__)

MODEL_FILE = "model.onnx"
GENAI_CONFIG = "genai_config.json"
# onnxruntime-genai's model types that are plain decoders (its model builder's names); a model
# of another type is refused rather than labelled as one it is not.
GENAI_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text")
# Example sizes for tracing: >= 2 and distinct (torch.export specialises 0 and 1).
_EXAMPLE = {"batch": 2, "sequence": 3, "past": 5}


class StandardDecoder(StageFunction):
    """The ``full`` stage with onnxruntime-genai's inputs and outputs (see the module
    docstring): ``forward(input_ids, attention_mask, position_ids, *pasts)`` returns
    ``(logits, *presents)``, pasts and presents as ``key, value`` per cache layer."""

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        input_ids, attention_mask, position_ids, *flat = args
        past = self.pasts(flat)
        s = input_ids.shape[1]
        p = flat[0].shape[2]  # past_sequence_length
        torch._check(attention_mask.shape[1] == p + s)
        q = (torch.arange(s, device=input_ids.device) + p)[None, :, None]  # [1, S, 1]
        k = torch.arange(p + s, device=input_ids.device)[None, None, :]  # [1, 1, T]
        causal = (k <= q) & (attention_mask[:, None, :] > 0)  # [B, S, T]
        masks = {}
        for kind in self.kinds:
            seen = causal
            if kind == "sliding_attention" and self.window is not None:
                seen = seen & (k > q - self.window)
            masks[kind] = _mask_of((seen | (k == q))[:, None], self.impl, self.dtype)
        cache = FunctionalKVCache(past)
        out = self.stage(input_ids=input_ids, position_ids=position_ids, masks=masks, cache=cache)
        presents = [t for layer in self.cache_layers for t in cache.present[layer]]
        return (out["logits"], *presents)


def genai_refusal(sm: SpeculativeModel) -> str | None:
    """Why ``sm`` cannot be exported as a standard decoder, or None."""
    if "full" not in sm.stages.modules:
        return (
            f"recipe {sm.recipe.name!r} has no 'full' stage (stages: "
            f"{', '.join(sm.stages.modules)}); apply 'autoregressive' to the same model and "
            "export that"
        )
    if sm.recipe.extra_cache_layers:
        return f"recipe {sm.recipe.name!r} adds cache layers a standard decoder does not have"
    model_type = sm.config.model_type
    if model_type not in GENAI_TYPES:
        return (
            f"model_type {model_type!r} is not one onnxruntime-genai decodes as a plain "
            f"decoder; allowed: {', '.join(GENAI_TYPES)}"
        )
    if len(set(kv_shapes(sm))) != 1:
        return "its layers' key/value shapes differ; onnxruntime-genai takes one head size"
    return None


def write_genai(
    sm: SpeculativeModel,
    tmp: Path,
    *,
    opset: int,
    optimize: bool,
    tokenizer: Any = None,
) -> dict[str, Any]:
    """Write the standard decoder folder into ``tmp`` (the caller renames it into place);
    returns the manifest written last."""
    stage = sm.stages["full"]
    sig = discover(sm, "full", stage)
    assert sig.tensor_inputs == ["input_ids", "position_ids"] and "logits" in sig.outputs
    module = StandardDecoder(stage, cache_layers=sig.cache_layers, layout=sm._layout)
    module.training = False  # the wrapper's own flag: .eval() would recurse into the model
    b, s, p = _EXAMPLE["batch"], _EXAMPLE["sequence"], _EXAMPLE["past"]
    param = next(sm.hf_model.parameters())
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, sm.config.vocab_size, (b, s), generator=gen).to(param.device)
    mask = torch.ones(b, p + s, dtype=torch.long, device=param.device)
    mask[0, :2] = 0  # a left-padded row: the mask is an input the graph reads
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, p:]
    kv = kv_shapes(sm)
    pasts = []
    for layer in sig.cache_layers:
        h, d = kv[layer]
        for _ in range(2):
            pasts.append(torch.randn(b, h, p, d, generator=gen).to(param.device, param.dtype))
    batch = torch.export.Dim("batch_size")
    sequence = torch.export.Dim("sequence_length")
    past = torch.export.Dim("past_sequence_length")
    shapes = (
        {0: batch, 1: sequence},
        {0: batch, 1: "total_sequence_length"},  # past + sequence: a named dynamic axis
        {0: batch, 1: sequence},
        *([{0: batch, 2: past}] * len(pasts)),
    )
    inputs = ["input_ids", "attention_mask", "position_ids"]
    inputs += [n for layer in sig.cache_layers for n in past_names(layer)]
    outputs = ["logits", *(n for layer in sig.cache_layers for n in present_names(layer))]
    program = onnx_files.export_program(
        module, (ids, mask, positions, *pasts), dynamic_shapes=(shapes,), input_names=inputs,
        output_names=outputs, opset=opset,
        refusal="the full stage cannot be exported as a standard decoder",
    )  # fmt: skip
    path = tmp / MODEL_FILE
    onnx_files.save_program(program, path)
    # The exporter names the axis it derives for presents freely; say what it is.
    _name_axes(path)
    rewrites = optimize_file(path) if optimize else {}  # q|k|v and gate|up fused; no GQA here
    weights = share_weights(tmp, [MODEL_FILE.removesuffix(".onnx")])
    import onnx

    onnx.checker.check_model(str(path), full_check=False)
    _write_json(tmp / GENAI_CONFIG, genai_config(sm, kv[0]))
    _write_json(tmp / "config.json", _hf_config(sm))
    (tmp / "generation_config.json").write_text(
        sm.hf_model.generation_config.to_json_string(use_diff=True)
    )
    files = save_tokenizer(tokenizer, tmp) if tokenizer is not None else []
    return {
        "format": GENAI_FORMAT,
        "format_version": 1,
        "leapfx_version": __version__,
        "recipe": sm.recipe.name,
        "model_type": sm.config.model_type,
        "dtype": str(sm._layout.dtype).removeprefix("torch."),
        "opset": opset,
        "model": MODEL_FILE,
        "inputs": inputs,
        "outputs": outputs,
        "cache": "past and new concatenated: a zero-length past first, presents that grow",
        "weights": {"file": "weights.bin", "bytes": weights["bytes"]},
        "rewrites": rewrites,
        "tokenizer": files,
    }


def _name_axes(path: Path) -> None:
    """Name the presents' sequence axis ``total_sequence_length`` and the logits' axes as the
    model builder does (the exporter derives names of its own for computed sizes)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    for out in model.graph.output:
        dims = out.type.tensor_type.shape.dim
        names = (
            ["batch_size", "sequence_length", None]
            if out.name == "logits"
            else ["batch_size", None, "total_sequence_length", None]
        )
        for dim, name in zip(dims, names, strict=False):
            if name is not None and not dim.HasField("dim_value"):
                dim.dim_param = name
    onnx.save(model, str(path))


def genai_config(sm: SpeculativeModel, kv: tuple[int, int]) -> dict[str, Any]:
    """``genai_config.json`` as onnxruntime-genai's model builder writes it for a decoder
    without shared past/present buffers."""
    config = sm.config
    gen = sm.hf_model.generation_config
    eos = gen.eos_token_id if gen.eos_token_id is not None else config.eos_token_id
    eos_ids = [] if eos is None else [int(eos)] if isinstance(eos, int) else [int(t) for t in eos]
    pad = gen.pad_token_id if gen.pad_token_id is not None else config.pad_token_id
    pad = int(pad) if pad is not None else (eos_ids[0] if eos_ids else 0)
    bos = gen.bos_token_id if gen.bos_token_id is not None else config.bos_token_id
    context = int(getattr(config, "max_position_embeddings", 0) or 2048)
    heads, head_dim = kv
    return {
        "model": {
            "bos_token_id": int(bos) if bos is not None else pad,
            "context_length": context,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": MODEL_FILE,
                "head_size": head_dim,
                "hidden_size": config.hidden_size,
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "position_ids": "position_ids",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
                "num_attention_heads": config.num_attention_heads,
                "num_hidden_layers": config.num_hidden_layers,
                "num_key_value_heads": heads,
            },
            # one id, or the list when the model stops at several (chat models' end of turn)
            "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
            "pad_token_id": pad,
            "type": config.model_type,
            "vocab_size": config.vocab_size,
        },
        "search": {
            "diversity_penalty": 0.0,
            "do_sample": False,  # greedy: the lossless reference
            "early_stopping": True,
            "length_penalty": 1.0,
            "max_length": context,
            "min_length": 0,
            "no_repeat_ngram_size": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            # the graph concatenates past and new (optimum's convention too); see the module
            # docstring
            "past_present_share_buffer": False,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
        },
    }


def _hf_config(sm: SpeculativeModel) -> dict[str, Any]:
    config = sm.config.to_dict()
    config["use_cache"] = True  # optimum reads it: the graph takes and returns the cache
    return config


def save_tokenizer(tokenizer: Any, directory: Path) -> list[str]:
    """The tokenizer's files (``save_pretrained``, or a folder's tokenizer files copied), its
    chat template also inside ``tokenizer_config.json``, where onnxruntime-genai reads it."""
    before = set(p.name for p in directory.iterdir())
    if isinstance(tokenizer, (str, Path)):
        source = Path(tokenizer)
        names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")  # fmt: skip
        found = [source / n for n in names if (source / n).is_file()]
        if not source.is_dir() or not any(f.name == "tokenizer.json" for f in found):
            raise ValueError(
                f"tokenizer: {str(tokenizer)!r} holds no tokenizer.json; allowed: a folder "
                "with one, or a transformers tokenizer"
            )
        for file in found:
            shutil.copyfile(file, directory / file.name)
    elif hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(str(directory))
    else:
        raise ValueError(
            f"tokenizer: {type(tokenizer).__name__} is invalid; allowed: a transformers "
            "tokenizer, a folder with tokenizer.json, or None"
        )
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    changed = False
    template_file = directory / "chat_template.jinja"
    if template_file.is_file() and "chat_template" not in config:
        config["chat_template"] = template_file.read_text()
        changed = True
    if changed:
        _write_json(config_file, config)
    return sorted(set(p.name for p in directory.iterdir()) - before)


def _write_json(path: Path, value: Any) -> None:
    # inside the export's temporary folder, which is renamed into place whole
    path.write_text(json.dumps(value, indent=2) + "\n")


__all__ = [
    "GENAI_CONFIG", "MODEL_FILE", "StandardDecoder", "genai_config", "save_tokenizer",
    "write_genai",
]  # fmt: skip
