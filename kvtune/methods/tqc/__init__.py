"""``--method tqc``: Transform -> Quantize -> Codec KV compression search (KVServe, "KVServe:
Service-Aware KV Cache Compression for Communication-Efficient Disaggregated LLM Serving",
arXiv 2605.13734).

- :mod:`kvtune.methods.tqc.method`: :class:`TQCMethod` on the shared runner (context, stages, table);
- :mod:`kvtune.methods.tqc.profile`: ``run_profile`` (the Python API of ``kvtune profile``) and
  its pure helpers (settings checks, refinement order, fidelity split, trial checks).
"""

from kvtune.methods.tqc.method import TQCMethod
from kvtune.run.method import register_method

__all__ = ["METHOD", "TQCMethod"]

METHOD = register_method(TQCMethod())
