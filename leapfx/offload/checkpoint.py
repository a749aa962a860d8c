"""Load an MoE checkpoint for offloading without holding its experts in memory.

``rewrite.apply(model, recipe, offload=...)`` over a model from ``from_pretrained`` offloads
experts that are already in RAM: the slow tier is written from them and the slots hold half of
them, but the model's own expert tensors stay. ``load_offloaded`` is the path for a model whose
experts do not fit::

    >>> from leapfx.offload import OffloadOptions, load_offloaded
    >>> model = load_offloaded("path/to/olmoe")          # experts stay in the checkpoint
    >>> sm = rewrite.apply(model, "autoregressive", offload=OffloadOptions(slots=0.5))

It builds the model on the ``meta`` device, loads every tensor except the experts from the
safetensors files (one file or a sharded index), and leaves each ``<X>Experts`` module's
``gate_up_proj`` / ``down_proj`` on ``meta``, with a ``CheckpointExperts`` pair beside them
(attribute ``EXPERT_SOURCE``) that reads one expert at a time from the checkpoint. The offload
runtime writes its slow tier from that pair, one expert at a time, so at no point is more than
one expert of the checkpoint in memory besides the fast tier's slots. Such a model runs only
offloaded: ``rewrite.apply`` without ``offload`` refuses it.

Checkpoint layouts (what ``save_pretrained`` of transformers 5 writes, and the hub's):

- per expert, qwen2_moe / qwen3_moe / olmoe: ``mlp.experts.{e}.gate_proj.weight``,
  ``up_proj.weight``, ``down_proj.weight``; mixtral: ``block_sparse_moe.experts.{e}.w1``
  (gate), ``w3`` (up), ``w2`` (down), its other ``block_sparse_moe.`` keys renamed ``mlp.``;
  ``gate_up_proj[e]`` is [gate; up] (transformers' ``MergeModulelist`` + ``Concatenate``);
- fused, as the modules hold them: ``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``.

Non-persistent buffers (the rotary embedding's ``inv_freq``) are not in a checkpoint: the
module holding one is built again from its ``config``. Anything else missing is an error that
names it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from torch import nn

from ..modules.hf import EXPERT_SOURCE, expert_tensors  # noqa: F401
from ..passes.capture import decoder_pieces, is_moe_layer

_SAFETENSORS_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}


class CheckpointExperts:
    """One MoE layer's ``gate_up_proj`` or ``down_proj`` [E, ...] in a safetensors
    checkpoint, read one expert at a time: ``source[e]`` is expert e's slice in ``dtype``
    (what ``module.gate_up_proj[e]`` would be). ``shape``, ``dtype``, ``device`` and ``len``
    are those of the tensor it stands for; the stores index it as they index that tensor."""

    def __init__(
        self, handles: dict[str, object], keys: list[list[str]] | str, shape: tuple[int, ...],
        dtype: torch.dtype, device: torch.device,
    ) -> None:  # fmt: skip
        # keys: per expert the checkpoint keys concatenated along dim 0 (gate, up for
        # gate_up), or one fused key [E, ...] sliced at e
        self._handles = handles
        self._keys = keys
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.device = device
        # the dtype the checkpoint stores them in (None if its keys differ): a narrower one
        # holds every expert exactly, which the disk tier's slow_dtype check then need not read
        slices = {k: handles[k].get_slice(k) for k in self._flat_keys()}
        stored = {sl.get_dtype() for sl in slices.values()}
        self.stored_dtype = _SAFETENSORS_DTYPES.get(stored.pop()) if len(stored) == 1 else None
        # one expert's shape as the checkpoint stores it (read from its header, not its data)
        if isinstance(keys, str):
            self.expert_shape = tuple(slices[keys].get_shape()[1:])
        else:
            first = [slices[k].get_shape() for k in keys[0]]
            self.expert_shape = (sum(shape[0] for shape in first), *first[0][1:])

    def _flat_keys(self) -> list[str]:
        keys = self._keys
        return [keys] if isinstance(keys, str) else [k for per in keys for k in per]

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, e: int) -> torch.Tensor:
        if not 0 <= e < self.shape[0]:
            raise IndexError(f"expert {e} of {self.shape[0]}")
        if isinstance(self._keys, str):
            t = self._handles[self._keys].get_slice(self._keys)[e]
        else:
            parts = [self._handles[k].get_tensor(k) for k in self._keys[e]]
            t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return t.to(self.dtype)

    def fingerprint(self) -> dict:
        """What identifies these experts without reading them: each checkpoint file they come
        from (path, size, modification time in ns), their keys and the dtype they are read as
        (``DiskStore`` reuses a file written from the same)."""
        files = sorted({self._handles[k].path for k in self._flat_keys()})
        stats = [[f, st.st_size, st.st_mtime_ns] for f, st in ((f, os.stat(f)) for f in files)]
        return {"files": stats, "keys": self._keys, "dtype": str(self.dtype)}

    def materialize(self) -> torch.Tensor:
        """Every expert as one [E, ...] tensor (the host tier holds them all in RAM)."""
        return torch.stack([self[e] for e in range(len(self))])


def checkpoint_only(model: nn.Module) -> list[str]:
    """The experts modules of ``model`` whose weights live only in a checkpoint."""
    return [name for name, m in model.named_modules() if hasattr(m, EXPERT_SOURCE)]


def _open_checkpoint(path: Path) -> dict[str, object]:
    """key -> an open safetensors handle holding it (one file or a sharded index)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (path / "model.safetensors").is_file():
        files, weight_map = ["model.safetensors"], None
    else:
        raise ValueError(
            f"path: {str(path)!r} has no model.safetensors or model.safetensors.index.json; "
            "allowed: a HF checkpoint directory saved as safetensors"
        )
    handles = {}
    for name in files:
        raw = safe_open(str(path / name), framework="pt")
        f = _Handle(raw, os.path.abspath(path / name))
        for key in raw.keys():
            if weight_map is None or weight_map.get(key) == name:
                handles[key] = f
    return handles


class _Handle:
    """An open safetensors file and its path (the fingerprint of what it holds)."""

    def __init__(self, f, path: str) -> None:
        self._f = f
        self.path = path

    def get_tensor(self, key: str) -> torch.Tensor:
        return self._f.get_tensor(key)

    def get_slice(self, key: str):
        return self._f.get_slice(key)


def _expert_keys(handles, prefix: str, num_experts: int):
    """The checkpoint keys of the experts module ``prefix``: (gate_up keys, down keys)."""
    fused = (f"{prefix}.gate_up_proj", f"{prefix}.down_proj")
    if all(k in handles for k in fused):
        return fused
    mixtral = prefix.replace(".mlp.", ".block_sparse_moe.")
    for base, (gate, up, down) in (
        (prefix, ("gate_proj", "up_proj", "down_proj")),
        (mixtral, ("w1", "w3", "w2")),
        (prefix, ("w1", "w3", "w2")),
    ):
        keys = [[f"{base}.{e}.{p}.weight" for p in (gate, up, down)] for e in range(num_experts)]
        if all(k in handles for per in keys for k in per):
            return [per[:2] for per in keys], [per[2:] for per in keys]
    raise ValueError(
        f"path: the checkpoint has no experts for {prefix!r} (looked for {fused[0]!r}, "
        f"'{prefix}.0.gate_proj.weight' and '{mixtral}.0.w1.weight'); allowed: the layouts of "
        "leapfx.offload.checkpoint's docstring"
    )


def _checkpoint_key(handles, key: str) -> str | None:
    for candidate in (key, key.replace(".mlp.", ".block_sparse_moe.")):
        if candidate in handles:
            return candidate
    return None


def load_offloaded(
    path: str | os.PathLike, *, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> nn.Module:
    """A HF MoE causal LM from the checkpoint directory ``path`` whose experts stay in the
    checkpoint (see the module docstring): every other weight in ``dtype`` on ``device``.
    Run it with ``rewrite.apply(model, recipe, offload=OffloadOptions(...))``.

    Raises ValueError naming the problem for a directory that is no safetensors checkpoint,
    a model without MoE layers, or a weight the checkpoint lacks.
    """

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"path: {str(path)!r} has no config.json; expected a HF checkpoint")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype: {dtype!r} is invalid; allowed: a floating torch.dtype")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"device: {device!r} is invalid; allowed: a torch device ('cpu', 'cuda', 'cuda:1')"
        ) from None
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    pieces = decoder_pieces(model)  # checks the architecture is supported
    experts = {f"{pieces.prefix}.layers.{i}.mlp.experts": layer.mlp.experts
               for i, layer in enumerate(pieces.layers) if is_moe_layer(layer)}  # fmt: skip
    if not experts:
        raise ValueError(
            f"path: {str(path)!r} holds a {config.model_type} model without MoE layers; "
            "allowed: an MoE model (mixtral, qwen2_moe, qwen3_moe, olmoe)"
        )
    handles = _open_checkpoint(path)
    expert_params = {f"{name}.{p}" for name in experts for p in ("gate_up_proj", "down_proj")}
    state, missing = {}, []
    for key, t in model.state_dict(keep_vars=True).items():
        if key in expert_params:
            continue
        found = _checkpoint_key(handles, key)
        if found is None:
            missing.append(key)
            continue
        value = handles[found].get_tensor(found)
        if tuple(value.shape) != tuple(t.shape):
            raise ValueError(
                f"path: {found!r} has shape {tuple(value.shape)} in the checkpoint and "
                f"{tuple(t.shape)} in the model of config.json"
            )
        state[key] = value.to(device, dtype if value.is_floating_point() else value.dtype)
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    missing = [k for k in missing if k not in tied]
    if missing:
        raise ValueError(f"path: the checkpoint lacks {missing[:3]} ({len(missing)} in all)")
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        model.tie_weights()
    _rebuild_non_persistent(model, device)
    for name, m in experts.items():
        gate_up, down = m.gate_up_proj, m.down_proj
        keys = _expert_keys(handles, name, gate_up.shape[0])
        pair = tuple(CheckpointExperts(handles, k, tuple(t.shape), dtype, device)
                     for k, t in zip(keys, (gate_up, down), strict=True))  # fmt: skip
        for source, t in zip(pair, (gate_up, down), strict=True):
            if source.expert_shape != tuple(t.shape[1:]):
                raise ValueError(
                    f"path: an expert of {name!r} has shape {source.expert_shape} in the "
                    f"checkpoint and {tuple(t.shape[1:])} in the model of config.json"
                )
        setattr(m, EXPERT_SOURCE, pair)
    left = [k for k, t in [*model.named_parameters(), *model.named_buffers()]
            if t.is_meta and k not in expert_params]  # fmt: skip
    if left:
        raise ValueError(f"path: no value for {left[:3]} ({len(left)} in all)")
    gen = path / "generation_config.json"
    if gen.is_file():
        model.generation_config = transformers.GenerationConfig.from_pretrained(path)
    return model.eval()


def _rebuild_non_persistent(model: nn.Module, device: torch.device) -> None:
    """Modules whose non-persistent buffers are still on meta (rotary embeddings), built again
    from their ``config`` on ``device``."""
    for name, module in list(model.named_modules()):
        if not any(b.is_meta for b in module.buffers(recurse=False)):
            continue
        config = getattr(module, "config", None)
        if config is None or not name:
            raise ValueError(f"path: no value for the buffers of {name!r} (not in a checkpoint)")
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        with torch.device(device):
            setattr(parent, attr, type(module)(config=config))
