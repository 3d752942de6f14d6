"""The kvtune codec library: Transform -> Quantizer -> Codec policies and the KV wire format.

Components are registered by name (:data:`TRANSFORMS`, :data:`QUANTIZERS`, :data:`CODECS`);
a :class:`PolicyConfig` composes them, :func:`encode_kv` / :func:`decode_kv` turn a KV cache
(``list[(K, V)]``, each ``(batch, kv_heads, tokens, head_dim)``) into a self-describing,
checksummed stream and back. The pipeline is the modular compression-strategy space of KVServe
("KVServe: Service-Aware KV Cache Compression for Communication-Efficient
Disaggregated LLM Serving", arXiv 2605.13734).

Registered components:

* transforms: ``identity``, ``hadamard`` (QuaRot-style randomized Hadamard rotation)
* quantizers: ``uniform`` (KIVI-style grouped integer quantization), ``none`` (bfloat16),
  ``codebook`` (non-uniform NF / Lloyd-Max levels, :mod:`kvtune.codecs.codebook`)
* codecs: ``bitpack`` (dense bit packing)
"""

from kvtune.codecs.base import (
    CODECS,
    QUANTIZERS,
    TRANSFORMS,
    Codec,
    Component,
    MetaField,
    QuantizedTensor,
    Quantizer,
    Transform,
    param,
    register_codec,
    register_quantizer,
    register_transform,
)
from kvtune.codecs.bitpack import BitPack
from kvtune.codecs.codebook import CodebookQuantizer
from kvtune.codecs.policy import KVLayers, PolicyConfig, decode_kv, encode_kv, kept_positions, original_nbytes
from kvtune.codecs.quantizers import NoQuantizer, UniformQuantizer
from kvtune.codecs.stream import FORMAT_VERSION, MAGIC, StreamHeader, read_header
from kvtune.codecs.transforms import Hadamard, Identity

__all__ = [
    "KVLayers",
    "PolicyConfig",
    "encode_kv",
    "decode_kv",
    "kept_positions",
    "original_nbytes",
    "read_header",
    "StreamHeader",
    "MAGIC",
    "FORMAT_VERSION",
    "Component",
    "Transform",
    "Quantizer",
    "Codec",
    "QuantizedTensor",
    "MetaField",
    "TRANSFORMS",
    "QUANTIZERS",
    "CODECS",
    "register_transform",
    "register_quantizer",
    "register_codec",
    "param",
    "Identity",
    "Hadamard",
    "UniformQuantizer",
    "NoQuantizer",
    "CodebookQuantizer",
    "BitPack",
]

# codecs in their own modules register themselves on import
from kvtune.codecs import range_coder as _range_coder  # noqa: E402,F401
from kvtune.codecs import zstd_codec as _zstd_codec  # noqa: E402,F401
from kvtune.codecs import rans as _rans  # noqa: E402,F401
