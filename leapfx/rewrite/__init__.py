"""The front door: ``apply(model, recipe, **options) -> SpeculativeModel``.

    >>> from leapfx import rewrite
    >>> sm = rewrite.apply(hf_model, "layerskip", exit_layer=4, num_speculations=6)
    >>> out = sm.generate(input_ids, max_new_tokens=128)
    >>> kg = rewrite.apply(hf_model, "kangaroo", exit_layer=2)
    >>> kg.fit(token_ids); kg.save_parts("kangaroo-parts/")
    >>> kg = rewrite.apply(hf_model, "kangaroo", parts="kangaroo-parts/")  # the trained parts

``rewrite.recipes()`` lists the registered recipes. An unknown recipe or option, or an option
value out of range, raises ValueError naming it and what is allowed, before anything runs.
What ``apply`` picks for choices left unset (the CPU kernels, a shipped model's tuned options)
is in ``leapfx.rewrite.defaults``.
"""

from __future__ import annotations

import dataclasses
import logging
from functools import partial

from torch import nn

from ..export import export_onnx
from ..lower import lower
from ..offload import OffloadOptions, build_offload
from ..offload.checkpoint import checkpoint_only
from ..options import check_bool
from ..passes.base import PassPipeline
from ..passes.capture import EXTRA_CACHE_LAYERS, capture, check_supported
from ..passes.offload import OffloadExperts
from ..recipes import RECIPES, Recipe, get_recipe, lookup_recipes
from ..runtime.model import SpeculativeModel
from ..runtime.recipe_info import RecipeInfo, RecipeTraining
from .defaults import best_drafter, kernels_choice, resolve_parts, shipped_options

__all__ = ["apply", "recipes", "get_recipe", "Recipe", "OffloadOptions"]

BACKENDS = ("eager", "inductor")  # apply's backend=; ONNX is an export (leapfx.lower.lower)

log = logging.getLogger(__name__)


def recipes() -> dict[str, str]:
    """Registered recipe names and one-line descriptions."""
    return {name: r.description for name, r in RECIPES.items()}


def load_training(name: str) -> RecipeTraining:
    """The trainer ``leapfx.train.recipe_training`` has under ``name`` (a recipe's
    ``training``); the model's ``fit`` and ``save_parts`` call ``partial(load_training, name)``
    when they first need it, so decoding never imports training code."""
    from ..train.recipe_training import training

    return training(name)


def make_options(recipe: Recipe, num_layers: int, options: dict):
    """Build and validate the recipe's options dataclass from keyword options.

    ``lookup=False`` and ``adaptive=False`` are every recipe's behaviour, so a recipe without
    the options takes them; ``True`` there is refused with the reason and the recipes that
    take it."""
    fields = [f.name for f in dataclasses.fields(recipe.options_type)]
    for name in ("lookup", "adaptive"):
        if name in options and name not in fields:
            if options[name] is not False:
                raise ValueError(
                    f"{name}: recipe {recipe.name!r} does not take {name}={options[name]!r} "
                    f"({recipe.lookup_refusal}); recipes that take it: "
                    f"{', '.join(lookup_recipes())}"
                )
            options = {k: v for k, v in options.items() if k != name}
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise ValueError(
            f"option {unknown[0]!r} is not an option of recipe {recipe.name!r}; "
            f"its options are: {', '.join(fields)}"
        )
    return recipe.options_type(**options).validate(num_layers)


def parts_options(recipe: Recipe, parts, options: dict) -> dict:
    """The recipe option that ``apply(..., parts=dir)`` stands for (e.g. Kangaroo's ``adapter``)."""
    if recipe.parts_option is None:
        with_parts = [n for n, r in RECIPES.items() if r.parts_option is not None]
        raise ValueError(
            f"parts: recipe {recipe.name!r} inserts nothing that trains or is calibrated, so it "
            f"takes no parts directory; recipes with parts: {', '.join(with_parts)}"
        )
    if options.get(recipe.parts_option) is not None:
        raise ValueError(
            f"parts: given together with {recipe.parts_option}={options[recipe.parts_option]!r}; "
            f"allowed: one of the two (for recipe {recipe.name!r} they name the same directory)"
        )
    return {recipe.parts_option: parts}


def _batch_plan(recipe: Recipe, opts):
    """How the applied recipe drafts in a batch (None: it does not batch); a draft stage whose
    verify splits (``Capabilities.split_verify``) verifies whole rounds with it."""
    if recipe.batch is None:
        return None
    plan = recipe.batch(opts)
    if plan.drafter == "stage" and recipe.capabilities.split_verify:
        plan = dataclasses.replace(plan, split_verify=True)
    return plan


def fit_drafts_to_slots(recipe: Recipe, opts, given: dict, runtime):
    """``opts`` with fewer drafts a round where a verify pass over the offloaded model
    (``runtime``: its ``ExpertOffload``) would check more tokens than
    ``runtime.call_tokens()`` and the caller left the recipe's ``draft_option`` unset
    (default, or a parts directory's): then d + 1 = call_tokens, at least one draft. Speed
    only: greedy tokens are the same for every d, sampled ones equal in distribution.

    A verify pass of d + 1 tokens routes to up to (d + 1) * top_k experts a layer; past the
    slots it runs in waves and evicts what the round's drafts prefetched, which can make
    speculation slower than on-demand decoding (docs/recipes.md).
    """
    name = recipe.draft_option
    if name is None or given.get(name) is not None:
        return opts
    tokens, fit = recipe.lookahead(opts), runtime.call_tokens()
    if tokens <= fit:
        return opts
    before = getattr(opts, name)
    opts = dataclasses.replace(opts, **{name: max(1, before - (tokens - fit))})
    log.info(
        "offload: %s=%d (was %d), a verify pass of %d tokens: %d expert slots a layer hold "
        "the top-%d experts of %d tokens (one draft at least); pass %s=N to choose", name,
        getattr(opts, name), before, recipe.lookahead(opts), runtime.num_slots, runtime.top_k,
        runtime.num_slots // runtime.top_k, name,
    )  # fmt: skip
    return opts


def apply(
    model: nn.Module,
    recipe: str,
    *,
    backend: str = "eager",
    cpu_kernels: bool | None = None,
    parts="auto",
    offload: OffloadOptions | None = None,
    **options,
) -> SpeculativeModel:
    """Rewrite ``model`` with ``recipe``; the model itself is never modified.

    The returned SpeculativeModel shares the model's weights by reference. ``backend``:
    ``"eager"`` runs the stages as PyTorch modules; ``"inductor"`` compiles them with
    ``torch.compile`` and warms them up (``SpeculativeModel.compile``) before returning.
    ``cpu_kernels``: run the projections through leapfx's small-M CPU kernels (float32 CPU
    models; see ``SpeculativeModel.use_cpu_kernels``). None (auto, the default): on where
    they run (a float32 model on a CPU, kernels built), off elsewhere, never an error; True:
    on (ValueError where they cannot be); False: off (the eager stages are HF's math, bit for
    bit). The choice is logged at INFO and read back as ``sm.cpu_kernels`` and
    ``sm.last_metrics.cpu_kernels``. Options left unset take the model's shipped tuned values
    where its folder has a ``leapfx_defaults.json`` (``leapfx.rewrite.defaults``; the reference
    model's: LayerSkip's measured exit layer and draft length). ``parts``: a directory written by
    ``SpeculativeModel.save_parts`` (the trained parts the recipe inserts, with the options
    they were trained with); every recipe with trained parts takes it. ``"auto"`` (the
    default): the shipped parts trained for this model, where there are some (logged), else
    none, with a warning naming the command that trains them; None: none, silently
    (``leapfx.rewrite.defaults.resolve_parts``). ``"auto"``, the recipe, runs the best drafting
    the model has: EAGLE with prompt lookup where a head was trained for it, else its quantized
    copy with prompt lookup where that pays (``qspec``: large float32 weights on a CPU), else
    adaptive prompt lookup (``defaults.best_drafter``; ``sm.recipe.name`` says which).
    ``offload``: run an MoE model's experts from a fast tier of expert slots per layer over a
    slow tier (disk on a CPU, pinned host memory on a GPU); any recipe, same tokens (see
    ``leapfx.offload.OffloadOptions``; the eager backend only, with or without
    ``cpu_kernels``). A drafting recipe whose draft length is left unset then drafts no more
    tokens a round than a verify pass can route within the slots (``fit_drafts_to_slots``).

    >>> sm = apply(moe_model, "layerskip", offload=OffloadOptions(slots=0.5, prefetch="next_gate"))
    """
    check_bool("cpu_kernels", cpu_kernels, none=True, allowed="True, False or None (auto)")
    if backend not in BACKENDS:
        raise ValueError(
            f"backend: {backend!r} is invalid; allowed: {', '.join(map(repr, BACKENDS))} "
            "(ONNX: sm.export_onnx(dir), then leapfx.export.OnnxModel(dir))"
        )
    if offload is not None:
        if not isinstance(offload, OffloadOptions):
            raise ValueError(
                f"offload: {offload!r} is invalid; allowed: None or a leapfx.offload.OffloadOptions"
            )
        offload.validate()
        if backend != "eager":
            raise ValueError(
                f"offload: runs on the eager backend; got backend={backend!r} (allowed: "
                "backend='eager', with or without cpu_kernels)"
            )
    r = get_recipe(recipe)
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected a HuggingFace causal LM, got {type(model).__name__}")
    check_supported(model)
    if r.name == "auto" and isinstance(parts, str) and parts == "auto" and offload is None:
        best = best_drafter(model, options)
        if best is not None:
            name, chosen = best
            log.info("auto: %s with %s", name, ", ".join(f"{k}={v!r}" for k, v in chosen.items()))
            return apply(model, name, backend=backend, cpu_kernels=cpu_kernels, **chosen)
    parts = resolve_parts(r, model, parts, options)
    if offload is None and (held := checkpoint_only(model)):
        raise ValueError(
            f"offload: None, and the experts of {held[0]!r} (and {len(held) - 1} more) are in "
            "the checkpoint only (leapfx.offload.load_offloaded); allowed: "
            "offload=OffloadOptions(...)"
        )
    given = options
    if parts is not None:
        options = {**options, **parts_options(r, parts, options)}
    shipped, source = shipped_options(model, r.name)
    shipped = {k: v for k, v in shipped.items() if options.get(k) is None}
    if shipped:
        log.info(
            "%s: %s from %s (pass them to choose)", r.name,
            ", ".join(f"{k}={v!r}" for k, v in shipped.items()), source,
        )  # fmt: skip
        options = {**options, **shipped}
    opts = make_options(r, model.config.num_hidden_layers, options)
    passes = r.passes(opts)
    if offload is not None:  # after the recipe's passes: it runs whatever stages they cut
        passes = [*passes, OffloadExperts(prefetch=offload.prefetch, m2r2_parts=offload.m2r2_parts)]
    pipeline = PassPipeline(passes)
    gm = pipeline(capture(model))
    runtime = None
    if offload is not None:  # the pass rewrote the graph; the slots, slow tier and threads:
        runtime = build_offload(gm, offload)
        opts = fit_drafts_to_slots(r, opts, given, runtime)
    stages = r.cut(gm)
    log.info("applied recipe %s with %s; passes: %s", r.name, opts, pipeline.counters)
    info = RecipeInfo(
        name=r.name,
        options=opts,
        schedule=r.schedule(opts),
        lookahead=r.lookahead(opts),
        extra_cache_layers=gm.meta.get(EXTRA_CACHE_LAYERS, 0),
        training=partial(load_training, r.training) if isinstance(r.training, str) else r.training,
        lossless=r.lossless(opts) if callable(r.lossless) else r.lossless,
        capabilities=r.capabilities,
        batch=_batch_plan(r, opts),
        batch_refusal=r.batch_refusal,
    )
    sm = SpeculativeModel(model, gm, stages, info, offload=runtime, lower=lower, export=export_onnx)
    if backend == "inductor":  # compile() resolves cpu_kernels the same way
        lower(sm, "inductor", cpu_kernels=cpu_kernels)
        log.info("%s: cpu_kernels=%s (inductor, given %s)", r.name, sm.cpu_kernels, cpu_kernels)
        return sm
    lay = sm._layout
    kernels, why = kernels_choice(cpu_kernels, lay.device, lay.dtype)
    log.info("%s: cpu_kernels=%s (%s)", r.name, kernels, why)
    return lower(sm, "cpu_kernels") if kernels else sm
