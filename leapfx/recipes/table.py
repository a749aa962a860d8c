"""Recipes: data that says which passes run, how the graph is cut, and which schedule decodes.

Every recipe has one frozen options dataclass. Options are validated against the model when
``apply`` builds the recipe, so a bad value fails before anything is captured.

Past 600 lines on purpose: the registry (``RECIPES``, at the end) reads as one table, each
recipe's options dataclass and pass list a screen above it; a recipe whose options need more
than a screen gets a module of its own beside this one (``specee.py``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from torch import fx

from ..options import SavedOptions, check_bool, check_int, check_number
from ..parts.eagle import read_eagle_config
from ..parts.kangaroo import read_adapter_config
from ..parts.m2r2 import read_parts_config
from ..parts.swift import read_skip_set
from ..passes.accelerator import InsertAccelerator, check_gates
from ..passes.adapter import InsertKangarooAdapter
from ..passes.base import GraphPass
from ..passes.draft_vocab import SubsetDraftHead
from ..passes.eagle_head import FuseEagleHeadLayer, InsertEagleHead, eagle_stages
from ..passes.exit_head import InsertExitHead
from ..passes.fast_partition import exit_stages, fast_stream_stages
from ..passes.fuse_layers import FuseDecoderLayers
from ..passes.load_parts import LoadAccelerator, LoadEagleHead, LoadKangarooAdapter
from ..passes.partition import Stages, early_exit_stages, full_stage, partition
from ..passes.quantized_draft import QuantizeDraft, qspec_stages
from ..passes.skip_layers import DraftSkipSet, check_skip_set, swift_stages
from ..passes.specee_stages import specee_stages
from ..runtime import adaptive, eagle, kangaroo, lookup, m2r2, qspec, rounds, schedules, swift
from ..runtime.batch import BatchPlan
from ..runtime.capabilities import Capabilities
from ..runtime.recipe_info import RecipeTraining, Schedule
from ..runtime.skip_search import OnlineSkipSearch
from . import specee as specee_recipe


def default_exit_layer(num_layers: int) -> int:
    """A quarter of the depth (LayerSkip exits around L/4..L/2), at least 1."""
    return max(1, num_layers // 4)


def _check_cache(value) -> None:
    if value is not None:
        check_int("max_cache_len", value, 2)


def _directory(option: str, value, allowed: str = "a directory written by "
               "SpeculativeModel.save_parts") -> str | None:  # fmt: skip
    """A saved-parts option's directory as a string (None stays None); ValueError naming
    ``option`` for anything but a path."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError(
            f"{option}: {value!r} is invalid; allowed: {allowed} (str or os.PathLike) or None"
        )
    return os.fspath(value)


def _saved(
    option: str, value, read: Callable[[str], dict], *,
    allowed: str = "a directory written by SpeculativeModel.save_parts", what: str = "parts",
) -> tuple[str | None, SavedOptions]:  # fmt: skip
    """A saved-parts option's directory (``_directory``) and the options saved there
    (``read(directory)``); None and no saved options where the option is None. ``what``: how
    errors name the directory."""
    path = _directory(option, value, allowed)
    if path is None:
        return None, SavedOptions(what=what)
    return path, SavedOptions(read(path), path, what=what)


# Every recipe's options carry fuse_layers: run decoder layers through FuseDecoderLayers
# (bitwise-identical math without nn.Module dispatch, ~25% faster per layer in eager mode).
# False calls the HF layer modules themselves (their forward hooks then fire).


def _fuse(options) -> list[GraphPass]:
    return [FuseDecoderLayers()] if options.fuse_layers else []


def _check_common(o, max_cache_len, *, draft_vocab: bool = False) -> None:
    """The checks of the options every recipe has: ``max_cache_len`` (its value after the saved
    parts, where they give one) and ``fuse_layers``; with ``draft_vocab``, that option (the
    drafters whose head can compute a subset of the vocabulary)."""
    _check_cache(max_cache_len)
    check_bool("fuse_layers", o.fuse_layers)
    if draft_vocab:
        check_int("draft_vocab", o.draft_vocab, 1, none=True)


@dataclass(frozen=True)
class AutoregressiveOptions:
    """The runtime's own autoregressive schedule (no rewrite): the baseline."""

    max_cache_len: int | None = None  # None: sized per generate call
    fuse_layers: bool = True

    def validate(self, num_layers: int) -> AutoregressiveOptions:
        _check_common(self, self.max_cache_len)
        return self


@dataclass(frozen=True)
class EarlyExitOptions:
    """LayerSkip sec. 4.2: exit after the first ``exit_layer`` layers for every token (lossy)."""

    exit_layer: int | None = None  # None: default_exit_layer(L)
    max_cache_len: int | None = None
    fuse_layers: bool = True

    def validate(self, num_layers: int) -> EarlyExitOptions:
        e = default_exit_layer(num_layers) if self.exit_layer is None else self.exit_layer
        check_int("exit_layer", e, 1, num_layers - 1)
        _check_common(self, self.max_cache_len)
        return dataclasses.replace(self, exit_layer=e)


# Prompt lookup: d = 8 drafts a match continues for at most; a round's verify is one full call
# over d + 1 tokens, so a long draft costs little more than a short one where weights dominate
# (small batches). n-grams of 3 down to 1 tokens: HF's default max_matching_ngram_size is 2,
# vLLM's ngram proposer searches 1..k; a 1-gram still matches often in code and chat.
LOOKUP_NUM_SPECULATIONS = 8
LOOKUP_MAX_NGRAM = 3


def _check_ngrams(max_ngram, min_ngram) -> None:
    check_int("max_ngram", max_ngram, 1)
    check_int("min_ngram", min_ngram, 1, max_ngram)


@dataclass(frozen=True)
class LookupFirstOptions:
    """``lookup=True``, an option of the drafting recipes whose rounds it composes with
    (:func:`lookup_recipes`): each round first looks the text so far (prompt + generated) up
    as the ``lookup`` recipe does, with its ``max_ngram`` and ``min_ngram``, and verifies a
    match's drafts (at most the recipe's own draft length) with one full-model call; a round
    without a match drafts with the recipe's own drafter (``leapfx.runtime.lookup.LookupFirst``).
    Lossless either way; ``last_metrics.drafter_rounds`` counts the rounds of each drafter.

    ``adaptive=True``: each round chooses among the recipe's own drafter, prompt lookup (with
    ``lookup=True``, where the text has a match) and no drafting at all, and how many drafts,
    by the expected tokens per second each choice has measured so far
    (``leapfx.runtime.adaptive.AdaptiveDrafter``, the policy of the ``auto`` recipe): a drafter
    that does not pay on this model and machine is turned off (and probed now and then).
    """

    lookup: bool = False
    max_ngram: int = LOOKUP_MAX_NGRAM  # longest suffix matched (tried first)
    min_ngram: int = 1  # shortest suffix matched
    adaptive: bool = False

    def check_lookup(self) -> None:
        check_bool("lookup", self.lookup)
        check_bool("adaptive", self.adaptive)
        _check_ngrams(self.max_ngram, self.min_ngram)

    def lookup_first(self) -> lookup.LookupFirst | adaptive.Adaptive | None:
        """The schedule's ``first`` drafter: prompt lookup where ``lookup``, all of it chosen
        round by round where ``adaptive`` (one policy set a model), else None."""
        first = lookup.LookupFirst(self.max_ngram, self.min_ngram) if self.lookup else None
        return adaptive.Adaptive(first) if self.adaptive else first


@dataclass(frozen=True)
class LayerSkipOptions(LookupFirstOptions):
    """LayerSkip sec. 4.3: draft with layers < exit_layer, verify with the rest (lossless)."""

    exit_layer: int | None = None  # None: default_exit_layer(L)
    # Draft tokens per verify step (the paper's d). Its tables use 4..12; 6 suits an exit
    # layer around L/4 with acceptance rates near 0.7-0.8.
    num_speculations: int = 6
    # 0 (the paper): every round drafts num_speculations tokens. > 0: a round stops drafting
    # after the first draft whose exit top-1 probability is <= this (Kangaroo's eq. 4 rule on
    # the exit head; not in LayerSkip). Lossless either way: only the draft length changes.
    confidence_threshold: float = 0.0
    max_cache_len: int | None = None
    fuse_layers: bool = True

    def validate(self, num_layers: int) -> LayerSkipOptions:
        e = default_exit_layer(num_layers) if self.exit_layer is None else self.exit_layer
        check_int("exit_layer", e, 1, num_layers - 1)
        check_int("num_speculations", self.num_speculations, 1)
        _check_threshold("confidence_threshold", self.confidence_threshold)
        self.check_lookup()
        _check_common(self, self.max_cache_len)
        return dataclasses.replace(self, exit_layer=e)


@dataclass(frozen=True)
class LookupOptions:
    """Prompt-lookup decoding: drafts copied from the latest earlier match of the last n tokens
    of prompt + generated text, verified by the full model in one call (lossless, no training).
    """

    num_speculations: int = LOOKUP_NUM_SPECULATIONS  # d: most drafts a round
    max_ngram: int = LOOKUP_MAX_NGRAM  # longest suffix matched (tried first)
    min_ngram: int = 1  # shortest suffix matched
    max_cache_len: int | None = None
    fuse_layers: bool = True

    def validate(self, num_layers: int) -> LookupOptions:
        check_int("num_speculations", self.num_speculations, 1)
        _check_ngrams(self.max_ngram, self.min_ngram)
        _check_common(self, self.max_cache_len)
        return self


def _lookup_schedule(o: LookupOptions, loop: Callable = lookup.lookup, **more):
    """``loop`` (prompt lookup's, or the ``auto`` recipe's) with the options' draft length and
    n-gram sizes, and ``more`` of its keywords."""
    return partial(loop, num_speculations=o.num_speculations, max_ngram=o.max_ngram,
                   min_ngram=o.min_ngram, **more)  # fmt: skip


@dataclass(frozen=True)
class AutoOptions(LookupOptions):
    """The adaptive drafter: prompt lookup whose draft length (none at all included) each round
    is chosen from the live acceptance and the measured cost of each length, so decoding never
    runs materially slower than without speculation (``leapfx.runtime.adaptive``; lossless).
    ``num_speculations`` is the most a round drafts."""

    def validate(self, num_layers: int) -> AutoOptions:
        super().validate(num_layers)
        return self


def _auto_schedule(o: AutoOptions):
    # one set of policies a model: its costs carry over
    return _lookup_schedule(o, adaptive.auto, policies=adaptive.Policies())


def default_skip_layers(num_layers: int) -> tuple[int, ...]:
    """Every second layer of 1..L-2 (about half the depth; the first and last layers run: SWIFT
    and CLaSp find them the least skippable). A starting point: ``swift.search_skip_set``
    finds the set that measures fastest on a model."""
    return tuple(range(1, num_layers - 1, 2)) or (1,)


@dataclass(frozen=True)
class SwiftOptions(LookupFirstOptions):
    """SWIFT-style layer-skip self-speculation: draft with the model minus ``skip_layers``,
    verify with the full model (lossless, no training).

    With ``parts`` (a directory written by ``SpeculativeModel.save_parts``, typically after
    ``calibrate``) the draft skips the set saved there; a ``skip_layers`` given as well must
    be the same set.

    ``search="online"``: SWIFT's on-the-fly search (``leapfx.runtime.skip_search``) chooses
    the set during decoding, starting from ``skip_layers``: it measures candidate sets on
    real rounds, plain steps among them, then drafts with the fastest, or not at all where
    none beats plain steps. Its state lives with the model (``SpeculativeModel.skip_search``).
    """

    skip_layers: tuple[int, ...] | None = None  # None: the parts', else default_skip_layers(L)
    num_speculations: int = 4  # d: drafts a round
    parts: str | os.PathLike | None = None  # a saved (calibrated) skip set; None: none
    search: str | None = None  # None: draft with skip_layers; "online": search while decoding
    max_cache_len: int | None = None
    fuse_layers: bool = True

    def validate(self, num_layers: int) -> SwiftOptions:
        if num_layers < 2:
            raise ValueError(f"swift: a {num_layers}-layer model has no layer to skip")
        path = _directory("parts", self.parts)
        saved = None if path is None else saved_skip_set(path, num_layers)
        skip = self.skip_layers
        if skip is None:
            skip = default_skip_layers(num_layers) if saved is None else saved
        skip = check_skip_set(skip, num_layers)
        if saved is not None and skip != saved:
            raise ValueError(
                f"skip_layers: {skip} differs from the set {saved} saved in parts={path!r}; "
                f"allowed: one of the two, or skip_layers={saved}"
            )
        check_int("num_speculations", self.num_speculations, 1)
        if self.search not in SKIP_SEARCHES:
            raise ValueError(
                f"search: {self.search!r} is invalid; allowed: None (draft with skip_layers; "
                "sm.calibrate(prompts) searches offline) or 'online' (search the skip set while "
                "decoding, from skip_layers)"
            )
        self.check_lookup()
        _check_common(self, self.max_cache_len)
        return dataclasses.replace(self, skip_layers=skip, parts=path)


SKIP_SEARCHES = (None, "online")


def _swift_export_refusal(o: SwiftOptions) -> str | None:
    """Why swift with options ``o`` does not export: the online search's skip set."""
    if o.search != "online":
        return None
    return (
        "search: 'online' chooses the draft's skip set while decoding, cutting candidate "
        "draft stages from the eager 'full' stage and timing them, so no skip set is there to "
        "export; allowed: search=None (skip_layers, or parts=DIR saved after sm.calibrate)"
    )


def _swift_schedule(o: SwiftOptions):
    online = o.search == "online"
    return partial(
        swift.swift, num_speculations=o.num_speculations, first=o.lookup_first(),
        # one search a model: its trials and its choice carry over between calls
        search=OnlineSkipSearch(o.skip_layers, o.num_speculations) if online else None,
        stages=swift.SkipStages() if online else None,
    )  # fmt: skip


# The block formats a qspec draft's weights take (``draft_weights``), by how many bytes they
# read (Q8_0's 34-byte blocks, Q4_1's 20, Q4_0's 18) and how close they stay to the float model
# (Q8_0: within half a step of 1/127 of a block's largest weight; Q4_0, Q4_1: 1/15 of its range).
DRAFT_WEIGHTS = ("q8_0", "q4_0", "q4_1")
# The default: the fastest draft that keeps acceptance high. On SmolLM2's float32 weights
# (docs/recipes.md, "qspec") a Q8_0 step cost 0.78 of a float step with 0.99 of its drafts
# accepted, a Q4_0 step no less (its dequantization is as dear) with 0.68 accepted; Q4_1 there
# re-derives the file's own blocks (those weights are Q4_1 values), which no real float
# checkpoint offers: a 4-bit copy of one loses more tokens than an 8-bit copy does.
DEFAULT_DRAFT_WEIGHTS = "q8_0"


@dataclass(frozen=True)
class QSpecOptions(LookupFirstOptions):
    """A quantized copy of the model drafts for it (lossless, no training): at ``apply`` the
    model's linear weights are quantized into ``draft_weights`` blocks (the head into
    ``head_weights``); drafts run those blocks through the CPU block kernels over the same KV
    cache, and one float call verifies them and rewrites the drafted positions.

    ``skip_layers``: the draft also skips these decoder layers (as ``swift``'s does: a second,
    cheaper level). ``adaptive`` (the default here): each round's draft length, none included,
    by measured tokens per second (``leapfx.runtime.adaptive``); ``num_speculations`` is then
    the most a round drafts. ``lookup=True``: prompt lookup first, as for every drafter.
    """

    draft_weights: str = DEFAULT_DRAFT_WEIGHTS
    head_weights: str | None = None  # the head's blocks; None: draft_weights
    skip_layers: tuple[int, ...] | None = None  # None: the draft runs every layer
    # d: drafts a round (the most, with adaptive): a copy that agrees with the model on most
    # tokens keeps long rounds, and the adaptive policy shortens them where they do not pay
    num_speculations: int = 6
    adaptive: bool = True
    max_cache_len: int | None = None
    fuse_layers: bool = True

    def validate(self, num_layers: int) -> QSpecOptions:
        fmt = _check_draft_weights("draft_weights", self.draft_weights)
        head = None
        if self.head_weights is not None:
            head = _check_draft_weights("head_weights", self.head_weights)
        skip = () if self.skip_layers in (None, (), []) else self.skip_layers
        if skip:
            skip = check_skip_set(skip, num_layers)
        check_int("num_speculations", self.num_speculations, 1)
        self.check_lookup()
        _check_common(self, self.max_cache_len)
        return dataclasses.replace(self, draft_weights=fmt, head_weights=head, skip_layers=skip)


def _check_draft_weights(name: str, value) -> str:
    if not isinstance(value, str) or value.lower() not in DRAFT_WEIGHTS:
        raise ValueError(
            f"{name}: {value!r} is invalid; allowed: "
            + ", ".join(repr(f) for f in DRAFT_WEIGHTS)
            + " (GGUF block formats)"
        )
    return value.lower()


def _qspec_passes(o: QSpecOptions) -> list[GraphPass]:
    # Fused first: the copies are of the modules the graph calls (FusedDecoderLayer's HF layer)
    fmt = o.draft_weights.upper()
    head = None if o.head_weights is None else o.head_weights.upper()
    return [*_fuse(o), QuantizeDraft(fmt=fmt, head_fmt=head, skip=tuple(o.skip_layers))]


def _qspec_schedule(o: QSpecOptions):
    return partial(qspec.qspec, num_speculations=o.num_speculations, first=o.lookup_first())


def _check_depth(path: str, meta: dict, num_layers: int, held: str) -> None:
    """ValueError naming ``parts`` where the parts at ``path`` (``meta``: their JSON) are for a
    model of another depth; ``held``: what they are, in the message ("was trained")."""
    depth = meta.get("host", {}).get("num_hidden_layers")
    if depth != num_layers:
        raise ValueError(
            f"parts: {path!r} {held} for another model: num_hidden_layers={depth!r} (model: "
            f"{num_layers})"
        )


def saved_skip_set(path: str, num_layers: int) -> tuple[int, ...]:
    """The skip set saved in the swift parts at ``path``; ValueError naming ``parts`` where
    it was chosen for a model of another depth."""
    meta = read_skip_set(path)
    _check_depth(path, meta, num_layers, "holds a skip set")
    return check_skip_set(meta["options"]["skip_layers"], num_layers)


def default_kangaroo_exit_layer(num_layers: int) -> int:
    """ceil(L / 16), at least 1 and at most L - 1.

    Kangaroo (Fig. 3a) exits after l=2 of Vicuna-7B's 32 layers and l=3 of Vicuna-13B's 40:
    ceil(L/16) gives exactly those, and l=1 for models of up to 16 layers, where one layer is
    already at least 1/16 of the depth (the draft must stay cheap: the paper finds that deeper
    exits raise acceptance but lose end-to-end speed).
    """
    return max(1, min(num_layers - 1, -(-num_layers // 16)))


def _exit_head_passes(o) -> list[GraphPass]:
    """An exit head after ``exit_layer`` (``early_exit``, ``layerskip``), then fused layers."""
    return [InsertExitHead(layer=o.exit_layer), *_fuse(o)]


def _layerskip_schedule(o: LayerSkipOptions):
    # threshold 0 is the paper's fixed d: schedules.draft then never stops early nor syncs.
    drafter = partial(schedules.draft, threshold=float(o.confidence_threshold))
    return partial(
        rounds.self_speculative, num_speculations=o.num_speculations, drafter=drafter,
        first=o.lookup_first(),
    )  # fmt: skip


def _check_threshold(name: str, value) -> None:
    allowed = "a number in [0, 1) (0 drafts the maximum number of tokens every round)"
    check_number(name, value, 0, 1, high_open=True, allowed=allowed)


# Kangaroo's paper settings (sec. 4.2): at most gamma = 6 drafts a round, threshold eta = 0.6.
KANGAROO_MAX_DRAFT_TOKENS = 6
KANGAROO_CONFIDENCE_THRESHOLD = 0.6


@dataclass(frozen=True)
class KangarooOptions(LookupFirstOptions):
    """Kangaroo: draft with layers < exit_layer + an adapter, stop drafting when unsure (lossless).

    With ``adapter`` (a directory written by ``SpeculativeModel.save_adapter``) every option
    left as None comes from the checkpoint, and ``exit_layer`` must match it.
    """

    exit_layer: int | None = None  # l; None: the adapter's, else default_kangaroo_exit_layer(L)
    max_draft_tokens: int | None = None  # gamma; None: the adapter's, else 6
    # eta (eq. 4): a round stops drafting once the draft's top-1 probability is <= eta; 0 drafts
    # gamma tokens every round. None: the adapter's, else 0.6.
    confidence_threshold: float | None = None
    adapter: str | os.PathLike | None = None  # trained adapter dir; None: initialised from layer l
    max_cache_len: int | None = None
    fuse_layers: bool = True
    # N: the draft's LM head computes the N most frequent tokens' logits only (FR-Spec,
    # ``passes.draft_vocab``; the ranking is saved with the adapter). Lossless either way. A
    # decoding choice, never taken from the adapter. None: the full head.
    draft_vocab: int | None = None

    def validate(self, num_layers: int) -> KangarooOptions:
        path, saved = _saved("adapter", self.adapter, _adapter_options,
                             allowed="a checkpoint directory", what="adapter")  # fmt: skip
        pick = saved.picker(self)

        e = pick("exit_layer", default_kangaroo_exit_layer(num_layers))
        check_int("exit_layer", e, 1, num_layers - 1)
        saved.require(
            "exit_layer", e, trained=f"which was trained after layer {saved.get('exit_layer')}"
        )
        gamma = pick("max_draft_tokens", KANGAROO_MAX_DRAFT_TOKENS)
        check_int("max_draft_tokens", gamma, 1)
        eta = pick("confidence_threshold", KANGAROO_CONFIDENCE_THRESHOLD)
        _check_threshold("confidence_threshold", eta)
        self.check_lookup()
        cache_len = pick("max_cache_len", None)
        _check_common(self, cache_len, draft_vocab=True)
        return dataclasses.replace(
            self,
            exit_layer=e,
            max_draft_tokens=gamma,
            confidence_threshold=float(eta),
            adapter=path,
            max_cache_len=cache_len,
        )


def _drafter_parts(load: type, role: str, parts, draft_vocab: int | None) -> list[GraphPass]:
    """The passes after a drafter's insertion: ``load`` its saved ``parts`` (where given), then
    its draft head's vocabulary subset (``role``: the head's node) where ``draft_vocab`` asks
    for one or the parts may hold a ranking."""
    passes: list[GraphPass] = [] if parts is None else [load(path=parts)]
    if parts is not None or draft_vocab is not None:
        path = None if parts is None else os.fspath(parts)
        passes.append(SubsetDraftHead(role=role, draft_vocab=draft_vocab, path=path))
    return passes


def _adapter_options(path: str) -> dict:
    return read_adapter_config(path, recipe="kangaroo").get("options", {})


def _kangaroo_passes(o: KangarooOptions) -> list[GraphPass]:
    # The adapter copies layer l's attention, so it goes before passes that replace layers.
    passes: list[GraphPass] = [InsertKangarooAdapter(exit_layer=o.exit_layer), *_fuse(o)]
    return passes + _drafter_parts(LoadKangarooAdapter, "adapter_head", o.adapter, o.draft_vocab)


def default_fast_layers(num_layers: int) -> int:
    """k = 4 (sec. 2.3.2: J = 1, R = N/k), at most N - 1."""
    return max(1, min(4, num_layers - 1))


def _parts_meta(parts) -> tuple[str | None, SavedOptions]:
    return _saved("parts", parts, lambda path: read_parts_config(path).get("options", {}))


M2R2_NUM_SPECULATIONS = 3  # the paper's g (sec. 3.2)


@dataclass(frozen=True)
class M2R2Options(LookupFirstOptions):
    """M2R2 self-speculation (sec. 2.3.2): fast-stream drafts, slow verification (lossless).

    With ``parts`` (a directory written by ``SpeculativeModel.save_parts``) every option left
    as None comes from it (as Kangaroo's from its adapter: a drafter's best draft length
    depends on how often it is right and what it costs, so the parts carry the setting
    measured for them); its gates must start with ``fast_layers``.
    """

    fast_layers: int | None = None  # k: the gate E_1 = k, rate R = N/k; None: 4 (or N-1)
    heads: int | None = None  # fast query heads; None: the parts', else one per KV group / 8
    rank: int | None = None  # adapter and LoRA rank; None: the parts', else 8 (Fig. 10a)
    # gamma: drafts a round; None: the parts', else 3 (the paper's g)
    num_speculations: int | None = None
    # > 0: a round stops drafting after the first draft whose top-1 probability is <= this
    # (not in the paper). Lossless either way: only the draft length changes. None: the
    # parts', else 0.
    confidence_threshold: float | None = None
    # Sec. 2.5: each draft reads only this many slow keys per layer and KV head (those the
    # round's first draft weights most) plus the round's fast keys; None: every key. Drafting
    # only, so lossless either way.
    fast_keys: int | None = None
    parts: str | os.PathLike | None = None
    max_cache_len: int | None = None
    fuse_layers: bool = True
    # N: the draft's LM head computes the N most frequent tokens' logits only (FR-Spec,
    # ``passes.draft_vocab``; the ranking is saved with the parts). Lossless either way. A
    # decoding choice, never taken from the parts. None: the full head.
    draft_vocab: int | None = None

    def validate(self, num_layers: int) -> M2R2Options:
        path, saved = _parts_meta(self.parts)
        gates = saved.get("gates")  # the parts' gates; the fast stream's one gate E_1 is k
        k = self.fast_layers
        if k is None:
            k = gates[0] if gates else default_fast_layers(num_layers)
        check_int("fast_layers", k, 1, num_layers - 1)
        if gates:
            saved.require("fast_layers", k, gates[0], trained=f"trained with gates {gates}")
        heads = saved.pick("heads", self.heads)
        if heads is not None:
            check_int("heads", heads, 1)
        rank = check_int("rank", saved.pick("rank", self.rank, 8), 1)
        gamma = saved.pick("num_speculations", self.num_speculations, M2R2_NUM_SPECULATIONS)
        check_int("num_speculations", gamma, 1)
        eta = saved.pick("confidence_threshold", self.confidence_threshold, 0.0)
        _check_threshold("confidence_threshold", eta)
        if self.fast_keys is not None:
            check_int("fast_keys", self.fast_keys, 1)
        self.check_lookup()
        _check_common(self, self.max_cache_len, draft_vocab=True)
        return dataclasses.replace(
            self, fast_layers=k, heads=heads, rank=rank, parts=path, num_speculations=gamma,
            confidence_threshold=float(eta),
        )  # fmt: skip


def default_exit_gates(num_layers: int) -> tuple[int, ...]:
    """N/4, N/2, 3N/4 (the spec's choice for ARLA), distinct and within 1..N-1."""
    gates = sorted({max(1, min(num_layers - 1, (num_layers * q) // 4)) for q in (1, 2, 3)})
    return tuple(gates)


@dataclass(frozen=True)
class M2R2ExitOptions:
    """M2R2 dynamic early exit with ARLA routers (sec. 2.3.1; lossy).

    A token exits at the first gate whose router score is >= ``threshold``; a threshold above
    1 never exits (token-identical to greedy). With ``parts``, ``gates``, ``heads`` and
    ``rank`` left as None come from it.
    """

    gates: tuple[int, ...] | None = None  # E_1..E_J; None: the parts', else N/4, N/2, 3N/4
    threshold: float = 0.8  # tau: exit when the gate's ARLA score >= tau (swept in Fig. 7)
    # The gates whose router may exit a token, a subset of ``gates``; the others do not run
    # (no fast stream, router or head): a gate whose exits are rare or often wrong costs more
    # than it saves. None: the parts' choice, else every gate.
    exit_gates: tuple[int, ...] | None = None
    heads: int | None = None
    rank: int | None = None
    parts: str | os.PathLike | None = None
    max_cache_len: int | None = None
    fuse_layers: bool = True

    def validate(self, num_layers: int) -> M2R2ExitOptions:
        path, saved = _parts_meta(self.parts)
        gates = self.gates
        if gates is None:
            gates = saved.get("gates") or default_exit_gates(num_layers)
        gates = check_gates(tuple(gates) if isinstance(gates, list) else gates, num_layers)
        saved.require("gates", list(gates), verb="do",
                      trained=f"trained with gates {saved.get('gates')}")  # fmt: skip
        allowed = "a number >= 0 (above 1: never exit)"
        check_number("threshold", self.threshold, 0, allowed=allowed)
        exit_gates = self.exit_gates
        if exit_gates is None:
            exit_gates = saved.get("exit_gates") or gates
        if isinstance(exit_gates, list):
            exit_gates = tuple(exit_gates)
        if not (
            isinstance(exit_gates, tuple) and exit_gates and set(exit_gates) <= set(gates)
            and list(exit_gates) == sorted(set(exit_gates))
        ):  # fmt: skip
            raise ValueError(
                f"exit_gates: {exit_gates!r} is invalid; allowed: None or a non-empty increasing "
                f"subset of the gates {list(gates)}"
            )
        heads = saved.pick("heads", self.heads)
        if heads is not None:
            check_int("heads", heads, 1)
        rank = check_int("rank", saved.pick("rank", self.rank, 8), 1)
        _check_common(self, self.max_cache_len)
        return dataclasses.replace(
            self, gates=gates, threshold=float(self.threshold), exit_gates=exit_gates,
            heads=heads, rank=rank, parts=path,
        )  # fmt: skip


def _m2r2_passes(o) -> list[GraphPass]:
    exits = isinstance(o, M2R2ExitOptions)
    gates = tuple(o.gates) if exits else (o.fast_layers,)
    fast_keys = None if exits else o.fast_keys  # top-k keys: drafting only
    # The fast layers read the HF layers' modules, so the accelerator goes before fusing.
    passes: list[GraphPass] = [
        InsertAccelerator(
            gates=gates, heads=o.heads, rank=o.rank, routers=exits, fast_keys=fast_keys
        )
    ]
    passes += _fuse(o)
    if exits:  # no draft head: nothing of draft_vocab
        return passes + ([] if o.parts is None else [LoadAccelerator(path=o.parts)])
    return passes + _drafter_parts(LoadAccelerator, "gate_head", o.parts, o.draft_vocab)


# EAGLE's chain setting: 5 drafts a round (its chain experiments; EAGLE-2's tree has depth
# 5-6). The threshold stops a chain early once the head is unsure (Kangaroo's eq. 4 rule on the
# head's top-1 probability; EAGLE-2 ranks its tree by the same confidence).
EAGLE_MAX_DRAFT_TOKENS = 5
EAGLE_CONFIDENCE_THRESHOLD = 0.3


@dataclass(frozen=True)
class EagleOptions(LookupFirstOptions):
    """EAGLE: a one-layer draft head on the last hidden state drafts a chain (lossless).

    With ``parts`` (a directory written by ``SpeculativeModel.save_parts``) every option left
    as None comes from it.
    """

    max_draft_tokens: int | None = None  # d; None: the parts', else 5
    # A round stops drafting once the head's top-1 probability is <= this; 0 drafts d tokens
    # every round. None: the parts', else 0.3.
    confidence_threshold: float | None = None
    # The host layer whose copy starts the head's decoder layer; None: the parts', else L-1.
    init_layer: int | None = None
    parts: str | os.PathLike | None = None  # trained head; None: initialised from the host
    max_cache_len: int | None = None
    fuse_layers: bool = True
    # N: the head's logits over the N most frequent tokens only (FR-Spec,
    # ``passes.draft_vocab``; the ranking is saved with the parts). Lossless either way. A
    # decoding choice, never taken from the parts. None: the full head.
    draft_vocab: int | None = None

    def validate(self, num_layers: int) -> EagleOptions:
        path, saved = _saved("parts", self.parts, partial(_head_options, num_layers=num_layers),
                             allowed="a parts directory", what="head")  # fmt: skip
        pick = saved.picker(self)

        d = pick("max_draft_tokens", EAGLE_MAX_DRAFT_TOKENS)
        check_int("max_draft_tokens", d, 1)
        eta = pick("confidence_threshold", EAGLE_CONFIDENCE_THRESHOLD)
        _check_threshold("confidence_threshold", eta)
        init = pick("init_layer", num_layers - 1)
        check_int("init_layer", init, 0, num_layers - 1)
        copied = saved.get("init_layer")
        saved.require("init_layer", init, trained=f"whose layer was copied from layer {copied}")
        self.check_lookup()
        cache_len = pick("max_cache_len", None)
        _check_common(self, cache_len, draft_vocab=True)
        return dataclasses.replace(
            self,
            max_draft_tokens=d,
            confidence_threshold=float(eta),
            init_layer=init,
            parts=path,
            max_cache_len=cache_len,
        )


def _head_options(path: str, num_layers: int) -> dict:
    """The options saved with an EAGLE head (its ``init_layer`` among them); ValueError where
    it was trained for a model of another depth."""
    meta = read_eagle_config(path)
    _check_depth(path, meta, num_layers, "was trained")
    return {**meta.get("options", {}), "init_layer": meta.get("init_layer")}


def _eagle_passes(o: EagleOptions) -> list[GraphPass]:
    # The head copies a host layer, so it goes before passes that replace layers.
    passes: list[GraphPass] = [InsertEagleHead(init_layer=o.init_layer)]
    if o.fuse_layers:
        passes += [FuseDecoderLayers(), FuseEagleHeadLayer()]
    return passes + _drafter_parts(LoadEagleHead, "eagle_head", o.parts, o.draft_vocab)


@dataclass(frozen=True)
class Recipe:
    """A named recipe: options type, passes, partition, schedule (and what trains, if any)."""

    name: str
    description: str
    options_type: type
    passes: Callable[[object], list[GraphPass]]
    cut: Callable[[fx.GraphModule], Stages]
    schedule: Callable[[object], Schedule]
    lookahead: Callable[[object], int]
    lossless: bool | Callable[[object], bool]  # a function of the options where they decide
    # What fits and saves the inserted parts: a trainer's name in ``leapfx.train.recipe_training``
    # (train sits above the recipes: ``rewrite.apply`` hands the model the trainer it names), or
    # a factory of the runtime's own (swift's ``SwiftParts``: nothing trains, its skip set
    # saves); None: no parts.
    training: str | Callable[[], RecipeTraining] | None = None
    # The option that takes a directory written by ``SpeculativeModel.save_parts``;
    # ``apply(..., parts=dir)`` fills it. None: the recipe has no trained parts.
    parts_option: str | None = None
    # What its stages lower to (Inductor, ONNX, a draft chain ...; see Capabilities): lowering
    # and export ask the SpeculativeModel's copy instead of branching on recipe names.
    capabilities: Capabilities = field(default_factory=Capabilities)
    # The option that sets how many tokens a round drafts (``lookahead``: the tokens a verify
    # pass checks); None: the recipe does not draft. Over an offloaded MoE model, apply lowers
    # it to fit the slots where the caller left it unset (``fit_drafts_to_slots``).
    draft_option: str | None = None
    # Why ``lookup=True`` is refused, for a recipe whose options do not take it (those of
    # ``lookup_recipes()`` do).
    lookup_refusal: str = "it has no draft-and-verify rounds to draft for"
    # How it drafts in a batch (``leapfx.runtime.batch``); None: one row at a time, and
    # ``batch_refusal`` says why.
    batch: Callable[[object], BatchPlan] | None = None
    batch_refusal: str = "it decodes one sequence at a time"


def _batch_lookup(o) -> BatchPlan:
    """A batch drafts by prompt lookup alone (``lookup``, ``auto``)."""
    return BatchPlan("lookup", o.num_speculations, max_ngram=o.max_ngram,
                     min_ngram=o.min_ngram, name="lookup")  # fmt: skip


def _batch_stage(name: str, drafts: str = "num_speculations") -> Callable[[object], BatchPlan]:
    """A batch drafts with the recipe's ``draft`` stage (after prompt lookup with
    ``lookup=True``) and verifies with its ``full`` stage, or, where the recipe's
    ``Capabilities.split_verify`` says so (``rewrite.apply`` sets the plan's), a round the stage
    drafted whole with its ``verify`` stage over the draft's exit states."""

    def plan(o) -> BatchPlan:
        return BatchPlan("stage", getattr(o, drafts), lookup=o.lookup, max_ngram=o.max_ngram,
                         min_ngram=o.min_ngram, name=name)  # fmt: skip

    return plan


def _batch_eagle(o) -> BatchPlan:
    """A batch drafts with EAGLE's head on each row's own last hidden state (after prompt
    lookup with ``lookup=True``), a row stopping at ``confidence_threshold``, and verifies with
    the ``target`` stage."""
    return BatchPlan("eagle", o.max_draft_tokens, lookup=o.lookup, max_ngram=o.max_ngram,
                     min_ngram=o.min_ngram, name="eagle",
                     threshold=o.confidence_threshold)  # fmt: skip


_LOSSY_BATCH = "it is lossy: a batch decodes lossless recipes only"


def _full_only(gm: fx.GraphModule) -> Stages:
    return Stages(modules={"full": full_stage(gm)})


def _drafting(*, drafts: str = "num_speculations", **fields) -> Recipe:
    """A lossless draft-and-verify recipe: a round drafts at most ``o.<drafts>`` tokens (its
    ``draft_option``) and a verify pass checks them and one more (its ``lookahead``)."""
    return Recipe(lookahead=lambda o: getattr(o, drafts) + 1, lossless=True,
                  draft_option=drafts, **fields)  # fmt: skip


def _lookup_recipe(name: str, description: str, options_type: type, schedule) -> Recipe:
    """A recipe that drafts by prompt lookup alone (``lookup``, ``auto``), its full stage
    verifying."""
    return _drafting(name=name, description=description, options_type=options_type,
                     passes=_fuse, cut=_full_only, schedule=schedule, batch=_batch_lookup,
                     lookup_refusal="it drafts by prompt lookup itself")  # fmt: skip


def _chain_schedule(loop: Callable, drafts: str = "max_draft_tokens") -> Callable:
    """A drafter's ``loop`` with the options' draft length (``drafts``), confidence threshold
    and prompt-lookup drafter (``lookup_first``)."""

    def schedule(o):
        threshold, first = o.confidence_threshold, o.lookup_first()
        return partial(loop, **{drafts: getattr(o, drafts)}, confidence_threshold=threshold,
                       first=first)  # fmt: skip

    return schedule


def _eager_only(reason: str, export: str) -> Capabilities:
    """Stages that run eager only: ``reason`` says why not Inductor, ``export`` why not ONNX."""
    return Capabilities(compiles=False, eager_reason=reason, exportable=False,
                        export_refusal=f"its stages run eager only: {export}; use the eager "
                        "backend")  # fmt: skip


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            name="autoregressive",
            description="the leapfx runtime without speculation (baseline)",
            options_type=AutoregressiveOptions,
            passes=_fuse,
            cut=_full_only,
            schedule=lambda o: schedules.autoregressive,
            lookahead=lambda o: 1,
            lossless=True,
            batch=lambda o: BatchPlan("none"),
        ),
        _lookup_recipe(
            "lookup",
            "prompt-lookup (n-gram) drafts, full-model verify (lossless, no training)",
            LookupOptions,
            _lookup_schedule,
        ),  # fmt: skip
        _lookup_recipe(
            "auto",
            "adaptive drafter: lookup drafts only where they pay, else plain steps",
            AutoOptions,
            _auto_schedule,
        ),  # fmt: skip
        _drafting(
            name="swift",
            description="SWIFT layer-skip drafts, full-model verify (lossless, no training)",
            options_type=SwiftOptions,
            passes=lambda o: [*_fuse(o), DraftSkipSet(layers=o.skip_layers)],
            cut=swift_stages,
            schedule=_swift_schedule,
            # nothing trains; the parts are the skip set (SpeculativeModel.calibrate finds it)
            training=swift.SwiftParts,
            parts_option="parts",
            capabilities=Capabilities(
                compiles=False,
                eager_reason="its layer-skipped draft stage's Inductor path is not written",
                export_refusal_for=_swift_export_refusal,
            ),
            batch=_batch_stage("swift"),
        ),
        _drafting(
            name="qspec",
            description="a quantized copy of the model drafts, float verify (lossless, untrained)",
            options_type=QSpecOptions,
            passes=_qspec_passes,
            cut=qspec_stages,
            schedule=_qspec_schedule,
            capabilities=_eager_only(
                "its draft's quantized blocks run leapfx's CPU block kernels, which have no "
                "Inductor or ONNX path",
                "its draft's quantized blocks run leapfx's CPU block kernels, which have no ONNX "
                "path (a float export of the copy would be the model itself)",
            ),
            batch=_batch_stage("qspec"),
        ),
        Recipe(
            name="early_exit",
            description="LayerSkip early-exit inference (lossy)",
            options_type=EarlyExitOptions,
            passes=_exit_head_passes,
            cut=early_exit_stages,
            schedule=lambda o: partial(schedules.early_exit, exit_layer=o.exit_layer),
            lookahead=lambda o: 1,
            lossless=False,
            batch_refusal=_LOSSY_BATCH,
        ),
        _drafting(
            name="layerskip",
            description="LayerSkip self-speculative decoding (lossless)",
            options_type=LayerSkipOptions,
            passes=_exit_head_passes,
            cut=partition,
            schedule=_layerskip_schedule,
            # greedy rounds of d exit-head drafts; its draft stage is verify's lower part
            capabilities=Capabilities(has_chain=True, split_verify=True),
            batch=_batch_stage("layerskip"),
        ),
        _drafting(
            name="kangaroo",
            description="Kangaroo: shallow layers + adapter draft, dynamic length (lossless)",
            options_type=KangarooOptions,
            passes=_kangaroo_passes,
            cut=partition,
            schedule=_chain_schedule(kangaroo.kangaroo),
            drafts="max_draft_tokens",
            training="kangaroo",
            parts_option="adapter",
            batch=_batch_stage("kangaroo", "max_draft_tokens"),
        ),
        _drafting(
            name="m2r2",
            description="M2R2: accelerated-residual drafts, slow verification (lossless)",
            options_type=M2R2Options,
            passes=_m2r2_passes,
            cut=fast_stream_stages,
            schedule=_chain_schedule(m2r2.m2r2, "num_speculations"),
            training="m2r2",
            parts_option="parts",
            capabilities=Capabilities(
                compiles=False,
                eager_reason="its fast stream keeps per-sequence scratch state (FastScratch), "
                "a Python object that Inductor does not trace",
                # (its ONNX export takes the scratch as tensors: leapfx.export.fast_draft)
            ),
            batch_refusal="its fast stream keeps per-sequence scratch state (FastScratch)",
        ),
        Recipe(
            name="m2r2_exit",
            description="M2R2: ARLA dynamic early exit on accelerated residuals (lossy)",
            options_type=M2R2ExitOptions,
            passes=_m2r2_passes,
            cut=exit_stages,
            schedule=lambda o: partial(
                m2r2.m2r2_exit,
                gates=tuple(o.gates),
                threshold=o.threshold,
                exit_gates=tuple(o.exit_gates),
            ),  # fmt: skip
            lookahead=lambda o: 1,
            lossless=False,
            training="m2r2",
            parts_option="parts",
            capabilities=_eager_only(
                "its per-layer gates decide each token's exit on the host between per-layer stages",
                "its per-layer gates decide each token's exit on the host between per-layer "
                "stages, and the onnxruntime executor has no such schedule",
            ),
            batch_refusal=_LOSSY_BATCH,
        ),
        _drafting(
            name="eagle",
            description="EAGLE: one-layer draft head on the last hidden state, chain (lossless)",
            options_type=EagleOptions,
            passes=_eagle_passes,
            cut=eagle_stages,
            schedule=_chain_schedule(eagle.eagle),
            drafts="max_draft_tokens",
            training="eagle",
            parts_option="parts",
            batch=_batch_eagle,
        ),
        Recipe(
            name="specee",
            description="SpecEE exit predictors (lossy; lossless with verify=True)",
            options_type=specee_recipe.SpecEEOptions,
            passes=specee_recipe.specee_passes,
            cut=specee_stages,
            schedule=specee_recipe.specee_schedule,
            lookahead=specee_recipe.specee_lookahead,
            lossless=lambda o: o.verify,
            training="specee",
            parts_option="parts",
            capabilities=Capabilities(
                layer_segments=True,
                exportable=False,
                export_refusal=(
                    "its per-token exits are host decisions between per-layer stages and "
                    "exit-check nodes, and the onnxruntime executor has no such schedule "
                    "(missing: per-layer stages, exit-check stages and the SpecEE schedule in "
                    "leapfx.lower.onnxruntime); use the eager backend"
                ),
            ),
            lookup_refusal=(
                "its decoder keeps state from pass to pass that a full-model round does not "
                "update: the EAGLE drafter's last hidden state, the per-layer validity of cached "
                "keys (kv_fill='mask'), the online layer schedule; and without verify=True it "
                "is lossy"
            ),
            batch_refusal="its exits are per-token host decisions between per-layer stages",
        ),
    )
}


def get_recipe(name: str) -> Recipe:
    """The recipe registered as ``name``; ValueError listing the registered ones."""
    if name not in RECIPES:
        raise ValueError(f"recipe: unknown recipe {name!r}; available: {', '.join(RECIPES)}")
    return RECIPES[name]


def lookup_recipes() -> list[str]:
    """The recipes whose options take ``lookup=True`` (prompt lookup before their own drafter:
    ``LookupFirstOptions``)."""
    return [n for n, r in RECIPES.items() if issubclass(r.options_type, LookupFirstOptions)]
