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
  most frequent tokens where the vocabulary is large; else, where a quantized copy of the
  model pays as its draft (:func:`qspec_pays`: float32 weights on a CPU, large enough that
  reading them bounds a step), ``qspec`` with prompt lookup, chosen round by round the same
  way; else prompt lookup with an adaptive length (the ``auto`` recipe itself).
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

from ..kernels import cpu, cpu_blocks
from ..models.parts import TRAIN_COMMANDS, find_parts
from ..modules.blocks import is_blocks
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
    if head is None and not qspec_pays(model):
        return None
    chosen: dict = {"lookup": True, "adaptive": True}
    for name in ("max_ngram", "min_ngram", "max_cache_len", "fuse_layers"):
        if name in options:
            chosen[name] = options[name]
    if head is None:  # the model's quantized copy drafts
        if "num_speculations" in options:
            chosen["num_speculations"] = options["num_speculations"]
        if set(options) - set(chosen):
            return None  # an option only auto takes: auto itself refuses or runs it
        return "qspec", chosen
    chosen["parts"] = str(head)
    if "num_speculations" in options:
        chosen["max_draft_tokens"] = options["num_speculations"]
    unknown = sorted(set(options) - {"num_speculations", *chosen})
    if unknown:
        return None  # an option only auto takes: auto itself refuses or runs it
    if model.config.vocab_size >= 4 * DRAFT_VOCAB and read_ranking(str(head)) is not None:
        chosen["draft_vocab"] = DRAFT_VOCAB
    return "eagle", chosen


# The float32 linear weights above which ``auto`` drafts with the model's quantized copy
# (``qspec``). A draft pays when its step costs well under a float step (c), and c falls as the
# weights outgrow the caches: a float step then reads them from memory (4 bytes a weight),
# while a Q8_0 step reads 1.06 and is bound by the block kernels' arithmetic. SmolLM2-135M
# (538 MB) measured c = 0.75-0.8 against a per-draft acceptance of 0.99 with Q8_0, for a
# formula ceiling of about 1.15x (docs/recipes.md, "qspec"), which the adaptive policy's
# probes and the copy's load time (seconds) eat; at 1 GB and more a float step is at least
# twice SmolLM2's, its time outside the products (attention, norms, ~6.7 ms there) a smaller
# share, and c below ~0.5 (an estimate by that arithmetic: no such model was measured here).
QSPEC_MIN_FLOAT_BYTES = 1 << 30


def qspec_pays(model: nn.Module) -> bool:
    """Whether ``auto`` drafts with ``model``'s quantized copy: float32 linear weights on a
    CPU (none already blocks: a GGUF model's copy would be the model itself) of at least
    ``QSPEC_MIN_FLOAT_BYTES``, and the block kernels built."""
    linear = [m for m in model.modules() if type(m) is nn.Linear]
    if any(is_blocks(m) for m in model.modules()) or not linear:
        return False
    weights = [m.weight for m in linear]
    if any(w.dtype != torch.float32 or w.device.type != "cpu" for w in weights):
        return False
    size = 4 * sum(w.numel() for w in {id(w): w for w in weights}.values())
    return size >= QSPEC_MIN_FLOAT_BYTES and cpu_blocks.available()


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
