"""Run LMCache's command line with the ``"kvtune"`` serde registered.

LMCache builds its L2 adapters, and looks their ``"serde"`` up in its serde factory, inside its
own process; a third-party serde is found only if its module was imported first. This adapter
imports :mod:`kvtune.serving.lmcache` (which registers the serde) and then hands the command
line to LMCache's ``lmcache`` CLI (``lmcache.cli.main.main``, LMCache 0.5.6), e.g.::

    python -m kvtune.serving.lmcache_plugin server \\
        --l2-adapter '{"type": "fs", "base_path": "/cache",
                       "serde": {"type": "kvtune", "table": "profiles/smollm2-default",
                                 "q_min": 0.97, "bandwidth_gbps": 1.0}}'

A process that embeds LMCache (e.g. a vLLM worker) can instead ``import
kvtune.serving.lmcache`` before LMCache creates its storage manager.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import kvtune.serving.lmcache as _registers_the_serde  # noqa: F401  (import side effect)

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> None:
    """Run ``lmcache <argv>`` (default ``sys.argv[1:]``) with the kvtune serde registered."""
    from lmcache.cli.main import main as lmcache_main

    lmcache_main(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
