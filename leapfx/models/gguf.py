"""GGUF files as cached safetensors checkpoints.

transformers loads a ``.gguf`` file with ``from_pretrained(folder, gguf_file=name)`` and
dequantizes every tensor on the way (tens of seconds for a 135M model on a 2-core CPU). We do
that once per (file, dtype) and keep the result as an ordinary HF checkpoint folder:

    $LEAPFX_CACHE/gguf/<file stem>-<size>-<sha256[:16]>-<dtype>/
        config.json  generation_config.json  model.safetensors  tokenizer files
        leapfx_cache.json     written last: the key; a folder without it is incomplete

The folder is built under a temporary name beside its final one and renamed into place, so a
killed build never leaves a folder that looks complete; a folder whose key file is missing or
disagrees, or whose weights do not load, is rebuilt. The weights are the dequantized ones: a
model loaded this way is the quantized model's, not the original checkpoint's.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

import torch
import transformers
from safetensors import safe_open

from ..files import temp_beside

log = logging.getLogger(__name__)

KEY_FILE = "leapfx_cache.json"
CACHE_ENV = "LEAPFX_CACHE"


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir``, else ``$LEAPFX_CACHE``, else ``~/.cache/leapfx``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "leapfx"


def file_key(path: Path) -> dict:
    """What identifies a GGUF file: its size and the SHA-256 of its bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def gguf_checkpoint(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    *,
    cache_dir: str | Path | None = None,
    progress: bool = True,
) -> Path:
    """The cached checkpoint folder of GGUF file ``path`` dequantized to ``dtype``, built on
    first use (needs the packages ``gguf`` and ``accelerate``)."""
    path = Path(path).expanduser().resolve()
    key = {"source": path.name, **file_key(path), "dtype": _dtype_name(dtype)}
    root = cache_root(cache_dir) / "gguf"
    folder = root / f"{path.stem}-{key['size']}-{key['sha256'][:16]}-{key['dtype']}"
    if _complete(folder, key):
        return folder
    if folder.exists():
        log.warning("leapfx: rebuilding the incomplete GGUF cache folder %s", folder)
        shutil.rmtree(folder)
    root.mkdir(parents=True, exist_ok=True)
    log.info("leapfx: dequantizing %s to %s once; cached in %s", path.name, key["dtype"], folder)
    return publish_folder(folder, key, lambda tmp: _convert(path, dtype, tmp, progress=progress),
                          _complete)  # fmt: skip


def publish_folder(folder: Path, key: dict, fill, done) -> Path:
    """Build cache entry ``folder`` atomically: ``fill(tmp)`` writes it under a temporary name
    beside it, ``key`` goes into its ``KEY_FILE``, and a rename puts it in place; where another
    process renamed a finished entry there first (``done(folder, key)``), that one stays. A
    failure leaves nothing behind."""
    tmp = temp_beside(folder, folder=True)
    try:
        fill(tmp)
        (tmp / KEY_FILE).write_text(json.dumps(key, indent=2) + "\n")
        try:
            os.rename(tmp, folder)
        except OSError:  # another process finished the same folder first
            if not done(folder, key):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def _complete(folder: Path, key: dict) -> bool:
    """Whether ``folder`` is a finished cache entry for ``key`` whose weights load."""
    try:
        if json.loads((folder / KEY_FILE).read_text()) != key:
            return False

        with safe_open(str(folder / "model.safetensors"), "pt") as f:  # header + index only
            return len(list(f.keys())) > 0
    except (OSError, ValueError, RuntimeError):  # missing, truncated or corrupt
        return False
    except Exception as exc:  # safetensors raises its own error type for a bad header
        log.debug("leapfx: cache entry %s unreadable: %s", folder, exc)
        return False


def _convert(path: Path, dtype: torch.dtype, out: Path, *, progress: bool) -> None:
    """Dequantize ``path`` with transformers' GGUF loader and save it to ``out``."""
    missing = [m for m in ("gguf", "accelerate") if not _installed(m)]
    if missing:
        raise ValueError(
            f"--model: loading {path.name!r} (a GGUF file) needs the package(s) "
            f"{', '.join(missing)}; install with: pip install gguf accelerate"
        )
    if not progress:
        transformers.utils.logging.disable_progress_bar()
    try:
        kw = {"gguf_file": path.name, "local_files_only": True}
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, dtype=dtype, **kw)
        tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, **kw)
    except (OSError, KeyError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"--model: cannot load the GGUF file {str(path)!r}: {first}") from None
    # The weights are plain tensors now; the quantizer only stands in save_pretrained's way.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = path.name
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None
