"""A test-side memo of ``torch.onnx.export`` for stage modules that are identical in every input.

Exporting one stage of a tiny model costs 4-20 s on a 2-core machine (torch.export, its
decompositions, the translation), and many recipes share stages: autoregressive, lookup and
auto export the same ``full`` stage, layerskip's three settings the same three stages. The memo
replaces ``leapfx.export.onnx_files.export_program`` (the exporter call) and ``save_program``
(its file writer): a stage whose key was seen before is copied from the files the first export
wrote, everything else of the export (signatures, leapfx's graph rewrites, the draft chain,
shared weights, the checker, the manifest) runs as it does without the memo.

The key is a SHA-256 over everything that decides what the exporter writes: the module tree
(each submodule's class, its plain attributes and model config, each ``GraphModule``'s code),
every parameter, buffer and tensor constant (names, tie structure, dtype, shape, bytes), the
example arguments (values included), the dynamic shapes, input and output names, opset and the
file name (the external data file is named after it). Anything not seen exports for real, and
an export that fails is never stored: a refusal test sees the exporter's own error.

Shared between pytest-xdist workers through a folder of the run (``shared_root``) guarded by a
file lock per key, so the same stage is exported once per run whichever worker asks first.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from torch import fx

from leapfx.export import onnx_files


def shared_root(tmp_path_factory) -> Path:
    """A folder of this run shared by its xdist workers (the workers' base temp folders sit in
    one per-run folder); without xdist the run's own base temp folder (its parent is shared
    by every run, so a memo there would outlive a code change)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return root / "onnx-stage-memo"


def _plain(value: Any, depth: int = 0) -> Any:
    """A JSON-able stand-in for an attribute that can change what a module computes."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (torch.dtype, torch.device, torch.Size)):
        return repr(value)
    if depth < 4 and isinstance(value, (list, tuple)):
        return [_plain(v, depth + 1) for v in value]
    if depth < 4 and isinstance(value, dict):
        return {str(k): _plain(v, depth + 1) for k, v in sorted(value.items(), key=repr)}
    if hasattr(value, "to_json_string"):  # a transformers config
        return value.to_json_string(use_diff=False)
    if isinstance(value, enum.Enum) or callable(value):
        return f"{type(value).__qualname__}:{getattr(value, '__qualname__', value)!r}"
    if depth < 4 and hasattr(value, "__dict__"):  # a dataclass or plain object (a layout)
        public = {k: v for k, v in vars(value).items() if not k.startswith("_")}
        return [type(value).__qualname__, _plain(public, depth + 1)]
    return type(value).__qualname__


def _tensor_digest(h, t: torch.Tensor) -> None:
    t = t.detach()
    h.update(f"{t.dtype}{tuple(t.shape)}{t.device}".encode())
    if t.numel():
        flat = t.contiguous().reshape(-1).cpu()
        h.update(flat.view(torch.uint8).numpy().tobytes())


def stage_key(module: torch.nn.Module, args: tuple, file_name: str, **kwargs: Any) -> str:
    h = hashlib.sha256()
    first: dict[int, str] = {}  # tensor id -> its first name: ties are part of the graph
    for name, mod in module.named_modules(remove_duplicate=False):
        h.update(f"\0module {name} {type(mod).__module__}.{type(mod).__qualname__}".encode())
        if isinstance(mod, fx.GraphModule):
            h.update(mod.code.encode())
        attrs = {}
        for key, value in sorted(vars(mod).items()):
            if isinstance(value, torch.Tensor):
                h.update(f"\0const {name}.{key}".encode())
                _tensor_digest(h, value)
            elif not key.startswith("_"):
                attrs[key] = _plain(value)
        h.update(json.dumps(attrs, sort_keys=True, default=repr).encode())
    tensors = [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]
    for name, t in tensors:
        owner = first.setdefault(id(t), name)
        h.update(f"\0tensor {name} = {owner}".encode())
        if owner == name:
            _tensor_digest(h, t)
    for i, a in enumerate(args):
        h.update(f"\0arg {i}".encode())
        _tensor_digest(h, a) if isinstance(a, torch.Tensor) else h.update(repr(a).encode())
    h.update(f"\0file {file_name}".encode())
    h.update(repr(sorted(kwargs.items(), key=lambda kv: kv[0])).encode())
    return h.hexdigest()[:32]


class _Pending:
    """What ``export_program`` hands ``save_program`` under the memo: the key, and the
    exporter's program (None where the key's files are already stored)."""

    def __init__(self, key_of_name, program) -> None:
        self.key_of_name, self.program = key_of_name, program


class StageMemo:
    """Counts ``hits`` (stages copied) and ``misses`` (stages exported) of this process."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.hits = 0
        self.misses = 0

    def _files(self, key: str) -> Path:
        return self.root / key

    @contextlib.contextmanager
    def installed(self, monkeypatch=None):
        """The memo in place of the exporter call while the block runs (``monkeypatch``: a
        pytest MonkeyPatch to use, else a private one undone on leaving)."""
        real_program, real_save = onnx_files.export_program, onnx_files.save_program
        memo = self

        def program(module, args, **kwargs):
            def key_of_name(file_name: str) -> str:
                return stage_key(module, args, file_name, **kwargs)

            # the key needs the file name, which only save_program is told: export unless some file
            # name's key is stored (a stage is saved under its own name, so try that later)
            return _Pending(key_of_name, (module, args, kwargs))

        def save(pending, path: Path) -> None:
            if not isinstance(pending, _Pending):
                return real_save(pending, path)
            path = Path(path)
            key = pending.key_of_name(path.name)
            memo.root.mkdir(parents=True, exist_ok=True)
            stored = memo._files(key)
            with FileLock(str(memo.root / f"{key}.lock")):
                if not stored.is_dir():
                    module, args, kwargs = pending.program
                    real_save(real_program(module, args, **kwargs), path)
                    partial = memo.root / f"{key}.partial"
                    shutil.rmtree(partial, ignore_errors=True)
                    partial.mkdir()
                    for f in path.parent.iterdir():
                        if f.name == path.name or f.name.startswith(path.name + "."):
                            shutil.copy2(f, partial / f.name)
                    partial.rename(stored)
                    memo.misses += 1
                    return
            for f in stored.iterdir():
                shutil.copy2(f, path.parent / f.name)
            memo.hits += 1

        with contextlib.ExitStack() as stack:
            mp = monkeypatch
            if mp is None:
                from pytest import MonkeyPatch

                mp = stack.enter_context(MonkeyPatch.context())
            mp.setattr(onnx_files, "export_program", program)
            mp.setattr(onnx_files, "save_program", save)
            yield self
