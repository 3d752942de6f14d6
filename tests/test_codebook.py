"""The ``codebook`` quantizer (kvtune.codecs.codebook): NF levels, the Lloyd-Max fit, its error
against ``uniform``, byte accounting, and forged codebooks in streams.

Round trips and fast path == reference bytes for the registered examples run in the component
matrix of test_codecs.py; the kernels against the reference in test_kernels.py.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from kvtune.codecs import PolicyConfig, decode_kv, encode_kv, read_header
from kvtune.codecs.codebook import (
    HIST_BINS,
    CodebookQuantizer,
    check_levels,
    fit_lloyd,
    lloyd_from_histogram,
    lloyd_histogram,
    nearest_level,
    nf_levels,
)
from kvtune.codecs.quantizers import UniformQuantizer
from kvtune.codecs.stream import read_stream, write_stream
from kvtune.core.errors import ConfigError, CorruptStreamError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# bitsandbytes' NF4 datatype (QLoRA, arXiv 2305.14314, appendix E)
NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
       0.7229568362236023, 1.0]


def gaussian(shape=(1, 4, 256, 128), seed=0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def mse(q, x: torch.Tensor) -> float:
    symbols, meta = q.quantize_block(x)
    return float(((q.dequantize_block(symbols, meta, x.shape) - x) ** 2).mean())


# ----------------------------------------------------------------------------- levels


def test_nf4_levels_are_the_published_nf4_values():
    assert nf_levels(4).tolist() == pytest.approx(NF4, abs=1e-6)


@pytest.mark.parametrize("bits", range(2, 9))
def test_nf_levels_are_sorted_normal_quantiles_with_an_exact_zero(bits):
    lv = nf_levels(bits)
    assert lv.shape == (2**bits,) and lv.dtype == torch.float64
    assert (lv[1:] > lv[:-1]).all()
    assert lv[0] == -1.0 and lv[-1] == 1.0 and int((lv == 0).sum()) == 1
    assert int((lv > 0).sum()) == 2 ** (bits - 1)  # one more positive level than negative ones
    with pytest.raises(ValueError, match="2..8"):
        nf_levels(1)


def test_lloyd_recovers_the_centres_of_a_mixture():
    """Normalised groups hold their extremes at -1 and 1 (the pinned end levels) and the rest in
    two clusters: the inner levels land on the clusters' centres."""
    g = torch.Generator().manual_seed(1)
    centres = torch.tensor([-0.35, 0.3])
    inner = centres[torch.randint(0, 2, (20000,), generator=g)] + 0.02 * torch.randn(20000, generator=g)
    u = torch.cat((inner, torch.tensor([-1.0, 1.0]).repeat(500)))
    lv = fit_lloyd(u, bits=2)
    assert lv.dtype == torch.float16 and lv.shape == (4,)
    assert lv.float().tolist() == pytest.approx([-1.0, -0.35, 0.3, 1.0], abs=3e-3)
    # NF's inner levels for 2 bits are 0 and 0.44: the fit moved them
    assert nf_levels(2).tolist() == pytest.approx([-1.0, 0.0, 0.4358, 1.0], abs=1e-4)


def test_lloyd_on_a_histogram_is_one_dimensional_k_means():
    """Point masses and a 4-level codebook started elsewhere: each inner level lands on the
    weighted mean of the masses nearest to it (their bin centres), the end levels stay where
    they started; a level without data stays where it is."""
    counts = torch.zeros(HIST_BINS, dtype=torch.int64)
    counts[[100, 1000, 1100, 3000]] = torch.tensor([5, 1, 3, 7])  # bin centres (2b + 1 - 4096) / 4096
    lv = lloyd_from_histogram(counts, torch.tensor([-0.9, -0.3, 0.2, 0.95], dtype=torch.float64))
    centre = [(2 * b + 1 - HIST_BINS) / HIST_BINS for b in (100, 1000, 1100, 3000)]
    assert lv.tolist() == [-0.9, (centre[1] + 3 * centre[2]) / 4, centre[3], 0.95]
    empty = lloyd_from_histogram(torch.zeros(HIST_BINS, dtype=torch.int64), nf_levels(3))
    assert torch.equal(empty, nf_levels(3))
    assert torch.equal(lloyd_histogram(torch.tensor([-1.0, -0.9999, 0.0, 1.0, 2.0]))[[0, 2048, 4095]],
                       torch.tensor([2, 1, 2]))


def test_nearest_level_ties_take_the_lower_level():
    lv = torch.tensor([-1.0, 0.0, 0.5, 1.0])
    u = torch.tensor([-1.0, -0.5, -0.4999, 0.25, 0.26, 0.75, 0.9, 1.0])
    assert nearest_level(u, lv).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


# ----------------------------------------------------------------------------- error


@pytest.mark.parametrize("granularity", ["per_token", "per_channel"])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_lloyd_error_on_gaussian_data_is_below_uniform_at_the_same_metadata(bits, granularity):
    """Lloyd with absmax groups vs symmetric uniform (one float16 scale per group each), with
    min/max groups vs asymmetric uniform (scale and zero point each): >= 5 % lower MSE
    (measured on this data at 3 bits per token: 0.0239 vs 0.0283 min/max, 0.0286 vs 0.0380
    absmax; 0.0056 vs 0.0062 min/max at 4 bits)."""
    x = gaussian()
    for normalize, symmetric in (("absmax", True), ("minmax", False)):
        cb = mse(CodebookQuantizer(bits=bits, levels="lloyd", normalize=normalize, granularity=granularity), x)
        uni = mse(UniformQuantizer(bits=bits, symmetric=symmetric, granularity=granularity), x)
        assert cb < 0.95 * uni, (normalize, cb, uni)


@pytest.mark.parametrize("bits", [3, 4])
def test_nf_error_on_gaussian_data_is_below_symmetric_uniform(bits):
    """Data-free NF levels beat the symmetric uniform grid of the same cost at 3 and 4 bits (at
    2 bits NF's levels -1, 0, 0.44, 1 are worse: the Lloyd fit is the 2-bit choice)."""
    x = gaussian(seed=2)
    nf = mse(CodebookQuantizer(bits=bits, levels="nf", normalize="absmax"), x)
    assert nf < 0.95 * mse(UniformQuantizer(bits=bits, symmetric=True), x)
    assert mse(CodebookQuantizer(bits=bits, normalize="absmax"), x) < nf


def test_zero_and_constant_groups_decode_exactly_with_nf():
    x = gaussian((1, 1, 64, 32), seed=3)
    x[0, 0, 5] = 0.0
    x[0, 0, 6] = -2.5  # float16-exact: its absmax scale, times the level -1
    q = CodebookQuantizer(bits=3, levels="nf", normalize="absmax", group_size=0)
    y = q.dequantize_block(*q.quantize_block(x), x.shape)
    assert torch.equal(y[0, 0, 5], x[0, 0, 5]) and torch.equal(y[0, 0, 6], x[0, 0, 6])
    assert (y - x).abs().max() <= x.abs().amax(-1, keepdim=True).max() * 0.5  # within a group's scale


# ----------------------------------------------------------------------------- bytes


def test_metadata_layout_and_lloyd_levels_are_counted_in_the_stream():
    q = CodebookQuantizer(bits=3, levels="lloyd", normalize="minmax", granularity="per_channel", recent_tokens=28)
    layouts = q.meta_layout((1, 3, 100, 64), layer=0, kind="key")
    assert [[(f.name, f.shape, f.dtype) for f in lay] for lay in layouts] == [
        [("levels", (8,), torch.float16), ("scale", (1, 3, 3, 64), torch.float16), ("zero", (1, 3, 3, 64), torch.float16)],
        [],  # the bfloat16 recent window
    ]
    x = [(gaussian((1, 3, 100, 64), seed=4), gaussian((1, 3, 100, 64), seed=5))]
    sizes = {}
    for levels in ("nf", "lloyd"):
        spec = {"name": "codebook", "bits": 3, "levels": levels, "granularity": "per_channel", "recent_tokens": 28}
        stream = encode_kv(x, PolicyConfig.from_dict({"key": spec, "value": dict(spec, granularity="per_token")}))
        h = read_header(stream)
        sizes[levels] = (h.meta_nbytes, h.payload_nbytes)
    assert sizes["lloyd"][0] - sizes["nf"][0] == 2 * 8 * 2  # K and V: 8 float16 levels each
    assert sizes["lloyd"][1] == sizes["nf"][1] == 2 * math.ceil(1 * 3 * 72 * 64 * 3 / 8) + 2 * 2 * 3 * 28 * 64


def test_parameters_are_validated():
    with pytest.raises(ConfigError, match="bits"):
        CodebookQuantizer(bits=1)
    with pytest.raises(ConfigError, match="levels"):
        CodebookQuantizer(levels="kmeans")
    with pytest.raises(ConfigError, match="normalize"):
        CodebookQuantizer(normalize="rms")
    assert CodebookQuantizer(bits=2, granularity="per_channel", recent_tokens=128).short_label() == "cb2llm/ch/g32/r128"
    assert CodebookQuantizer(levels="nf", normalize="absmax", group_size=0).short_label() == "cb3nf/tok"


# ----------------------------------------------------------------------------- forged codebooks

LLOYD = PolicyConfig.from_dict({
    "key": {"name": "codebook", "bits": 2, "levels": "lloyd", "granularity": "per_channel", "recent_tokens": 8},
    "value": {"name": "codebook", "bits": 3, "levels": "lloyd", "normalize": "minmax"},
})


def forge_levels(stream: bytes, levels: np.ndarray) -> bytes:
    """The stream with layer 0's K codebook replaced by ``levels`` (float16, written as they
    are) and every checksum recomputed: an intact stream whose content is wrong."""
    h, sections = read_stream(stream)
    flat = [[[bytes(p) for p in t.flat()] for t in layer] for layer in sections]
    meta = flat[0][0][1]
    flat[0][0][1] = levels.astype("<f2").tobytes() + meta[8:]  # K has 2 bits: 4 levels
    return write_stream(policy=h.policy, policy_id=h.policy_id, layer_offset=h.layer_offset, dtype=h.dtype,
                        shapes=h.shapes, sections=flat)


@pytest.mark.parametrize("impl", ["reference", "fast", "torch"])
def test_forged_codebooks_are_corrupt_streams_on_every_path(impl):
    kv = [(gaussian((1, 2, 40, 16), seed=6), gaussian((1, 2, 40, 16), seed=7))]
    stream = encode_kv(kv, LLOYD, impl="reference")
    assert stream == encode_kv(kv, LLOYD, impl="fast") == encode_kv(kv, LLOYD, impl="torch")
    good = decode_kv(stream, expect=LLOYD, impl=impl)
    _, sections = read_stream(stream)
    lv = np.frombuffer(bytes(sections[0][0].meta[0]), "<f2", count=4)
    assert (np.diff(lv) > 0).all() and np.abs(lv).max() <= 1  # the genuine codebook
    assert all(torch.equal(a, b) for a, b in zip(decode_kv(forge_levels(stream, lv.copy()), impl=impl)[0], good[0]))
    for bad, what in (
        (np.array([-1.0, np.nan, 0.2, 1.0]), "finite"),
        (np.array([-1.0, np.inf, 0.2, 1.0]), "finite"),
        (np.array([-1.0, 0.3, 0.2, 1.0]), "sorted"),
        (np.array([-1.0, -0.2, 0.2, 2.0]), "within"),
        (np.array([-60000.0, -0.2, 0.2, 1.0]), "within"),
    ):
        with pytest.raises(CorruptStreamError, match=what):
            decode_kv(forge_levels(stream, bad), impl=impl)
    # a codebook of the wrong size is a metadata section of the wrong length
    with pytest.raises(CorruptStreamError, match="metadata"):
        decode_kv(forge_levels(stream, np.array([-1.0, 0.0, 1.0])), impl=impl)


def test_lloyd_streams_decode_on_the_batch_route_and_refuse_forged_codebooks_as_the_reference_does():
    """The batch kernels check fitted codebooks themselves (``bad_codebook``), so a Lloyd policy
    decodes in one call per codec thread; a forged codebook gets the reference's error."""
    from kvtune.codecs import fastpath

    kv = [(gaussian((1, 2, 40, 16), seed=8 + i), gaussian((1, 2, 40, 16), seed=18 + i)) for i in range(3)]
    stream = encode_kv(kv, LLOYD)
    header = read_header(stream)
    assert fastpath.decode_plan(LLOYD, header, torch.float32) is not None
    out = [(torch.empty_like(k), torch.empty_like(v)) for k, v in kv]
    decode_kv(stream, out=out, impl="fast")
    assert all(torch.equal(a, b) for pa, pb in zip(out, decode_kv(stream, impl="reference")) for a, b in zip(pa, pb))
    for bad in (np.array([-1.0, 0.3, 0.2, 1.0]), np.array([-1.0, -0.2, 0.2, 2.0]), np.array([-1.0, np.nan, 0.2, 1.0])):
        forged = forge_levels(stream, bad)
        with pytest.raises(CorruptStreamError) as ref:
            decode_kv(forged, impl="reference")
        with pytest.raises(CorruptStreamError) as fast:
            decode_kv(forged, impl="fast")
        assert type(fast.value) is type(ref.value) and str(fast.value) == str(ref.value)
    for fine in (np.array([-1.0, -1.0, 0.5, 1.0]), np.array([-0.0, 0.0, 0.0, 1.0])):  # repeats and -0 are allowed
        forged = forge_levels(stream, fine)
        assert all(torch.equal(a, b) for pa, pb in zip(decode_kv(forged, impl="fast"), decode_kv(forged, impl="reference"))
                   for a, b in zip(pa, pb))


def test_several_corruptions_raise_the_reference_error_on_every_path():
    """A NaN float16 anywhere in the metadata is reported before a bad codebook of an earlier
    layer, as the reference (which checks the whole stream's metadata first) does."""
    kv = [(gaussian((1, 2, 40, 16), seed=30 + i), gaussian((1, 2, 40, 16), seed=40 + i)) for i in range(2)]
    h, sections = read_stream(encode_kv(kv, LLOYD))
    flat = [[[bytes(p) for p in t.flat()] for t in layer] for layer in sections]
    for layer, levels in ((0, [-1.0, 0.3, 0.2, 1.0]), (1, [-1.0, np.nan, 0.2, 1.0])):  # K: 2 bits, 4 levels
        flat[layer][0][1] = np.array(levels).astype("<f2").tobytes() + flat[layer][0][1][8:]
    forged = write_stream(policy=h.policy, policy_id=h.policy_id, layer_offset=h.layer_offset, dtype=h.dtype,
                          shapes=h.shapes, sections=flat)
    for impl in ("reference", "fast", "torch", "auto"):
        with pytest.raises(CorruptStreamError, match="layer 1 K has a NaN or inf float16 in its metadata"):
            decode_kv(forged, impl=impl)


def test_check_levels_names_the_bad_level():
    check_levels(torch.tensor([-1.0, -1.0, 0.0, 1.0]))  # repeated levels are allowed (a code never used)
    with pytest.raises(CorruptStreamError, match="level 2 .* below level 1"):
        check_levels(torch.tensor([-1.0, 0.5, 0.25, 1.0]))
    with pytest.raises(CorruptStreamError, match="level 0 is nan"):
        check_levels(torch.tensor([float("nan"), 0.5], dtype=torch.float16))


# ----------------------------------------------------------------------------- calibrated codebooks


CAL = {"name": "codebook", "bits": 3, "levels": "calibrated", "granularity": "per_token", "recent_tokens": 8}


def _contexts(n: int, seed: int, layers: int = 2, tokens: int = 40):
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(1, 2, tokens, 32, generator=g) * (1 + layer), torch.distributions.Laplace(0, 1).sample(
        (1, 2, tokens, 32))) for layer in range(layers)] for _ in range(n)]


def test_a_calibrated_codebook_is_the_lloyd_fit_of_all_calibration_values_pooled():
    from kvtune.evaluate.calibrate_codebook import fit_codebooks

    torch.manual_seed(0)
    cfg = PolicyConfig.from_dict({"key": CAL, "value": {**CAL, "normalize": "absmax"}})
    contexts = _contexts(3, seed=1)
    for kind, quant in (("key", cfg.key), ("value", cfg.value)):
        table = fit_codebooks(cfg, kind, contexts)
        assert len(table) == 2
        for layer in range(2):
            # the normalised values outside the recent window, every context concatenated: one fit
            body = [kv[layer][0 if kind == "key" else 1][:, :, :32] for kv in contexts]
            u = torch.cat([quant.coder(3)._normalized(x)[0].reshape(-1) for x in body])
            assert table[layer] == tuple(fit_lloyd(u, 3).double().tolist())
            assert table[layer][0] == -1.0 and table[layer][-1] == 1.0
    # keys (Gaussian) and values (Laplacian, absmax) get different levels
    assert fit_codebooks(cfg, "key", contexts)[0] != fit_codebooks(cfg, "value", contexts)[0]


def test_calibrated_codebooks_see_the_values_after_the_transforms_and_ignore_token_selection():
    from kvtune.evaluate.calibrate_codebook import calibrate_codebooks, codebook_key, fit_codebooks

    contexts = _contexts(2, seed=2)
    plain = PolicyConfig.from_dict({"key": CAL, "value": CAL})
    rotated = PolicyConfig.from_dict({"transforms": ["hadamard"], "key": CAL, "value": CAL})
    kept = PolicyConfig.from_dict({"transforms": [{"name": "keep", "fraction": 0.5}, "hadamard"], "key": CAL, "value": CAL})
    assert fit_codebooks(plain, "key", contexts) != fit_codebooks(rotated, "key", contexts)
    assert codebook_key(rotated, "key") == codebook_key(kept, "key") != codebook_key(plain, "key")
    assert codebook_key(rotated, "key") != codebook_key(rotated, "value")
    cache: dict = {}
    ready = calibrate_codebooks(rotated, contexts, cache)
    assert sorted(cache) == sorted({codebook_key(rotated, "key"), codebook_key(rotated, "value")})
    assert ready.key.codebooks == fit_codebooks(rotated, "key", contexts) and not ready.needs_codebooks
    as_tensor = rotated.with_codebooks({k: torch.tensor(getattr(ready, k).codebooks, dtype=torch.float16)
                                        for k in ("key", "value")})
    assert as_tensor == ready and as_tensor.policy_id == ready.policy_id
    calls = []
    assert calibrate_codebooks(kept, lambda: calls.append(1) or contexts, cache).key.codebooks == ready.key.codebooks
    assert calls == []  # read from the cache: no contexts needed
    assert calibrate_codebooks(ready, lambda: calls.append(1)) is ready and calls == []


def test_calibrated_policies_encode_with_their_layers_levels_and_refuse_what_they_lack():
    from kvtune.evaluate.calibrate_codebook import calibrate_codebooks, fit_codebooks

    cfg = PolicyConfig.from_dict({"key": CAL, "value": CAL})
    kv = _contexts(1, seed=3)[0]
    with pytest.raises(ConfigError, match="need codebooks from a calibration pass"):
        encode_kv(kv, cfg)
    with pytest.raises(ConfigError, match="at least one calibration context"):
        fit_codebooks(cfg, "key", [])
    with pytest.raises(ConfigError, match="has no calibrated levels"):
        fit_codebooks(PolicyConfig.kivi(2), "key", [kv])
    ready = calibrate_codebooks(cfg, _contexts(2, seed=4))
    stream = encode_kv(kv, ready)
    assert stream == encode_kv(kv, ready, impl="reference")
    (k0, v0), (k1, v1) = decode_kv(stream, expect=ready)
    # each layer decodes to levels of its own codebook: the body's values are level * scale + zero
    for layer, v in ((0, v0), (1, v1)):
        q = ready.value.quantize(kv[layer][1], layer=layer, kind="value")
        body = next(p for p in q.parts if p.bits == 3)
        assert body.segment.coder.codebooks == (ready.value.codebooks[layer],)
    with pytest.raises(ConfigError, match="cover layers 0..1; got layer 2"):
        encode_kv(kv, ready, layer_offset=1)
    # swapping the layers' codebooks changes the policy and the bytes
    swapped = ready.with_codebooks({"key": ready.key.codebooks, "value": ready.value.codebooks[::-1]})
    assert swapped.policy_id != ready.policy_id and encode_kv(kv, swapped)[64:] != stream[64:]
    with pytest.raises(ConfigError, match="has no calibrated levels"):
        PolicyConfig.kivi(2).with_codebooks({"key": ready.key.codebooks})
    with pytest.raises(ConfigError, match="no value codebooks"):
        cfg.with_codebooks({"key": ready.key.codebooks})


OK8 = [-1.0, -0.5, -0.25, 0.0, 0.125, 0.25, 0.5, 1.0]  # float16 values, sorted


@pytest.mark.parametrize("codebooks, match", [
    ([[-1, -0.5, 0, 0.5, 1]], r"codebooks\[0\] must be a list of 8 levels"),
    ([OK8[:7] + [1.5]], r"codebooks\[0\]\[7\] is 1.5: levels must be float16 values within \[-1, 1\]"),
    ([OK8[:7] + [float("nan")]], r"codebooks\[0\]\[7\] is nan"),
    ([OK8[:7] + [1.0001]], r"codebooks\[0\]\[7\] is 1.0001"),
    ([OK8[:6] + [0.30001, 1]], r"codebooks\[0\]\[6\] is 0.30001: levels must be float16"),
    ([OK8, OK8[:6] + [0.125, 1]], r"codebooks\[1\]\[6\] \(0.125\) is below level 5"),
    ([["a"] * 8], r"codebooks\[0\] must hold numbers"),
    ([[True] * 8], r"codebooks\[0\] must hold numbers"),
    ("abc", r"parameter .codebooks. = .abc. is invalid; allowed: a list"),
])
def test_forged_calibrated_codebooks_are_refused_when_the_policy_is_built(codebooks, match):
    spec = {**CAL, "codebooks": codebooks}
    with pytest.raises(ConfigError, match=match):
        PolicyConfig.from_dict({"key": spec, "value": spec})


def test_calibrated_codebooks_round_trip_through_json_and_name_the_policy():
    spec = {**CAL, "codebooks": [OK8, OK8[:7] + [0.75]]}
    cfg = PolicyConfig.from_dict({"key": spec, "value": spec})
    assert cfg.key.codebooks == (tuple(OK8), tuple(OK8[:7] + [0.75]))
    assert PolicyConfig.from_json(cfg.to_json()) == cfg
    other = PolicyConfig.from_dict({"key": spec, "value": {**spec, "codebooks": [OK8, OK8]}})
    assert other.label == cfg.label == "identity|K:cb3clm/tok/g32/r8|V:cb3clm/tok/g32/r8|bitpack"
    assert other.policy_id != cfg.policy_id


def test_codebooks_go_with_calibrated_levels_only():
    with pytest.raises(ConfigError, match="'codebooks' goes with levels='calibrated', not 'lloyd'"):
        CodebookQuantizer(levels="lloyd", codebooks=((-1.0, 0.0, 0.5, 1.0),), bits=2)


def test_a_run_fits_codebooks_once_on_its_calibration_contexts_and_reads_them_back(tiny_model_dir, tmp_path):
    import json

    from kvtune.evaluate.calibrate_codebook import codebook_key, fit_codebooks
    from kvtune.evaluate.capture import capture
    from kvtune.evaluate.model import load_model
    from kvtune.core.errors import KvtuneError
    from kvtune.methods.tqc.profile import codebook_calibrator

    lm = load_model(str(tiny_model_dir), "cpu")
    ids = torch.randint(0, 100, (2, 40), generator=torch.Generator().manual_seed(5))
    cfg = PolicyConfig.from_dict({"transforms": ["hadamard"], "key": {**CAL, "granularity": "per_channel"}, "value": CAL})
    calls = []
    ready = codebook_calibrator(lm, lambda: calls.append(1) or ids, tmp_path)(cfg)
    cap = capture(lm, ids, 40, baseline=False)
    contexts = [cap.context_kv(i) for i in range(cap.num_contexts)]
    assert calls == [1] and ready.key.codebooks == fit_codebooks(cfg, "key", contexts)
    assert len(ready.value.codebooks) == lm.num_layers
    stored = json.loads((tmp_path / "calibration.json").read_text())["codebooks"]
    assert sorted(stored) == sorted(codebook_key(cfg, k) for k in ("key", "value"))
    # read back, never refitted: the contexts are not even made
    assert codebook_calibrator(lm, lambda: calls.append(1) or ids, tmp_path)(cfg) == ready and calls == [1]
    stored[codebook_key(cfg, "key")][0][3] = 2.0  # an edited file is refused, not replaced
    (tmp_path / "calibration.json").write_text(json.dumps({"codebooks": stored}))
    with pytest.raises(ConfigError, match=r"codebooks\[0\]\[3\] is 2.0"):
        codebook_calibrator(lm, ids, tmp_path)(cfg)
    (tmp_path / "calibration.json").write_text(json.dumps({"codebooks": [1, 2]}))
    with pytest.raises(KvtuneError, match="codebooks must be an object"):
        codebook_calibrator(lm, ids, tmp_path)(cfg)


# ----------------------------------------------------------------------------- calibrated: bad input


def _calibrated_stream():
    from kvtune.evaluate.calibrate_codebook import calibrate_codebooks

    cfg = calibrate_codebooks(PolicyConfig.from_dict({"key": CAL, "value": CAL}), _contexts(1, seed=8))
    kv = _contexts(1, seed=9)[0]
    return cfg, kv, encode_kv(kv, cfg)


@pytest.mark.parametrize("impl", ["reference", "fast"])
@pytest.mark.parametrize("level, match", [(-10**400, r"codebooks\[1\]\[2\] is -1000"), (0.3, "float16 values"),
                                          (2, "within"), ("x", "must hold numbers")],
                         ids=["huge-int", "not-float16", "out-of-range", "string"])
def test_a_stream_whose_policy_carries_forged_codebooks_is_a_kv_stream_error(impl, level, match):
    """Every checksum of the forged stream is right: the policy itself is refused."""
    from kvtune.core.errors import KVStreamError

    _, _, stream = _calibrated_stream()
    h, sections = read_stream(stream)
    policy = json.loads(json.dumps(h.policy))
    policy["value"]["codebooks"][1][2] = level
    flat = [[[bytes(p) for p in t.flat()] for t in layer] for layer in sections]
    forged = write_stream(policy=policy, policy_id=h.policy_id, layer_offset=h.layer_offset, dtype=h.dtype,
                          shapes=h.shapes, sections=flat)
    with pytest.raises(KVStreamError, match=match):
        decode_kv(forged, impl=impl)


def test_a_negative_zero_level_is_zero_so_that_policies_and_decoders_agree():
    neg = [-1.0, -0.5, -0.25, -0.0, 0.125, 0.25, 0.5, 1.0]
    spec = {**CAL, "normalize": "absmax", "codebooks": [neg, neg]}
    cfg = PolicyConfig.from_dict({"key": spec, "value": spec})
    assert all(math.copysign(1.0, v) > 0 for v in cfg.key.codebooks[0][3:4])
    pos = PolicyConfig.from_dict({"key": {**spec, "codebooks": [OK8, OK8]}, "value": {**spec, "codebooks": [OK8, OK8]}})
    assert pos == cfg and pos.policy_id == cfg.policy_id and "-0.0" not in cfg.to_json()  # one policy, not two
    kv = [(gaussian((1, 2, 64, 32), seed=1) * 0.01, gaussian((1, 2, 64, 32), seed=2) * 0.01) for _ in range(2)]
    stream = encode_kv(kv, cfg, impl="fast")
    assert stream == encode_kv(kv, cfg, impl="reference")
    fast, ref = decode_kv(stream, impl="fast"), decode_kv(stream, impl="reference")
    for (a, b), (c, d) in zip(fast, ref):  # bit for bit: -0.0 and 0.0 differ
        assert torch.equal(a.view(torch.int32), c.view(torch.int32)) and torch.equal(b.view(torch.int32), d.view(torch.int32))


def test_malformed_calibration_input_is_a_typed_error_before_any_fit(caplog):
    from kvtune.codecs.codebook import MAX_CODEBOOK_LAYERS
    from kvtune.core.errors import KVInputError, KVInputTypeError
    from kvtune.evaluate.calibrate_codebook import calibrate_codebooks, codebook_key, fit_codebooks

    cfg = PolicyConfig.from_dict({"key": CAL, "value": CAL})
    ok = _contexts(1, seed=10)[0]
    with pytest.raises(ConfigError, match="codebooks for 0 layers"):
        cfg.with_codebooks({"key": [], "value": []})
    with pytest.raises(ConfigError, match="with_codebooks takes"):
        cfg.with_codebooks([1])
    with pytest.raises(ConfigError, match="no layers"):
        calibrate_codebooks(cfg, [[]])
    with pytest.raises(ConfigError, match="kind must be 'key' or 'value'"):
        codebook_key(cfg, "keys")
    with pytest.raises(ConfigError, match="kind must be"):
        fit_codebooks(cfg, "foo", [ok])
    nan = [(k.clone(), v.clone()) for k, v in ok]
    nan[1][1][0, 1, 5, 3] = float("nan")
    with pytest.raises(KVInputError, match="calibration context 1: kv\\[1\\] V"):
        fit_codebooks(cfg, "value", [ok, nan])
    huge = [(k.clone(), v.clone()) for k, v in ok]
    huge[0][0][0, 0, 2, 0] = 1e6
    with pytest.raises(KVInputError, match="layer 0 key"):
        fit_codebooks(cfg, "key", [huge])
    with pytest.raises(KVInputTypeError, match="calibration context 0: kv\\[0\\] must be a \\(K, V\\) pair"):
        fit_codebooks(cfg, "key", [[(ok[0][0],)]])
    with pytest.raises(KVInputError, match="calibration context 0: kv\\[0\\] K must be a"):
        fit_codebooks(cfg, "key", [[(ok[0][0][0], ok[0][1])]])
    with pytest.raises(ConfigError, match=f"cover {MAX_CODEBOOK_LAYERS + 1} layers; at most {MAX_CODEBOOK_LAYERS}"):
        cfg.with_codebooks({"key": [OK8] * (MAX_CODEBOOK_LAYERS + 1), "value": [OK8]})
    with pytest.raises(ConfigError, match="nested too deeply"):
        PolicyConfig.from_json("[" * 100_000 + "]" * 100_000)
    # contexts no longer than the recent window: nothing to fit, NF levels and a warning
    short = [(k[:, :, :8], v[:, :, :8]) for k, v in ok]
    with caplog.at_level("WARNING"):
        table = fit_codebooks(cfg, "key", [short])
    assert table[0] == tuple(nf_levels(3).float().half().double().tolist()) and "NF levels" in caplog.text


def test_a_run_refuses_recorded_codebooks_that_do_not_fit_its_model(tiny_model_dir, tmp_path):
    from kvtune.core.errors import KvtuneError
    from kvtune.evaluate.calibrate_codebook import codebook_key
    from kvtune.evaluate.model import load_model
    from kvtune.methods.tqc.profile import codebook_calibrator
    from kvtune.serving.artifacts import codebook_problems

    lm = load_model(str(tiny_model_dir), "cpu")
    cfg = PolicyConfig.from_dict({"key": CAL, "value": CAL})
    key = codebook_key(cfg, "key")
    path = tmp_path / "calibration.json"
    for entry, error, match in (
        ({key: [OK8] * (lm.num_layers + 1)}, ConfigError, f"codebooks.{key} .key codebooks of .*cover 3 layers; the model has 2"),
        ({key: None}, ConfigError, f"calibration.json: codebooks.{key} .*must be a list of per-layer lists"),
        ({key: [OK8[:7]] * 2}, ConfigError, r"codebooks\[0\] must be a list of 8 levels"),
        (False, KvtuneError, "codebooks must be an object"),
        ([], KvtuneError, "codebooks must be an object"),
    ):
        path.write_text(json.dumps({"codebooks": entry}))
        with pytest.raises(error, match=match):
            codebook_calibrator(lm, lambda: pytest.fail("a recorded entry must not be refitted"), tmp_path)(cfg)
    one = PolicyConfig.from_dict({"key": {**CAL, "codebooks": [OK8]}, "value": {**CAL, "codebooks": [OK8, OK8]}})
    assert codebook_problems({"p": one}, num_layers=2) == ["policy p has key codebooks for 1 layers"]
    assert codebook_problems({"p": one}, num_layers=1) == ["policy p has value codebooks for 2 layers"]
