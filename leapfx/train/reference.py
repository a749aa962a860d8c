"""The project's reference model: a deep, narrow, byte-level Llama trained with LayerSkip.

No weights can be downloaded here, so the benchmarks run on a model the project trains itself,
on a 2-core CPU, in about an hour. ``train_reference(out_dir)`` does it end to end and writes::

    out_dir/tokenizer/                    the tokenizer, saved first (a resumed run reuses it)
    out_dir/checkpoints/, metrics.jsonl   see trainer.py
    out_dir/model/                        save_pretrained() in float16 + tokenizer
    out_dir/model/reference_report.json   held-out loss, bits/byte, per-exit agreement, loops

Choice of model (measured, not guessed). Training is matmul-bound on this CPU (~35 GFLOP/s per
core), so tokens/s is fixed by the FLOPs per token. Sixteen layers of 192 (4 heads of 48, 2 KV
heads, MLP 512, untied head: a tied head reads an early layer's output, still close to the
current token's embedding, as "repeat this token") give early exits a fine grid (an exit after
4 layers costs a quarter of the model) at ~6.6M parameters, 13 MB in float16.

Tokenizer: bytes (259 ids). Two one-thread, one-hour runs of this shape compared (the held-out
report of each):

    BPE-2048, 8 x 512 tokens a step, rotational exits (R=4):  1.77 bits/byte, agreement of the
        exit after 2/3/4/8 layers with the last layer 24/36/43/66%, 8/16 greedy outputs loop
    bytes, 8 x 256 a step, every exit every step:              1.51 bits/byte, 47/57/64/83%,
        7/16 loop

Bytes win on every count: the LM head is 8x smaller, so an exit loss at every layer and every
step costs ~10% more compute instead of doubling it; steps of 2048 tokens give ~1900 AdamW steps
an hour instead of ~700; and a next byte is often predictable from few layers (the rest of an
identifier, indentation), which is what self-speculation exploits.

Recipe: the paper's pretraining-from-scratch recipe with the early-exit terms turned up, since
early-exit quality is what the model is for: ``p_max = 0.2`` (their Llama2 7B setting),
``S_exp``, ``e_scale = 1`` (the top of the paper's range, used for their code finetuning) and
the early-exit loss at every layer on every step (``C(t, l) = 1``), at ``lr = 2e-3`` (layer
dropout tolerates higher rates). 256-byte sequences cover a benchmark prompt plus its
generation.

Second phase (``distill_minutes``, not in the paper; the shipped model spends 10 of its 50
minutes on it): what self-speculation needs from an exit is agreement with the last layer, and
on the benchmark that is agreement on the model's own output, half of which repeats text the
output already holds. Eq. 5 trains each exit on the labels; the second phase trains it on the
last layer's whole distribution instead (``exit_distill=1``: KL from the detached last layer),
with no layer dropout, the exit after 6 layers (the benchmarks' E) at 18% of the early-exit loss,
a fresh AdamW at a peak LR of 3e-4, the last layer still on the labels. This phase raises
layerskip's acceptance and the exit's agreement; self-generated batches added nothing, so the
corpus alone is used (the measurements: docs/training.md).

Device and corpus. ``device="cuda"`` trains (and evaluates) on a GPU in float32; checkpoints and
the model are written from CPU tensors as on a CPU run, and a run resumes on either device.
``corpus_root`` reads the stdlib from a copy of another interpreter's folder, so a machine with
another Python trains on the same files and the same split (the split depends on relative paths
only); the report records the root, the file count and a digest of the corpus to compare runs by.

Steps are not fixed: a short throughput probe on a copy of the model sets ``T`` so the run fits
``minutes`` (T must be known up front: the LR schedule and both curricula depend on it), and the
trainer's wall-clock budget stops it if the machine gets slower. A resumed run keeps the ``T``
of its checkpoint.

Example::

    >>> report = train_reference("runs/reference", minutes=60)
    >>> report["exits"]["4"]["agreement_top1"]
    >>> train_reference("runs/reference-gpu", device="cuda", corpus_root=".stdlib311")
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import math
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from leapfx.files import write_atomic, write_text_atomic
from leapfx.train.data import (
    CorpusSplit,
    byte_tokenizer,
    encode_documents,
    held_out_prompts,
    stdlib_corpus,
    stdlib_root,
    token_byte_lengths,
    train_bpe_tokenizer,
)
from leapfx.train.evaluate import evaluate_exits, greedy_loop_stats
from leapfx.train.layerskip import LayerSkipTrainConfig, check_focus, layerskip_loss
from leapfx.train.trainer import (
    LayerSkipTrainer,
    TrainerConfig,
    TrainResult,
    describe_device,
    make_optimizer,
    resolve_device,
    sample_batch,
    save_pretrained_atomic,
    step_generator,
    synchronize,
)

log = logging.getLogger(__name__)

TOKENIZERS = ("bpe", "byte")
REPORT_NAME = "reference_report.json"
HELD_OUT_FRACTION = 0.05  # of the stdlib files, by path hash (see data.py)

# See the module docstring for why these values.
REFERENCE_RECIPE = LayerSkipTrainConfig(
    p_max=0.2, dropout_curriculum="exp", e_scale=1.0, exit_curriculum="all"
)
# The second phase (``distill_minutes`` > 0): no layer dropout, every exit distilled from the
# last layer, the exit the benchmarks use (after 6 layers) with 18% of the early-exit loss.
REFERENCE_DISTILL_RECIPE = LayerSkipTrainConfig(
    p_max=0.0, dropout_curriculum="none", e_scale=1.0, exit_curriculum="all",
    focus_exit=6, focus_share=0.18, exit_distill=1.0,
)  # fmt: skip
REFERENCE_DISTILL_LR = 3e-4


@dataclass(frozen=True)
class ReferenceModelSpec:
    """Shape of the reference Llama. Defaults: 16 x 192, bytes, ~6.6M parameters, 13 MB fp16."""

    num_layers: int = 16
    hidden_size: int = 192
    intermediate_size: int = 512
    num_heads: int = 4
    num_kv_heads: int = 2
    tokenizer: str = "byte"  # "byte" or "bpe" (trained on the training split)
    vocab_size: int = 2048  # BPE only; the byte tokenizer has 259
    max_position_embeddings: int = 2048  # trained on seq_len tokens; RoPE has no learned limit

    def __post_init__(self) -> None:
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(
                f"tokenizer: got {self.tokenizer!r}; allowed values are {', '.join(TOKENIZERS)}"
            )
        check_shape(self)


def check_shape(spec) -> None:
    """The checks every reference spec shares (``num_layers``, ``num_heads``, ``num_kv_heads``
    against ``hidden_size``): a ValueError naming the field, else nothing."""
    if spec.num_layers < 2:
        raise ValueError(f"num_layers: got {spec.num_layers}; allowed range is >= 2")
    if spec.hidden_size % spec.num_heads:
        raise ValueError(
            f"num_heads: got {spec.num_heads}; must divide hidden_size={spec.hidden_size}"
        )
    if spec.num_heads % spec.num_kv_heads:
        raise ValueError(
            f"num_kv_heads: got {spec.num_kv_heads}; must divide num_heads={spec.num_heads}"
        )


def config_kwargs(spec, tokenizer) -> dict:
    """The transformers config fields every reference model shares, from its spec."""
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        # Untied: with a tied head an early exit, whose hidden state is still close to the
        # current token's embedding, is pulled towards repeating that token.
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def build_model(spec: ReferenceModelSpec, tokenizer, seed: int):
    """A freshly initialised ``LlamaForCausalLM`` of ``spec`` (untied LM head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**config_kwargs(spec, tokenizer))
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def reference_corpus(
    corpus_root: str | Path | None = None, *, option: str = "corpus_root"
) -> CorpusSplit:
    """The stdlib corpus under ``corpus_root`` (None: this interpreter's), split as the reference.

    Raises ValueError naming ``option`` when ``corpus_root`` is no folder or holds no split.

    >>> corpus = reference_corpus(".stdlib311")      # a copy of another interpreter's stdlib
    """
    if corpus_root is not None and not Path(corpus_root).is_dir():
        raise ValueError(
            f"{option}: got {str(corpus_root)!r}, which is not a folder; allowed: a (copy of a) "
            f"Python standard library folder, or None for this interpreter's ({stdlib_root()})"
        )
    corpus = stdlib_corpus(HELD_OUT_FRACTION, root=corpus_root)
    if not corpus.train or not corpus.held_out:
        raise ValueError(
            f"{option}: {corpus.root!r} gives {len(corpus.train)} training and "
            f"{len(corpus.held_out)} held-out .py files; expected a Python standard library folder"
        )
    return corpus


def corpus_digest(corpus: CorpusSplit) -> str:
    """sha256 of every document's name and text, in split order: equal digests, equal corpora."""
    digest = hashlib.sha256()
    for split, docs in (("train", corpus.train), ("held_out", corpus.held_out)):
        for doc in docs:
            digest.update(f"{split}\0{doc.name}\0".encode())
            digest.update(doc.text.encode())
            digest.update(b"\0")
    return digest.hexdigest()


def _tokenizer(spec: ReferenceModelSpec, out_dir: Path, corpus):
    from transformers import AutoTokenizer

    path = out_dir / "tokenizer"
    if path.is_dir():  # a resumed run must keep its token ids
        return AutoTokenizer.from_pretrained(path)
    if spec.tokenizer == "byte":
        tok = byte_tokenizer()
    else:
        tok = train_bpe_tokenizer([d.text for d in corpus.train], vocab_size=spec.vocab_size)
    write_atomic(path, tok.save_pretrained, folder=True)
    return tok


def probe_seconds_per_step(
    model, tokens: torch.Tensor, trainer: TrainerConfig, recipe: LayerSkipTrainConfig, steps: int
) -> float:
    """Mean wall-clock seconds of a training step, measured on a copy of ``model``.

    Steps ``0 .. steps-1`` are timed after one untimed warm-up step; at ``t ~ 0`` the dropout
    curriculum drops nothing, so this slightly overestimates the average step. The copy runs on
    ``trainer.device``, and the clock is read after the device's queued work is done.
    """
    device = torch.device(trainer.device)
    probe = copy.deepcopy(model).to(device)
    optimizer = make_optimizer(probe, trainer)
    times = []
    for t in range(steps + 1):
        batch = sample_batch(
            tokens, trainer.batch_size, trainer.seq_len, step_generator(1, t, "probe")
        )
        synchronize(device)
        start = time.perf_counter()
        batch = batch.to(device)
        out = layerskip_loss(probe, batch, step=t, total_steps=max(2, steps + 1), config=recipe)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        optimizer.step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return sum(times[1:]) / steps


@dataclass
class _Phase:
    result: TrainResult
    config: TrainerConfig
    probe_s: float | None


def _run_phase(
    model, train_ids, *, out_dir: Path, final_dir: Path, fallback_dir: Path, base: TrainerConfig,
    recipe: LayerSkipTrainConfig, steps: int | None, probe_steps: int, max_warmup: int,
    checkpoints: int, deadline_s: float, start: float, tokenizer, resume: bool, progress: bool,
    save_dtype: str, name: str, aux_loss=None,
) -> _Phase:  # fmt: skip
    """Train ``model`` with ``recipe`` (checkpoints in ``out_dir``) until ``deadline_s`` seconds
    after ``start``. ``T`` is the resumed run's, else ``steps``, else sized from a probe. A
    finished run saves into ``final_dir``; one stopped by the clock into ``fallback_dir``."""
    saved = _saved_steps(out_dir) if resume else None
    steps = saved if saved is not None else steps
    probe_s = None
    if steps is None:
        probe_s = probe_seconds_per_step(model, train_ids, base, recipe, probe_steps)
        budget_s = deadline_s - (time.perf_counter() - start)
        # 5% slack: the machine is shared and a step's cost varies with the exits it enables.
        steps = max(2, int(0.95 * budget_s / probe_s))
        log.info("%s probe: %.2f s/step -> %d steps", name, probe_s, steps)
    remaining_min = (deadline_s - (time.perf_counter() - start)) / 60.0
    config = dataclasses.replace(
        base,
        steps=steps,
        warmup_steps=min(max_warmup, max(1, steps // 10)),
        checkpoint_every=max(1, steps // checkpoints),
        max_minutes=max(0.05, remaining_min),
        progress=progress,
        save_dtype=save_dtype,
    )
    trainer = LayerSkipTrainer(
        model, train_ids, out_dir=out_dir, config=config, recipe=recipe, tokenizer=tokenizer,
        aux_loss=aux_loss,
    )  # fmt: skip
    result = trainer.train(resume=resume, final_dir=final_dir)
    if not result.finished:  # over budget: still leave a usable model, flagged in the report
        log.warning("%s stopped at step %d of %d (wall-clock budget)", name, result.step, steps)
        save_pretrained_atomic(
            model, fallback_dir, tokenizer=tokenizer, dtype=getattr(torch, save_dtype),
            extra_json={"leapfx_training.json": trainer.identity(finished=False)},
        )  # fmt: skip
    return _Phase(result, config, probe_s)


def _saved_steps(out_dir: Path) -> int | None:
    found = sorted((out_dir / "checkpoints").glob("step-*/trainer_state.json"))
    if not found:
        return None
    return int(json.loads(found[-1].read_text())["config"]["steps"])


@dataclass
class _Setup:
    """What a reference trainer holds before its phases: the tokenized corpus, the model and
    the trainer options every phase starts from."""

    train_ids: torch.Tensor
    held_ids: torch.Tensor
    model: torch.nn.Module
    params: int
    base: TrainerConfig
    reserve_s: float  # seconds kept free for the evaluation and the final save
    final_dir: Path


def _set_up(
    what: str, build, tokenizer, corpus, *, out_dir: Path, minutes: float, batch_size: int,
    seq_len: int, lr: float, seed: int, dev,
) -> _Setup:  # fmt: skip
    """Tokenize ``corpus``, build the model (``build(tokenizer)``) and log its size."""
    train_ids = encode_documents(tokenizer, corpus.train)
    held_ids = encode_documents(tokenizer, corpus.held_out)
    model = build(tokenizer)
    params = sum(p.numel() for p in model.parameters())
    log.info("%s: %.2fM parameters, %d training tokens", what, params / 1e6, len(train_ids))
    base = TrainerConfig(batch_size=batch_size, seq_len=seq_len, lr=lr, seed=seed, device=str(dev))
    # Evaluation and the final save take ~1 min at the default sizes; keep 5% (>= 1 min) free.
    reserve_s = max(60.0, 0.05 * minutes * 60.0)
    return _Setup(train_ids, held_ids, model, params, base, reserve_s, out_dir / "model")


def _report_model(architecture: str, setup: _Setup, dtype: str, spec, tokenizer) -> dict:
    """The report's ``model`` entry: what was saved in ``setup.final_dir``."""
    return {
        "architecture": architecture,
        "parameters": setup.params,
        "weights_bytes": sum(f.stat().st_size for f in setup.final_dir.glob("*.safetensors")),
        "dtype": dtype,
        **dataclasses.asdict(spec),
        "vocab_size": len(tokenizer),
    }


def _report_training(phase: _Phase, recipe, dev) -> dict:
    """The report's ``training`` entry as both reference trainers write it (each adds its own)."""
    result, config = phase.result, phase.config
    return {
        "steps": result.step,
        "planned_steps": config.steps,
        "finished": result.finished,
        "tokens_seen": result.step * config.batch_size * config.seq_len,
        "tokens_per_s": result.tokens_per_s,
        "train_minutes": result.elapsed_s / 60.0,
        "threads": torch.get_num_threads(),
        "device": describe_device(dev),
        "torch": torch.__version__,
        "seed": config.seed,
        "trainer": dataclasses.asdict(config),
        "recipe": dataclasses.asdict(recipe),
    }


def train_reference(
    out_dir: str | Path,
    *,
    minutes: float = 60.0,
    seed: int = 0,
    spec: ReferenceModelSpec | None = None,
    recipe: LayerSkipTrainConfig = REFERENCE_RECIPE,
    steps: int | None = None,
    batch_size: int = 8,
    seq_len: int = 256,
    lr: float = 2e-3,
    threads: int | None = None,
    eval_tokens: int = 32768,
    save_dtype: str = "float16",
    resume: bool = True,
    progress: bool = True,
    device: str = "cpu",
    corpus_root: str | Path | None = None,
    distill_minutes: float = 0.0,
    distill_recipe: LayerSkipTrainConfig = REFERENCE_DISTILL_RECIPE,
    distill_lr: float = REFERENCE_DISTILL_LR,
    distill_steps: int | None = None,
) -> dict:
    """Train the reference model into ``out_dir`` within about ``minutes``; return the report.

    ``steps=None`` sizes the run from a throughput probe; ``threads`` sets torch's intra-op
    threads (None leaves torch's default). Calling it again on the same ``out_dir`` resumes (on
    any device). ``device`` is where training and the evaluation run ("cpu", "cuda", ...);
    ``corpus_root`` is the stdlib folder to read (None: this interpreter's). Both are checked
    before anything is written.

    ``distill_minutes`` > 0 adds a second phase: the first gets ``minutes - distill_minutes``
    and the second the rest of ``minutes`` (at least ``distill_minutes``; more when the first
    finishes early, since its step count keeps 5% slack). The
    pretrained model (kept in ``out_dir/pretrained``) is finetuned with ``distill_recipe`` at a
    peak LR of ``distill_lr`` (checkpoints in ``out_dir/distill``), and that is the model saved
    in ``out_dir/model`` and reported. ``distill_steps=None`` sizes that phase from a probe.

    >>> report = train_reference("runs/reference", minutes=60, seed=0)
    """
    if not minutes > 0:
        raise ValueError(f"minutes: got {minutes!r}; allowed range is minutes > 0")
    if not 0 <= distill_minutes < minutes:
        raise ValueError(
            f"distill_minutes: got {distill_minutes!r}; allowed range is "
            f"0 <= distill_minutes < minutes ({minutes!r})"
        )
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    dev = resolve_device(device)
    corpus = reference_corpus(corpus_root)
    spec = spec or ReferenceModelSpec()
    check_focus(recipe.focus_exit, recipe.focus_share, spec.num_layers)  # before any write
    if distill_minutes > 0:
        check_focus(distill_recipe.focus_exit, distill_recipe.focus_share, spec.num_layers)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if threads is not None:
        torch.set_num_threads(threads)
    tokenizer = _tokenizer(spec, out_dir, corpus)
    setup = _set_up(
        "reference model", lambda tok: build_model(spec, tok, seed), tokenizer, corpus,
        out_dir=out_dir, minutes=minutes, batch_size=batch_size, seq_len=seq_len, lr=lr,
        seed=seed, dev=dev,
    )  # fmt: skip
    model, train_ids, base = setup.model, setup.train_ids, setup.base
    reserve_s, final_dir = setup.reserve_s, setup.final_dir
    common = dict(start=start, tokenizer=tokenizer, resume=resume, progress=progress,
                  save_dtype=save_dtype)  # fmt: skip
    first = _run_phase(
        model, train_ids, out_dir=out_dir, base=base, recipe=recipe, steps=steps,
        final_dir=out_dir / "pretrained" if distill_minutes > 0 else final_dir,
        fallback_dir=final_dir,
        # Up to one full rotation of the exits (each step enables a different set).
        probe_steps=min(4, recipe.rotation_for(spec.num_layers)), max_warmup=100, checkpoints=12,
        deadline_s=(minutes - distill_minutes) * 60.0 - reserve_s, name="layerskip", **common,
    )  # fmt: skip
    distill = None
    if distill_minutes > 0 and first.result.finished:
        second = _run_phase(
            model, train_ids, out_dir=out_dir / "distill", final_dir=final_dir,
            fallback_dir=final_dir, recipe=distill_recipe, steps=distill_steps,
            # Batches from another seed's stream: seed would replay the first phase's batches.
            base=dataclasses.replace(base, lr=distill_lr, seed=seed + 1),
            probe_steps=2, max_warmup=30, checkpoints=4, deadline_s=minutes * 60.0 - reserve_s,
            name="distill", **common,
        )  # fmt: skip
        distill = {
            "steps": second.result.step,
            "planned_steps": second.config.steps,
            "finished": second.result.finished,
            "train_minutes": second.result.elapsed_s / 60.0,
            "probe_s_per_step": second.probe_s,
            "trainer": dataclasses.asdict(second.config),
            "recipe": dataclasses.asdict(distill_recipe),
            "pretrained": str(out_dir / "pretrained"),
        }

    # Measure what was saved (float16 weights), computing in float32 on the training device.
    saved_model = AutoModelForCausalLM.from_pretrained(final_dir, dtype=torch.float32).to(dev)
    exits = evaluate_exits(
        saved_model,
        setup.held_ids,
        seq_len=seq_len,
        max_tokens=eval_tokens,
        byte_lengths=token_byte_lengths(tokenizer),
    )
    prompts = [p.input_ids for p in held_out_prompts(tokenizer, corpus, num_tokens=32, count=16)]
    loops = greedy_loop_stats(saved_model, prompts, new_tokens=64)
    model_entry = _report_model("LlamaForCausalLM", setup, save_dtype, spec, tokenizer)
    size = model_entry["weights_bytes"]
    report = {
        "exit_convention": "E = decoder layers run before the shared norm and LM head "
        "(HF assistant_early_exit=E); E = num_layers is the full model",
        "model": model_entry,
        "training": {
            **_report_training(first, recipe, dev),
            "train_tokens_in_corpus": len(train_ids),
            "total_minutes": (time.perf_counter() - start) / 60.0,
            "probe_s_per_step": first.probe_s,
            "python": platform.python_version(),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
        },
        "distill": distill,
        "corpus": {
            # reference_corpus(root) gives this corpus again where the digest matches
            "root": str(Path(corpus.root).resolve()),
            "files": len(corpus.train) + len(corpus.held_out),
            "train_files": len(corpus.train),
            "sha256": corpus_digest(corpus),
        },
        "held_out": {
            # stdlib_corpus() with this fraction gives the same split (held_out_prompts too)
            "held_out_fraction": HELD_OUT_FRACTION,
            "files": len(corpus.held_out),
            "tokens": exits.tokens,
            "bytes": exits.bytes,
            "loss_nats_per_token": exits.loss[exits.last],
            "bits_per_token": exits.bits_per_token,
            "bits_per_byte": exits.bits_per_byte,
        },
        "exits": {
            str(e): {
                "agreement_top1": exits.agreement[e],
                "accuracy_top1": exits.accuracy[e],
                "loss_nats_per_token": exits.loss[e],
            }
            for e in sorted(exits.loss)
        },
        "greedy_generation": loops,
    }
    if size > 25 * 2**20:
        log.warning("reference weights are %.1f MB, above the 25 MB target", size / 2**20)
    write_text_atomic(final_dir / REPORT_NAME, json.dumps(report, indent=2) + "\n")
    if not math.isfinite(exits.loss[exits.last]):
        raise RuntimeError(f"reference training diverged: held-out loss {exits.loss[exits.last]}")
    return report
