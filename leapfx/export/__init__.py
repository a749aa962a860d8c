"""ONNX export of a SpeculativeModel's stages, and an onnxruntime model that decodes with them.

    >>> sm = rewrite.apply(hf_model, "layerskip", exit_layer=2)
    >>> sm.export_onnx("layerskip-onnx/")                 # full.onnx, draft.onnx, verify.onnx,
    >>> model = OnnxModel("layerskip-onnx/")              # manifest.json
    >>> out = model.generate(input_ids, max_new_tokens=32)

The export format (per stage; optimum's naming, KV cache explicit):

- inputs ``input_ids`` [batch, sequence] int64, ``position_ids`` [batch, sequence] int64, and
  for ``verify`` also ``exit_hidden`` [batch, hidden_sequence, hidden] and
  ``remainder_position_ids`` [batch, remainder_sequence]; then ``past_key_values.{i}.key`` /
  ``.value`` [batch, kv_heads, past_sequence, head_dim] for every cache layer ``i`` the stage
  touches (verify's upper layers: ``remainder_past_sequence``);
- outputs the stage's own (``logits`` [batch, ., vocab]; ``draft`` also ``hidden``), then
  ``present.{i}.key`` / ``.value`` = past and new concatenated;
- attention masks are built inside each graph from the position ids and the past length;
- a layerskip export with a fixed draft length d also has ``draft_chain``: d greedy draft steps
  in one graph (``chain``), one token in, ``tokens`` [batch, d] and ``hidden`` out.

See ``stage_module`` (graph side), ``onnx_export`` (writer), ``onnx_files`` (the exporter call
and the files), ``onnx_optimize`` (rewrites) and ``chain``. Loading and running an export is
``lower/``'s (``leapfx.lower.manifest``, ``leapfx.lower.onnxruntime``,
``leapfx.lower.ort_stages``; ``lower(sm, "onnxruntime", export_dir=...)`` exports and loads in
one call): ``OnnxModel`` and the manifest reader are re-exported here for users.
onnx, onnxruntime and onnxscript come with the ``onnx`` extra: ``pip install -e '.[onnx]'`` in
leapfx's checkout.
"""

from __future__ import annotations

from ..lower.manifest import FORMAT, MANIFEST, read_manifest
from ..lower.onnxruntime import OnnxModel, default_providers
from ..lower.ort_stages import OrtChainStage, OrtKVCache, OrtStage
from .onnx_export import export_onnx

__all__ = [
    "FORMAT",
    "MANIFEST",
    "OnnxModel",
    "OrtChainStage",
    "OrtKVCache",
    "OrtStage",
    "default_providers",
    "export_onnx",
    "read_manifest",
]
