"""Stage signatures: which cache layers a stage touches, and which position input feeds each.

A stage GraphModule takes ``input_ids`` / ``exit_hidden`` / ``position_ids`` ... as named
inputs, a ``masks`` dict and a ``cache``; which cache layers it reads and writes, and whose
queries each position input positions, are not written anywhere. ``discover`` finds out with
one eager call on a few tokens over empty pasts, a different token count per position input (a
cache layer's present length then says which input fed it). The compiled stages
(``lower.inductor``) and the ONNX export (``leapfx.export.onnx_export``) both start from it.
The names of the cache inputs and outputs follow optimum (``past_key_values.{i}.key``,
``present.{i}.key``).

    >>> sig = discover(sm, "full", sm.stages.modules["full"])  # a 4-layer model
    >>> sig.tensor_inputs, sig.cache_layers, sig.groups
    (['input_ids', 'position_ids'], [0, 1, 2, 3], {'position_ids': [0, 1, 2, 3]})
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from ..runtime.cache import KVCache, cache_for
from ..runtime.masks import position_masks

if TYPE_CHECKING:
    from ..runtime.model import SpeculativeModel

# Each position input of a stage, the mask input it feeds, and the name of its sequence axis.
POSITION_INPUTS = {
    "position_ids": ("masks", "sequence"),
    "remainder_position_ids": ("remainder_masks", "remainder_sequence"),
}
MASK_INPUTS = frozenset(m for m, _ in POSITION_INPUTS.values())
# Each position input and the mask input it feeds.
POSITION_MASKS = {p: m for p, (m, _) in POSITION_INPUTS.items()}
# Token counts of the discovery call (distinct, so that a present's length names its input).
DISCOVERY_TOKENS = {"input_ids": 1, "exit_hidden": 2}


class FunctionalKVCache(KVCache):
    """``update`` concatenates past and new keys/values and records them as the presents.

    >>> past = {0: (torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))}
    >>> cache = FunctionalKVCache(past)
    >>> k, v = cache.update(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4), 0)
    >>> k.shape, sorted(cache.present)
    (torch.Size([1, 2, 4, 4]), [0])
    """

    def __init__(self, past: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.past = past
        self.present: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def claim(self, layer_idx: int, n: int) -> Any:
        """The past's length: the new keys follow it."""
        assert layer_idx not in self.present, f"cache layer {layer_idx} written twice in a stage"
        return self.get_seq_length(layer_idx)

    def write(self, layer_idx: int, at: Any, key_states, value_states) -> None:
        # key_states: [B, H_kv, S, D]; past: [B, H_kv, P, D] -> [B, H_kv, P + S, D]
        past_k, past_v = self.past[layer_idx]
        keys = torch.cat([past_k, key_states], dim=2)
        values = torch.cat([past_v, value_states], dim=2)
        self.present[layer_idx] = (keys, values)

    def read(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.present[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.past[layer_idx][0].shape[2]


def past_names(layer: int) -> tuple[str, str]:
    return f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"


def present_names(layer: int) -> tuple[str, str]:
    return f"present.{layer}.key", f"present.{layer}.value"


def fast_past_names(layer: int, top: bool = False) -> tuple[str, ...]:
    """M2R2's draft stage: the round's earlier drafts' fast keys/values of cache layer
    ``layer`` (its scratch, ``leapfx.export.fast_draft``), and with ``top`` (a ``fast_keys``
    layer) the round's choice of slow slots."""
    names = (f"fast_past.{layer}.key", f"fast_past.{layer}.value")
    return (*names, f"fast_past.{layer}.top") if top else names


def fast_present_names(layer: int, top: bool = False) -> tuple[str, ...]:
    """M2R2's draft stage: ``fast_past`` of ``layer`` with this draft's key/value appended
    (and the round's choice, made at its first draft)."""
    names = (f"fast_present.{layer}.key", f"fast_present.{layer}.value")
    return (*names, f"fast_present.{layer}.top") if top else names


# A stage input whose name is also one of the stage's outputs, and its name in an export (ONNX
# names each value once): EAGLE's head reads ``hidden`` (h_{t-1} of each token, or its own g)
# and returns ``hidden`` (its g).
ONNX_INPUT_NAMES = {"hidden": "hidden_in"}
STAGE_INPUT_NAMES = {v: k for k, v in ONNX_INPUT_NAMES.items()}


def onnx_input(name: str, outputs: list[str]) -> str:
    """The name of stage input ``name`` in an export of a stage returning ``outputs``."""
    return ONNX_INPUT_NAMES.get(name, name) if name in outputs else name


def stage_input(name: str) -> str:
    """The stage input an exported input ``name`` feeds (``onnx_input``'s inverse)."""
    return STAGE_INPUT_NAMES.get(name, name)


def step_present(name: str, step: int) -> str:
    """The output under which step ``step`` (not the last) of an export's ``draft_chain``
    returns present ``name`` (``leapfx.export.chain``)."""
    return f"{name}.step{step}"


@dataclasses.dataclass(frozen=True)
class StageSignature:
    """The tensor interface of one stage, as discovered and exported."""

    tensor_inputs: list[str]  # input_ids, position_ids, [exit_hidden, remainder_position_ids]
    outputs: list[str]  # the stage's own outputs: logits, [hidden]
    cache_layers: list[int]  # cache layers read and written, in input order
    groups: dict[str, list[int]]  # position input -> cache layers whose queries it positions
    # cache layers written (a present each); None: every one of ``cache_layers`` (M2R2's
    # draft reads slow layers it does not write)
    cache_writes: list[int] | None = None

    @property
    def written(self) -> list[int]:
        return self.cache_layers if self.cache_writes is None else self.cache_writes

    @property
    def input_names(self) -> list[str]:
        """The export's input names (``onnx_input``), then every cache layer's past."""
        tensors = [onnx_input(n, self.outputs) for n in self.tensor_inputs]
        return tensors + [n for i in self.cache_layers for n in past_names(i)]

    @property
    def output_names(self) -> list[str]:
        return self.outputs + [n for i in self.written for n in present_names(i)]


def placeholders(stage: fx.GraphModule) -> list[str]:
    return [n.name for n in stage.graph.nodes if n.op == "placeholder"]


def kv_shapes(sm: SpeculativeModel) -> list[tuple[int, int]]:
    """(kv heads, head dim) of every cache layer (the model's layers, then extra ones)."""
    cache = cache_for(sm.hf_model, 1, extra_layers=sm.recipe.extra_cache_layers)
    return [(k.shape[1], k.shape[3]) for k in cache.keys]


def example_generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def example_inputs(
    sm: SpeculativeModel,
    names: list[str],
    batch: int,
    tokens: dict[str, int],
    pasts: dict[str, int],
) -> dict[str, torch.Tensor]:
    """Consistent example tensors: positions continue each group's past.

    Random values come from a private generator: discovering and exporting never move the
    caller's RNG.
    """
    param = next(sm.hf_model.parameters())
    gen = example_generator()
    config = sm.config
    n_ids = tokens["input_ids"]
    n_hidden = tokens.get("exit_hidden", 0)
    out: dict[str, torch.Tensor] = {}
    for name in names:
        if name == "input_ids":
            ids = torch.randint(0, config.vocab_size, (batch, n_ids), generator=gen)
            out[name] = ids.to(param.device)
        elif name == "exit_hidden":
            shape = (batch, n_hidden, config.hidden_size)
            out[name] = torch.randn(shape, generator=gen).to(param.device, param.dtype)
        elif name in ("hidden", "prev_hidden"):  # the EAGLE stages' state inputs
            n = n_ids if name == "hidden" else 1
            shape = (batch, n, config.hidden_size)
            out[name] = torch.randn(shape, generator=gen).to(param.device, param.dtype)
        elif name == "position_ids":
            start = pasts["position_ids"]
            out[name] = torch.arange(start, start + n_ids, device=param.device).expand(batch, -1)
        elif name == "remainder_position_ids":
            start = pasts["remainder_position_ids"]
            length = n_hidden + n_ids
            out[name] = torch.arange(start, start + length, device=param.device).expand(batch, -1)
        else:
            raise ValueError(f"stage input {name!r} is not one leapfx knows how to export")
    return out


def example_masks(
    sm: SpeculativeModel, positions: torch.Tensor, past: int
) -> dict[str, torch.Tensor]:
    lay = sm._layout
    kv_len = past + positions.shape[1]
    return position_masks(
        positions, kv_len, kinds=lay.kinds, impl=lay.impl, window=lay.window, dtype=lay.dtype
    )


@torch.no_grad()
def discover(sm: SpeculativeModel, name: str, stage: fx.GraphModule) -> StageSignature:
    """Run ``stage`` once over empty pasts and record the cache layers it touches."""
    names = placeholders(stage)
    tensor_inputs = [p for p in names if p not in MASK_INPUTS and p != "cache"]
    param = next(sm.hf_model.parameters())
    empty = {
        i: (
            torch.zeros(1, h, 0, d, dtype=param.dtype, device=param.device),
            torch.zeros(1, h, 0, d, dtype=param.dtype, device=param.device),
        )
        for i, (h, d) in enumerate(kv_shapes(sm))
    }
    cache = FunctionalKVCache(empty)
    pasts = dict.fromkeys(POSITION_INPUTS, 0)
    inputs: dict[str, Any] = example_inputs(sm, tensor_inputs, 1, DISCOVERY_TOKENS, pasts)
    queries: dict[str, int] = {}  # position input -> query count it positions
    for positions, (mask, _) in POSITION_INPUTS.items():
        if positions in inputs:
            inputs[mask] = example_masks(sm, inputs[positions], 0)
            queries[positions] = inputs[positions].shape[1]
    out = stage(**inputs, cache=cache)
    groups: dict[str, list[int]] = {p: [] for p in queries}
    for layer, (keys, _) in sorted(cache.present.items()):
        fed = [p for p, n in queries.items() if n == keys.shape[2]]
        assert len(fed) == 1, f"stage {name}: cache layer {layer} matches no position input"
        groups[fed[0]].append(layer)
    return StageSignature(
        tensor_inputs=tensor_inputs,
        outputs=list(out),
        cache_layers=sorted(cache.present),
        groups={p: layers for p, layers in groups.items() if layers},
    )


# The EAGLE stages (``passes.eagle_head``): their state inputs ``hidden`` / ``prev_hidden``
# are warmed up by Inductor and exported with their own axes.
EAGLE_STAGES = ("target", "head")
