"""Writing a file or a directory whole or not at all: the one way leapfx writes what it keeps.

A writer fills a temporary name beside the target (same filesystem, so a rename moves it),
then the rename puts it in place: a reader sees the old file or the whole new one, never a
part, and a failure leaves the target as it was and no temporary behind. A directory that
replaces an older one swaps it out first and puts it back if the swap fails. Used by the
saved parts, the trainers' checkpoints and reports, the ONNX export, the GGUF cache, the
offload store and the reuse probe. Standard library only: every floor may import it (it sits
beside ``options`` on the lowest floor of ``tools/check_layers.py``).

    >>> write_atomic("report.json", lambda tmp: tmp.write_text("{}\\n"))
    >>> write_atomic("parts/", lambda tmp: (tmp / "config.json").write_text("{}"), folder=True)
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def temp_beside(final: str | os.PathLike, *, folder: bool = False, suffix: str = "") -> Path:
    """A new empty file (``folder``: directory) named ``.<name>.tmp-...`` beside ``final``."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{final.name}.tmp-"
    if folder:
        tmp = Path(tempfile.mkdtemp(prefix=prefix, suffix=suffix, dir=final.parent))
    else:
        fd, name = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=final.parent)
        os.close(fd)
        tmp = Path(name)
    # The modes a plain open() or mkdir() gives: mkstemp's 0600 and mkdtemp's 0700 would
    # survive the rename and hide a shipped file, a cache entry or an export from others.
    os.chmod(tmp, (0o777 if folder else 0o666) & ~_umask())
    return tmp


def move_into_place(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """Rename the finished ``tmp`` to ``final``; an older directory there is swapped out (and
    put back if the rename fails), then deleted."""
    tmp, final = Path(tmp), Path(final)
    if not (tmp.is_dir() and final.exists()):
        os.replace(tmp, final)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
    os.rename(final, old / final.name)
    try:
        os.rename(tmp, final)
    except BaseException:
        os.rename(old / final.name, final)  # put the previous one back
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


def remove(tmp: str | os.PathLike) -> None:
    """Drop a temporary file or directory, whichever it is, if it is still there."""
    tmp = Path(tmp)
    if tmp.is_dir():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.unlink(missing_ok=True)


def write_atomic(
    path: str | os.PathLike, write: Callable[[Path], object], *, folder: bool = False
) -> Path:
    """``write(tmp)`` fills a temporary file (``folder``: directory) beside ``path``, which then
    takes its place (replacing an older one); on any failure nothing is left behind and
    ``path`` is as it was. Returns ``path``."""
    final = Path(path)
    tmp = temp_beside(final, folder=folder)
    try:
        write(tmp)
        move_into_place(tmp, final)
    except BaseException:
        remove(tmp)
        raise
    return final


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """``path`` holds ``text`` (UTF-8), written whole or not at all."""
    return write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
