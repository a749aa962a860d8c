"""What every parts directory on disk shares: written atomically, read with checks.

Trained parts (Kangaroo's adapter, an EAGLE head, SpecEE's predictors, M2R2's accelerators) are
directories of safetensors weights and a JSON file of metadata, nothing pickled. This module holds
the two things they do alike: ``write_dir_atomic`` fills a temporary directory beside the target
and renames it into place (a directory with the final name is always complete; one that existed
is replaced), and ``read_meta`` reads the JSON file with errors that name the user's option.

    >>> write_dir_atomic("parts/", lambda tmp: save_file(tensors, str(tmp / "w.safetensors")))
    >>> meta = read_meta("parts/", "adapter.json", option="adapter", fmt=1)
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_dir_atomic(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp_dir)``, then rename ``tmp_dir`` to ``path`` (replacing it)."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would survive the rename
    try:
        write(tmp)
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def read_meta(path: str | os.PathLike, config: str, *, option: str, fmt: int) -> dict[str, Any]:
    """The JSON object in ``path/config``, of format ``fmt``; ValueError naming ``option``."""
    file = Path(path) / config
    try:
        meta = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{option}: {file} is not valid JSON ({exc})") from exc
    found = meta.get("format") if isinstance(meta, dict) else None
    if found != fmt:
        raise ValueError(f"{option}: {file} has format {found!r}; this leapfx reads format {fmt}")
    return meta


def check_host(option: str, path, host: dict[str, Any], saved: dict[str, Any]) -> None:
    """Refuse parts trained for another model: every ``host`` field must equal the saved one."""
    diff = sorted(k for k in host if saved.get(k) != host[k])
    if diff:
        pairs = ", ".join(f"{k}={saved.get(k)!r} (model: {host[k]!r})" for k in diff)
        raise ValueError(f"{option}: {str(path)!r} was trained for another model: {pairs}")
