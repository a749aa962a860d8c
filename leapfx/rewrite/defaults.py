"""What ``rewrite.apply`` picks when the caller leaves a choice unset.

Two kinds of choice, both logged once per ``apply`` at INFO and overridden by passing them:

- ``cpu_kernels`` None ("auto"): leapfx's CPU kernels (``leapfx.kernels.cpu``) where they run,
  a float32 model on a CPU whose kernels built; off elsewhere (another dtype or device, or no
  compiler here: then one warning names what is missing). Never an error; True requires them
  and raises ValueError where they cannot run. :func:`kernels_choice` decides and says why.
- Trained parts (``parts="auto"``, the default): the shipped parts trained for this model
  (``leapfx.models.parts.find_parts``: their recorded host equals the model's), loaded as
  ``parts=DIR`` would load them; a recipe with trainable parts and none found runs untrained
  and warns once, naming the command that trains them (:func:`resolve_parts`).
- ``auto``, the best drafting a model has (:func:`best_drafter`): where an EAGLE head was
  trained for the model, EAGLE with prompt lookup, each round choosing the head, lookup or no
  drafting by measured tokens per cost (``lookup=True, adaptive=True``), the head over its
  most frequent tokens where the vocabulary is large; else prompt lookup with an adaptive
  length (the ``auto`` recipe itself).
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
import logging
import warnings
from pathlib import Path

import torch
from torch import nn

from ..kernels import cpu
from ..models.parts import TRAIN_COMMANDS, find_parts
from ..parts.draft_vocab import read_ranking

DEFAULTS_FILE = "leapfx_defaults.json"
# The head over the N most frequent tokens (FR-Spec) where the vocabulary has 4N or more.
DRAFT_VOCAB = 8192

log = logging.getLogger(__name__)


def resolve_parts(recipe, model: nn.Module, parts, options: dict):
    """The ``parts`` ``apply`` loads for ``recipe`` (a ``Recipe``): a directory as given,
    None as given (untrained), or for ``"auto"`` the shipped parts trained for ``model``
    (None where there are none, or the recipe takes none, or its parts option is given)."""
    if not (isinstance(parts, str) and parts == "auto"):
        return parts
    if recipe.parts_option is None or options.get(recipe.parts_option) is not None:
        return None
    found = find_parts(model.config, recipe.name)
    if found is not None:
        log.info("%s: the parts trained for this model, %s (parts=None: none)", recipe.name,
                 found)  # fmt: skip
        return str(found)
    if recipe.name in TRAIN_COMMANDS:
        warnings.warn(
            f"{recipe.name}: no trained parts found for this model, so the parts it inserts run "
            f"as initialised (poor drafts or exits); train them with "
            f"`{TRAIN_COMMANDS[recipe.name]} --model ...` or sm.fit(...) and pass parts=DIR "
            "(parts=None: untrained, without this warning)",
            UserWarning,
            stacklevel=3,
        )
    return None


def best_drafter(model: nn.Module, options: dict) -> tuple[str, dict] | None:
    """What ``apply(model, "auto")`` runs where a trained head beats prompt lookup alone:
    (recipe, its options), or None (the ``auto`` recipe itself). ``options`` are ``auto``'s:
    its ``num_speculations`` caps the head's drafts a round."""
    head = find_parts(model.config, "eagle")
    if head is None:
        return None
    chosen: dict = {"parts": str(head), "lookup": True, "adaptive": True}
    for name in ("max_ngram", "min_ngram", "max_cache_len", "fuse_layers"):
        if name in options:
            chosen[name] = options[name]
    if "num_speculations" in options:
        chosen["max_draft_tokens"] = options["num_speculations"]
    unknown = sorted(set(options) - {"num_speculations", *chosen})
    if unknown:
        return None  # an option only auto takes: auto itself refuses or runs it
    if model.config.vocab_size >= 4 * DRAFT_VOCAB and read_ranking(str(head)) is not None:
        chosen["draft_vocab"] = DRAFT_VOCAB
    return "eagle", chosen


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
