"""Teacher-forced features of the target model over a corpus, cached on disk between runs.

A drafter's trainer needs, for every training window, what the target computes on it: the
EAGLE head regresses the pre-norm last-layer state h and matches the logits head(norm(h)); a
Kangaroo adapter reads the residual stream after its exit layer and matches the same logits.
The target's forward is most of a training step's cost on a small CPU, so it runs once per
window, here, and a run (and every later run on the same model, data and settings) reads the
states back. Logits are never stored (V floats a position): the trainer recomputes them from h
through the frozen norm and head, which is the forward's own last step.

Windows: ``windows`` windows of ``seq_len`` tokens spread evenly over the token stream (the
first at 0, the last at the end), so a few hundred windows still span the corpus. States:
``layers`` are HF ``hidden_states`` indices (``i``: the residual stream after ``i`` decoder
layers, 0 the embeddings); ``L`` (the layer count) is the pre-norm last-layer state, which HF
does not return (its ``hidden_states[L]`` is post-norm). Stored as float16 (halves the disk;
float32 where float16 would overflow).

On disk: ``<cache_dir>/features-<sha256 of the key>.safetensors`` (``tokens`` [n, S], one
``layer.<i>`` [n, S, D] a layer, the key in the metadata), written to a temporary name and
renamed. The key holds the model's weights digest, the token stream's digest and the settings,
so a changed model, corpus or option never reads a stale file.

    >>> feats = cached_features(model, stream, seq_len=128, windows=512, layers=(30,),
    ...                         cache_dir="~/.cache/leapfx/train", key={"data": "stdlib"})
    >>> ids, (h,) = feats.batch(8, generator)     # [8, 128], [8, 128, D]
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from leapfx.files import write_atomic
from leapfx.options import check_int
from leapfx.passes.capture import decoder_pieces


@dataclass(frozen=True)
class TeacherFeatures:
    """Windows of token ids and the target's states on them (see the module docstring)."""

    tokens: torch.Tensor  # [n, S] int64
    states: dict[int, torch.Tensor]  # layer index -> [n, S, D] (float16 or float32)

    def batch(
        self, batch_size: int, generator: torch.Generator, layers: Sequence[int]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``batch_size`` windows drawn at random with ``generator``: ids [B, S] and the
        states of ``layers`` [B, S, D] each (in the stored dtype)."""
        missing = [i for i in layers if i not in self.states]
        if missing:
            raise ValueError(
                f"data: the cached features hold layers {sorted(self.states)}, not {missing}; "
                "allowed: features collected for this recipe's layers"
            )
        idx = torch.randint(0, self.tokens.shape[0], (batch_size,), generator=generator)
        return self.tokens[idx], [self.states[i][idx] for i in layers]


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 of every parameter and buffer of ``model`` (names, shapes, dtypes, bytes)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}\0{tuple(t.shape)}\0{t.dtype}\0".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def tokens_digest(tokens: torch.Tensor) -> str:
    """sha256 of a token stream's int64 values."""
    return hashlib.sha256(tokens.long().cpu().contiguous().numpy().tobytes()).hexdigest()


def window_starts(length: int, seq_len: int, windows: int) -> list[int]:
    """``windows`` starts of ``seq_len``-token windows spread evenly over ``length`` tokens
    (fewer when the stream holds fewer whole windows)."""
    last = length - seq_len
    if last < 0:
        raise ValueError(f"seq_len: {seq_len} is longer than the data ({length} tokens)")
    n = min(windows, last + 1)
    return [0] if n == 1 else [k * last // (n - 1) for k in range(n)]


@torch.no_grad()
def collect_features(
    model: torch.nn.Module,
    stream: torch.Tensor,
    *,
    seq_len: int,
    windows: int,
    layers: Sequence[int],
    batch_size: int = 4,
    progress: bool = False,
) -> TeacherFeatures:
    """Run ``model`` over the windows of ``stream`` and keep the states of ``layers``."""
    check_int("seq_len", seq_len, 2)
    check_int("windows", windows, 1)
    num_layers = model.config.num_hidden_layers
    for i in layers:
        check_int("layers", i, 0, num_layers)
    starts = window_starts(stream.numel(), seq_len, windows)
    tokens = torch.stack([stream[s : s + seq_len] for s in starts]).long()
    device = next(model.parameters()).device
    norm = decoder_pieces(model).norm
    seen: list[torch.Tensor] = []
    hook = norm.register_forward_hook(lambda module, args, out: seen.append(args[0]))
    kept: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
    try:
        for b in tqdm(range(0, len(starts), batch_size), desc="teacher features",
                      disable=not progress):  # fmt: skip
            seen.clear()
            ids = tokens[b : b + batch_size].to(device)
            out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
            for i in layers:
                state = seen[0] if i == num_layers else out.hidden_states[i]
                kept[i].append(state.float().cpu())
    finally:
        hook.remove()
    states = {}
    for i, parts in kept.items():
        full = torch.cat(parts)
        half = full.half()
        states[i] = half if torch.isfinite(half).all() else full
    return TeacherFeatures(tokens, states)


def cached_features(
    model: torch.nn.Module,
    stream: torch.Tensor,
    *,
    seq_len: int,
    windows: int,
    layers: Sequence[int],
    cache_dir: str | Path,
    key: dict[str, Any],
    progress: bool = False,
) -> TeacherFeatures:
    """:func:`collect_features`, read from ``cache_dir`` when a run with the same model, data
    and settings wrote it (``key``: what else identifies the data, e.g. its source)."""
    full_key = {
        **key,
        "model": weights_digest(model),
        "tokens": tokens_digest(stream),
        "seq_len": seq_len,
        "windows": windows,
        "layers": sorted(int(i) for i in layers),
        "format": 1,
    }
    text = json.dumps(full_key, sort_keys=True)
    root = Path(cache_dir).expanduser()
    file = root / f"features-{hashlib.sha256(text.encode()).hexdigest()[:24]}.safetensors"
    if file.is_file():
        with safe_open(str(file), framework="pt") as f:
            if f.metadata().get("key") == text:
                tokens = f.get_tensor("tokens")
                states = {int(k.split(".")[1]): f.get_tensor(k) for k in f.keys() if k != "tokens"}
                return TeacherFeatures(tokens, states)
    feats = collect_features(model, stream, seq_len=seq_len, windows=windows, layers=layers,
                             progress=progress)  # fmt: skip
    tensors = {"tokens": feats.tokens, **{f"layer.{i}": s for i, s in feats.states.items()}}
    write_atomic(file, lambda tmp: save_file(tensors, str(tmp), metadata={"key": text}))
    return feats
