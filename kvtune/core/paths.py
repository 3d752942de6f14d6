"""kvtune's user cache folder, shared by the asset resolver and the compiled-kernel cache.

Kept in :mod:`kvtune.core` (stdlib only) so that the codecs, which cache their numba kernels
there, do not import the profiling side (:mod:`kvtune.evaluate`) to find it.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CACHE_ENV", "cache_root"]

CACHE_ENV = "KVTUNE_CACHE"
"""Environment variable that overrides the cache folder."""


def cache_root() -> Path:
    """The asset cache folder: ``$KVTUNE_CACHE`` or the platform user cache dir."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("kvtune"))
