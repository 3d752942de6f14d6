"""Golden stream hashes: the bytes of existing policies must not change.

Every preset of ``kvtune/search/spaces/presets.yaml`` (``duo-like`` with fixed head scores) plus a few
policies covering the stateful ``affine`` transform, ``hadamard``, ``delta`` anchors and the
``fp8`` scaled quantizer is encoded on a fixed seeded random KV cache (two layers, float32,
bfloat16 and float16 inputs; ``kvquant-3c`` with fixed codebooks), on both the fast path and the reference path; the SHA-256 of
every stream is pinned below. The values were computed before the stream-hardening change
(issue 13, step 8), so they check that the change kept streams byte-identical.

Range-coded presets (codec ``range``: ``cachegen``) are EXCLUDED: the range coder's in-stream
tables and CacheGen's anchor coding change independently of this module. ``cachegen`` is
included with its codec swapped for ``bitpack`` (same transforms and quantizers). Presets that
need a PCA basis (``kvtc-*``) are EXCLUDED: their streams name a basis fitted on a run's
calibration KV (their round trips and typed errors are tested in ``tests/test_pca.py``).
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from kvtune.codecs import PolicyConfig, encode_kv
from kvtune.codecs.presets import read_presets

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHAPE = (1, 3, 160, 64)  # 3 KV heads; 160 tokens: a 128-token recent window plus a body
SCORES = [[0.1, 0.9, 0.3], [0.8, 0.2, 0.4], [0.5, 0.6, 0.7]]  # layers 0..2 (offset 1: layers 1, 2)
LAYER_OFFSET = 1
CODEBOOKS = (  # kvquant-3c's calibrated levels, layers 0..2 (float16 values)
    (-1.0, -0.625, -0.3125, -0.0625, 0.1875, 0.4375, 0.6875, 1.0),
    (-1.0, -0.5, -0.25, -0.125, 0.0, 0.25, 0.5, 1.0),
    (-1.0, -0.75, -0.375, -0.125, 0.125, 0.375, 0.75, 1.0),
)

EXTRA_POLICIES = {
    "affine-hadamard": {
        "transforms": [{"name": "affine"}, {"name": "hadamard", "seed": 3}],
        "key": {"name": "uniform", "bits": 3, "granularity": "per_token", "group_size": 32},
        "value": {"name": "uniform", "bits": 2, "granularity": "per_token", "group_size": 0},
    },
    "affine-absmax-shift-delta": {
        "transforms": [{"name": "affine", "statistic": "absmax", "shift": True},
                       {"name": "delta", "group_size": 8, "anchor_bits": 16}],
        "key": {"name": "uniform", "bits": 4, "granularity": "per_channel", "group_size": 32, "sink_tokens": 2},
        "value": {"name": "fp8", "format": "e5m2", "scaled": True},
    },
}


def _is_range_coded(policy: dict) -> bool:
    codec = policy.get("codec", "bitpack")
    return (codec.get("name") if isinstance(codec, dict) else codec) == "range"


def pinned_presets() -> dict:
    """The presets whose streams are pinned: all but those that need a PCA basis."""
    return {n: p for n, p in read_presets().items() if not p.config().needs_pca_basis}


def golden_policies() -> dict[str, PolicyConfig]:
    """The pinned policies: non-range-coded presets, cachegen with bitpack, and the extras."""
    out = {}
    for name, preset in pinned_presets().items():
        policy = dict(preset.policy)
        if _is_range_coded(policy):
            policy["codec"] = "bitpack"
            name = f"{name}+bitpack"
        cfg = PolicyConfig.from_dict(policy)
        cfg = cfg.with_head_scores(SCORES) if cfg.needs_head_scores else cfg
        out[name] = cfg.with_codebooks({"key": CODEBOOKS, "value": CODEBOOKS[::-1]}) if cfg.needs_codebooks else cfg
    for name, policy in EXTRA_POLICIES.items():
        out[name] = PolicyConfig.from_dict(policy)
    return out


def golden_kv(dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two layers of seeded Gaussian KV (keys with an outlier channel), rounded to ``dtype``."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(2):
        k = torch.randn(SHAPE, generator=g)
        k[..., 5] *= 12.0
        v = torch.randn(SHAPE, generator=g) * 0.5
        out.append((k.to(dtype), v.to(dtype)))
    return out


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

GOLDEN: dict[tuple[str, str], str] = {  # (policy, input dtype): sha256 of the stream
    ("kivi-2", "float32"): "4fbfa56c67b1464edc00544c13f7513b69267026def14c3070ab42b3bdfab682",
    ("kivi-2", "bfloat16"): "0a59d6279fbee842c26d15eda661b5aaf263fc8ee192211fcef99ef0388fdfb9",
    ("kivi-2", "float16"): "250abb4edc7b1adb10052534367b5eb8ac47ca1855daea193dd951a13f2fc742",
    ("kivi-4", "float32"): "e68a2e0601b6a01467141bfbcbeab62491298b98d456f2248548c0de0941b931",
    ("kivi-4", "bfloat16"): "f7343822d8f1fde6e966bacf2d9048970b70321324a3024db10d40b8a623ce4c",
    ("kivi-4", "float16"): "415921f464a983614922f478598aa13f0f3df08f0b8a50ed5d7a74296d0b8224",
    ("cachegen+bitpack", "float32"): "9044efb579404c533ff3b86cc9d99757c29c08759a9ed6026879bade2d12c63d",
    ("cachegen+bitpack", "bfloat16"): "5428914b75ab2e93ab2cc95cf77473a508326676076551f7b24fb955f2acee6a",
    ("cachegen+bitpack", "float16"): "4d624ec3d8c0794d2b64bc38c591f6bec323ce6e5674aae4791dc82d77e6831e",
    ("quarot-4", "float32"): "c354f5fd4af6b4ad8a6c8d67ad22c1e2eb735928a7692d72061fab39037cfc85",
    ("quarot-4", "bfloat16"): "561f914ed7dc43fa457876b7154db73bc40744517ee6d8f55b95ab71960b4053",
    ("quarot-4", "float16"): "c3a0c922fb602fd7b7068f0e6a199e0d6d35facfdd913f3cfc148d6546240ecd",
    ("duo-like", "float32"): "d4dbba68a64cd6982f492ae4c70626ec340e1cae615d0ad05953ce0bb7adc250",
    ("duo-like", "bfloat16"): "732b517d16d85e100552c3add882c02c825d5a054a44d709ecb282f2555f2300",
    ("duo-like", "float16"): "f3a77279f0838c8a495a247daf06546ade9356d9656e28edaeefa0aa58bc03a9",
    # kvquant-3: pinned when the codebook quantizer was added (issue 16)
    ("kvquant-3", "float32"): "1c525cb0b8f2b9d525e2e2d64346e1dee70d8641fb680584958425d2c4f9a6ed",
    ("kvquant-3", "bfloat16"): "c32a223eb5259560cfd5a15d996575c09fce07c3a853cc9a4a589943a57e5cb8",
    ("kvquant-3", "float16"): "b35e783c7d4bed7de78218d0c1ed73f6f4cb998eae11c7fbf963190b560e2417",
    # kvquant-3c (codebooks calibrated offline, issue 16, session 37): pinned when it was written
    ("kvquant-3c", "float32"): "77dea537a77dc298a109d3ca5386d80aea15f4213d3f64306dc781a95343a92b",
    ("kvquant-3c", "bfloat16"): "2b93cfb12a6192f988b850c8f1caef999ecc77e783ea1078dc9e0d293b1b10d3",
    ("kvquant-3c", "float16"): "3820685615c0e4642f6779d715a947ebbbad54b65c5133018f860d79392f5f4a",
    ("fp8", "float32"): "fc7ebf4677cfaed85be01b2f11071d5d579dddbbc870a60d1e59f2285181cd33",
    ("fp8", "bfloat16"): "28f28b957c418885581a29f278299192c284c15061d0a8135ab6155eae40c8bf",
    ("fp8", "float16"): "d37d0641cb615e539f9a13be234563b17cd6b673ad2fb79c872291defb5d31f7",
    ("none", "float32"): "31d99addad6c3a547303fcc1546528c8aa00f1b1c4746d0f290c25e1701c2127",
    ("none", "bfloat16"): "598e6163f712506750939462cfed242b242767b77fe2e10550f28134d41ef4e3",
    ("none", "float16"): "5b599b97cf670208ed7fd2f52001848e32124cd87d7f363b31cfa2ed609ef0af",
    # added with the snapkv-like preset (token selection, issue 16): pinned when it was written
    ("snapkv-like", "float32"): "3f1ef3159c4c2db27e06ddc128d82f5d783843826b0298ca368e79cb1d4205cb",
    ("snapkv-like", "bfloat16"): "3fcd4974d3fb211a2609e3c25afd3c9584c79656f364bd35d276ff35833fb126",
    ("snapkv-like", "float16"): "68c3d8559f4f4383988ef29458593fc39bcdffae14cf9e1da9b508389a995bf9",
    ("affine-hadamard", "float32"): "bf102ab462b5f3735260d75c36e165280dfc59f95eb360ef082a450327567ac6",
    ("affine-hadamard", "bfloat16"): "1eadd1d0c09926060c2bd40ab1fa75c81b45c331444405734512806dbea0bfcc",
    ("affine-hadamard", "float16"): "4bc09c597ba552659c6b57694d851fdece90b20462839f58fb40379ead013029",
    ("affine-absmax-shift-delta", "float32"): "b7949beb2195de9479d28348ae3d517eb0ec86666998108eb0b19311acb589f7",
    ("affine-absmax-shift-delta", "bfloat16"): "b61a59a3279693ce19c19abab5210657eabe78557c67008d4ae6102d8212ddc0",
    ("affine-absmax-shift-delta", "float16"): "021bd871db357ea288a2ded4eaf1507aeb847bccbb1ac87162f0055abc9b9c29",
}


def stream_hash(name: str, dtype_name: str, impl: str) -> str:
    cfg = golden_policies()[name]
    stream = encode_kv(golden_kv(DTYPES[dtype_name]), cfg, layer_offset=LAYER_OFFSET, impl=impl)
    return hashlib.sha256(stream).hexdigest()


def test_golden_covers_every_non_range_preset():
    names = {n for n in golden_policies() if n not in EXTRA_POLICIES}
    assert names == {n + ("+bitpack" if _is_range_coded(p.policy) else "") for n, p in pinned_presets().items()}
    assert set(read_presets()) - set(pinned_presets()) == {"kvtc-2", "kvtc-3"}
    assert set(GOLDEN) == {(n, d) for n in golden_policies() for d in DTYPES}


@pytest.mark.parametrize("impl", ["fast", "reference"])
@pytest.mark.parametrize("key", sorted(GOLDEN), ids=lambda k: f"{k[0]}-{k[1]}")
def test_stream_bytes_are_unchanged(key, impl):
    assert stream_hash(*key, impl) == GOLDEN[key]
