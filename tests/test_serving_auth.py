"""Stream authentication (kvtune.serving.auth): CRCs catch corruption, not forgery; with a shared
key, an unsealed, truncated, forged or wrong-key stream is refused before decoding."""

from __future__ import annotations

import hashlib
import hmac
import struct
import zlib
from pathlib import Path

import pytest
import torch

from kvtune.codecs import decode_kv, read_header
from kvtune.core.errors import KVStreamError
from kvtune.serving import AuthenticationError, KeyConfigError, ServingPolicy, load_key, seal, unseal
from kvtune.serving.auth import KEY_ENV, KEY_FILE_ENV, MAX_KEY_BYTES, OVERHEAD, is_sealed, key_id

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "profiles" / "example" / "policy_table.json"
KEY = bytes(range(32))
OTHER = bytes(range(1, 33))

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def kv_cache(tokens: int = 64):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(1, 3, tokens, 64, generator=g), torch.randn(1, 3, tokens, 64, generator=g)) for _ in range(30)]


def policy(key=None) -> ServingPolicy:
    return ServingPolicy.load(TABLE, q_min=0.97, key=key, controller={"epsilon": 0.0})


def forge(stream: bytes) -> bytes:
    """Flip one payload byte of a kvtune stream and recompute its CRC32 (the header checksum
    covers only the header, which is untouched): what an attacker on the wire can do."""
    body = bytearray(stream[:-4])
    body[-10] ^= 0xFF
    return bytes(body) + struct.pack("<I", zlib.crc32(body))


# ---------------------------------------------------------------------------- frame


def test_seal_then_unseal_returns_the_payload():
    sealed = seal(b"payload bytes", KEY)
    assert len(sealed) == len(b"payload bytes") + OVERHEAD == len(b"payload bytes") + 54
    assert sealed[:4] == b"KVTA" and sealed[6:14] == hashlib.sha256(KEY).digest()[:8] and is_sealed(sealed)
    head = sealed[:22]
    assert sealed[22:54] == hmac.new(KEY, head + b"payload bytes", hashlib.sha256).digest()
    assert bytes(unseal(sealed, KEY)) == b"payload bytes"
    assert bytes(unseal(seal(b"", KEY), KEY)) == b""


def test_unsealed_data_is_refused():
    with pytest.raises(AuthenticationError, match="not sealed"):
        unseal(b"KVTN" + bytes(100), KEY)
    with pytest.raises(AuthenticationError, match="not sealed"):
        unseal(b"", KEY)


@pytest.mark.parametrize("cut", [1, 40, 60])
def test_truncated_frames_are_refused(cut):
    sealed = seal(bytes(range(50)), KEY)
    with pytest.raises(AuthenticationError, match="truncated"):
        unseal(sealed[:-cut], KEY)


def test_padded_frame_is_refused():
    with pytest.raises(AuthenticationError, match="longer than its frame"):
        unseal(seal(b"abc", KEY) + b"\0", KEY)


def test_edited_payload_or_header_is_refused():
    sealed = bytearray(seal(bytes(range(200)), KEY))
    sealed[100] ^= 1
    with pytest.raises(AuthenticationError, match="tag mismatch"):
        unseal(bytes(sealed), KEY)
    sealed = bytearray(seal(bytes(range(200)), KEY))
    sealed[4] = 2  # frame version
    with pytest.raises(AuthenticationError, match="frame version 2"):
        unseal(bytes(sealed), KEY)


def test_wrong_key_names_both_key_ids_and_no_key():
    sealed = seal(b"x" * 10, KEY)
    with pytest.raises(AuthenticationError) as err:
        unseal(sealed, OTHER)
    msg = str(err.value)
    assert key_id(KEY).hex() in msg and key_id(OTHER).hex() in msg
    assert KEY.hex() not in msg and OTHER.hex() not in msg
    assert isinstance(err.value, KVStreamError)  # connectors treat it like any bad stream


@pytest.mark.parametrize("bad", [b"short", b"", "a str key" * 4, bytes(MAX_KEY_BYTES + 1)])
def test_unusable_keys_are_key_config_errors(bad):
    with pytest.raises(KeyConfigError):
        seal(b"x", bad)


# ---------------------------------------------------------------------------- keyed runtime


def test_forged_stream_decodes_without_a_key_but_not_with_one():
    plain = policy()
    enc = plain.encode(kv_cache(), bandwidth_gbps=0.1)
    assert enc.policy_id == "48750b40bb5e"
    forged = forge(enc.stream)
    read_header(forged)  # every checksum agrees
    good, bad = plain.decode(enc.stream), plain.decode(forged)  # the unkeyed path decodes it
    assert not all(torch.equal(a[1], b[1]) for a, b in zip(good, bad))

    keyed = policy(KEY)
    sealed = keyed.encode(kv_cache(), bandwidth_gbps=0.1)
    assert bytes(unseal(sealed.stream, KEY)) == enc.stream
    inner = sealed.stream[OVERHEAD:]
    with pytest.raises(AuthenticationError, match="tag mismatch"):
        keyed.decode(sealed.stream[:OVERHEAD] + forge(inner))  # forged inside the frame, CRCs recomputed
    with pytest.raises(AuthenticationError, match="key id"):
        keyed.decode(seal(forge(inner), OTHER))  # forged and re-sealed with the attacker's key
    with pytest.raises(AuthenticationError, match="not sealed"):
        keyed.decode(forged)  # forged, no frame


def test_keyed_policy_round_trips_and_refuses_bad_frames():
    keyed = policy(KEY)
    kv = kv_cache()
    enc = keyed.encode(kv, bandwidth_gbps=100.0)
    assert enc.policy_id == "none" and enc.stream[:4] == b"KVTA"
    out = keyed.decode(enc.stream)
    want = decode_kv(bytes(unseal(enc.stream, KEY)))
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(out, want))
    with pytest.raises(AuthenticationError, match="not sealed"):
        keyed.decode(policy().encode(kv, bandwidth_gbps=100.0).stream)
    with pytest.raises(AuthenticationError, match="truncated"):
        keyed.decode(enc.stream[:-100])
    with pytest.raises(AuthenticationError, match="key id"):
        policy(OTHER).decode(enc.stream)


def test_keyed_chunks_are_sealed_one_by_one():
    keyed = ServingPolicy.load(TABLE, q_min=0.97, key=KEY, initial_bandwidth_gbps=1.0)
    chunks = keyed.encode_chunks(kv_cache(tokens=16), chunk_layers=15)
    streams = []
    for enc in chunks:
        assert is_sealed(enc.stream)
        streams.append(enc.stream)
        chunks.feedback(enc, transfer_s=0.001)
    assert len(keyed.decode_chunks(streams)) == 30
    with pytest.raises(AuthenticationError, match="not sealed"):
        keyed.decode_chunks([streams[0], bytes(unseal(streams[1], KEY))])


def test_key_never_shows_in_repr():
    keyed = policy(KEY)
    assert keyed.key_id == key_id(KEY).hex() and f"key_id={key_id(KEY).hex()}" in repr(keyed)
    assert KEY.hex() not in repr(keyed) and repr(KEY) not in repr(keyed)


def test_key_config_errors_at_load():
    with pytest.raises(KeyConfigError):
        ServingPolicy.load(TABLE, q_min=0.97, key=b"too short")


# ---------------------------------------------------------------------------- environment


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)
    return monkeypatch


def test_no_key_configured(env):
    assert load_key() is None


def test_key_from_hex(env):
    env.setenv(KEY_ENV, KEY.hex())
    assert load_key() == KEY


def test_key_from_file_is_its_bytes(env, tmp_path):
    path = tmp_path / "kv.key"
    path.write_bytes(KEY + b"\n")
    env.setenv(KEY_FILE_ENV, str(path))
    assert load_key() == KEY + b"\n"


def test_bad_key_settings(env, tmp_path):
    secret = "zz" + KEY.hex()
    env.setenv(KEY_ENV, secret)
    with pytest.raises(KeyConfigError, match="not a hex string") as err:
        load_key()
    assert secret not in str(err.value)
    env.setenv(KEY_ENV, "00" * 8)
    with pytest.raises(KeyConfigError, match="8 bytes"):
        load_key()
    env.setenv(KEY_FILE_ENV, str(tmp_path / "k"))
    with pytest.raises(KeyConfigError, match="both"):
        load_key()
    env.delenv(KEY_ENV)
    with pytest.raises(KeyConfigError, match="cannot read the key file"):
        load_key()
    (tmp_path / "k").write_bytes(b"0123456789")
    with pytest.raises(KeyConfigError, match="has 10 bytes"):
        load_key()
    (tmp_path / "k").write_bytes(bytes(MAX_KEY_BYTES + 1))
    with pytest.raises(KeyConfigError, match="larger than 4096"):
        load_key()
    env.setenv(KEY_FILE_ENV, "")
    with pytest.raises(KeyConfigError, match="empty"):
        load_key()
    env.setenv(KEY_FILE_ENV, str(tmp_path))
    with pytest.raises(KeyConfigError, match="cannot read"):
        load_key()
