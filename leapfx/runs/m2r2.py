"""One training run of M2R2's accelerator for any model: what ``leapfx train-m2r2`` runs,
with the trainer ``sm.fit`` uses (``leapfx.train.m2r2``), resumable as the drafters' runs are
(``runs.drafters``).

    >>> report = train_parts("runs/m2r2-smollm2", model_path="smollm2", data="self")
"""

from __future__ import annotations

import dataclasses
import json
import platform
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .. import rewrite
from ..files import write_text_atomic
from ..models import load_model
from ..models.gguf import cache_root
from ..options import check_int
from ..passes.load_parts import load_compatible
from ..train.evaluate import greedy_continuations
from ..train.fit_checkpoint import fit_identity
from ..train.m2r2 import M2R2FitConfig, fit, parts_options, save_parts
from ..train.sources import check_data, training_data
from .drafters import run_checkpoints


def train_parts(
    out: str | Path,
    *,
    model_path: str | Path | None = None,
    recipe: str = "m2r2",
    init: str | Path | None = None,
    heads: int | None = None,
    rank: int | None = None,
    num_speculations: int | None = None,
    confidence_threshold: float | None = None,
    fast_layers: int | None = None,
    exit_gates: tuple[int, ...] | None = None,
    held_out_tokens: int = 16384,
    corpus_root: str | None = None,
    greedy_data: int = 0,
    data: str = "stdlib",
    cache_dir: str | Path | None = None,
    exclude: Sequence[str] | None = None,
    self_options: Any = None,
    fresh: bool = False,
    **options: Any,
) -> dict[str, Any]:
    """Train M2R2 parts for a checkpoint (default: the shipped reference model) on the stdlib
    corpus's training split and write them to ``out`` with ``m2r2_report.json`` (the held-out
    alignment before and after). ``init``: start from parts written earlier (a resumed run;
    the optimizer starts fresh; only the fast layers of the same intervals load, see
    ``load_compatible``). ``heads``, ``rank``, ``fast_layers`` (m2r2's gate; N/2 is the rate-2
    stream of the MoE offload's ``m2r2`` prefetch policy), and for ``m2r2``
    ``num_speculations`` and ``confidence_threshold`` (recorded in the parts, the drafting
    setting they decode with unless ``apply`` is given another), for ``m2r2_exit``
    ``exit_gates`` (the gates whose routers decide, recorded in the parts the same way): the
    recipe's options.
    ``data``: ``stdlib``, ``self`` or a file (``train.sources``; ``exclude``: the benchmark
    prompts ``self`` data is checked against, ``self_options`` its budget, ``cache_dir`` where
    it is cached). ``greedy_data`` > 0: train instead on that many windows of the training
    split (a quarter of ``seq_len``) each continued by the model's own greedy tokens (the
    rest): the contexts drafting meets. ``options``: :class:`M2R2FitConfig` fields.

    Resumable as ``train-eagle`` is (``runs.drafters``): the run's checkpoint lives under
    ``cache_dir/checkpoints/m2r2-<key>`` (keyed by ``out``, the data, the recipe's options and
    the fit's, not by ``max_minutes``); a run stopped by ``max_minutes`` writes the parts it
    has (``"finished": false`` in the report) and the same call continues it; ``fresh`` drops
    the checkpoint first. It is deleted once every step has run. What ``leapfx train-m2r2``
    runs."""
    check_data(data)
    config = M2R2FitConfig(**options)  # checked before anything is loaded
    model, tokenizer = load_model(model_path)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else cache_root() / "train"
    text = training_data(data, model, tokenizer, cache_dir=cache, exclude=exclude,
                         corpus_root=corpus_root, self_options=self_options,
                         held_out_tokens=held_out_tokens)  # fmt: skip
    train, held = text.train, text.held_out
    check_int("greedy_data", greedy_data, 0)
    if greedy_data:
        seq_len = options.get("seq_len", M2R2FitConfig.seq_len)
        prompt = max(1, seq_len // 4)
        train = greedy_continuations(
            model, train, count=greedy_data, prompt_tokens=prompt, new_tokens=seq_len - prompt,
            seed=options.get("seed", 0),
        ).reshape(-1)  # fmt: skip
    shape = {"heads": heads, "rank": rank}
    if fast_layers is not None:  # an m2r2 option only (m2r2_exit takes gates)
        shape["fast_layers"] = fast_layers
    drafting = {"num_speculations": num_speculations, "confidence_threshold": confidence_threshold}
    shape.update({k: v for k, v in drafting.items() if v is not None})
    if exit_gates is not None:  # an m2r2_exit option only: the recipe refuses it elsewhere
        shape["exit_gates"] = tuple(exit_gates)
    # The adapters' LoRA factors start random: seeded, so that the same seed gives the same
    # parts whether or not the run was stopped and continued (the caller's RNG is untouched).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        sm = rewrite.apply(model, recipe, **shape)
    initialised = [] if init is None else load_compatible(sm.graph_module, init)
    key = (str(Path(out).resolve()), recipe, text.info.get("sha256"), parts_options(sm),
           fit_identity(config), init and str(init), greedy_data)  # fmt: skip
    checkpoints = run_checkpoints(cache, "m2r2", *key)
    if fresh:
        shutil.rmtree(checkpoints, ignore_errors=True)
    result = fit(sm, train, eval_data=held, checkpoint_dir=checkpoints, **options)
    path = save_parts(sm, out)
    report = {
        "recipe": recipe,
        "options": parts_options(sm),
        "fit": {**dataclasses.asdict(config), "init": init and str(init),
                "initialised_layers": initialised},
        "greedy_data": greedy_data,
        "steps": len(result.losses),
        "steps_asked": result.steps,
        "finished": result.finished,
        "tokens": result.tokens,
        "seconds": round(result.seconds, 1),
        "final_loss": result.final_loss,
        "final_ce": result.ce[-1],
        "final_mse": result.mse[-1],
        "final_router_bce": result.router_losses[-1] if result.router_losses else None,
        "held_out_before": result.held_out_before,
        "held_out_after": result.held_out_after,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "data": text.info,
    }  # fmt: skip
    if not result.finished:  # the parts so far are written; the same call continues
        report["checkpoint"] = str(checkpoints)
    write_text_atomic(
        path / "m2r2_report.json", json.dumps(report, indent=2, sort_keys=True) + "\n"
    )
    if result.finished:
        shutil.rmtree(checkpoints, ignore_errors=True)
    return report
