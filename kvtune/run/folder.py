"""A run folder (``<out>/<run>/``): its safe name, its lock, and the clean-up on opening it.

Every method (T/Q/C compression, SCD, BiCache) writes its results into one run folder. While
a process works on a folder it holds an exclusive ``flock`` on ``<run>/.kvtune.lock`` (the
file records the holder's pid), so two ``--resume`` of one folder, or a ``kvtune report``
during a run, cannot interleave their trials: the second gets :class:`RunLockedError`. The
kernel drops the lock when the holder dies, even on ``kill -9``. Opening a folder also removes
the temporary files of :mod:`kvtune.core.atomic` that a killed process left behind (they are never
in use: the lock is held).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from collections.abc import Iterator
from pathlib import Path

from kvtune.core.errors import RunFolderError, RunLockedError

__all__ = ["LOCK_NAME", "check_out_folder", "check_run_name", "open_run_folder", "remove_stale_temps"]

LOCK_NAME = ".kvtune.lock"
#: The temporary files :func:`kvtune.core.atomic.atomic_path` creates: ``.<name>.<8 random chars>.tmp``.
_TEMP = re.compile(r"^\..+\.[A-Za-z0-9_]{8}\.tmp$")
_UNSAFE = re.compile(r"[\x00-\x1f/\\]")

_held: dict[Path, int] = {}  # run folders locked by this process -> nesting depth


def check_run_name(name: str) -> str:
    """Return ``name`` if it is a single safe path component (a run folder name under ``--out``).

    Raises:
        RunFolderError: empty, ``.``/``..``, longer than 200 bytes in UTF-8 (file systems cap a
            name at 255 bytes, and the report's temporary file adds ~20 to the run name), not
            encodable, or holding a path separator or a control character (so ``--run ../../x``
            cannot escape ``--out``).
    """
    try:
        nbytes = len(name.encode("utf-8")) if isinstance(name, str) else 0
    except UnicodeEncodeError:
        nbytes = 0
    if not nbytes or name in (".", "..") or nbytes > 200 or _UNSAFE.search(name):
        raise RunFolderError(f"--run {name!r}: a run name must be a single folder name (no '/', '\\', '..' "
                             "or control characters, at most 200 bytes in UTF-8)")
    return name


def check_out_folder(path: str | os.PathLike[str], option: str = "--out") -> Path:
    """Return ``path`` as a Path if it is a folder or does not exist yet.

    Raises:
        RunFolderError: ``path`` (or one of its parents) is an existing file.
    """
    p = Path(path)
    for q in (p, *p.parents):
        if q.exists() and not q.is_dir():
            raise RunFolderError(f"{option} {path}: {q} is a file, not a folder")
    return p


def remove_stale_temps(run_dir: Path) -> list[Path]:
    """Delete the temporary files of interrupted atomic writes under ``run_dir``; return them.

    Call it only while holding the folder's lock (no live writer can own them then).
    """
    gone = []
    for p in sorted(Path(run_dir).rglob(".*.tmp")):
        if p.is_file() and _TEMP.match(p.name):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                gone.append(p)
    return gone


def _holder(lock_file: Path) -> str:
    try:
        pid = lock_file.read_text(encoding="utf-8").strip()
    except OSError:
        pid = ""
    return f"pid {pid}" if pid.isdigit() else "an unknown process"


@contextlib.contextmanager
def open_run_folder(run_dir: str | os.PathLike[str], *, create: bool = True) -> Iterator[Path]:
    """Hold ``run_dir``'s lock for the duration of the ``with`` block; yield the folder.

    The folder is created when missing (``create``); if it was created here and still holds
    nothing but the lock file on exit (the run failed before writing its first file), it is
    removed again. Re-entrant within one process. Stale temporary files are removed on entry.

    Raises:
        RunFolderError: ``run_dir`` is a file, or is missing and ``create`` is False.
        RunLockedError: another process holds the lock (the message names the folder and the
            holder's pid).
    """
    path = Path(run_dir)
    key = path.resolve()
    if key in _held:
        _held[key] += 1
        try:
            yield path
        finally:
            _held[key] -= 1
        return
    check_out_folder(path, "run folder")
    created = [q for q in (path, *path.parents) if not q.exists()]  # deepest first
    if created and not create:
        raise RunFolderError(f"{path}: no such run folder")
    path.mkdir(parents=True, exist_ok=True)
    lock_file = path / LOCK_NAME
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunLockedError(f"run folder {path} is in use by another kvtune process ({_holder(lock_file)}); "
                                 "wait for it to finish or stop it") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        remove_stale_temps(path)
        _held[key] = 1
        try:
            yield path
        finally:
            del _held[key]
            if created and [p.name for p in path.iterdir()] == [LOCK_NAME]:
                lock_file.unlink()
                for q in created:  # nothing was written: remove the folders made here
                    with contextlib.suppress(OSError):
                        q.rmdir()
    finally:
        os.close(fd)  # releases the flock
