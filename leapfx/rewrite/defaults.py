"""What ``rewrite.apply`` picks when the caller leaves a choice unset.

Two kinds of choice, both logged once per ``apply`` at INFO and overridden by passing them:

- ``cpu_kernels`` None ("auto"): leapfx's CPU kernels (``leapfx.kernels.cpu``) where they run,
  a float32 model on a CPU whose kernels built; off elsewhere (another dtype or device, or no
  compiler here: then one warning names what is missing). Never an error; True requires them
  and raises ValueError where they cannot run. :func:`kernels_choice` decides and says why.
- A shipped model's tuned recipe options: a checkpoint folder may hold ``leapfx_defaults.json``
  beside its ``config.json``, ``{"recipes": {recipe: {option: value}}}``; ``apply`` fills the
  options the caller left unset from it (:func:`shipped_options`). The shipped reference model
  carries the setting ``leapfx bench --sweep`` measured best there (docs/benchmarks.md), so that
  ``apply(reference, "layerskip")`` runs what the bench's ``leapfx_layerskip`` row runs.

    >>> shipped_options(reference_model, "layerskip")
    ({'exit_layer': 6, 'num_speculations': 4}, PosixPath('.../leapfx_defaults.json'))
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..kernels import cpu

DEFAULTS_FILE = "leapfx_defaults.json"


def kernels_choice(
    setting: bool | None, device: torch.device, dtype: torch.dtype
) -> tuple[bool, str]:
    """(use the CPU kernels, why) for ``cpu_kernels=setting`` on a model on ``device`` in
    ``dtype``; True where they cannot run raises ValueError naming the option (``cpu.resolve``).
    """
    use = cpu.resolve(setting, device, dtype)
    if setting is not None:
        return use, "as given"
    if use:
        return True, f"auto: a {_name(dtype)} model on a CPU"
    if device.type == "cpu" and dtype == torch.float32:
        return False, "auto: the kernels did not build here (see the warning)"
    return False, f"auto: they run float32 models on a CPU; this one is {_name(dtype)} on {device}"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def defaults_file(model: nn.Module) -> Path | None:
    """The model's ``leapfx_defaults.json``: in the local folder it was loaded from, if any."""
    folder = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", "")
    if not folder:
        return None
    path = Path(folder) / DEFAULTS_FILE
    return path if path.is_file() else None


def read_defaults(path: Path) -> dict:
    """The contents of a ``leapfx_defaults.json`` (ValueError naming the file when malformed)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: unreadable ({exc}); allowed: a JSON object") from None
    recipes = data.get("recipes", {}) if isinstance(data, dict) else None
    if not isinstance(recipes, dict) or not all(isinstance(v, dict) for v in recipes.values()):
        raise ValueError(
            f"{path}: 'recipes' must map recipe names to options, e.g. "
            '{"recipes": {"layerskip": {"exit_layer": 6}}}'
        )
    return data


def shipped_options(model: nn.Module, recipe: str) -> tuple[dict, Path | None]:
    """The options the model's ``leapfx_defaults.json`` sets for ``recipe`` (empty without
    one), and the file."""
    path = defaults_file(model)
    if path is None:
        return {}, None
    return dict(read_defaults(path).get("recipes", {}).get(recipe, {})), path
