"""The ``specee`` recipe's options, passes and schedule (SpecEE, sec. 4-5; spec: specee.md).

    >>> sm = rewrite.apply(hf_model, "specee", drafter="exit_head")     # untrained predictors
    >>> sm.fit(token_ids); sm.save_parts("specee-parts/")
    >>> sm = rewrite.apply(hf_model, "specee", parts="specee-parts/")   # lossy early exit
    >>> sm = rewrite.apply(hf_model, "specee", parts="specee-parts/", verify=True)  # lossless

With ``parts`` every option left as None comes from the parts directory (drafter, exit layer,
offline layer subset), and the drafter and exit layer must match it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from ..options import SavedOptions, check_bool, check_choice, check_int, check_number, is_int
from ..parts.kangaroo import read_adapter_config
from ..parts.specee import ADAPTER_DIR, EAGLE_DIR, read_parts_config
from ..passes.adapter import InsertKangarooAdapter
from ..passes.base import GraphPass
from ..passes.eagle_head import FuseEagleHeadLayer, InsertEagleHead
from ..passes.exit_head import InsertExitHead
from ..passes.fuse_layers import FuseDecoderLayers
from ..passes.load_parts import LoadEagleHead, LoadKangarooAdapter, LoadSpecEEParts
from ..passes.predictor import InsertExitPredictors
from ..runtime.specee import SpecEEConfig, specee

# Where the speculative tokens come from. "eagle": an EAGLE draft head on the previous
# position's hidden state (the paper's); "exit_head": the host's own norm and LM head after the
# first E layers (a LayerSkip exit); "kangaroo": the Kangaroo adapter after layer E.
DRAFTERS = ("eagle", "exit_head", "kangaroo")
KV_FILLS = ("mask", "next")


def _check_path(name: str, value) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"{name}: {value!r} is invalid; allowed: a directory (str or PathLike)")
    return os.fspath(value)


@dataclass(frozen=True)
class SpecEEOptions:
    """SpecEE: exit predictors decide each token's depth (lossy), or draft for it (verify)."""

    drafter: str | None = None  # None: the parts', else "eagle"
    # E: predictors check layers E-1..L-2 (exit_head / kangaroo: the draft head reads h_{E-1}).
    # None: the parts', else 1 (eagle), L // 4 (exit_head) or the adapter's / ceil(L / 16)
    # (kangaroo, as that recipe).
    exit_layer: int | None = None
    # Exit when the predictor's probability is > this (1.0: never). None: the parts' (a
    # threshold calibrated on held-out data when they were trained), else 0.5 (the paper's).
    threshold: float | None = None
    verify: bool = False  # True: exited tokens are drafts, verified by the remainder (lossless)
    # K/V of the layers an exited token skipped (see runtime.specee). None: "next" when lossy
    # (the complete cache keeps agreement higher than "mask" at the same threshold:
    # docs/benchmarks.md), "mask" with verify=True (the verify pass recomputes what drafts
    # skipped).
    kv_fill: str | None = None
    max_draft_tokens: int = 6  # verify=True: drafts per round at most
    window: int = 2  # online schedule: layers within +-window of a recent exit are active
    history: int = 5  # ... of the last `history` exits (active once that many were seen)
    # The offline level: layers whose predictor always runs. None: the parts', else every
    # predicted layer (untrained predictors: nothing measured yet).
    offline_layers: tuple[int, ...] | None = None
    parts: str | os.PathLike | None = None  # a directory written by save_parts
    adapter: str | os.PathLike | None = None  # drafter="kangaroo": a trained adapter directory
    eagle: str | os.PathLike | None = None  # drafter="eagle": a trained head (eagle parts dir)
    max_cache_len: int | None = None
    fuse_layers: bool = True

    def validate(self, num_layers: int) -> SpecEEOptions:
        parts = _check_path("parts", self.parts)
        saved = SavedOptions(read_parts_config(parts).get("options", {}) if parts else {}, parts)
        drafter = check_choice("drafter", saved.pick("drafter", self.drafter, "eagle"), DRAFTERS)
        saved.require("drafter", drafter)
        default_e = 1 if drafter == "eagle" else max(1, num_layers // 4)
        if drafter == "kangaroo":
            default_e = max(1, min(num_layers - 1, -(-num_layers // 16)))
            adapter_dir = _check_path("adapter", self.adapter)
            if adapter_dir is not None:  # the adapter's own layer
                saved_adapter = read_adapter_config(adapter_dir).get("options", {})
                default_e = saved_adapter.get("exit_layer", default_e)
        e = check_int("exit_layer", saved.pick("exit_layer", self.exit_layer, default_e), 1,
                      num_layers - 1)  # fmt: skip
        saved.require("exit_layer", e)
        t = saved.pick("threshold", self.threshold, 0.5)
        check_number("threshold", t, 0, 1, allowed="a number in [0, 1] (1.0 never exits)")
        check_bool("verify", self.verify)
        kv_fill = self.kv_fill if self.kv_fill is not None else "mask" if self.verify else "next"
        check_choice("kv_fill", kv_fill, KV_FILLS)
        if self.verify and kv_fill != "mask":
            raise ValueError(
                f"kv_fill: {kv_fill!r} is invalid with verify=True; allowed: 'mask' or None (the "
                "verify pass recomputes what drafts skipped)"
            )
        check_int("max_draft_tokens", self.max_draft_tokens, 1)
        check_int("window", self.window, 0)
        check_int("history", self.history, 1)
        offline = self.offline_layers
        if offline is None:
            offline = saved.get("offline_layers", range(e - 1, num_layers - 1))
        offline = tuple(sorted(set(offline)))
        if not all(is_int(i) for i in offline) or any(
            not e - 1 <= i <= num_layers - 2 for i in offline
        ):
            raise ValueError(
                f"offline_layers: {self.offline_layers!r} is invalid; allowed: layer indices in "
                f"{e - 1}..{num_layers - 2} (the predicted layers)"
            )
        adapter = _check_path("adapter", self.adapter)
        if adapter is not None and drafter != "kangaroo":
            raise ValueError(
                f"adapter: {adapter!r} is only for drafter='kangaroo' (drafter is {drafter!r})"
            )
        if adapter is None and parts and drafter == "kangaroo":
            if (Path(parts) / ADAPTER_DIR).is_dir():
                adapter = str(Path(parts) / ADAPTER_DIR)
        eagle = _check_path("eagle", self.eagle)
        if eagle is not None and drafter != "eagle":
            raise ValueError(
                f"eagle: {eagle!r} is only for drafter='eagle' (drafter is {drafter!r})"
            )
        if eagle is None and parts and drafter == "eagle" and (Path(parts) / EAGLE_DIR).is_dir():
            eagle = str(Path(parts) / EAGLE_DIR)
        if self.max_cache_len is not None:
            check_int("max_cache_len", self.max_cache_len, 2)
        check_bool("fuse_layers", self.fuse_layers)
        return dataclasses.replace(
            self, drafter=drafter, exit_layer=e, threshold=float(t), offline_layers=offline,
            parts=parts, adapter=adapter, eagle=eagle, kv_fill=kv_fill,
        )  # fmt: skip


def specee_passes(o: SpecEEOptions) -> list[GraphPass]:
    passes: list[GraphPass] = []
    if o.drafter == "eagle":
        # The head copies a host layer, so it goes before passes that replace layers.
        passes.append(InsertEagleHead())
        passes.append(InsertExitPredictors(first_layer=o.exit_layer - 1))
        if o.fuse_layers:
            passes += [FuseDecoderLayers(), FuseEagleHeadLayer()]
        if o.eagle is not None:
            passes.append(LoadEagleHead(path=o.eagle))
        if o.parts is not None:
            passes.append(LoadSpecEEParts(path=o.parts))
        return passes
    if o.drafter == "kangaroo":
        passes.append(InsertKangarooAdapter(exit_layer=o.exit_layer))
        if o.adapter is not None:
            passes.append(LoadKangarooAdapter(path=o.adapter))
    else:
        passes.append(InsertExitHead(layer=o.exit_layer))
    passes.append(InsertExitPredictors())
    if o.fuse_layers:
        passes.append(FuseDecoderLayers())
    if o.parts is not None:
        passes.append(LoadSpecEEParts(path=o.parts))
    return passes


def specee_schedule(o: SpecEEOptions):
    config = SpecEEConfig(
        threshold=o.threshold,
        offline=frozenset(o.offline_layers),
        verify=o.verify,
        kv_fill=o.kv_fill,
        max_draft_tokens=o.max_draft_tokens,
        window=o.window,
        history=o.history,
        head_drafts=o.drafter == "exit_head",
    )
    return lambda runner, prompt, request, metrics: specee(runner, prompt, request, metrics, config)


def specee_lookahead(o: SpecEEOptions) -> int:
    return o.max_draft_tokens + 1 if o.verify else 1
