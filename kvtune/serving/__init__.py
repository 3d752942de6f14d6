"""kvtune at serving time: a profiled policy table drives real KV transfers.

The runtime side of KVServe ("KVServe: Service-Aware KV Cache Compression for
Communication-Efficient Disaggregated LLM Serving", arXiv 2605.13734, Service-Aware Online
Controller). Importing this package loads only the table, controller and codec modules (torch,
numpy, pandas, numba kernels), never the profiling stack (transformers, BoTorch, Optuna,
``kvtune.search`` / ``run`` / ``evaluate`` / ``methods``).

* :mod:`kvtune.serving.artifacts` -- table, model geometry and calibration loaded at start-up.
* :mod:`kvtune.serving.auth` -- HMAC-SHA256 sealing of streams that cross machines.
* :mod:`kvtune.serving.runtime` -- :class:`ServingPolicy`: per-transfer selection through
  :class:`kvtune.tables.Controller`, encode / decode, feedback, per-chunk re-selection.
* :mod:`kvtune.serving.lmcache` -- the ``"kvtune"`` serde for LMCache ("LMCache: An Efficient
  KV Cache Layer for Enterprise-Scale LLM Inference", arXiv 2510.09665); needs the optional
  ``lmcache`` package and is not imported here. :mod:`kvtune.serving.lmcache_plugin` runs
  LMCache's CLI with it registered.
"""

from kvtune.serving.artifacts import CalibrationError, ModelGeometry, ModelMismatchError
from kvtune.serving.auth import AuthenticationError, KeyConfigError, load_key, seal, unseal
from kvtune.serving.runtime import ChunkAssemblyError, ChunkedEncoding, EncodedKV, ServingPolicy

__all__ = [
    "AuthenticationError",
    "CalibrationError",
    "ChunkAssemblyError",
    "ChunkedEncoding",
    "EncodedKV",
    "KeyConfigError",
    "ModelGeometry",
    "ModelMismatchError",
    "ServingPolicy",
    "load_key",
    "seal",
    "unseal",
]
