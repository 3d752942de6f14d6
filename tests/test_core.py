"""kvtune.core: the one policy-id function and the strict-JSON helpers."""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest

from kvtune.core.ids import config_policy_id, policy_id
from kvtune.core.jsonio import canonical_json, dec_float, enc_float, jsonable, plain, strict_dumps


def test_policy_ids_of_every_method_are_the_one_function():
    from kvtune.methods.bicache.table import bicache_policy_id
    from kvtune.codecs import PolicyConfig

    cfg = PolicyConfig.kivi(4, 32)
    assert cfg.policy_id == policy_id(cfg.to_json())  # T/Q/C ids unchanged
    bc = {"method": "bicache", "reuse_depth": 2, "codec": "bf16", "prefix_ratio": [0.3, 0.6]}
    old = hashlib.sha256(json.dumps(bc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:12]
    assert bicache_policy_id(bc) == config_policy_id(bc) == old  # BiCache ids unchanged
    scd = json.dumps({"method": "scd", "ranks": [64]}, sort_keys=True)
    assert policy_id(scd) == hashlib.sha256(scd.encode()).hexdigest()[:12] and len(policy_id(scd)) == 12


def test_codec_and_synthetic_ids_hash_through_the_core_function(monkeypatch):
    import types

    from kvtune.codecs import PolicyConfig
    from kvtune.core import ids
    from kvtune.search.optimizers.synthetic import synthetic_space

    hashed = []

    def sha256(data):
        hashed.append(bytes(data))
        return hashlib.sha256(data)

    monkeypatch.setattr(ids, "hashlib", types.SimpleNamespace(sha256=sha256))
    cfg = PolicyConfig.kivi(2, 32)
    assert cfg.policy_id == hashlib.sha256(cfg.to_json().encode("ascii")).hexdigest()[:12]  # ids unchanged
    assert hashed == [cfg.to_json().encode("ascii")]
    cand = synthetic_space("small").candidates[0]
    text = ";".join(f"{k}={cand.params[k]}" for k in sorted(cand.params))
    assert cand.config.policy_id == hashlib.sha256(text.encode()).hexdigest()[:16]  # stored 16-char ids unchanged
    assert text.encode() in hashed


def test_streams_write_the_core_canonical_json():
    from kvtune.codecs import stream
    from kvtune.core import jsonio

    assert stream.canonical_json is jsonio.canonical_json and "canonical_json" not in stream.__all__


def test_strict_json_helpers():
    assert [enc_float(v) for v in (1.5, math.inf, -math.inf)] == [1.5, "inf", "-inf"] and enc_float(math.nan) == "nan"
    assert dec_float("inf", "x") == math.inf and dec_float(2, "x") == 2.0
    with pytest.raises(ValueError, match="x: expected a number"):
        dec_float(True, "x")
    doc = jsonable({"a": (np.float64(math.nan), np.int64(3)), 4: [math.inf]})
    assert doc == {"a": ["nan", 3], "4": ["inf"]} and json.loads(strict_dumps(doc)) == doc
    with pytest.raises(ValueError):
        strict_dumps({"a": math.nan})
    kept = plain({"a": (np.float64(math.inf), np.int64(3))})
    assert kept == {"a": [math.inf, 3]} and type(kept["a"][1]) is int
    assert canonical_json({"b": 1, "a": [1, 2]}) == '{"a":[1,2],"b":1}'
