"""Large read-mostly tensors kept on disk, rows read back on demand.

The ``continuation`` workload's baseline holds the uncompressed run's log-probabilities at every
continuation position (``N * C * vocab`` float32: 0.6 GB for the default profile, 3.2 GB for a
262k-token vocabulary); every evaluation needs only one batch of contexts of it at a time. A
:class:`DiskTensor` keeps such a tensor in a temporary file that is unlinked as soon as it is
created (nothing is left behind, even after ``kill -9``), so it lives in the page cache, which
the system can reclaim, instead of the process's resident memory; reading a batch back costs
a copy from the page cache (~0.02 s per 100 MB here).
"""

from __future__ import annotations

import math
import os
import tempfile

import torch

from kvtune.core.errors import KvtuneError

__all__ = ["DiskTensor", "SpoolError"]


class SpoolError(KvtuneError):
    """A spooled tensor could not be written or read back in full (disk full, file gone)."""


class DiskTensor:
    """An ``(N, ...)`` tensor of a fixed dtype stored row after row in an unlinked temporary file.

    ``t[a:b]`` is a view of rows ``a:b`` (same file); :meth:`read` returns them as a tensor;
    :meth:`write` stores rows. Create one with :meth:`empty`.

    Attributes:
        shape: the full shape; dtype: the element type.
    """

    def __init__(self, fd: int, shape: tuple[int, ...], dtype: torch.dtype, offset: int = 0,
                 base: "DiskTensor | None" = None) -> None:
        self.fd, self.shape, self.dtype, self.offset = fd, tuple(shape), dtype, offset
        self.base = base  # a view keeps the tensor owning the file alive

    @classmethod
    def empty(cls, shape: tuple[int, ...], dtype: torch.dtype = torch.float32, folder: str | None = None) -> "DiskTensor":
        """A new tensor of ``shape`` in a temporary file of ``folder`` (None: the system's
        temporary folder, ``$TMPDIR``), its space reserved now.

        Raises:
            SpoolError: the file cannot be created or the space reserved (the message names
                the folder and the bytes).
        """
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        where = folder or tempfile.gettempdir()
        try:
            handle = tempfile.TemporaryFile(dir=where)  # unlinked at once: gone when closed or killed
            fd = os.dup(handle.fileno())
            handle.close()
            os.posix_fallocate(fd, 0, nbytes) if hasattr(os, "posix_fallocate") else os.ftruncate(fd, nbytes)
        except OSError as exc:
            raise SpoolError(f"cannot keep {nbytes / 1e9:.2f} GB of baseline in {where} ({exc}); free space there "
                             "or point $TMPDIR elsewhere") from None
        return cls(fd, shape, dtype)

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        """Bytes on disk of these rows."""
        return self.shape[0] * self.row_bytes

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows: slice) -> "DiskTensor":
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError("a DiskTensor is sliced by contiguous row ranges only")
        start, stop, _ = rows.indices(self.shape[0])
        stop = max(stop, start)
        return DiskTensor(self.fd, (stop - start, *self.shape[1:]), self.dtype, self.offset + start * self.row_bytes,
                          base=self.base or self)

    def write(self, start: int, rows: torch.Tensor) -> None:
        """Store ``rows`` (``(k, *shape[1:])``, this dtype, on the CPU) at rows ``start:start+k``.

        Raises:
            ValueError: a shape, dtype or row range that does not fit.
            SpoolError: the write failed.
        """
        if tuple(rows.shape[1:]) != self.shape[1:] or rows.dtype != self.dtype or not 0 <= start <= len(self) - len(rows):
            raise ValueError(f"rows {tuple(rows.shape)} {rows.dtype} at {start} do not fit {self.shape} {self.dtype}")
        data = memoryview(rows.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy())
        pos, done = self.offset + start * self.row_bytes, 0
        try:
            while done < len(data):
                done += os.pwrite(self.fd, data[done:], pos + done)
        except OSError as exc:
            raise SpoolError(f"writing {len(data)} bytes of baseline failed ({exc})") from None

    def read(self) -> torch.Tensor:
        """These rows as a new CPU tensor.

        Raises:
            SpoolError: the file holds fewer bytes than the rows (it was cut) or reading failed.
        """
        out = torch.empty(self.shape, dtype=self.dtype)
        view = memoryview(out.view(torch.uint8).reshape(-1).numpy())
        done = 0
        try:
            while done < len(view):
                n = os.preadv(self.fd, [view[done:]], self.offset + done)
                if n == 0:
                    raise SpoolError(f"the spooled baseline ends {len(view) - done} bytes early")
                done += n
        except OSError as exc:
            raise SpoolError(f"reading {len(view)} bytes of baseline failed ({exc})") from None
        return out

    def close(self) -> None:
        """Release the file of a tensor made by :meth:`empty` (its space goes back to the disk;
        its views then fail to read); a view's ``close`` does nothing."""
        if self.base is None and self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        try:
            self.close()
        except OSError:  # pragma: no cover - interpreter shutdown
            pass
