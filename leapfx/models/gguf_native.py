"""GGUF files loaded as they are: weights kept as the file's blocks, memory-mapped.

``load_native(path)`` builds the HF model on the meta device, then puts in each projection a
``BlockLinear`` and in the embedding a ``BlockEmbedding`` over the file's own bytes (a
read-only memory map: nothing is dequantized, and the resident weights grow to about the
file's size as they are read), and the norms as float tensors. A tied head shares the
embedding's blocks. Llama's q and k rows are reordered as transformers' GGUF loader does
(llama.cpp stores them permuted for its rotary): a copy of those rows only.

Formats kept as blocks: F32, F16, BF16, Q4_0, Q4_1, Q8_0 (``leapfx.kernels.cpu_blocks``). Any
other tensor type (the K-quants Q4_K, Q5_K, Q6_K ...) is dequantized with ``gguf.quants`` at
load, with a warning naming the type: the same floats, at float32's memory.

The tensor table is read by :func:`read_tensors` (the header only: gguf's ``GGUFReader`` parses
every metadata array, the tokenizer's ~100k strings included, in seconds). The config and
tokenizer come from transformers' GGUF code once and are kept in the leapfx cache beside the
float checkpoints (``<file stem>-<size>-<sha256[:16]>-native/``: config.json, tokenizer files,
the key file written last), so a later load reads the file's header and small JSON files only.
"""

from __future__ import annotations

import json
import logging
import mmap
import shutil
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import transformers
from torch import nn

from ..kernels.cpu_blocks import FORMATS, WEIGHTS_PER_BLOCK, Blocks
from ..modules.blocks import BlockEmbedding, BlockLinear
from .gguf import KEY_FILE, _installed, cache_root, file_key, publish_folder

log = logging.getLogger(__name__)

# ggml type id -> (weights per block, bytes per block) for every type a tensor may have
# (gguf.constants.GGML_QUANT_SIZES holds the same; read from there when gguf is installed).
GGUF_MAGIC = b"GGUF"
# GGUF metadata value types: sizes of the fixed-size ones (gguf.GGUFValueType)
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
# Architectures whose GGUF q/k rows llama.cpp permuted (transformers' LlamaTensorProcessor).
PERMUTED_QK = frozenset({"llama", "mistral"})


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # [rows, columns] (GGUF lists dims innermost first; reversed here)
    type_id: int
    offset: int  # from the start of the file


def read_tensors(path: str | Path) -> tuple[dict[str, TensorInfo], str, mmap.mmap]:
    """The tensor table of GGUF file ``path``, its ``general.architecture`` and a read-only
    memory map of the file (the tensors' bytes are views of it)."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    buf = memoryview(mm)
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise ValueError(f"--model: {str(path)!r} is not a GGUF file (no GGUF magic)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    pos = 24
    arch, alignment = "", 32

    def string(p: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, p)
        return bytes(buf[p + 8 : p + 8 + n]).decode("utf-8", "replace"), p + 8 + n

    def skip(kind: int, p: int) -> int:
        if kind in _SCALAR:
            return p + _SCALAR[kind]
        if kind == _STRING:
            (n,) = struct.unpack_from("<Q", buf, p)
            return p + 8 + n
        if kind == _ARRAY:
            item, count = struct.unpack_from("<IQ", buf, p)
            p += 12
            if item in _SCALAR:
                return p + _SCALAR[item] * count
            for _ in range(count):
                p = skip(item, p)
            return p
        raise ValueError(f"--model: {str(path)!r}: unknown GGUF value type {kind}")

    for _ in range(n_kv):
        key, pos = string(pos)
        (kind,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if key == "general.architecture" and kind == _STRING:
            arch, _ = string(pos)
        elif key == "general.alignment" and kind == 4:
            (alignment,) = struct.unpack_from("<I", buf, pos)
        pos = skip(kind, pos)
    infos = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (dims,) = struct.unpack_from("<I", buf, pos)
        shape = struct.unpack_from(f"<{dims}Q", buf, pos + 4)
        type_id, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * dims)
        pos += 4 + 8 * dims + 12
        infos.append((name, tuple(reversed(shape)), type_id, offset))
    data_start = -(-pos // alignment) * alignment
    buf.release()  # the map may be closed or handed on; the tensors view it through numpy
    table = {n: TensorInfo(n, s, t, data_start + o) for n, s, t, o in infos}
    log.debug("leapfx: GGUF v%d %s, %d tensors", version, arch, len(table))
    return table, arch, mm


def _type_sizes() -> dict[int, tuple[int, int]]:
    from gguf.constants import GGML_QUANT_SIZES

    return {int(t): size for t, size in GGML_QUANT_SIZES.items()}


def tensor_bytes(mm: mmap.mmap, info: TensorInfo) -> np.ndarray:
    """The bytes of tensor ``info`` as a read-only uint8 array [rows, row bytes] (a view)."""
    per_block, block_bytes = _type_sizes()[info.type_id]
    cols = info.shape[-1]
    rows = int(np.prod(info.shape[:-1], dtype=np.int64)) if len(info.shape) > 1 else 1
    row_bytes = cols // per_block * block_bytes
    return np.frombuffer(mm, np.uint8, rows * row_bytes, info.offset).reshape(rows, row_bytes)


def _torch_view(a: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # read-only memory: leapfx never writes to it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def _type_name(type_id: int) -> str:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(type_id).name


def _float_of(mm: mmap.mmap, info: TensorInfo) -> torch.Tensor:
    """Tensor ``info`` dequantized to float32 by ``gguf.quants`` (any type), [rows, cols]."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = tensor_bytes(mm, info)
    out = dequantize(raw, GGMLQuantizationType(info.type_id))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(info.shape)


def _blocks_of(mm: mmap.mmap, info: TensorInfo, rows: np.ndarray | None = None) -> Blocks | None:
    """Tensor ``info`` (2-D) as Blocks over the file's bytes (``rows``: a row order, copied),
    or None where its type or shape has no kernel."""
    name = _type_name(info.type_id)
    if name not in FORMATS or len(info.shape) != 2 or info.shape[1] % WEIGHTS_PER_BLOCK:
        return None
    raw = tensor_bytes(mm, info)
    if rows is not None:
        copy = np.ascontiguousarray(raw[rows])
        _unmap(mm, info.offset, raw.nbytes)  # the file's copy of these rows is not read again
        raw = copy
    return Blocks(_torch_view(raw), name, info.shape[0], info.shape[1])


def _unmap(mm: mmap.mmap, offset: int, length: int) -> None:
    """Drop this process's mapping of the file's bytes ``offset .. offset + length`` (whole
    pages inside it): they stay in the page cache, and a later read maps them again, so only
    resident memory changes. Where the platform has no ``madvise``, nothing."""
    page = mmap.PAGESIZE
    start = -(-offset // page) * page
    end = (offset + length) // page * page
    if end > start and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
        mm.madvise(mmap.MADV_DONTNEED, start, end - start)


def _qk_rows(n: int, heads: int) -> np.ndarray:
    """The row order transformers' GGUF loader gives llama's q/k weight (its
    ``_reverse_permute_weights``), as indices into the file's rows."""
    dim = n // heads // 2
    return np.arange(n).reshape(heads, dim, 2).swapaxes(2, 1).reshape(n)


def _name_map(config, arch: str):
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    ids = [k for k, v in MODEL_ARCH_NAMES.items() if v == arch]
    if not ids:
        raise ValueError(f"--weights: native: gguf does not know the architecture {arch!r}")
    return get_tensor_name_map(ids[0], config.num_hidden_layers)


def native_supported(arch: str) -> bool:
    """Whether ``load_native`` handles a GGUF file of architecture ``arch``: the
    architectures whose GGUF tensors map one to one onto transformers' (no merged experts)."""
    return arch in {"llama", "mistral", "qwen2", "qwen3"}


def load_native(path: Path, folder: Path):
    """The HF model of GGUF file ``path`` over its own blocks (see the module docstring), with
    its config from ``folder`` (see :func:`native_folder`). float32 norms, on the CPU."""
    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    table, arch, mm = read_tensors(path)
    names = _name_map(config, arch)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    permute = arch in PERMUTED_QK
    used: set[str] = set()

    def info_for(hf_name: str) -> TensorInfo | None:
        gguf_name = names.get_name(hf_name)
        info = table.get(f"{gguf_name}.weight") if gguf_name else None
        if info is not None:
            used.add(info.name)
        return info

    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear | nn.Embedding):
            continue
        info = info_for(name)
        if info is None:
            if name == "lm_head" and config.tie_word_embeddings:
                continue  # below: the embedding's blocks
            raise ValueError(f"--weights: native: {path.name} has no tensor for {name}")
        rows = None
        if permute and name.endswith(("self_attn.q_proj", "self_attn.k_proj")):
            heads = config.num_attention_heads
            if name.endswith("k_proj"):
                heads = config.num_key_value_heads
            rows = _qk_rows(info.shape[0], heads)
        blocks = _blocks_of(mm, info, rows)
        if blocks is None:
            log.warning(
                "leapfx: %s (%s) is a %s tensor, which leapfx's kernels do not read: "
                "dequantized to float32 at load", info.name, name, _type_name(info.type_id),
            )  # fmt: skip
            weight = _float_of(mm, info)
            if rows is not None:
                weight = weight[torch.from_numpy(rows)].contiguous()
            new = _float_module(module, weight)
        elif isinstance(module, nn.Embedding):
            new = BlockEmbedding(blocks)
        else:
            new = BlockLinear(blocks)
        model.set_submodule(name, new)
    embed = model.get_input_embeddings()
    if config.tie_word_embeddings and not info_for("lm_head"):
        head = (
            BlockLinear(embed.weights) if isinstance(embed, BlockEmbedding)
            else _float_module(nn.Linear(1, 1, bias=False), embed.weight)
        )  # fmt: skip
        model.set_submodule("lm_head", head)
    for name, param in list(model.named_parameters()):
        if not param.is_meta:
            continue
        module_name, _, attr = name.rpartition(".")
        info = info_for(module_name)
        if info is None or attr != "weight":
            raise ValueError(f"--weights: native: {path.name} has no tensor for {name}")
        value = _float_of(mm, info).reshape(param.shape)
        setattr(model.get_submodule(module_name), attr, nn.Parameter(value, requires_grad=False))
    _rebuild_meta_buffers(model)
    unused = sorted(set(table) - used)
    if unused:
        log.info("leapfx: %s: tensors not used: %s", path.name, ", ".join(unused[:8]))
    model.config.name_or_path = path.name
    return model.eval()


def _float_module(module: nn.Module, weight: torch.Tensor) -> nn.Module:
    if isinstance(module, nn.Embedding):
        return nn.Embedding.from_pretrained(weight, freeze=True)
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    out.weight = nn.Parameter(weight, requires_grad=False)
    return out


def _rebuild_meta_buffers(model: nn.Module) -> None:
    """The modules whose buffers are still on the meta device (the rotary embedding's
    ``inv_freq``: computed, not loaded), built again on the CPU."""
    for name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            if not type(module).__name__.endswith("RotaryEmbedding"):
                raise ValueError(f"--weights: native: cannot build {name}'s buffers")
            with torch.device("cpu"):
                model.set_submodule(name, type(module)(config=model.config))


def native_folder(path: Path, *, cache_dir: str | Path | None = None) -> Path:
    """The cached folder with GGUF file ``path``'s config and tokenizer (no weights), built
    with transformers' GGUF code on first use (tens of seconds: it parses every metadata
    array), under a temporary name, then renamed into place."""
    path = Path(path).expanduser().resolve()
    key = {"source": path.name, **file_key(path), "weights": "native"}
    root = cache_root(cache_dir) / "gguf"
    folder = root / f"{path.stem}-{key['size']}-{key['sha256'][:16]}-native"
    if _done(folder, key):
        return folder
    missing = [m for m in ("gguf",) if not _installed(m)]
    if missing:
        raise ValueError(
            f"--model: loading {path.name!r} (a GGUF file) needs the package gguf; install "
            "with: pip install gguf"
        )
    if folder.exists():
        shutil.rmtree(folder)
    root.mkdir(parents=True, exist_ok=True)
    log.info("leapfx: reading %s's config and tokenizer once; cached in %s", path.name, folder)

    def fill(tmp: Path) -> None:
        kw = {"gguf_file": path.name, "local_files_only": True}
        try:
            config = transformers.AutoConfig.from_pretrained(path.parent, **kw)
            tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, **kw)
        except (OSError, KeyError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"--model: cannot load the GGUF file {str(path)!r}: {first}") from None
        config.name_or_path = path.name
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return publish_folder(folder, key, fill, _done)


def _done(folder: Path, key: dict) -> bool:
    try:
        return (
            json.loads((folder / KEY_FILE).read_text()) == key
            and (folder / "config.json").is_file()
        )
    except (OSError, ValueError):
        return False
