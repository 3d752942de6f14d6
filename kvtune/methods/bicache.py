"""``--method bicache``: shared-prefix reuse depth for bidirectional encoders (BiCache,
"Enabling KV Caching of Shared Prefix for Diffusion Language Models", arXiv 2606.07571):
:class:`kvtune.bicache.api.BiCacheMethod` on the shared runner."""

from __future__ import annotations

from kvtune.bicache.api import BiCacheMethod

METHOD = BiCacheMethod()
