"""One training run of a drafter's parts for any model: what ``leapfx train-eagle`` and
``leapfx train-kangaroo`` run, with the trainers ``sm.fit`` uses.

    model (--model) -> data (--data, ``sources``) -> teacher features (cached, ``features``)
      -> sm.fit (resumable: a checkpoint every N steps) -> held-out report -> parts (--out)

Where files go. The parts go to ``out``; nothing is ever written inside the installed package
(``check_out``), except that a shipped model's own parts may be regenerated in its own asset
folder (the documented ``leapfx train-eagle`` of the reference model, whose default ``out``
that is). Any other model needs an ``out``. Caches and checkpoints live under ``cache_dir``
(default ``$LEAPFX_CACHE/train``, ``~/.cache/leapfx/train``):

    features-<key>.safetensors   teacher states (``features``), keyed by model + data + settings
    self-<key>.jsonl             the model's own pairs (``--data self``)
    checkpoints/<recipe>-<key>/  the run's checkpoint (``fit_checkpoint``), keyed by out, model,
                                 data and options; deleted once the run has taken all its steps

A run stopped by its clock (``minutes``) writes the parts it has so far (``"finished": false``
in their summary) and a checkpoint; one stopped by an interrupt leaves its last checkpoint
(every ``checkpoint_every`` steps). The same command again continues from the checkpoint, and
the same seed gives the same parts as a run never stopped.

The held-out report: the teacher-forced top-1 agreement of the drafter with the model before
and after training (the share of held-out positions where the draft's greedy token is the
model's: what a greedy chain's acceptance follows), and with ``draft_vocab`` the same over the
vocabulary subset (a draft's token restricted to the N most frequent training tokens).

    >>> summary = train_drafter("eagle", "runs/eagle-smollm2", model="smollm2", data="self",
    ...                         fit={"steps": 2000}, exclude=benchmark_texts())
"""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from leapfx.models import ASSETS, MOE_REFERENCE_MODEL, REFERENCE_MODEL, resolve

PACKAGE = ASSETS.parent  # the installed leapfx package
OWN_ASSETS = (REFERENCE_MODEL, MOE_REFERENCE_MODEL)  # shipped models whose parts it regenerates
DRAFTERS = ("eagle", "kangaroo")


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_out(out: str | Path | None, model: str | Path | None, *, shipped: Path | None,
              option: str = "--out") -> Path:  # fmt: skip
    """The parts directory to write: ``out``, or ``shipped`` (a shipped model's own parts,
    regenerated) when ``out`` is None and ``model`` is that shipped model. ValueError when an
    output is required, or ``out`` lies inside the installed package elsewhere than in the
    asset folder of the shipped model being trained."""
    source = resolve(model)
    folder = source.path.resolve() if source.kind == "folder" and source.path else None
    own = next((a.resolve() for a in OWN_ASSETS if folder == a.resolve()), None)
    if out is None:
        if own is None or shipped is None or not _inside(shipped.resolve(), own):
            raise ValueError(
                f"{option}: required for --model {source.name!r} (only a shipped model's own "
                "parts have a default place); allowed: a directory outside the installed "
                f"package {str(PACKAGE)!r}"
            )
        return shipped
    path = Path(out).expanduser().resolve()
    if _inside(path, PACKAGE.resolve()) and not (own is not None and _inside(path, own)):
        raise ValueError(
            f"{option}: {str(out)!r} lies inside the installed package {str(PACKAGE)!r}, and "
            "nothing is written there but a shipped model's own regenerated parts (its asset "
            "folder, with that model); allowed: a directory outside the package"
        )
    return Path(out)


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def run_checkpoints(cache: Path, recipe: str, *parts: Any) -> Path:
    """A training run's checkpoint folder, ``cache/checkpoints/<recipe>-<key>``, keyed by
    ``parts`` (what changes the steps the run takes: never how it is watched or stopped)."""
    return Path(cache) / "checkpoints" / f"{recipe}-{_key(*parts)}"


def _subset_agreement(sm, recipe: str, held: torch.Tensor, draft_vocab: int) -> float:
    """Teacher-forced top-1 agreement with the draft's token restricted to the ranking's first
    ``draft_vocab`` ids (what ``draft_vocab`` drafts)."""
    from leapfx.passes.draft_vocab import ranking_of

    subset = ranking_of(sm.graph_module)[:draft_vocab]
    agree = count = 0
    with torch.no_grad():
        for start in range(0, held.numel() - 1, 256):
            window = held[start : start + 256][None]
            draft, target = _draft_and_target(sm, recipe, window)
            pick = subset.to(draft.device)[draft[..., subset.to(draft.device)].argmax(-1)]
            agree += int((pick == target.argmax(-1)).sum())
            count += window.shape[1]
    return agree / count


def _draft_and_target(sm, recipe: str, window: torch.Tensor):
    device = next(sm.hf_model.parameters()).device
    window = window.to(device)
    if recipe == "eagle":
        from leapfx.train.eagle import head_outputs, teacher_features

        h, target = teacher_features(sm, window)
        return head_outputs(sm, window, h)[1], target
    from leapfx.train.kangaroo import adapter_and_target_logits

    return adapter_and_target_logits(sm, window)


def _layers(sm, recipe: str) -> tuple[int, ...]:
    last = sm.config.num_hidden_layers
    if recipe == "eagle":
        return (last,)
    from leapfx.passes.adapter import adapter_of

    return (adapter_of(sm.graph_module).exit_layer, last)


def train_drafter(
    recipe: str,
    out: str | Path | None,
    *,
    model: str | Path | None = None,
    data: str = "stdlib",
    apply: dict[str, Any] | None = None,
    fit: dict[str, Any] | None = None,
    resume: bool = False,
    features: int = 512,
    checkpoint_every: int = 100,
    fresh: bool = False,
    draft_vocab: int | None = None,
    cache_dir: str | Path | None = None,
    exclude: Sequence[str] | None = None,
    corpus_root: str | Path | None = None,
    self_options=None,
    held_out_tokens: int = 32768,
    device: str = "cpu",
    progress: bool = False,
) -> dict[str, Any]:
    """Train ``recipe``'s parts (``eagle`` or ``kangaroo``) for ``model`` on ``data`` and write
    them to ``out``; returns the run's summary (also saved in the parts' JSON file under
    ``"training"``). ``apply``: recipe options; ``fit``: the trainer's options (its
    ``*FitConfig``); ``resume``: start from the parts already in ``out``; ``features``: teacher
    windows collected once and cached (0: the model runs at every step on random windows);
    ``fresh``: drop this run's checkpoint and start over; ``draft_vocab``: also report the
    held-out agreement over that many most frequent tokens. See the module docstring."""
    from leapfx import rewrite
    from leapfx.models import load_model
    from leapfx.models.gguf import cache_root
    from leapfx.options import check_int
    from leapfx.train.eagle import EagleFitConfig
    from leapfx.train.features import cached_features
    from leapfx.train.fit_checkpoint import RUNTIME_FIELDS
    from leapfx.train.kangaroo import KangarooFitConfig
    from leapfx.train.sources import check_data, training_data
    from leapfx.train.trainer import describe_device, resolve_device

    if recipe not in DRAFTERS:
        raise ValueError(f"recipe: {recipe!r}; allowed: {', '.join(DRAFTERS)}")
    config_type = EagleFitConfig if recipe == "eagle" else KangarooFitConfig
    fit = {**(fit or {}), "progress": progress, "checkpoint_every": checkpoint_every}
    config = config_type(**fit)  # checked before anything is loaded
    check_int("features", features, 0)
    check_int("draft_vocab", draft_vocab, 1, none=True)
    check_data(data)
    shipped = REFERENCE_MODEL / ("eagle" if recipe == "eagle" else "kangaroo_adapter")
    out = check_out(out, model, shipped=shipped)
    torch_device = resolve_device(device, option="--device")
    cache = Path(cache_dir).expanduser() if cache_dir is not None else cache_root() / "train"
    hf_model, tokenizer = load_model(model)
    hf_model.to(torch_device)  # before rewrite.apply: the parts are built on the model's device
    if draft_vocab is not None:
        check_int("draft_vocab", draft_vocab, 1, hf_model.config.vocab_size)
    text = training_data(data, hf_model, tokenizer, cache_dir=cache, exclude=exclude,
                         corpus_root=corpus_root, self_options=self_options,
                         held_out_tokens=held_out_tokens, progress=progress)  # fmt: skip
    parts_file = "eagle_head.json" if recipe == "eagle" else "adapter.json"
    start_from = str(out) if resume and (Path(out) / parts_file).is_file() else None
    parts_option = "parts" if recipe == "eagle" else "adapter"
    options = {**(apply or {}), **({parts_option: start_from} if start_from else {})}
    sm = rewrite.apply(hf_model, recipe, **options)
    train = text.train
    if features:
        train = cached_features(hf_model, text.train, seq_len=config.seq_len, windows=features,
                                layers=_layers(sm, recipe), cache_dir=cache,
                                key={"data": text.info["sha256"]}, progress=progress)  # fmt: skip
    # Keyed by what changes the steps, not by how the run is watched or stopped (--minutes).
    steps_fit = {k: v for k, v in fit.items() if k not in RUNTIME_FIELDS}
    checkpoints = run_checkpoints(cache, recipe, str(Path(out).resolve()), recipe,
                                  text.info["sha256"], options, steps_fit, features,
                                  start_from is not None)  # fmt: skip
    if fresh:
        shutil.rmtree(checkpoints, ignore_errors=True)
    result = sm.fit(train, eval_data=text.held_out, checkpoint_dir=checkpoints, **fit)
    finished = len(result.losses) >= config.steps
    summary: dict[str, Any] = {
        "recipe": recipe,
        "model": str(model or "reference"),
        "data": text.info,
        "held_out_agreement_before": result.agreement_before,
        "held_out_agreement_after": result.agreement_after,
        "steps": len(result.losses),
        "steps_asked": config.steps,
        "finished": finished,
        "fit": {k: v for k, v in fit.items() if k != "progress"},
        "features_windows": features,
        "resumed_from_parts": start_from is not None,
        "final_loss": result.final_loss,
        "seconds": round(result.seconds, 1),
        "device": describe_device(torch_device),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if draft_vocab is not None:
        summary["draft_vocab"] = draft_vocab
        summary["held_out_agreement_subset"] = _subset_agreement(sm, recipe, text.held_out,
                                                                 draft_vocab)  # fmt: skip
    if not finished:  # the parts so far are written; the same command continues
        summary["checkpoint"] = str(checkpoints)
    _save(sm, recipe, out, start_from, summary)
    if finished:
        shutil.rmtree(checkpoints, ignore_errors=True)
    summary["parts"] = str(out)
    return summary


def _save(sm, recipe: str, out: Path, start_from: str | None, summary: dict) -> None:
    """Write the parts with ``summary`` appended to the runs they came from."""
    parts_file = "eagle_head.json" if recipe == "eagle" else "adapter.json"
    history = []
    if start_from is not None:
        previous = json.loads((Path(out) / parts_file).read_text()).get("training", [])
        history = previous if isinstance(previous, list) else [previous]
    extra = {"training": [*history, summary]}
    if recipe == "eagle":
        from leapfx.train.eagle import save_parts

        save_parts(sm, out, extra=extra)
    else:
        from leapfx.train.kangaroo import save_adapter

        save_adapter(sm, out, extra=extra)
