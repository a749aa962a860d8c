"""A small, resumable trainer for the LayerSkip recipe on a HF causal LM.

AdamW (weight decay on matrices only), linear warmup then cosine decay, gradient clipping, a
tqdm bar, a JSON-lines metrics log, checkpoints every K steps and a wall-clock budget.

Determinism without saved RNG state: the batch and the layer-dropout draws of step ``t`` come
from generators seeded by ``(seed, t)``, so a run resumed from a checkpoint at step ``t`` takes
exactly the steps an uninterrupted run would have taken.

On disk (``out_dir``)::

    checkpoints/step-0000200/  model.safetensors, optimizer.safetensors, trainer_state.json
    metrics.jsonl              one JSON object per logged step
    model/                     the final save_pretrained() directory (+ tokenizer)

Every directory is written under a temporary name and renamed into place, so a directory with
its final name is always complete. Nothing is pickled: tensors go to safetensors, the rest to
JSON.

Devices. ``TrainerConfig.device`` ("cpu", "cuda", "cuda:1", ...) is where the model trains: the
trainer moves the model there and each batch as it is drawn. Batches and dropout draws still
come from CPU generators, so a step draws the same batch on every device. Files are always
written from host memory (safetensors copies each tensor to the CPU) and read back onto the
configured device, so a run checkpointed on a GPU resumes on a CPU and the other way round;
``device`` is a runtime option like ``max_minutes``. Compute stays float32: no autocast, and the
float32 matmul precision is left to torch (its default, "highest", uses no TF32 on a GPU).

Example::

    >>> trainer = LayerSkipTrainer(model, train_ids, out_dir="run/",
    ...                            config=TrainerConfig(steps=2000), recipe=LayerSkipTrainConfig())
    >>> result = trainer.train()          # resumes from run/checkpoints/ when present
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import nn
from tqdm.auto import tqdm

from leapfx.files import write_atomic
from leapfx.options import is_int
from leapfx.train.layerskip import LayerSkipTrainConfig, layerskip_loss

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1
SAVE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Options that only change how a run is watched or stopped, not the steps it takes: a resumed
# run may change them.
_RUNTIME_FIELDS = frozenset(
    {
        "checkpoint_every",
        "keep_checkpoints",
        "max_minutes",
        "log_every",
        "progress",
        "save_dtype",
        "device",
    }
)
DEVICES_ALLOWED = "'cpu' or a CUDA device ('cuda', 'cuda:0', ...) when one is present"


def resolve_device(value: str | torch.device, *, option: str = "device") -> torch.device:
    """``value`` as a ``torch.device`` this machine can train on; ValueError naming ``option``.

    >>> resolve_device("cpu")
    device(type='cpu')
    """
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(
            f"{option}: got {value!r}, which torch does not accept ({exc}); "
            f"allowed: {DEVICES_ALLOWED}"
        ) from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"{option}: got {value!r}; allowed: {DEVICES_ALLOWED}")
    if not torch.cuda.is_available():
        raise ValueError(
            f"{option}: got {value!r} but CUDA is not available here; allowed: {DEVICES_ALLOWED}"
        )
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(
            f"{option}: got {value!r} but this machine has {count} CUDA device(s); "
            f"allowed: 'cpu', 'cuda' or 'cuda:0' .. 'cuda:{count - 1}'"
        )
    return device


def describe_device(device: str | torch.device) -> str:
    """``"cpu"`` or ``"cuda: <GPU name>"``, for reports."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return device.type


def synchronize(device: str | torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously), e.g. before reading a clock."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class TrainerConfig:
    """Optimisation options. ``steps`` is T of the LayerSkip curricula and of the LR schedule."""

    steps: int = 1000  # T: optimiser steps of the whole run
    batch_size: int = 16
    seq_len: int = 256  # tokens per sample (the batch holds seq_len + 1 for the shifted targets)
    lr: float = 1e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    warmup_steps: int = 100  # linear warmup from lr / warmup_steps
    weight_decay: float = 0.1  # on weights with >= 2 dims only (not norms)
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    seed: int = 0
    checkpoint_every: int = 200  # steps between checkpoints; 0 = only when the run stops
    keep_checkpoints: int = 2  # older checkpoints are deleted
    max_minutes: float | None = None  # wall-clock budget of one train() call; None = no limit
    log_every: int = 10
    progress: bool = True  # tqdm bar
    save_dtype: str = "float32"  # dtype of the final save_pretrained(): float32/float16/bfloat16
    device: str = "cpu"  # where the model trains: "cpu" or a CUDA device ("cuda", "cuda:1")

    def __post_init__(self) -> None:
        # Checked here, where the option enters, so a bad device fails before any file is written.
        # Stored as a string: the config goes to JSON.
        object.__setattr__(self, "device", str(resolve_device(self.device)))
        positive = ("steps", "batch_size", "seq_len", "log_every", "keep_checkpoints")
        for name in positive:
            value = getattr(self, name)
            if not (is_int(value) and value >= 1):
                raise ValueError(f"{name}: got {value!r}; allowed range is an int >= 1")
        for name in ("warmup_steps", "checkpoint_every", "seed"):
            value = getattr(self, name)
            if not (is_int(value) and value >= 0):
                raise ValueError(f"{name}: got {value!r}; allowed range is an int >= 0")
        if not self.lr > 0:
            raise ValueError(f"lr: got {self.lr!r}; allowed range is lr > 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio: got {self.min_lr_ratio!r}; allowed range is 0..1")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay: got {self.weight_decay!r}; allowed range is >= 0")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name}: got {getattr(self, name)!r}; allowed range is [0, 1)")
        if self.grad_clip < 0:
            raise ValueError(f"grad_clip: got {self.grad_clip!r}; allowed range is >= 0")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ValueError(f"max_minutes: got {self.max_minutes!r}; allowed: > 0 or None")
        if self.save_dtype not in SAVE_DTYPES:
            raise ValueError(
                f"save_dtype: got {self.save_dtype!r}; allowed values are {', '.join(SAVE_DTYPES)}"
            )


@dataclass(frozen=True)
class TrainResult:
    """What ``train()`` did."""

    step: int  # steps completed in total (== config.steps when finished)
    finished: bool  # False when the wall-clock budget stopped it first
    elapsed_s: float  # wall-clock seconds of this call
    tokens_per_s: float  # training throughput of this call
    last_loss: float | None
    final_dir: Path | None  # the save_pretrained() directory when finished


def warmup_cosine(step: int, steps: int, warmup_steps: int, min_ratio: float = 0.0) -> float:
    """The learning rate's factor at ``step`` of ``steps``: a linear warmup over
    ``warmup_steps`` (from 1/warmup_steps at step 0), then a cosine from 1 to ``min_ratio``.

    The schedule of both trainers that decay (``lr_at``, the LayerSkip trainer's; M2R2's
    fit, which ends at 0). Not transformers' ``get_cosine_schedule_with_warmup``: its warmup starts
    at a factor of 0, a first step that trains nothing, and the shipped parts and reference
    models were trained (and resume) with this one.

    >>> warmup_cosine(0, 100, 10), warmup_cosine(10, 100, 10), warmup_cosine(100, 100, 10, 0.1)
    (0.1, 1.0, 0.1)
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * cosine


def lr_at(step: int, config: TrainerConfig) -> float:
    """Linear warmup over ``warmup_steps``, then cosine from ``lr`` to ``lr * min_lr_ratio``."""
    return config.lr * warmup_cosine(step, config.steps, config.warmup_steps, config.min_lr_ratio)


def step_generator(seed: int, step: int, stream: str) -> torch.Generator:
    """A CPU generator seeded from ``(seed, step, stream)`` only."""
    digest = hashlib.sha256(f"{seed}:{step}:{stream}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "big") >> 1)


def sample_batch(
    tokens: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> torch.Tensor:
    """``batch_size`` random windows of ``seq_len + 1`` tokens: ``[B, S+1]`` int64."""
    n = tokens.numel() - seq_len - 1
    if n < 1:
        raise ValueError(
            f"seq_len: got {seq_len}; the token stream has only {tokens.numel()} tokens"
        )
    starts = torch.randint(0, n + 1, (batch_size,), generator=generator)
    offsets = torch.arange(seq_len + 1)
    return tokens[starts[:, None] + offsets].long()


def make_optimizer(model: nn.Module, config: TrainerConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on parameters of >= 2 dims (matrices, embeddings) only."""
    decay, no_decay = [], []
    for p in model.parameters():  # deduplicates tied weights
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2))


def save_pretrained_atomic(
    model: nn.Module,
    final_dir: str | Path,
    *,
    tokenizer=None,
    dtype: torch.dtype | None = None,
    extra_json: dict[str, dict] | None = None,
) -> Path:
    """``model.save_pretrained`` (+ tokenizer, + extra JSON files) into ``final_dir``, atomically.

    The weights are written from host memory: a model on another device, or a ``dtype`` other
    than its own, is saved from a CPU copy (cast to ``dtype``); the caller's model is not changed.

    >>> save_pretrained_atomic(model, "out/model", tokenizer=tok, dtype=torch.bfloat16)
    """

    def fill(tmp: Path) -> None:
        on_cpu = all(t.device.type == "cpu" for t in model.state_dict().values())
        to_save = model
        if dtype is not None or not on_cpu:
            to_save = copy.deepcopy(model).to(device="cpu", dtype=dtype)
        to_save.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for name, obj in (extra_json or {}).items():
            (tmp / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")

    return write_atomic(final_dir, fill, folder=True)


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict, list[dict]]:
    sd = optimizer.state_dict()
    tensors = {}
    for idx, state in sd["state"].items():
        for key, value in state.items():
            tensors[f"state.{idx}.{key}"] = torch.as_tensor(value).detach().cpu().contiguous()
    groups = [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()}
        for g in sd["param_groups"]
    ]
    return tensors, groups


def _load_optimizer(optimizer: torch.optim.Optimizer, tensors: dict, groups: list[dict]) -> None:
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        _, idx, key = name.split(".", 2)
        state.setdefault(int(idx), {})[key] = value
    for g in groups:
        if isinstance(g.get("betas"), list):
            g["betas"] = tuple(g["betas"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})


class LayerSkipTrainer:
    """Trains ``model`` (a supported HF causal LM, in place) on a 1-D token stream.

    The model is moved to ``config.device`` and stays there. ``train_tokens`` stay on the CPU
    (batches are drawn there and copied to the device). ``out_dir`` holds checkpoints, metrics
    and the final model; ``tokenizer`` (optional) is saved beside the final model.
    """

    def __init__(
        self,
        model: nn.Module,
        train_tokens: torch.Tensor,
        *,
        out_dir: str | Path,
        config: TrainerConfig,
        recipe: LayerSkipTrainConfig,
        tokenizer=None,
        aux_loss: Callable[[], torch.Tensor] | None = None,
    ) -> None:
        if train_tokens.dim() != 1:
            raise ValueError(f"train_tokens: expected a 1-D tensor, got {train_tokens.dim()}-D")
        self.device = torch.device(config.device)
        self.model = model.to(self.device)
        self.tokens = train_tokens.cpu()
        self.out_dir = Path(out_dir)
        self.config = config
        self.recipe = recipe
        self.tokenizer = tokenizer
        self.optimizer = make_optimizer(self.model, config)
        self.step = 0  # the next step to run
        # A term added to the LayerSkip loss after each forward (an MoE model's load-balancing
        # loss, read from hooks on its routers); called once per step, after layerskip_loss.
        self.aux_loss = aux_loss

    # -- checkpoints -------------------------------------------------------------------------

    @property
    def checkpoint_root(self) -> Path:
        return self.out_dir / "checkpoints"

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.checkpoint_root.is_dir():
            return []
        return sorted(p for p in self.checkpoint_root.glob("step-*") if p.is_dir())

    def _identity(self) -> dict:
        trainer = {
            k: v for k, v in dataclasses.asdict(self.config).items() if k not in _RUNTIME_FIELDS
        }
        return {"trainer": trainer, "recipe": dataclasses.asdict(self.recipe)}

    def identity(self, *, finished: bool = True) -> dict:
        """What ``leapfx_training.json`` beside a saved model holds: the step reached, the
        options that define the run and, for a run stopped short, ``"finished": false``."""
        out = {"step": self.step, **self._identity()}
        if not finished:
            out["finished"] = False
        return out

    def save_checkpoint(self, elapsed_s: float = 0.0) -> Path:
        """Write the model, the optimizer and the step to ``checkpoints/step-NNNNNNN``."""
        final = self.checkpoint_root / f"step-{self.step:07d}"

        def fill(tmp: Path) -> None:
            # float32, as trained; safetensors copies each tensor to the CPU, and keeps one copy
            # of tied weights (which a plain CPU state dict would not).
            save_model(self.model, str(tmp / "model.safetensors"))
            tensors, groups = _optimizer_tensors(self.optimizer)
            save_file(tensors, str(tmp / "optimizer.safetensors"))
            state = {
                "format": CHECKPOINT_FORMAT,
                "step": self.step,
                "elapsed_s": elapsed_s,
                "param_groups": groups,
                "config": dataclasses.asdict(self.config),
                **self._identity(),
            }
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2) + "\n")

        write_atomic(final, fill, folder=True)
        for old in self.checkpoints()[: -self.config.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def load_checkpoint(self, path: str | Path | None = None) -> bool:
        """Restore the latest (or the given) checkpoint; False when there is none.

        Raises ValueError when the checkpoint was made with options that change the run.
        """
        if path is None:
            found = self.checkpoints()
            if not found:
                return False
            path = found[-1]
        path = Path(path)
        state = json.loads((path / "trainer_state.json").read_text())
        if state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"checkpoint {path}: format {state.get('format')!r} is not supported")
        mine = self._identity()
        diffs = [
            f"{section}.{key}: checkpoint {state[section].get(key)!r} vs now {value!r}"
            for section in ("trainer", "recipe")
            for key, value in mine[section].items()
            if state[section].get(key) != (list(value) if isinstance(value, tuple) else value)
        ]
        if diffs:
            raise ValueError(
                f"checkpoint {path} was made with other options ({'; '.join(diffs)}); "
                "resume with the same options or use a fresh out_dir"
            )
        # Read to the CPU; load_state_dict copies into the parameters wherever they live, and
        # the optimizer moves its state to its parameters' device.
        missing, unexpected = load_model(self.model, str(path / "model.safetensors"))
        assert not missing and not unexpected, (missing, unexpected)
        _load_optimizer(
            self.optimizer, load_file(str(path / "optimizer.safetensors")), state["param_groups"]
        )
        self.step = int(state["step"])
        log.info("resumed from %s at step %d", path, self.step)
        return True

    # -- training ----------------------------------------------------------------------------

    def train_step(self) -> dict:
        """One optimiser step at ``self.step``; returns its metrics."""
        cfg = self.config
        t = self.step
        batch = sample_batch(
            self.tokens, cfg.batch_size, cfg.seq_len, step_generator(cfg.seed, t, "batch")
        ).to(self.device, non_blocking=True)  # no stream sync (safe from pageable memory)
        lr = lr_at(t, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        out = layerskip_loss(
            self.model,
            batch,
            step=t,
            total_steps=cfg.steps,
            config=self.recipe,
            generator=step_generator(cfg.seed, t, "dropout"),
        )
        loss = out.loss
        aux = None
        if self.aux_loss is not None:
            aux = self.aux_loss()
            loss = loss + aux
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = None
        if cfg.grad_clip > 0:
            grad_norm = float(
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
            )
        self.optimizer.step()
        self.step += 1
        last = len(out.scales) - 1
        return {
            "step": t,
            "loss": float(out.loss.detach()),
            "last_layer_loss": out.layer_losses.get(last),
            # keyed by the exit E = l + 1 (layers run), as in evaluate.py's reports
            "exit_losses": {str(k + 1): v for k, v in out.layer_losses.items()},
            "lr": lr,
            "grad_norm": grad_norm,
            "dropped": int((~out.keep).sum()),
            **({} if aux is None else {"aux_loss": float(aux.detach())}),
            "tokens": out.tokens,
        }

    def train(self, *, resume: bool = True, final_dir: str | Path | None = None) -> TrainResult:
        """Run (or resume) the training; save the final model when all steps are done.

        With ``max_minutes`` the call stops before a step that would overrun the budget, saves a
        checkpoint, and returns ``finished=False``; calling ``train()`` again continues.
        """
        cfg = self.config
        torch.manual_seed(cfg.seed)
        if resume:
            self.load_checkpoint()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        budget_s = cfg.max_minutes * 60.0 if cfg.max_minutes is not None else math.inf
        start = time.perf_counter()
        tokens = 0
        last_loss = None
        step_s = 0.0  # slowest recent step, to stop before overrunning the budget
        saved_at = self.step
        bar = tqdm(total=cfg.steps, initial=self.step, disable=not cfg.progress, desc="layerskip")
        with open(self.out_dir / "metrics.jsonl", "a") as metrics:
            while self.step < cfg.steps:
                if time.perf_counter() - start + step_s > budget_s:
                    log.info(
                        "wall-clock budget of %.1f min reached at step %d",
                        cfg.max_minutes,
                        self.step,
                    )
                    break
                t0 = time.perf_counter()
                record = self.train_step()
                dt = time.perf_counter() - t0
                step_s = max(dt, 0.9 * step_s)
                tokens += record["tokens"]
                last_loss = record["loss"]
                elapsed = time.perf_counter() - start
                bar.update(1)
                bar.set_postfix(loss=f"{last_loss:.3f}", tok_s=f"{tokens / elapsed:.0f}")
                if record["step"] % cfg.log_every == 0 or self.step == cfg.steps:
                    record["elapsed_s"] = elapsed
                    record["tokens_per_s"] = tokens / elapsed
                    metrics.write(json.dumps(record) + "\n")
                    metrics.flush()
                if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                    self.save_checkpoint(elapsed)
                    saved_at = self.step
        bar.close()
        elapsed = time.perf_counter() - start
        if self.step != saved_at:
            self.save_checkpoint(elapsed)
        finished = self.step >= cfg.steps
        final = None
        if finished:
            final = save_pretrained_atomic(
                self.model,
                final_dir if final_dir is not None else self.out_dir / "model",
                tokenizer=self.tokenizer,
                dtype=SAVE_DTYPES[cfg.save_dtype] if cfg.save_dtype != "float32" else None,
                extra_json={"leapfx_training.json": self.identity()},
            )
        return TrainResult(
            step=self.step,
            finished=finished,
            elapsed_s=elapsed,
            tokens_per_s=tokens / elapsed if elapsed > 0 else 0.0,
            last_loss=last_loss,
            final_dir=final,
        )
