"""Tests of the calibrated PCA basis, the ``pca`` transform and the ``dp-alloc`` quantizer
(KVTC, arXiv 2511.01815, sec. 3), their stream round trips, typed errors, the basis file and
the run-folder calibration / serving load."""

from __future__ import annotations

import dataclasses
import json
import math
import struct

import numpy as np
import pytest
import torch

from kvtune.codecs import PolicyConfig, decode_kv, encode_kv, fastpath
from kvtune.codecs.bitalloc import (
    ECSQ_MIN_RATIO,
    ECSQ_SPAN,
    ComponentQuantizer,
    DPAlloc,
    allocate_across_layers,
    allocate_bits,
    allocate_ecsq,
    ecsq_entropy,
    ecsq_gaussian,
)
from kvtune.codecs.pca import (
    PCA,
    BasisError,
    BasisNotLoadedError,
    RopeSpec,
    fit_pca_basis,
    forget_basis,
    leading_width,
    load_basis,
    lookup,
    onednn_linear_available,
    project,
    project_leading,
    register_basis,
    rotate_keys,
    unproject,
    unproject_leading,
    save_basis,
    unrotate_keys,
)
from kvtune.codecs.policy import apply_transforms, invert_transforms
from kvtune.codecs import kept_positions
from kvtune.codecs.stream import read_stream
from kvtune.core.errors import ConfigError, CorruptStreamError, KVInputError, KVStreamError, TruncatedStreamError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HEADS, DIM = 3, 16
INV_FREQ = (1.0 / 10000 ** (torch.arange(0, DIM, 2, dtype=torch.float64) / DIM)).float()


def hf_rotate(x: torch.Tensor, inv_freq: torch.Tensor, scaling: float = 1.0) -> torch.Tensor:
    """Transformers' Llama RoPE on keys: ``x * cos + rotate_half(x) * sin`` at positions 0..T-1."""
    freqs = torch.arange(x.shape[2], dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1).double()
    cos, sin = emb.cos() * scaling, emb.sin() * scaling
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return x.double() * cos + torch.cat((-x2, x1), dim=-1).double() * sin


def correlated_kv(layers: int, tokens: int, *, seed: int, heads: int = HEADS, dim: int = DIM):
    """KV whose pre-RoPE keys and values are low-rank-ish (strongly correlated channels), keys rotated."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(layers):
        mix = torch.randn(heads * dim, heads * dim, generator=torch.Generator().manual_seed(100 + i))
        mix = mix * torch.logspace(0, -2, heads * dim)[:, None]  # decaying spectrum
        k = (torch.randn(1, tokens, heads * dim, generator=g) @ mix).reshape(1, tokens, heads, dim).permute(0, 2, 1, 3)
        v = (torch.randn(1, tokens, heads * dim, generator=g) @ mix.T).reshape(1, tokens, heads, dim).permute(0, 2, 1, 3)
        out.append((hf_rotate(k, INV_FREQ).float(), v.contiguous()))
    return out


ROPE = tuple(RopeSpec(INV_FREQ) for _ in range(2))


@pytest.fixture(scope="module")
def basis():
    b = fit_pca_basis([correlated_kv(2, 200, seed=s) for s in range(3)], key_rope="pre", rope=ROPE)
    register_basis(b)
    return b


def pca_policy(digest: str, quant: dict, codec: str = "bitpack", rope: str = "pre") -> PolicyConfig:
    return PolicyConfig.from_dict({"transforms": [{"name": "pca", "rope": rope}], "key": quant, "value": quant,
                                   "codec": codec}).with_pca_basis(digest)


# ----------------------------------------------------------------------------- allocation


def test_allocation_matches_a_hand_computed_greedy():
    # gains lambda * 4**-b: 16 | 4, 4 | 1, 1, 1 (ties: lower component first) | 0.25 ...
    assert allocate_bits([16, 4, 1, 0.25], 4, 8) == (3, 1, 0, 0)
    assert allocate_bits([16, 4, 1, 0.25], 6, 8) == (3, 2, 1, 0)
    assert allocate_bits([16, 4, 1, 0.25], 7, 8) == (4, 2, 1, 0)  # 0.25 gains: c0b3 comes first
    assert allocate_bits([1e6, 1.0], 5, 2) == (2, 2)  # capped at D * max_bits
    assert allocate_bits([0.0, 0.0, 0.0], 2, 8) == (2, 0, 0)  # zero variance: ties by (component, bit)
    assert sum(allocate_bits(torch.rand(50).tolist(), 75, 8)) == 75


# ----------------------------------------------------------------------------- basis


def test_fitted_basis_is_sorted_orthonormal_and_per_head_is_block_diagonal(basis):
    entry = basis.layers[0][0]
    c = entry.components.double()
    assert torch.allclose(c @ c.T, torch.eye(HEADS * DIM, dtype=torch.float64), atol=1e-5)
    assert bool((entry.eigenvalues[:-1] >= entry.eigenvalues[1:]).all())
    per_head = fit_pca_basis([correlated_kv(1, 100, seed=1)], mode="per_head")
    ph = per_head.layers[0][1].components
    mask = torch.block_diag(*[torch.ones(DIM, DIM)] * HEADS).bool()
    assert bool((ph[~mask] == 0).all()) and torch.allclose(ph.double() @ ph.double().T, torch.eye(HEADS * DIM, dtype=torch.float64), atol=1e-5)


def test_pre_rope_unrotate_inverts_the_model_rotation_and_rotate_inverts_it():
    x = torch.randn(2, HEADS, 50, DIM, dtype=torch.float64)
    spec = RopeSpec(INV_FREQ, 1.3)
    assert torch.allclose(unrotate_keys(hf_rotate(x, INV_FREQ, 1.3), spec), x, atol=1e-9)
    assert torch.allclose(rotate_keys(unrotate_keys(x, spec), spec), x, atol=1e-9)
    partial = RopeSpec(INV_FREQ[:4])  # rotary_dim 8 of 16: the last channels pass unchanged
    assert torch.equal(unrotate_keys(x, partial)[..., 8:], x[..., 8:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rotation_at_kept_positions_reads_the_cached_table_bit_for_bit(dtype, monkeypatch):
    """Kept positions take their rows of the cached table; the result equals the route that
    computes the angles of those positions directly (taken for tables too long to cache)."""
    import kvtune.codecs.pca as pca_module

    spec = RopeSpec(INV_FREQ, 1.3)
    x = torch.randn(2, HEADS, 7, DIM, dtype=dtype)
    pos = torch.tensor([0, 3, 4, 9, 20, 21, 40]).expand(2, HEADS, 7).contiguous()
    pos[1, 0] = torch.tensor([1, 2, 5, 6, 7, 30, 41])
    got = [(fn(x, spec, pos), fn(x, spec)) for fn in (unrotate_keys, rotate_keys)]
    monkeypatch.setattr(pca_module, "_ROPE_CACHE_ELEMENTS", 0)  # every table computed directly
    for (at_pos, default), fn in zip(got, (unrotate_keys, rotate_keys)):
        assert torch.equal(at_pos, fn(x, spec, pos))
        assert torch.equal(default, fn(x, spec))
        assert not torch.equal(at_pos, default)  # the positions matter
    assert unrotate_keys(x[:, :, :0], spec, pos[:, :, :0]).shape == (2, HEADS, 0, DIM)
    for other in (pos.int(), pos.to(torch.uint8), pos.double()):  # other dtypes: the same rotation
        assert torch.equal(unrotate_keys(x, spec, other), got[0][0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_linear_matches_matmul_on_both_routes(dtype, monkeypatch):
    """``linear`` is ``rows @ weight.T (+ bias)`` through oneDNN (float32 on the CPU, where the
    build has it) or ``matmul`` / ``addmm``; both routes agree to float32 rounding, a transposed
    weight view works, and float64 takes ``matmul`` exactly."""
    import kvtune.codecs.pca as pca_module

    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(37, 24, generator=gen, dtype=dtype)
    weight = torch.randn(24, 24, generator=gen, dtype=dtype)
    bias = torch.randn(24, generator=gen, dtype=dtype)
    fast = (pca_module.linear(rows, weight), pca_module.linear(rows, weight.T, bias))
    want = (rows @ weight.T, torch.addmm(bias, rows, weight))
    if dtype == torch.float64:
        assert all(torch.equal(a, b) for a, b in zip(fast, want))
    for a, b in zip(fast, want):
        assert a.dtype == dtype and a.shape == (37, 24)
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    # a strided or expanded bias (a basis mean can be a view): oneDNN reads a bias as packed
    strided = torch.randn(48, generator=gen, dtype=dtype)[::2]
    assert torch.allclose(pca_module.linear(rows, weight.T, strided), torch.addmm(strided, rows, weight), rtol=1e-5, atol=1e-5)
    zeros = torch.zeros(1, dtype=dtype).expand(24)
    assert torch.allclose(pca_module.linear(rows, weight.T, zeros), rows @ weight, rtol=1e-5, atol=1e-5)
    pca_module.onednn_linear_available.cache_clear()
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    try:
        assert not pca_module.onednn_linear_available()
        assert torch.equal(pca_module.linear(rows, weight.T, bias), torch.addmm(bias, rows, weight))
        assert pca_module.linear(rows[:0], weight).shape == (0, 24)
    finally:
        pca_module.onednn_linear_available.cache_clear()


@pytest.mark.parametrize("batch, sink", [(1, 1), (2, 3), (1, 0)])
def test_leading_products_give_the_full_products_bits(basis, batch, sink):
    """``project_leading`` / ``unproject_leading`` at ``leading_width`` give the bits of
    ``project`` / ``unproject``: the first ``width`` coefficients, the sink tokens' all, and the
    reconstruction of rows whose trailing coefficients are 0. On oneDNN's kernels every
    ``count >= 2`` truncates; one component, or no token after the sinks, does not."""
    tokens, dim = 40, HEADS * DIM
    entry = basis.layer(1, "value", HEADS, DIM)
    x = torch.randn(batch, HEADS, tokens, DIM, generator=torch.Generator().manual_seed(batch + sink)) * 3
    rows = project(x, entry).permute(0, 2, 1, 3).reshape(batch, tokens, dim)
    widths = {}
    for count in (2, 5, dim // 2, dim - 1, dim):
        widths[count] = width = leading_width(batch, tokens, dim, count, sink)
        y, ysink = project_leading(x, entry, width, sink)
        assert y.shape == (batch, tokens, width) and ysink.shape == (batch, sink, dim)
        assert torch.equal(y, rows[..., :width]) and torch.equal(ysink, rows[:, :sink])
        coeffs = rows.clone()
        coeffs[:, sink:, count:] = 0  # what the decoder holds: dropped components are 0 past the sinks
        want = unproject(coeffs.view(batch, tokens, HEADS, DIM).permute(0, 2, 1, 3), entry)
        got = unproject_leading(coeffs[..., :width].contiguous(), coeffs[:, :sink].contiguous(), entry)
        assert got.shape == want.shape and torch.equal(got, want)
    assert all(w in (c, dim) for c, w in widths.items()) and widths[dim] == dim
    if onednn_linear_available():
        assert all(widths[c] == c for c in (2, 5, dim // 2, dim - 1))
    assert leading_width(batch, tokens, dim, 1, sink) == dim  # one column: a matrix-vector route
    assert leading_width(batch, sink, dim, 5, sink) == dim  # no token past the sinks


@pytest.mark.parametrize("scale", [1e30, 5e36])
def test_pca_coefficients_beyond_the_quantizer_range_are_refused_on_both_paths(basis, scale):
    """Coefficients a segment's float16 metadata cannot represent (or that overflow float32) are
    a KVInputError naming the layer, on the fast path (which projects the leading components
    only) as on the reference."""
    kv = [(k * scale, v * scale) for k, v in correlated_kv(2, 30, seed=4)]
    cfg = pca_policy(basis.digest, {"name": "dp-alloc", "bits": 1.5, "grid": "ecsq", "sink_tokens": 1}, "rans")
    messages = []
    for impl in ("fast", "reference"):
        with pytest.raises(KVInputError, match="layer 0 key: a value") as err:
            encode_kv(kv, cfg, impl=impl)
        messages.append(str(err.value))
    assert messages[0] == messages[1]


def test_pre_rope_basis_concentrates_key_energy_better_than_post(basis):
    post = fit_pca_basis([correlated_kv(2, 200, seed=s) for s in range(3)], key_rope="post")
    top = lambda b: float(b.layers[1][0].eigenvalues[:8].sum() / b.layers[1][0].eigenvalues.sum())  # noqa: E731
    assert top(basis) > top(post) + 0.05


def test_basis_file_round_trip_and_digest(basis, tmp_path):
    path = save_basis(basis, tmp_path / "b.safetensors")
    back = load_basis(path, expect=basis.digest)
    assert back.digest == basis.digest and back.key_rope == "pre" and back.rope[1].scaling == 1.0
    assert torch.equal(back.layers[1][1].components, basis.layers[1][1].components)
    with pytest.raises(BasisError, match="expected"):
        load_basis(path, expect="0" * 64)


def _rewrite_header(path, edit):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    meta = json.loads(data[8 : 8 + n])
    edit(meta)
    head = json.dumps(meta).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + data[8 + n :])


def test_basis_load_is_bounded_and_typed(basis, tmp_path):
    path = save_basis(basis, tmp_path / "b.safetensors")

    def huge(meta):  # a forged header declaring a 1000-layer, D = 8000 basis: refused before reading tensors
        h = json.loads(meta["__metadata__"]["kvtune_pca_basis"])
        h["layers"], h["rope"] = [[100, 80, 100, 80]] * 1000, []
        meta["__metadata__"]["kvtune_pca_basis"] = json.dumps(h)

    _rewrite_header(path, huge)
    with pytest.raises(BasisError, match="differ from the basis header|bytes declared"):
        load_basis(path)
    path = save_basis(basis, tmp_path / "c.safetensors")
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(BasisError):
        load_basis(path)
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(BasisError, match="header"):
        load_basis(path)
    with pytest.raises(BasisError, match="cannot read"):
        load_basis(tmp_path / "missing.safetensors")


def test_lookup_of_an_unknown_digest_says_how_to_load_it():
    with pytest.raises(BasisNotLoadedError, match="load_basis"):
        lookup("ab" * 32)
    with pytest.raises(BasisNotLoadedError, match="with_pca_basis"):
        lookup("")


# ----------------------------------------------------------------------------- transform / quantizer


def test_pca_transform_inverts_and_checks_rope_and_geometry(basis):
    x = correlated_kv(2, 40, seed=9)
    t = PCA(basis=basis.digest)
    for layer, (k, v) in enumerate(x):
        for kind, tensor in (("key", k), ("value", v)):
            y = t.forward(tensor, layer=layer, kind=kind)
            assert y.shape == tensor.shape and y.dtype == torch.float32
            torch.testing.assert_close(t.inverse(y, layer=layer, kind=kind), tensor, rtol=1e-5, atol=1e-5)
    with pytest.raises(BasisError, match="fitted on pre-RoPE"):
        PCA(basis=basis.digest, rope="post").forward(x[0][0], layer=0, kind="key")
    with pytest.raises(BasisError, match="covers layers 0..1"):
        t.forward(x[0][0], layer=2, kind="key")
    with pytest.raises(BasisError, match="3 heads x 16 channels"):
        t.forward(torch.zeros(1, 2, 4, 16), layer=0, kind="key")


@pytest.mark.parametrize("codec", ["bitpack", "range"])
def test_pca_with_bfloat16_decodes_within_float_tolerance(basis, codec):
    kv = correlated_kv(2, 64, seed=5)
    cfg = pca_policy(basis.digest, {"name": "none"}, codec)
    for (k, v), (k2, v2) in zip(kv, decode_kv(encode_kv(kv, cfg), expect=cfg)):
        for a, b in ((k, k2), (v, v2)):
            assert float((a - b).norm() / a.norm()) < 5e-3  # bfloat16 coefficients


@pytest.mark.parametrize("codec", ["bitpack", "range"])
@pytest.mark.parametrize("quant", [{"name": "dp-alloc", "bits": 8}, {"name": "dp-alloc", "bits": 1.5},
                                   {"name": "dp-alloc", "bits": 3, "max_bits": 4, "grid": "minmax"},
                                   {"name": "dp-alloc", "bits": 2, "max_bits": 6, "grid": "ecsq"}])
def test_dp_alloc_round_trip_equals_the_in_memory_pipeline(basis, codec, quant):
    kv = correlated_kv(2, 77, seed=6)
    cfg = pca_policy(basis.digest, quant, codec)
    stream = encode_kv(kv, cfg)
    assert stream == encode_kv(kv, cfg, impl="reference")  # "auto" has no kernel path here: the reference
    out = decode_kv(stream, expect=cfg)
    for layer, ((k, v), (k2, v2)) in enumerate(zip(kv, out)):
        for orig, dec, q, kind in ((k, k2, cfg.key, "key"), (v, v2, cfg.value, "value")):
            y, states = apply_transforms(orig, cfg.transforms, layer=layer, kind=kind)
            ref = invert_transforms(q.dequantize(q.quantize(y, layer=layer, kind=kind), layer=layer, kind=kind),
                                    cfg.transforms, states, layer=layer, kind=kind)
            assert torch.equal(dec, ref)


def test_dp_alloc_error_falls_with_bits_and_is_small_at_8(basis):
    kv = correlated_kv(2, 256, seed=7)
    errs = []
    for bits in (1, 2, 4, 8):
        cfg = pca_policy(basis.digest, {"name": "dp-alloc", "bits": bits})
        out = decode_kv(encode_kv(kv, cfg))
        errs.append(max(float((a - b).norm() / a.norm()) for p, q in zip(kv, out) for a, b in zip(p, q)))
    assert errs == sorted(errs, reverse=True) and errs[-1] < 0.02


def test_dp_alloc_segments_follow_the_allocation_and_drop_zero_bit_components(basis):
    q = DPAlloc(bits=1.0, basis=basis.digest)
    widths = q.widths((1, HEADS, 10, DIM), layer=0, kind="value")
    assert sum(widths) == HEADS * DIM and 0 in widths  # the budget, some components dropped
    assert widths == allocate_bits(basis.layers[0][1].eigenvalues, HEADS * DIM, 8)
    plan = q.plan((1, HEADS, 10, DIM), layer=0, kind="value")
    assert sorted(s.bits for s in plan) == sorted({w for w in widths if w})
    assert sum(s.shape[3] for s in plan) == sum(1 for w in widths if w)
    y = torch.randn(1, HEADS, 10, DIM)
    dec = q.dequantize(q.quantize(y, layer=0, kind="value"), layer=0, kind="value")
    dropped = torch.tensor([w == 0 for w in widths]).reshape(HEADS, DIM)
    assert bool((dec[0].permute(1, 0, 2)[:, dropped] == 0).all())  # decoded as the mean (coefficient 0)


def test_component_quantizer_at_8_bits_minmax_is_within_half_a_step():
    x = torch.randn(2, 1, 300, 5) * torch.tensor([1.0, 10.0, 0.1, 3.0, 0.0])
    q = ComponentQuantizer(bits=8, grid="minmax")
    sym, meta = q.quantize_block(x)
    err = (q.dequantize_block(sym, meta, x.shape) - x).abs()
    assert bool((err <= meta["scale"].float() / 2 + 1e-3 * x.abs().amax(dim=2, keepdim=True) + 1e-6).all())


# ----------------------------------------------------------------------------- ecsq grid


def _gaussian_cells(ratio: float, n: int = 400_001) -> tuple[float, float]:
    """Entropy (bits) and distortion (step**2 units) of N(0, ratio**2) through round(), by
    midpoint integration of the density: an independent check of :func:`ecsq_gaussian`."""
    u = torch.linspace(-12 * ratio - 0.5, 12 * ratio + 0.5, n, dtype=torch.float64)
    w = (u[1] - u[0]) * torch.exp(-0.5 * (u / ratio) ** 2) / (ratio * math.sqrt(2 * math.pi))
    q = torch.round(u)
    p = torch.zeros(int(q.max() - q.min()) + 1, dtype=torch.float64).index_add_(0, (q - q.min()).long(), w)
    p = p[p > 0] / p.sum()
    return float(-(p * p.log2()).sum()), float((w * (u - q) ** 2).sum() / w.sum())


@pytest.mark.parametrize("ratio", [0.3, 0.46, 1.0, 2.5, 7.9])
def test_ecsq_gaussian_matches_a_numerical_integral(ratio):
    ent, dist = ecsq_gaussian([ratio])
    ref_ent, ref_dist = _gaussian_cells(ratio)
    assert float(ent[0]) == pytest.approx(ref_ent, abs=2e-4) and float(dist[0]) == pytest.approx(ref_dist, abs=2e-5)


def test_ecsq_gaussian_high_rate_form_and_errors():
    ent, dist = ecsq_gaussian(torch.tensor([[7.999, 8.001], [100.0, 1000.0]]))
    assert ent.shape == (2, 2) and float(ent[0, 1] - ent[0, 0]) == pytest.approx(math.log2(8.001 / 7.999), abs=1e-5)
    assert float(ent[1, 1] - ent[1, 0]) == pytest.approx(math.log2(10), abs=1e-5) and torch.equal(dist[1], torch.full((2,), 1 / 12, dtype=torch.float64))
    for bad in ([0.0], [-1.0], [math.nan], [math.inf]):
        with pytest.raises(ConfigError, match="ratios"):
            ecsq_gaussian(bad)


def test_ecsq_entropy_is_ecsq_gaussian_entropy_to_the_last_places():
    """The fast entropy (per-ratio cell ranges) against the full 147-cell sums, on both sides of
    every range's edge and of the high-rate switch at 8."""
    r = torch.exp(torch.linspace(math.log(0.01), math.log(40.0), 6001, dtype=torch.float64))
    edges = torch.tensor([c - 2 for c in (4, 8, 16, 32)], dtype=torch.float64) / 9
    r = torch.cat([r, edges, edges.nextafter(torch.full_like(edges, math.inf)), torch.tensor([8.0, 8.0 + 1e-12])])
    fast, full = ecsq_entropy(r), ecsq_gaussian(r)[0]
    assert float((fast - full).abs().max()) <= 2e-15
    assert ecsq_entropy(r[:6000].view(40, 150)).shape == (40, 150)
    for bad in ([0.0], [-1.0], [math.nan], [math.inf]):
        with pytest.raises(ConfigError, match="ratios"):
            ecsq_entropy(bad)


def test_allocate_ecsq_refuses_nan_and_infinite_eigenvalues():
    for bad in ([1.0, math.nan], [1.0, math.inf]):
        with pytest.raises(ConfigError, match="allocate_ecsq: eigenvalues must not be NaN or \\+inf"):
            allocate_ecsq(bad, 4.0, 8)
    assert allocate_ecsq([1.0, -math.inf], 4.0, 8)[0][1] == 0  # negative variances count as 0


@pytest.mark.parametrize("bad", [[1.0, [2.0]], "abc", 10**400, 1 + 2j, [1 + 2j], None, [[1.0, 2.0], [3.0]],
                                 torch.tensor([1 + 1j]), torch.tensor([True]), np.array(["a"]), np.array([1 + 9j, 3.0]),
                                 [True, False], np.array([True])])
def test_the_allocation_functions_refuse_values_that_are_not_real_numbers(bad):
    """Odd Python inputs are ConfigErrors that name the function, not torch's TypeErrors."""
    for fn, args in ((ecsq_gaussian, (bad,)), (ecsq_entropy, (bad,)), (allocate_ecsq, (bad, 4.0, 8)),
                     (allocate_bits, (bad, 4, 8)), (allocate_across_layers, ([bad], [1.0], 2.0, 8, "ecsq"))):
        with pytest.raises(ConfigError, match=f"{fn.__name__}: .*real numbers"):
            fn(*args)


def test_the_allocation_functions_take_numpy_numbers():
    lam = [4.0, 1.0, 0.25]
    assert allocate_bits(lam, np.int64(3), np.int64(8)) == allocate_bits(lam, 3, 8) == (2, 1, 0)
    widths, step = allocate_ecsq(np.array(lam), np.float32(2.5), np.int32(8))
    assert (widths, step) == allocate_ecsq(lam, 2.5, 8) and all(type(w) is int for w in widths)
    assert allocate_across_layers([np.array(lam)], [np.float64(1.0)], np.float32(1.0), np.int64(8), "ecsq") \
        == allocate_across_layers([lam], [1.0], 1.0, 8, "ecsq")
    with pytest.raises(ConfigError, match="max_bits"):
        allocate_ecsq(lam, 2.5, np.float64(8.0))  # an integer, not a float of integral value
    spectra = [torch.linspace(5.0, 0.01, 1250, dtype=torch.float64)] * 4
    widths = allocate_across_layers(spectra, [1.0] * 4, np.float16(2.5), 4, "gauss")  # the budget in float64
    assert sum(sum(w) for w, _ in widths) == 12_500
    assert allocate_across_layers(np.ones((2, 4)), (s for s in (1.0, 1.0)), 2.0, 4, "gauss") \
        == allocate_across_layers([[1.0] * 4] * 2, [1.0, 1.0], 2.0, 4, "gauss")  # rows of a 2-D array, a generator
    for args in ((None, [1.0], 2.0, 4, "gauss"), ([[1.0]], 3.0, 2.0, 4, "gauss"), ([[1.0, 2.0]], [1.0], 1e308, 4, "gauss")):
        with pytest.raises(ConfigError, match="allocate_across_layers"):
            allocate_across_layers(*args)


def test_ecsq_min_ratio_is_where_coding_stops_paying():
    """Below the ratio a coded component removes less distortion per bit than the high-rate slope."""
    r = torch.linspace(0.3, 0.7, 4001, dtype=torch.float64)
    ent, dist = ecsq_gaussian(r)
    pays = (r * r - dist) >= math.log(2) / 6 * ent
    crossing = float(r[pays][0])
    assert not bool(pays[0]) and bool(pays[-1]) and abs(crossing - ECSQ_MIN_RATIO) < 5e-3


def test_allocate_ecsq_meets_the_entropy_budget_and_drops_small_components():
    lam = torch.tensor([100.0 * 0.8**i for i in range(48)])
    for budget in (12.0, 48.0, 150.0):
        widths, step = allocate_ecsq(lam, budget, 8)
        m, _ = math.frexp(step)
        assert math.ldexp(m, 7) == round(math.ldexp(m, 7))  # 7 significant bits
        sigma = lam.sqrt()
        coded = sigma >= ECSQ_MIN_RATIO * step
        assert [w > 0 for w in widths] == coded.tolist() and not bool(coded[-1])  # trailing components dropped
        spent = float(ecsq_gaussian(sigma[coded] / step)[0].sum())
        assert spent == pytest.approx(budget, rel=0.03)  # the step is rounded to 1/128 of an octave
        for w, s in zip(widths, sigma.tolist()):
            if w:
                assert 3 <= w <= 8 and (w == 8 or 2 ** (w - 1) - 1 >= ECSQ_SPAN * s / step)
    assert allocate_ecsq([0.0, -1.0], 4.0, 8) == ((0, 0), 1.0)
    assert allocate_ecsq(lam, 12.0, 3)[0][0] == 3  # capped alphabet


@pytest.mark.parametrize("args, match", [((1.0, 2), "max_bits"), ((0.0, 8), "total_bits"), ((math.inf, 8), "total_bits"),
                                         ((True, 8), "total_bits")])
def test_allocate_ecsq_refuses_bad_arguments(args, match):
    with pytest.raises(ConfigError, match=match):
        allocate_ecsq([1.0, 2.0], *args)
    with pytest.raises(ConfigError, match="NaN"):
        allocate_ecsq([1.0, math.nan], 2.0, 8)


def test_component_quantizer_ecsq_uses_the_step_and_widens_only_for_outliers():
    x = torch.randn(2, 1, 500, 3, generator=torch.Generator().manual_seed(3)) * torch.tensor([0.5, 1.0, 0.05])
    x[1, 0, 7, 1] = 40.0  # an outlier token in batch row 1, component 1
    q = ComponentQuantizer(bits=5, grid="ecsq", step=0.25)
    sym, meta = q.quantize_block(x)
    scale = meta["scale"].float()[:, 0, 0]
    assert torch.equal(scale[0], torch.full((3,), 0.25)) and torch.equal(scale[1, [0, 2]], torch.full((2,), 0.25))
    dev = float((x[1, 0, :, 1] - meta["zero"].float()[1, 0, 0, 1]).abs().max())
    assert float(scale[1, 1]) == pytest.approx(dev / 15, rel=1e-3)  # 15 levels above the mean
    err = (q.dequantize_block(sym, meta, x.shape) - x).abs()
    assert bool((err <= meta["scale"].float() / 2 + 1e-3 * meta["scale"].float()).all())  # never clipped
    assert int(sym[0, 0, :, 2].float().mode().values) == 16  # the mean's symbol: 2**(bits - 1)
    with pytest.raises(ConfigError, match="bits >= 2"):
        ComponentQuantizer(bits=1, grid="ecsq")


def test_dp_alloc_ecsq_plans_from_the_basis(basis):
    q = DPAlloc(bits=1.5, grid="ecsq", basis=basis.digest)
    widths, step = q.allocation((1, HEADS, 10, DIM), layer=0, kind="value")
    assert (widths, step) == allocate_ecsq(basis.layers[0][1].eigenvalues, 1.5 * HEADS * DIM, 8) and 0 in widths
    plan = q.plan((1, HEADS, 10, DIM), layer=0, kind="value")
    assert all(s.coder.step == step and s.coder.grid == "ecsq" for s in plan)
    assert sum(s.shape[3] for s in plan) == sum(1 for w in widths if w)
    assert q.short_label() == "dp1.5/ecsq"
    with pytest.raises(ConfigError, match="max_bits >= 3"):
        DPAlloc(bits=1, max_bits=2, grid="ecsq")


@pytest.mark.parametrize("shape", [(1, HEADS, 1, DIM), (1, HEADS, 0, DIM), (2, HEADS, 3, DIM)])
def test_degenerate_token_counts_round_trip(basis, shape):
    kv = [(torch.randn(shape), torch.randn(shape))]
    cfg = pca_policy(basis.digest, {"name": "dp-alloc", "bits": 2}, "range")
    (k, v), = decode_kv(encode_kv(kv, cfg), expect=cfg)
    assert k.shape == shape and v.shape == shape and bool(torch.isfinite(k).all())


# ----------------------------------------------------------------------------- policies / streams


def test_policy_rules_fill_and_ids(basis):
    blank = PolicyConfig.from_dict({"transforms": ["pca"], "key": {"name": "dp-alloc"}, "value": {"name": "dp-alloc"},
                                    "codec": "range"})
    assert blank.needs_pca_basis and blank.pca_ropes_missing == {"pre"}
    filled = blank.with_pca_basis({"pre": basis.digest})
    assert not filled.needs_pca_basis and filled.key.basis == filled.transforms[0].basis == basis.digest
    assert filled.policy_id != blank.policy_id and PolicyConfig.from_json(filled.to_json()) == filled
    assert filled.label == f"pca:pre@{basis.digest[:8]}|K:dp2|V:dp2|range"
    with pytest.raises(ConfigError, match="last transform must be 'pca'"):
        PolicyConfig.from_dict({"key": {"name": "dp-alloc"}, "value": {"name": "none"}})
    with pytest.raises(ConfigError, match="differs"):
        PolicyConfig.from_dict({"transforms": [{"name": "pca", "basis": basis.digest}], "key": {"name": "dp-alloc"},
                                "value": {"name": "none"}})
    with pytest.raises(ConfigError, match="64-hex-digit"):
        PCA(basis="xyz")
    with pytest.raises(ConfigError, match="max_bits"):
        DPAlloc(bits=5, max_bits=4)


def test_unknown_basis_and_damaged_streams_are_typed_errors(basis):
    kv = correlated_kv(2, 30, seed=3)
    cfg = pca_policy(basis.digest, {"name": "dp-alloc", "bits": 2}, "range")
    stream = encode_kv(kv, cfg)
    with pytest.raises(TruncatedStreamError):
        decode_kv(stream[:-7])
    damaged = bytearray(stream)
    damaged[len(stream) // 2] ^= 0x10
    with pytest.raises(CorruptStreamError):
        decode_kv(bytes(damaged))
    other = fit_pca_basis([correlated_kv(2, 50, seed=99)], key_rope="pre", rope=ROPE)  # never registered
    cfg2 = pca_policy(other.digest, {"name": "dp-alloc", "bits": 2})
    with pytest.raises(BasisNotLoadedError, match="not loaded"):
        encode_kv(kv, cfg2)
    register_basis(other)
    stream2 = encode_kv(kv, cfg2)
    forget_basis(other.digest)  # a decoder that never loaded it
    with pytest.raises(KVStreamError, match="not loaded"):
        decode_kv(stream2)


# ----------------------------------------------------------------------------- run folder / serving


def test_run_calibration_writes_reads_back_and_serving_loads_the_basis(tiny_model_dir, tmp_path, monkeypatch):
    from kvtune.evaluate.model import load_model
    from kvtune.methods.tqc.profile import PCA_BASIS_FILES, calibrated_pca_bases
    from kvtune.serving.artifacts import load_pca_bases, pca_problems

    lm = load_model(str(tiny_model_dir), "cpu")
    ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    digests = calibrated_pca_bases(["pre"], lm, ids, tmp_path)
    doc = json.loads((tmp_path / "calibration.json").read_text())
    assert doc["pca_bases"]["pre"] == {"digest": digests["pre"], "file": PCA_BASIS_FILES["pre"], "mode": "joint"}
    basis = lookup(digests["pre"])
    assert len(basis.layers) == lm.num_layers and basis.layers[0][0].heads == lm.kv_heads
    assert len(basis.sensitivity) == lm.num_layers  # measured on the same windows
    before = (tmp_path / PCA_BASIS_FILES["pre"]).read_bytes()
    assert calibrated_pca_bases(["pre"], None, ids, tmp_path) == digests  # resume: read back, no model needed
    assert (tmp_path / PCA_BASIS_FILES["pre"]).read_bytes() == before
    (tmp_path / "calibration.json").write_text(json.dumps({**doc, "head_scores": {"x": 1}}))
    assert load_pca_bases(tmp_path) == (digests["pre"],)
    cfg = pca_policy(digests["pre"], {"name": "dp-alloc", "bits": 2})
    assert pca_problems(cfg) == []
    kv = [(torch.randn(1, lm.kv_heads, 5, lm.head_dim), torch.randn(1, lm.kv_heads, 5, lm.head_dim))] * lm.num_layers
    assert len(decode_kv(encode_kv(kv, cfg), expect=cfg)) == lm.num_layers
    assert math.isfinite(float(basis.layers[0][0].eigenvalues.sum()))


def test_sink_tokens_are_bfloat16_coefficients_outside_the_component_statistics(basis):
    kv = correlated_kv(2, 60, seed=8)
    kv = [(k.clone(), v.clone()) for k, v in kv]
    for k, v in kv:
        k[:, :, 0] *= 200.0  # an attention-sink-like outlier token
        v[:, :, 0] *= 200.0
    plain = pca_policy(basis.digest, {"name": "dp-alloc", "bits": 4}, "range")
    sink = pca_policy(basis.digest, {"name": "dp-alloc", "bits": 4, "sink_tokens": 1}, "range")
    assert sink.label.endswith("K:dp4/s1|V:dp4/s1|range")
    plan = sink.key.plan((1, HEADS, 60, DIM), layer=0, kind="key")
    assert plan[0].bits == 16 and plan[0].shape == (1, HEADS, 1, DIM) and all(s.shape[2] == 59 for s in plan[1:])
    errs = {}
    for name, cfg in (("plain", plain), ("sink", sink)):
        out = decode_kv(encode_kv(kv, cfg), expect=cfg)
        errs[name] = max(float((a[:, :, 1:] - b[:, :, 1:]).norm() / a[:, :, 1:].norm())
                         for p, q in zip(kv, out) for a, b in zip(p, q))
    assert errs["sink"] < errs["plain"] / 2  # the outlier no longer sets the other tokens' steps
    assert decode_kv(encode_kv([(torch.randn(1, HEADS, 1, DIM),) * 2], sink))[0][0].shape == (1, HEADS, 1, DIM)


# ----------------------------------------------------------------------------- calibration contexts


def _overlaps(starts: list[int], width: int, others: list[int], other_width: int) -> bool:
    return any(a < b + other_width and b < a + width for a in starts for b in others)


@pytest.mark.parametrize("stream, n_eval, window, n_calib, calib", [
    (1000, 4, 100, 4, 60), (1000, 1, 100, 8, 100), (1000, 10, 95, 2, 5), (620, 3, 150, 2, 80), (600, 1, 600, 0, 10)])
def test_gap_windows_share_no_position_with_the_taken_windows(stream, n_eval, window, n_calib, calib):
    from kvtune.evaluate.capture import gap_window_starts, window_starts

    taken = window_starts(stream, n_eval, window)
    starts = gap_window_starts(stream, taken, window, n_calib, calib)
    assert len(starts) == n_calib and starts == sorted(set(starts))
    assert all(0 <= s and s + calib <= stream for s in starts)
    assert all(b - a >= calib for a, b in zip(starts, starts[1:]))  # calibration windows apart from each other
    assert not _overlaps(starts, calib, taken, window)


def test_gap_windows_spread_over_the_gaps_and_too_many_is_a_named_error():
    from kvtune.core.errors import KvtuneError
    from kvtune.evaluate.capture import gap_window_starts

    # taken [0,100) [300,400) [600,700); free [100,300) [400,600) [700,1000): slots of 100
    assert gap_window_starts(1000, [0, 300, 600], 100, 3, 100) == [100, 400, 700]
    assert gap_window_starts(1000, [0, 300, 600], 100, 7, 100) == [100, 200, 400, 500, 700, 800, 900]
    with pytest.raises(KvtuneError, match=r"room for 7 calibration windows of 100 tokens, not 8.*--contexts.*--context-tokens"):
        gap_window_starts(1000, [0, 300, 600], 100, 8, 100)


def test_continuation_pca_calibration_windows_are_text_apart_from_the_evaluated_ones(tiny_model_dir, tiny_text):
    from kvtune.core.errors import KvtuneError
    from kvtune.evaluate.assets import read_texts
    from kvtune.evaluate.capture import token_stream
    from kvtune.evaluate.model import load_model
    from kvtune.evaluate.workloads import make_workload
    from kvtune.methods.tqc.settings import ProfileSettings

    lm = load_model(str(tiny_model_dir), "cpu")
    st = ProfileSettings(model=str(tiny_model_dir), text=str(tiny_text), samples=3, cheap_samples=2, context_tokens=48,
                         continuation_tokens=8, kv_dtype="bfloat16")
    wl = make_workload("continuation", lm, settings=st)
    stream = token_stream(lm.tokenizer, read_texts(str(tiny_text)))

    def place(row: list[int]) -> int:  # where a window lies in the text (unique for these pseudo-word windows)
        found = [i for i in range(len(stream) - len(row) + 1) if stream[i : i + len(row)] == row]
        assert len(found) == 1
        return found[0]

    evaluated = [place(s.context_ids + s.prompt_ids) for s in wl.samples]
    ids = wl.pca_calibration_ids(contexts=4, max_tokens=32)
    assert ids.shape == (4, 32) and ids.dtype == torch.long
    calib = [place(row) for row in ids.tolist()]
    assert len(set(calib)) == 4 and not _overlaps(calib, 32, evaluated, 56)
    assert wl.pca_calibration_ids(contexts=2, max_tokens=4096).shape == (2, 48)  # at most --context-tokens
    with pytest.raises(KvtuneError, match="--contexts"):
        wl.pca_calibration_ids(contexts=10_000)
    assert torch.equal(wl.calibration_ids(), torch.tensor([s.context_ids for s in wl.samples[:2]]))  # MixHQ: unchanged


def test_calibrated_space_fits_the_pca_basis_on_pca_ids_only_when_fitting(tiny_model_dir, tmp_path):
    from kvtune.evaluate.calibrate_pca import calibrate_pca_basis
    from kvtune.evaluate.model import load_model
    from kvtune.methods.tqc.profile import calibrated_pca_bases

    lm = load_model(str(tiny_model_dir), "cpu")
    gen = torch.Generator().manual_seed(1)
    heads_ids, pca_ids = torch.randint(0, 100, (2, 24), generator=gen), torch.randint(0, 100, (3, 20), generator=gen)
    calls = []
    digests = calibrated_pca_bases(["pre", "post"], lm, lambda: calls.append(1) or pca_ids, tmp_path)
    assert calls == [1]  # one call for both bases
    assert digests["pre"] == calibrate_pca_basis(lm, pca_ids, key_rope="pre").digest
    assert digests["pre"] != calibrate_pca_basis(lm, heads_ids, key_rope="pre").digest
    assert calibrated_pca_bases(["pre", "post"], lm, lambda: calls.append(1) or pca_ids, tmp_path) == digests
    assert calls == [1]  # read back from the run folder: not called


# ----------------------------------------------------------------------------- forged basis files


def _forge_header(basis, tmp_path, name, edit):
    path = save_basis(basis, tmp_path / name)
    _rewrite_header(path, edit)
    return path


def _edit_basis_header(key, index, value):
    def edit(meta):
        h = json.loads(meta["__metadata__"]["kvtune_pca_basis"])
        h[key][index][1] = value
        meta["__metadata__"]["kvtune_pca_basis"] = json.dumps(h)
    return edit


@pytest.mark.parametrize("name, edit", [
    ("entry_not_object", lambda m: m.__setitem__("layer0.key.mean", "x")),
    ("offsets_past_the_end", lambda m: m["layer0.key.mean"].__setitem__("data_offsets", [0, 10**12])),
    ("shape_of_floats", lambda m: m["layer0.key.mean"].__setitem__("shape", [float(m["layer0.key.mean"]["shape"][0])])),
    ("scaling_beyond_float", _edit_basis_header("rope", 0, 10**400)),
])
def test_forged_basis_headers_are_basis_errors(basis, tmp_path, name, edit):
    path = _forge_header(basis, tmp_path, name, edit)
    with pytest.raises(BasisError, match=path.name):
        load_basis(path)


def test_a_deeply_nested_basis_header_is_a_basis_error(basis, tmp_path):
    path = save_basis(basis, tmp_path / "deep.safetensors")
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    head = b"[" * 100_000 + b"]" * 100_000
    path.write_bytes(struct.pack("<Q", len(head)) + head + data[8 + n :])
    with pytest.raises(BasisError, match="deep.safetensors"):
        load_basis(path)


def test_a_basis_path_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path):
    import os

    os.mkfifo(tmp_path / "fifo.safetensors")  # opening a FIFO for reading blocks until a writer comes
    with pytest.raises(BasisError, match="not a regular file"):
        load_basis(tmp_path / "fifo.safetensors")
    with pytest.raises(BasisError, match="not a regular file"):
        load_basis(tmp_path)


# ----------------------------------------------------------------------------- damaged calibration.json


def _run_with_basis(basis, run_dir, pca_bases):
    save_basis(basis, run_dir / "pca_basis.safetensors")
    (run_dir / "calibration.json").write_text(json.dumps({"pca_bases": pca_bases}))
    return (run_dir / "calibration.json").read_bytes()


@pytest.mark.parametrize("record", [
    [1, 2],
    {"pre": "pca_basis.safetensors"},
    {"pre": {"digest": "ab" * 32}},
    {"pre": {"digest": [1], "file": "pca_basis.safetensors"}},
    {"pre": {"digest": "ab" * 32, "file": ["pca_basis.safetensors"]}},
], ids=["list", "entry_string", "no_file", "digest_list", "file_list"])
def test_a_malformed_pca_bases_record_is_a_typed_error_and_is_not_rewritten(basis, tmp_path, record):
    from kvtune.core.errors import KvtuneError
    from kvtune.methods.tqc.profile import calibrated_pca_bases

    before = _run_with_basis(basis, tmp_path, record)
    with pytest.raises(KvtuneError, match="calibration.json.*pca_bases"):
        calibrated_pca_bases(["pre"], None, torch.zeros(1, 1, dtype=torch.int64), tmp_path)
    assert (tmp_path / "calibration.json").read_bytes() == before  # never replaced by a refit


@pytest.mark.parametrize("file", ["../../etc/passwd", "/etc/passwd", "..", ""])
def test_a_pca_bases_file_outside_the_run_folder_is_never_read(basis, tmp_path, file):
    from kvtune.methods.tqc.profile import calibrated_pca_bases
    from kvtune.serving.artifacts import load_pca_bases

    _run_with_basis(basis, tmp_path, {"pre": {"digest": basis.digest, "file": file}})
    with pytest.raises(BasisError, match=str(tmp_path)):
        calibrated_pca_bases(["pre"], None, torch.zeros(1, 1, dtype=torch.int64), tmp_path)
    with pytest.raises(ConfigError, match=str(tmp_path)):
        load_pca_bases(tmp_path)


def test_a_deeply_nested_or_oversized_calibration_json_is_a_typed_error(tmp_path):
    from kvtune.core.errors import KvtuneError
    from kvtune.methods.tqc.profile import read_calibration
    from kvtune.serving.artifacts import load_pca_bases

    path = tmp_path / "calibration.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(KvtuneError, match="calibration.json"):
        read_calibration(path)
    with pytest.raises(KvtuneError, match="calibration.json"):
        load_pca_bases(tmp_path)
    path.unlink()
    with path.open("wb") as fh:  # sparse: 32 MiB of nothing, refused by its size before reading
        fh.truncate(32 << 20)
    with pytest.raises(KvtuneError, match="at most"):
        read_calibration(path)


@pytest.mark.parametrize("eigenvalues, total, max_bits, what", [
    ([4.0, 1.0, 1.0], 3, -1, "max_bits"),
    ([4.0, 1.0, 1.0], 3, 0, "max_bits"),
    ([4.0, 1.0, 1.0], 3, 9, "max_bits"),
    ([4.0, 1.0, 1.0], float("nan"), 8, "total_bits"),
    ([float("nan"), 1.0, 1.0], 3, 8, "eigenvalues"),
])
def test_allocate_bits_refuses_what_it_cannot_allocate(eigenvalues, total, max_bits, what):
    with pytest.raises(ConfigError, match=what):
        allocate_bits(eigenvalues, total, max_bits)
    assert allocate_bits([4.0, 1.0, 1.0], 3, 8) == (2, 1, 0)


def test_rope_tables_of_long_contexts_are_computed_not_cached(monkeypatch):
    """Short contexts take the cached tables, long ones (beyond ``_ROPE_CACHE_ELEMENTS``) compute
    theirs: both give the same rotation, bit for bit, in float32 and float64."""
    import kvtune.codecs.pca as pca_module

    spec = RopeSpec(INV_FREQ, 1.3)
    for dtype in (torch.float32, torch.float64):
        x = torch.randn(1, HEADS, 40, DIM, dtype=dtype)
        cached = unrotate_keys(x, spec), rotate_keys(x, spec)
        monkeypatch.setattr(pca_module, "_ROPE_CACHE_ELEMENTS", 0)
        computed = unrotate_keys(x, spec), rotate_keys(x, spec)
        monkeypatch.undo()
        assert all(torch.equal(a, b) and a.dtype == dtype for a, b in zip(cached, computed))


def test_unrotate_at_kept_positions_equals_unrotating_then_keeping():
    x = torch.randn(2, HEADS, 40, DIM, dtype=torch.float64)
    spec = RopeSpec(INV_FREQ, 1.3)
    pos = torch.stack([torch.randperm(40, generator=torch.Generator().manual_seed(i))[:25].sort().values
                       for i in range(2 * HEADS)]).reshape(2, HEADS, 25)
    take = lambda t: torch.gather(t, 2, pos[..., None].expand(*pos.shape, DIM))  # noqa: E731
    assert torch.allclose(unrotate_keys(take(x), spec, pos), take(unrotate_keys(x, spec)), atol=1e-12)
    assert torch.allclose(rotate_keys(unrotate_keys(take(x), spec, pos), spec, pos), take(x), atol=1e-9)


def test_keep_then_pca_unrotates_the_kept_keys_at_their_own_positions(basis):
    """After ``keep`` the key rows are the kept tokens: a pre-RoPE basis must un-rotate them at
    their original positions, not at their row index, or the keys leave the basis' subspace and
    a small budget codes them far worse (measured: 0.58 relative error instead of 0.15 at 1.5
    bits); the decoded keys match the kept ones as closely as without selection. The compiled
    fast path does the same."""
    kv = correlated_kv(2, 200, seed=7)
    quant = {"name": "dp-alloc", "bits": 1.5}
    spec = {"transforms": [{"name": "keep", "fraction": 0.5, "score": "key-norm", "per_head": False},
                           {"name": "pca", "rope": "pre"}], "key": quant, "value": quant}
    keep = PolicyConfig.from_dict(spec).with_pca_basis(basis.digest)
    every = pca_policy(basis.digest, quant)
    stream = encode_kv(kv, keep)
    kept = kept_positions(stream).positions
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    for (k, _), (kd, _), (full, _), pos in zip(kv, decode_kv(stream), decode_kv(encode_kv(kv, every)), kept):
        original = torch.gather(k, 2, pos[..., None].expand(*pos.shape, DIM))
        assert rel(kd, original) < 1.3 * rel(full, k)
    # the fast path gives the pca transform the same positions: the same bytes and tensors
    assert fastpath.supports(keep)
    assert stream == encode_kv(kv, keep, impl="fast") == encode_kv(kv, keep, impl="reference")
    for (k1, v1), (k2, v2) in zip(decode_kv(stream, impl="fast"), decode_kv(stream, impl="reference")):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    with pytest.raises(ConfigError, match="no torch path"):  # the device path takes rows at 0 .. tokens - 1
        decode_kv(stream, impl="torch")


@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_pca_streams_decode_to_contiguous_tensors_that_serve_as_out_buffers(basis, impl):
    """The inverse projection works on ``(batch, tokens, heads * head_dim)`` rows; the decoded
    tensors used to keep that permuted layout, so ``empty_like`` of them was refused as ``out``."""
    kv = correlated_kv(2, 50, seed=3)
    cfg = pca_policy(basis.digest, {"name": "dp-alloc", "bits": 3})
    stream = encode_kv(kv, cfg)
    decoded = decode_kv(stream, impl=impl)
    assert all(t.is_contiguous() for pair in decoded for t in pair)
    out = [(torch.empty_like(k), torch.empty_like(v)) for k, v in decoded]
    for (k, v), (k2, v2) in zip(decode_kv(stream, impl=impl, out=out), decoded):
        assert torch.equal(k, k2) and torch.equal(v, v2)


def test_dp_alloc_metadata_forged_to_nan_is_corrupt(basis):
    """dp-alloc's float16 scales and means, forged to NaN with the CRC recomputed, decoded to
    NaN tensors on both paths; the stream check refuses them (kvtune.codecs.policy.check_finite_metadata)."""
    import zlib

    from kvtune.codecs import read_header

    stream = encode_kv(correlated_kv(1, 60, seed=1), pca_policy(basis.digest, {"name": "dp-alloc", "bits": 2}, "rans"))
    h = read_header(stream)
    off = h.header_nbytes + h.sections[0][0].state  # K's first metadata section
    forged = bytearray(stream)
    forged[off : off + 2] = b"\x00\x7e"
    body = bytes(forged[:-4])
    for impl in ("fast", "reference"):
        with pytest.raises(CorruptStreamError, match="layer 0 K has a NaN or inf float16 in its metadata"):
            decode_kv(body + struct.pack("<I", zlib.crc32(body)), impl=impl)


def test_dp_alloc_sink_tokens_forged_to_nan_or_inf_are_corrupt(basis):
    """dp-alloc's bfloat16 sink tokens (no metadata, the tensor's first segment), one value
    forged to NaN / +-inf with the CRC recomputed, decoded into the output on the fast path;
    every path refuses them now."""
    import zlib

    from kvtune.codecs import read_header

    kv = correlated_kv(1, 60, seed=1)
    stream = encode_kv(kv, pca_policy(basis.digest, {"name": "dp-alloc", "bits": 2, "sink_tokens": 4}))
    h = read_header(stream)
    flat = h.sections[0][1].flat()  # V of layer 0: [state, meta_0, payload_0 (the sink), ...]
    b, heads, _, d = kv[0][1].shape
    assert flat[1] == 0 and flat[2] == 2 * b * heads * 4 * d  # no metadata, raw bfloat16
    off = h.header_nbytes + sum(h.sections[0][0].flat()) + flat[0]  # after K: V's sink
    for pattern in (b"\xc0\x7f", b"\x80\x7f", b"\x80\xff"):
        forged = bytearray(stream)
        forged[off + 2 : off + 4] = pattern
        body = bytes(forged[:-4])
        for impl in ("fast", "reference"):
            with pytest.raises(CorruptStreamError, match="layer 0 (V )?.*NaN or inf (bfloat16 )?value in (its|a) payload"):
                decode_kv(body + struct.pack("<I", zlib.crc32(body)), impl=impl)


def test_keep_per_head_before_pca_across_heads_is_refused(basis):
    """Each head keeping its own tokens would join different tokens' heads in one PCA row."""
    quant = {"name": "dp-alloc", "bits": 2}
    with pytest.raises(ConfigError, match="per_head: false"):
        PolicyConfig.from_dict({"transforms": [{"name": "keep", "fraction": 0.5}, {"name": "pca"}],
                                "key": quant, "value": quant})


def test_serving_finds_a_missing_or_unloaded_basis_when_the_policy_is_set_up(basis):
    from kvtune.serving.artifacts import basis_problem

    quant = {"name": "dp-alloc", "bits": 2}
    assert basis_problem(pca_policy(basis.digest, quant)) is None
    assert "without a basis" in basis_problem(PolicyConfig.from_dict({"transforms": ["pca"], "key": quant, "value": quant}))
    unloaded = pca_policy(basis.digest, quant).to_dict()
    unloaded["transforms"][0]["basis"] = unloaded["key"]["basis"] = unloaded["value"]["basis"] = "ab" * 32
    assert "abababababab" in basis_problem(PolicyConfig.from_dict(unloaded))


# ----------------------------------------------------------------------------- model-wide budget


def _modelled_bits(eigenvalues, widths, step) -> float:
    sig = torch.as_tensor(eigenvalues, dtype=torch.float64).sqrt()
    coded = torch.tensor([w > 0 for w in widths])
    return float(ecsq_gaussian(sig[coded] / step)[0].sum())


def test_allocate_across_layers_gives_the_sensitive_layer_a_finer_step_at_the_same_total_rate():
    eig = torch.logspace(1, -3, 24)
    (w0, s0), (w1, s1) = allocate_across_layers([eig, eig], [1.0, 16.0], 2.0, 8, "ecsq")
    assert s1 == s0 / 4  # delta_l = delta / sqrt(s_l), exact for a power of two
    assert sum(w1) > sum(w0) and all(b >= a for a, b in zip(w0, w1))
    total = _modelled_bits(eig, w0, s0) + _modelled_bits(eig, w1, s1)
    assert total == pytest.approx(2.0 * 48, rel=0.02)  # the shared budget, spent unevenly
    assert _modelled_bits(eig, w1, s1) > 1.5 * _modelled_bits(eig, w0, s0)
    # equal sensitivities: one allocation over the concatenated components
    widths, step = allocate_ecsq(torch.cat([eig, eig / 4]), 2.0 * 48, 8)
    assert allocate_across_layers([eig, eig / 4], [4.0, 4.0], 2.0, 8, "ecsq")[1] == (widths[24:], step)
    # fixed-rate grids: the greedy allocation on the weighted eigenvalues, round(bits * sum D) bits
    fixed = allocate_across_layers([[4.0, 1.0], [4.0, 1.0]], [1.0, 16.0], 1.5, 8, "minmax")
    assert fixed == (((1, 0), 0.0), ((3, 2), 0.0)) and sum(map(sum, (w for w, _ in fixed))) == 6


@pytest.mark.parametrize("sens", [[1.0], [1.0, 0.0], [1.0, float("nan")], [1.0, float("inf")]])
def test_allocate_across_layers_refuses_bad_sensitivities(sens):
    with pytest.raises(ConfigError, match="sensitivity"):
        allocate_across_layers([[1.0, 0.5], [1.0, 0.5]], sens, 2.0, 8, "ecsq")


def test_plans_made_before_the_codec_threads_keep_the_errors_in_layer_order(basis):
    """The fast path makes a KVTC policy's plans on the calling thread first (their bit
    allocations hold the GIL); a layer the basis lacks is still reported after an earlier
    layer's NaN, as the tasks report them, and the plans it made are the tasks' plans."""
    from kvtune.core.errors import KVInputError

    cfg = pca_policy(basis.digest, {"name": "dp-alloc", "bits": 2, "grid": "ecsq"}, "rans")
    kv = correlated_kv(3, 40, seed=11)  # the basis covers 2 layers
    kv[0] = (kv[0][0].clone(), kv[0][1])
    kv[0][0][0, 0, 5, 0] = float("nan")
    with pytest.raises(KVInputError, match=r"kv\[0\] K"):
        encode_kv(kv, cfg, impl="fast")
    with pytest.raises(BasisError, match="layers 0..1"):
        encode_kv(correlated_kv(3, 40, seed=11), cfg, impl="fast")
    ok = correlated_kv(2, 40, seed=12)
    comp = fastpath._compiled(cfg)
    comp.plans.clear()
    comp.warm(((kind, tuple(t.shape), i) for i, pair in enumerate(ok) for kind, t in zip(("key", "value"), pair)))
    assert len(comp.plans) == 4
    assert encode_kv(ok, cfg, impl="fast") == encode_kv(ok, cfg, impl="reference")


@pytest.fixture(scope="module")
def sensitive_basis(basis):
    b = dataclasses.replace(basis, sensitivity=((1.0, 1.0), (1.0, 64.0)))
    register_basis(b)
    return b


def test_dp_alloc_model_budget_plans_from_the_basis_sensitivity(basis, sensitive_basis):
    q = DPAlloc(bits=2, grid="ecsq", basis=sensitive_basis.digest, budget="model")
    shape = (1, HEADS, 10, DIM)
    (_, s0), (_, s1) = (q.allocation(shape, layer=i, kind="value") for i in (0, 1))
    assert s1 == s0 / 8
    assert q.allocation(shape, layer=0, kind="key") == allocate_across_layers(
        [basis.layers[0][0].eigenvalues, basis.layers[1][0].eigenvalues], [1.0, 1.0], 2, 8, "ecsq")[0]
    assert q.short_label() == "dp2/ecsq/model"
    assert "budget" not in DPAlloc(bits=2).to_dict() and q.to_dict()["budget"] == "model"  # old ids unchanged
    with pytest.raises(BasisError, match="sensitivity"):
        DPAlloc(bits=2, grid="ecsq", basis=basis.digest, budget="model").plan(shape, layer=0, kind="value")
    with pytest.raises(BasisError, match="layer 2"):
        q.plan(shape, layer=2, kind="value")


@pytest.mark.parametrize("grid", ["ecsq", "gauss"])
def test_dp_alloc_model_budget_round_trips_fast_as_reference(sensitive_basis, grid):
    kv = correlated_kv(2, 70, seed=9)
    cfg = pca_policy(sensitive_basis.digest, {"name": "dp-alloc", "bits": 2, "grid": grid, "budget": "model",
                                              "sink_tokens": 1}, "rans")
    stream = encode_kv(kv, cfg)
    assert stream == encode_kv(kv, cfg, impl="reference")
    fast, ref = decode_kv(stream, expect=cfg), decode_kv(stream, expect=cfg, impl="reference")
    for (k, v), (k2, v2), (k3, v3) in zip(kv, fast, ref):
        assert torch.equal(k2, k3) and torch.equal(v2, v3)
    err = [float((v - v2).square().mean()) for (_, v), (_, v2) in zip(kv, fast)]
    assert err[1] < err[0] / 4  # the 64x more sensitive layer's values are coded finer


def test_basis_sensitivity_is_stored_hashed_and_checked(basis, sensitive_basis, tmp_path):
    assert sensitive_basis.digest != basis.digest and "sensitivity" not in basis.header()
    back = load_basis(save_basis(sensitive_basis, tmp_path / "s.safetensors"), expect=sensitive_basis.digest)
    assert back.sensitivity == ((1.0, 1.0), (1.0, 64.0)) and back.layer_sensitivity("value") == (1.0, 64.0)
    with pytest.raises(BasisError, match="no per-layer sensitivity"):
        basis.layer_sensitivity("key")
    for bad in (((1.0, 1.0),), ((1.0, 1.0), (1.0, -2.0)), ((1.0, 1.0), (1.0, float("nan")))):
        with pytest.raises(BasisError, match="sensitivity"):
            dataclasses.replace(basis, sensitivity=bad)
    for i, value in enumerate((-1.0, "x", 0)):
        path = _forge_header(sensitive_basis, tmp_path, f"forged{i}.safetensors", _edit_basis_header("sensitivity", 1, value))
        with pytest.raises(BasisError, match="sensitivity"):
            load_basis(path)


def _continuation_loss(lm, kv, ids, context):
    from kvtune.evaluate.model import kv_to_cache

    cache = kv_to_cache([(k.clone(), v.clone()) for k, v in kv], lm.model.config, context_tokens=context)
    logits = lm.model(input_ids=ids[:, context:], cache=cache, use_cache=True).logits.double()
    return float(torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, context + 1 :], reduction="sum"))


def test_kv_gradients_match_finite_differences_and_sensitivity_averages_their_squares(tiny_model_dir):
    from kvtune.evaluate.calibrate_pca import kv_gradients, layer_sensitivity
    from kvtune.evaluate.model import cache_to_kv, forward_cache, load_model

    lm = load_model(str(tiny_model_dir), "cpu")
    ids = torch.randint(0, 100, (1, 24), generator=torch.Generator().manual_seed(1))
    context = 21  # what layer_sensitivity scores below: the last max(2, min(4, 24 // 8)) = 3 tokens
    grads = kv_gradients(lm, ids, context)
    assert len(grads) == lm.num_layers and grads[0][1].shape == (1, lm.kv_heads, context, lm.head_dim)
    with torch.no_grad():
        kv = [(k.double(), v.double()) for k, v in cache_to_kv(forward_cache(lm.model(input_ids=ids[:, :context], use_cache=True)))]
        lm.model.double()
        try:
            for layer, j in ((0, 1), (lm.num_layers - 1, 0)):
                u = torch.randn(kv[layer][j].shape, generator=torch.Generator().manual_seed(layer), dtype=torch.float64)
                eps = 1e-4
                moved = [list(p) for p in kv]
                moved[layer][j] = kv[layer][j] + eps * u
                up = _continuation_loss(lm, moved, ids, context)
                moved[layer][j] = kv[layer][j] - eps * u
                down = _continuation_loss(lm, moved, ids, context)
                assert (up - down) / (2 * eps) == pytest.approx(float((grads[layer][j].double() * u).sum()), rel=1e-2)  # float32 gradient
        finally:
            lm.model.float()
    sens = layer_sensitivity(lm, ids, key_rope="post", target_tokens=4, skip_tokens=2)
    assert sens[0][1] == pytest.approx(float(grads[0][1][:, :, 2:].double().square().mean()), rel=1e-6)
    assert len(sens) == lm.num_layers and all(v > 0 for pair in sens for v in pair)
    with pytest.raises(BasisError, match="no context"):
        layer_sensitivity(lm, ids[:, :6], skip_tokens=4)
    for kwargs in ({"key_rope": "bogus"}, {"skip_tokens": -5}, {"target_tokens": 0}):
        with pytest.raises(BasisError, match="layer_sensitivity"):
            layer_sensitivity(lm, ids, **kwargs)


def test_a_layer_whose_components_the_model_budget_drops_round_trips(basis):
    """A layer 10**6 times less sensitive than the other keeps (almost) no component: its elements
    outnumber its symbols, which the size rule allows through ``elements_per_symbol``."""
    b = dataclasses.replace(basis, sensitivity=((1e-6, 1e-6), (1.0, 1.0)))
    register_basis(b)
    kv = correlated_kv(2, 90, seed=10)
    cfg = pca_policy(b.digest, {"name": "dp-alloc", "bits": 0.5, "grid": "ecsq", "budget": "model",
                                "sink_tokens": 1}, "rans")
    shape = tuple(kv[0][1].shape)
    coded = [sum(1 for w in cfg.value.widths(shape, layer=i, kind="value") if w) for i in (0, 1)]
    assert coded[0] < coded[1] and cfg.value.elements_per_symbol(shape, layer=1, kind="value") == -(-HEADS * DIM // coded[1])
    stream = encode_kv(kv, cfg)
    assert stream == encode_kv(kv, cfg, impl="reference")
    header = read_stream(stream)[0]
    assert not fastpath.sizes_plausible(header) and fastpath.sizes_plausible(header, cfg)  # decoded on the fast path
    out, ref = decode_kv(stream, expect=cfg), decode_kv(stream, expect=cfg, impl="reference")
    assert all(torch.equal(a, b) for pair, rpair in zip(out, ref) for a, b in zip(pair, rpair))
    assert all(torch.isfinite(t).all() for pair in out for t in pair)


def test_sections_problem_scales_the_symbol_bound_by_elements_per_symbol():
    from kvtune.codecs.bitpack import BitPack
    from kvtune.codecs.policy import sections_problem
    from kvtune.codecs.stream import TensorSections

    secs = TensorSections.from_flat([b"", b"", bytes(2)])  # a 2-byte bit-packed payload: at most 16 symbols
    assert "at most 16" in sections_problem((1, 1, 8, 4), secs, BitPack())
    assert sections_problem((1, 1, 8, 4), secs, BitPack(), 2) is None
    assert "at most 32" in sections_problem((1, 1, 8, 5), secs, BitPack(), 2)
    # a quantizer that drops elements: at most MAX_ELEMENTS_PER_BYTE per section byte, whatever the symbol bound
    assert sections_problem((1, 1, 8, 1024), secs, BitPack(), 1024) is None
    assert "MAX_ELEMENTS_PER_BYTE" in sections_problem((1, 1, 9, 1024), secs, BitPack(), 2048)


@pytest.mark.parametrize("budget", ["model", "layer"])
def test_a_layer_that_would_code_nothing_codes_its_first_component(basis, budget):
    """Without sink tokens a layer whose allocation is empty still needs a segment."""
    b = dataclasses.replace(basis, sensitivity=((1.0, 1.0), (1e-2, 1e-2)))
    register_basis(b)
    kv = correlated_kv(2, 40, seed=9)
    bits = 0.5 if budget == "model" else 0.01
    cfg = pca_policy(b.digest, {"name": "dp-alloc", "bits": bits, "grid": "ecsq", "budget": budget}, "rans")
    shape = tuple(kv[1][0].shape)
    assert [w for w in cfg.key.widths(shape, layer=1, kind="key") if w] == [3]  # component 0 at the ecsq minimum
    out = decode_kv(encode_kv(kv, cfg), expect=cfg)
    assert all(torch.isfinite(t).all() for pair in out for t in pair)


def test_extreme_sensitivity_ratios_allocate_finite_steps(basis):
    eig = [basis.layers[0][1].eigenvalues, basis.layers[1][1].eigenvalues]
    ref = allocate_across_layers(eig, [1.0, 3.0], 2, 8, "ecsq")
    assert allocate_across_layers(eig, [1e300, 3e300], 2, 8, "ecsq") == ref  # only ratios matter
    (_, s0), (_, s1) = allocate_across_layers(eig, [1e300, 5e-324], 2, 8, "ecsq")
    assert math.isfinite(s0) and math.isfinite(s1) and s1 > s0  # floored at 1 / SENSITIVITY_RANGE
    b = dataclasses.replace(basis, sensitivity=((1e300, 1e300), (5e-324, 5e-324)))
    register_basis(b)
    cfg = pca_policy(b.digest, {"name": "dp-alloc", "bits": 2, "grid": "ecsq", "budget": "model", "sink_tokens": 1}, "rans")
    out = decode_kv(encode_kv(correlated_kv(2, 40, seed=3), cfg), expect=cfg)
    assert all(torch.isfinite(t).all() for pair in out for t in pair)


@pytest.mark.parametrize("args", [([], [], 2, 8, "ecsq"), ([[1.0]], [1.0], float("nan"), 8, "gauss"),
                                  ([[1.0]], [1.0], 0, 8, "gauss"), ([[1.0]], [1.0], 2, 8, "bogus"),
                                  ([[1.0]], ["1"], 2, 8, "ecsq"), ([[1.0]], [True], 2, 8, "ecsq")])
def test_allocate_across_layers_refuses_bad_arguments(args):
    with pytest.raises(ConfigError, match="allocate_across_layers"):
        allocate_across_layers(*args)


def test_a_model_budget_stream_without_its_basis_is_a_stream_error_and_serving_sees_it_first(basis, sensitive_basis):
    from kvtune.serving.artifacts import basis_problem

    kv = correlated_kv(2, 40, seed=4)
    cfg = pca_policy(sensitive_basis.digest, {"name": "dp-alloc", "bits": 2, "grid": "ecsq", "budget": "model"}, "rans")
    stream = encode_kv(kv, cfg)
    forget_basis(sensitive_basis.digest)
    try:
        for impl in ("auto", "reference"):
            with pytest.raises(KVStreamError, match="cannot decode layer 0"):
                decode_kv(stream, impl=impl)
    finally:
        register_basis(sensitive_basis)
    assert basis_problem(cfg) is None
    unmeasured = pca_policy(basis.digest, {"name": "dp-alloc", "bits": 2, "budget": "model"})
    assert "no per-layer sensitivity" in basis_problem(unmeasured)
