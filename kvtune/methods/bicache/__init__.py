"""BiCache: shared-prefix KV reuse for bidirectional models (BiCache,
"Enabling KV Caching of Shared Prefix for Diffusion Language Models", arXiv 2606.07571).

A shared prefix (an embedding instruction, a system prompt) is encoded alone once; later
requests ``prefix + suffix`` reuse its cached per-layer keys/values in layers ``1..d`` and
recompute everything above ``d``. The profile measures, per shared-prefix-ratio bucket, how
deep reuse stays faithful to full recompute, how much throughput it buys, and writes
``method = "bicache"`` rows into kvtune's policy tables keyed by the bucket.

Modules (one concept each):

* :mod:`~kvtune.methods.bicache.state` -- the cached prefix state and its (codec-compressed) payload;
* :mod:`~kvtune.methods.bicache.adapters` -- encoder adapters (BERT family) running reuse at depth d;
* :mod:`~kvtune.methods.bicache.workload` -- requests: a real instruction + NarrativeQA windows;
* :mod:`~kvtune.methods.bicache.stats` -- cosines, pooling, bootstrap, depth choice (pure functions);
* :mod:`~kvtune.methods.bicache.quality` -- quality vs full recompute per bucket x depth x codec;
* :mod:`~kvtune.methods.bicache.throughput` -- measured requests/s per depth;
* :mod:`~kvtune.methods.bicache.table` -- policy-table rows and their lower envelope per bucket;
* :mod:`~kvtune.methods.bicache.dlm` -- the diffusion-LM unmasking loop with deep-layer refresh;
* :mod:`~kvtune.methods.bicache.api` -- :func:`run_bicache_profile`, the run folder;
"""

from kvtune.methods.bicache.adapters import ADAPTERS, BertFamilyAdapter, EncoderAdapter, ReuseOutput, load_encoder, register_adapter
from kvtune.methods.bicache.api import CODEC_POLICIES, BiCacheMethod, BiCacheResult, BiCacheSettings, run_bicache_profile
from kvtune.methods.bicache.dlm import DenoiseResult, unmask_loop
from kvtune.methods.bicache.state import PrefixState, pack_prefix_state, prefix_state_bf16_bytes, unpack_prefix_state
from kvtune.methods.bicache.stats import CRITERIA, choose_depth
from kvtune.methods.bicache.table import compile_bicache_table
from kvtune.run.method import register_method

METHOD = register_method(BiCacheMethod())

__all__ = [
    "METHOD",
    "BiCacheMethod",
    "ADAPTERS",
    "CODEC_POLICIES",
    "CRITERIA",
    "BertFamilyAdapter",
    "BiCacheResult",
    "BiCacheSettings",
    "DenoiseResult",
    "EncoderAdapter",
    "PrefixState",
    "ReuseOutput",
    "choose_depth",
    "compile_bicache_table",
    "load_encoder",
    "pack_prefix_state",
    "prefix_state_bf16_bytes",
    "register_adapter",
    "run_bicache_profile",
    "unmask_loop",
    "unpack_prefix_state",
]
