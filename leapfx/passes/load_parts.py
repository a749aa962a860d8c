"""The passes that load saved parts into a rewritten graph: ``LoadKangarooAdapter``,
``LoadEagleHead``, ``LoadSpecEEParts``, ``LoadAccelerator`` (and ``load_compatible``, which
starts a fit from earlier M2R2 parts).

What is on disk and how it is read and written is ``leapfx.parts`` (a floor below); a pass here
only finds the module in the graph, reads the metadata with ``leapfx.parts``, checks it
against the module and loads the weights into it (``LoadParts``, the shape of every one).

    >>> gm = LoadKangarooAdapter(path="kangaroo-adapter/").run(gm).graph_module
    >>> gm = LoadEagleHead(path="eagle-parts/").run(gm).graph_module
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from safetensors.torch import load_file
from torch import fx, nn

from ..modules.eagle import EagleHead
from ..modules.kangaroo import KangarooAdapter
from ..parts import eagle, kangaroo, m2r2, specee
from ..parts.io import MODULE_WEIGHTS, check_host, host_signature, load_weights
from .accelerator import accelerator_of, compatible_layers
from .adapter import adapter_of
from .base import GraphPass, PassResult
from .eagle_head import eagle_head_of
from .predictor import predictors_of


@dataclass(frozen=True)
class LoadParts(GraphPass):
    """The shape of every ``Load*`` pass: ``module_of(gm)`` finds what the weights go into,
    ``read(path)`` its metadata, ``check(module, meta)`` refuses parts that do not fit it, and
    ``weights`` (a file in ``path``) is loaded into it (``load_weights``; ``misfit`` is the
    error when its tensors do not fit, ``subset`` loads only those the module has). The pass
    counts the tensors loaded."""

    weights: ClassVar[str]
    subset: ClassVar[bool] = False
    option: ClassVar[str] = "parts"  # the user's option that errors name
    what: ClassVar[str] = "parts"  # what the parts load into, as errors name it

    path: str

    def host_config(self, module: nn.Module) -> Any:
        """The HF config of the model ``module`` sits in, whose ``host_signature`` the parts
        must have been saved with; None: no host to check."""
        return None

    # Each pass names the two functions (plain attributes, not fields):
    # module_of(gm) -> the module, read(path) -> the metadata.
    def module_of(self, gm: fx.GraphModule) -> nn.Module:  # pragma: no cover - abstract
        raise NotImplementedError

    def read(self, path: str) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def check(self, module: nn.Module, meta: dict[str, Any]) -> None:
        """Refuse parts that do not fit ``module`` (ValueError naming the option): by default,
        parts trained for another model (``host_config``)."""
        config = self.host_config(module)
        if config is not None:
            check_host(self.option, self.path, host_signature(config), meta.get("host", {}))

    def misfit(self, module: nn.Module, meta: dict[str, Any]) -> str:
        """The error where the file's tensors do not fit ``module``: by default, the option,
        ``what`` the parts load into, and the tensors it expects."""
        return (
            f"{self.option}: the tensors in {self.path!r} do not fit this model's {self.what} "
            f"(expected {sorted(module.state_dict())})"
        )

    def loaded(self, module: nn.Module) -> None:
        """Called after the weights are in ``module``."""

    def run(self, gm: fx.GraphModule) -> PassResult:
        module = self.module_of(gm)
        meta = self.read(self.path)
        self.check(module, meta)
        misfit = self.misfit(module, meta)
        tensors = load_weights(module, Path(self.path) / self.weights, misfit=misfit,
                               subset=self.subset)  # fmt: skip
        self.loaded(module)
        return PassResult(gm, modified=True, matches=len(tensors))


@dataclass(frozen=True)
class LoadKangarooAdapter(LoadParts):
    """Load trained adapter weights from a checkpoint directory into the graph's adapter."""

    name: ClassVar[str] = "load-kangaroo-adapter"
    requires: ClassVar[frozenset[str]] = frozenset({"kangaroo-adapter"})
    provides: ClassVar[frozenset[str]] = frozenset({"kangaroo-adapter-weights"})
    weights: ClassVar[str] = kangaroo.WEIGHTS
    option: ClassVar[str] = "adapter"
    what: ClassVar[str] = "adapter"

    module_of = staticmethod(adapter_of)
    read = staticmethod(kangaroo.read_adapter_config)

    def host_config(self, adapter: KangarooAdapter) -> Any:
        return adapter.attention.config

    def check(self, adapter: KangarooAdapter, meta: dict[str, Any]) -> None:
        super().check(adapter, meta)
        saved_exit = meta.get("options", {}).get("exit_layer")
        if saved_exit != adapter.exit_layer:
            raise ValueError(
                f"exit_layer: the adapter at {self.path!r} was trained after layer {saved_exit}, "
                f"not {adapter.exit_layer}"
            )


@dataclass(frozen=True)
class LoadEagleHead(LoadParts):
    """Load trained head weights from a parts directory into the graph's EAGLE head."""

    name: ClassVar[str] = "load-eagle-head"
    requires: ClassVar[frozenset[str]] = frozenset({"eagle-head"})
    provides: ClassVar[frozenset[str]] = frozenset({"eagle-head-weights"})
    weights: ClassVar[str] = eagle.WEIGHTS
    what: ClassVar[str] = "EAGLE head"

    module_of = staticmethod(eagle_head_of)
    read = staticmethod(eagle.read_eagle_config)

    def host_config(self, head: EagleHead) -> Any:
        return head.layer.self_attn.config


def _lm_head(bank: nn.Module) -> nn.Module | None:
    return bank.exits[0]._host[1] if len(bank.exits) else None


@dataclass(frozen=True)
class LoadSpecEEParts(LoadParts):
    """Load trained exit predictors and the offline subset into the graph's predictors."""

    name: ClassVar[str] = "load-specee-parts"
    requires: ClassVar[frozenset[str]] = frozenset({"exit-predictors"})
    provides: ClassVar[frozenset[str]] = frozenset({"exit-predictor-weights"})
    weights: ClassVar[str] = specee.WEIGHTS

    module_of = staticmethod(predictors_of)
    read = staticmethod(specee.read_parts_config)

    def check(self, bank: nn.Module, meta: dict[str, Any]) -> None:
        head = _lm_head(bank)
        saved = meta.get("host", {})
        if head is not None and saved.get("vocab_size") not in (None, head.weight.shape[0]):
            raise ValueError(
                f"parts: {self.path!r} were trained for a vocabulary of {saved['vocab_size']}, "
                f"not {head.weight.shape[0]}"
            )

    def misfit(self, bank: nn.Module, meta: dict[str, Any]) -> str:
        return (
            f"parts: the tensors in {self.path!r} do not fit this model's predictors "
            f"(expected {len(bank.state_dict())} tensors for {bank.num_layers - 1} layers)"
        )

    def loaded(self, bank: nn.Module) -> None:
        head = _lm_head(bank)
        if head is not None:
            bank.to(head.weight.device)


@dataclass(frozen=True)
class LoadAccelerator(LoadParts):
    """Load trained accelerator weights (and routers, when present) from ``path``; the parts'
    tensors this graph's accelerator lacks (fast layers of other gates) are left out.

    Parts may hold more fast layers than a graph needs: parts trained for the exit gates
    (N/4, N/2, 3N/4) load into the self-speculation recipe (gate N/4), whose first interval is
    the same (``compatible_layers``). A graph layer the parts do not cover is an error."""

    name: ClassVar[str] = "load-accelerator"
    requires: ClassVar[frozenset[str]] = frozenset({"m2r2-accelerator"})
    provides: ClassVar[frozenset[str]] = frozenset({"m2r2-accelerator-weights"})
    weights: ClassVar[str] = MODULE_WEIGHTS
    subset: ClassVar[bool] = True

    module_of = staticmethod(accelerator_of)
    read = staticmethod(m2r2.read_parts_config)

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
    meta = m2r2.read_parts_config(path)
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
