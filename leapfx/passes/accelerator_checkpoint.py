"""M2R2's trained accelerator on disk, and the pass that loads it into a rewritten graph.

A one-module parts directory (``parts_io.write_module_parts``, as Kangaroo's adapter):
``adapter.safetensors`` (the Accelerator's state dict: ``layers.<i>.<name>``, trainable tensors
only) and ``adapter.json`` (``recipe``, the ``options`` it was trained with -- gates, heads,
rank --, the ``host`` signature), written to a temporary directory and renamed into place.

A checkpoint may hold more fast layers than a graph needs: parts trained for the exit gates
(N/4, N/2, 3N/4) load into the self-speculation recipe (gate N/4), whose first interval is the
same (``compatible_layers``). A graph layer the checkpoint does not cover is an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from safetensors.torch import load_file
from torch import fx, nn

from .accelerator import accelerator_of, compatible_layers
from .parts_io import (
    MODULE_WEIGHTS,
    LoadParts,
    check_host,
    host_signature,
    read_module_parts_config,
)

RECIPES = ("m2r2", "m2r2_exit")


def read_parts_config(path) -> dict[str, Any]:
    """The JSON of an M2R2 parts directory (either recipe); ValueError naming ``parts``."""
    missing = (
        "is not an M2R2 parts directory (missing {files}); pass a directory written by "
        "SpeculativeModel.save_parts"
    )
    errors = []
    for recipe in RECIPES:
        try:
            return read_module_parts_config(path, recipe=recipe, option="parts", missing=missing)
        except ValueError as exc:
            errors.append(str(exc))
    raise ValueError(errors[-1])


@dataclass(frozen=True)
class LoadAccelerator(LoadParts):
    """Load trained accelerator weights (and routers, when present) from ``path``; the parts'
    tensors this graph's accelerator lacks (fast layers of other gates) are left out."""

    name: ClassVar[str] = "load-accelerator"
    requires: ClassVar[frozenset[str]] = frozenset({"m2r2-accelerator"})
    provides: ClassVar[frozenset[str]] = frozenset({"m2r2-accelerator-weights"})
    weights: ClassVar[str] = MODULE_WEIGHTS
    subset: ClassVar[bool] = True

    def module_of(self, gm: fx.GraphModule) -> nn.Module:
        return accelerator_of(gm)

    def read(self, path: str) -> dict[str, Any]:
        return read_parts_config(path)

    def host_config(self, acc: nn.Module) -> Any:
        return next(iter(acc.layers.values())).host.self_attn.config

    def check(self, acc: nn.Module, meta: dict[str, Any]) -> None:
        super().check(acc, meta)
        options = meta.get("options", {})
        saved_gates = options.get("gates", [])
        layers = self.host_config(acc).num_hidden_layers
        ok = compatible_layers(saved_gates, layers, acc.gates, acc.num_layers)
        if ok != sorted(int(i) for i in acc.layers):
            raise ValueError(
                f"gates: the accelerator at {self.path!r} was trained for gates {saved_gates}, "
                f"which do not cover this graph's gates {list(acc.gates)}"
            )

    def misfit(self, acc: nn.Module, meta: dict[str, Any]) -> str:
        options = meta.get("options", {})
        return (
            f"parts: the tensors in {self.path!r} do not fit this accelerator (heads, rank: "
            f"saved {options.get('heads')}, {options.get('rank')}; expected "
            f"{sorted(acc.state_dict())})"
        )


def load_compatible(gm: fx.GraphModule, path) -> list[int]:
    """Load the fast layers of ``path`` that were trained for the same interval as this
    graph's (``compatible_layers``) and return their indices; the rest stay as they are.
    Training starts from earlier parts this way (e.g. the exit gates' first interval from
    self-speculation parts); decoding loads with :class:`LoadAccelerator`, which needs all."""
    acc = accelerator_of(gm)
    meta = read_parts_config(path)
    first = next(iter(acc.layers.values()))
    host = host_signature(first.host.self_attn.config)
    check_host("parts", path, host, meta.get("host", {}))
    saved_gates = meta.get("options", {}).get("gates", [])
    layers = compatible_layers(saved_gates, host["num_hidden_layers"], acc.gates, acc.num_layers)
    tensors = load_file(str(Path(path) / MODULE_WEIGHTS))
    own = acc.state_dict()
    wanted = {
        k: v
        for k, v in tensors.items()
        if k in own and k.startswith("layers.") and int(k.split(".")[1]) in layers
    }
    acc.load_state_dict(wanted, strict=False)
    return layers
