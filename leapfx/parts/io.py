"""The one reader and writer of parts directories (the format: ``leapfx.parts``).

Trained parts (Kangaroo's adapter, an EAGLE head, SpecEE's predictors, M2R2's accelerators, a
swift skip set) are directories of a safetensors file of one module's state dict and a JSON file
of metadata (``{"format", "recipe", "options", "host", ...}``), nothing pickled. Each recipe's
module of ``leapfx.parts`` names its files and checks; what they do alike lives here:

- ``write_parts_files`` writes the two files, ``leapfx.files.write_atomic`` fills a temporary
  directory beside the target and renames it into place (a directory with the final name is always
  complete; one that existed is replaced);
- ``read_parts_meta`` refuses a directory without its files, ``read_meta`` reads the JSON file
  with errors that name the user's option, ``check_host`` refuses parts of another model;
- ``write_module_parts`` / ``read_module_parts_config``: the one-module directory Kangaroo's
  adapter and M2R2's accelerators share (``adapter.safetensors`` + ``adapter.json``, the names
  Kangaroo's adapter gave the format first; saved parts keep them); ``host_signature`` is what
  every parts directory records of the model it fits;
- ``load_weights`` puts a file's tensors into a module (same names and shapes, or a
  ValueError naming the option): what every ``Load*`` pass (``passes.load_parts``) ends with.

    >>> write_atomic("parts/", lambda tmp: write_parts_files(tmp, "w.safetensors",
    ...                  "w.json", module_tensors(module), {"format": 1, "recipe": "eagle"}))
    >>> meta = read_meta("parts/", "w.json", option="parts", fmt=1)
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..files import write_atomic

# A one-module parts directory (Kangaroo's adapter, M2R2's accelerators): its files and format.
MODULE_WEIGHTS = "adapter.safetensors"
MODULE_CONFIG = "adapter.json"
MODULE_FORMAT = 1


def host_signature(config) -> dict[str, Any]:
    """What parts must match in the model they are loaded into (``check_host``)."""
    heads = config.num_attention_heads
    return {
        "model_type": config.model_type,
        "num_hidden_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
        "vocab_size": config.vocab_size,
    }


def read_meta(path: str | os.PathLike, config: str, *, option: str, fmt: int) -> dict[str, Any]:
    """The JSON object in ``path/config``, of format ``fmt``; ValueError naming ``option``."""
    file = Path(path) / config
    try:
        meta = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{option}: {file} is not valid JSON ({exc})") from exc
    found = meta.get("format") if isinstance(meta, dict) else None
    if found != fmt:
        raise ValueError(f"{option}: {file} has format {found!r}; this leapfx reads format {fmt}")
    return meta


def check_host(option: str, path, host: dict[str, Any], saved: dict[str, Any]) -> None:
    """Refuse parts trained for another model: every ``host`` field must equal the saved one."""
    diff = sorted(k for k in host if saved.get(k) != host[k])
    if diff:
        pairs = ", ".join(f"{k}={saved.get(k)!r} (model: {host[k]!r})" for k in diff)
        raise ValueError(f"{option}: {str(path)!r} was trained for another model: {pairs}")


def module_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state dict as detached contiguous CPU tensors (what safetensors saves)."""
    return {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}


def write_parts_files(
    directory: Path,
    weights: str | None,
    config: str,
    tensors: dict[str, torch.Tensor] | None,
    meta: dict[str, Any],
) -> None:
    """Write ``tensors`` to ``directory/weights`` (unless ``weights`` is None) and ``meta`` to
    ``directory/config``; the directory exists (not atomic by itself:
    ``leapfx.files.write_atomic``)."""
    if weights is not None:
        save_file(tensors, str(directory / weights), metadata={"format": str(meta["format"])})
    (directory / config).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def read_parts_meta(
    path: str | os.PathLike, files: tuple[str, ...], config: str, *, option: str, fmt: int,
    missing: str,
) -> dict[str, Any]:  # fmt: skip
    """``read_meta`` of ``path/config`` once every one of ``files`` is there; else ValueError
    ``{option}: 'path' {missing}`` with ``{files}`` in ``missing`` naming the absent ones."""
    root = Path(path)
    absent = [name for name in files if not (root / name).is_file()]
    if absent:
        raise ValueError(f"{option}: {str(path)!r} " + missing.format(files=", ".join(absent)))
    return read_meta(root, config, option=option, fmt=fmt)


def load_weights(
    module: nn.Module, file: Path, *, misfit: str, subset: bool = False
) -> dict[str, torch.Tensor]:
    """Load the safetensors ``file`` into ``module`` (copied into its dtype and device) and
    return what was loaded; ``subset``: only the file's tensors the module has. ValueError
    ``misfit`` unless the names and shapes are the module's."""
    tensors = load_file(str(file))  # safetensors: no unpickling
    own = module.state_dict()
    if subset:
        tensors = {k: v for k, v in tensors.items() if k in own}
    if set(tensors) != set(own) or any(tensors[k].shape != own[k].shape for k in own):
        raise ValueError(misfit)
    module.load_state_dict(tensors)
    return tensors


def write_module_files(
    directory: Path,
    module: nn.Module,
    *,
    weights: str,
    config: str,
    fmt: int,
    recipe: str,
    options: dict[str, Any],
    host: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> None:
    """Write ``module``'s state dict to ``directory/weights`` and the metadata every trained
    module records (``format``, ``recipe``, ``options``, ``host``, ``parameters``, then
    ``extra``) to ``directory/config``; the directory exists (not atomic by itself)."""
    tensors = module_tensors(module)
    meta = {
        "format": fmt,
        "recipe": recipe,
        "options": options,
        "host": host,
        "parameters": sum(t.numel() for t in tensors.values()),
        **(extra or {}),
    }
    write_parts_files(directory, weights, config, tensors, meta)


def write_module_parts(
    module: nn.Module,
    path: str | os.PathLike,
    *,
    recipe: str,
    options: dict[str, Any],
    host: dict[str, Any],
    extra: dict[str, Any] | None = None,
    also: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``module``'s state dict and its metadata (``extra`` added) as a one-module parts
    directory at ``path`` (replaced if it exists); ``also(dir)`` writes further files into it
    before the rename (a draft-vocabulary ranking).

    >>> write_module_parts(adapter_of(gm), "kangaroo-adapter/", recipe="kangaroo",
    ...                    options={"exit_layer": 2}, host=host_signature(hf_model.config))
    """
    names = {"weights": MODULE_WEIGHTS, "config": MODULE_CONFIG, "fmt": MODULE_FORMAT}

    def write(tmp: Path) -> None:
        write_module_files(
            tmp, module, **names, recipe=recipe, options=options, host=host, extra=extra
        )
        if also is not None:
            also(tmp)

    return write_atomic(path, write, folder=True)


def read_module_parts_config(
    path: str | os.PathLike, *, recipe: str, option: str, missing: str
) -> dict[str, Any]:
    """The metadata of the one-module parts directory at ``path``, saved by ``recipe``;
    ValueError naming ``option`` (``missing``: see ``read_parts_meta``)."""
    files = (MODULE_WEIGHTS, MODULE_CONFIG)
    meta = read_parts_meta(path, files, MODULE_CONFIG, option=option, fmt=MODULE_FORMAT,
                           missing=missing)  # fmt: skip
    if meta.get("recipe") != recipe:
        raise ValueError(
            f"{option}: {str(path)!r} was saved by recipe {meta.get('recipe')!r}, not {recipe!r}"
        )
    return meta
