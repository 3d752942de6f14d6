"""Atomic file writes: write a temp file in the target's directory, then ``os.replace``.

A reader never sees a half-written table or report: either the old file or the new one.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_path", "atomic_write_bytes", "atomic_write_text", "atomic_write_parquet"]


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on clean exit fsync it and move it over.

    On an exception the temporary file is removed and ``path`` is left untouched. The parent
    directory is created if missing. The final file gets the mode of the file it replaces,
    or 0o644.

    Args:
        path: destination file.

    Yields:
        Path of the temporary file to write (already exists, empty).
    """
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        try:
            mode = dest.stat().st_mode & 0o777
        except FileNotFoundError:
            mode = 0o644
        os.chmod(tmp, mode)
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    with contextlib.suppress(OSError):  # best effort: persist the rename itself
        dir_fd = os.open(dest.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def atomic_write_text(path: str | os.PathLike[str], text: str, *, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_path`); return the Path."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding=encoding)
    return Path(path)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_path`); return the Path."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def atomic_write_parquet(df, path: str | os.PathLike[str]) -> Path:
    """Write a pandas DataFrame to Parquet atomically (no index); return the Path."""
    with atomic_path(path) as tmp:
        df.to_parquet(tmp, index=False)
    return Path(path)
