"""kvtune.serving.paged: probing vLLM's paged block layout and copying KV in and out of it.

The writers below stand in for the engine's cache-write kernel, one per layout vLLM's CPU
attention kernels use (token-major; channel-major keys of ``vec``; AMX's pairs: keys as channel
pairs of each token, values as token pairs of each channel). The real kernel runs in
tests/test_vllm_connector.py.
"""

from __future__ import annotations

import pytest
import torch

from kvtune.serving.artifacts import ModelMismatchError
from kvtune.serving.paged import PagedLayout, gather_blocks, paged_geometry, probe_layout, scatter_blocks


def _token_major(bs, d):
    return torch.arange(bs * d)


def _channel_major(bs, d):
    return torch.arange(bs * d).view(bs, d).t().reshape(-1)


def _channel_pairs(bs, d):
    """Memory ``[c // 2][t][c % 2]``: the AMX kernels' keys."""
    return torch.arange(bs * d).view(bs, d // 2, 2).permute(1, 0, 2).reshape(-1)


def _token_pairs(bs, d):
    """Memory ``[t // 2][c][t % 2]``: the AMX kernels' values."""
    return torch.arange(bs * d).view(bs // 2, 2, d).permute(0, 2, 1).reshape(-1)


def make_writer(key_order, value_order, *, drop=False, head_shift=False):
    """A cache-write kernel storing logical element ``order[p]`` at memory position ``p`` of
    each half (``order`` int64 ``(bs * d,)``); ``drop``: the last element is never written;
    ``head_shift``: head 1 uses the order rolled by one position."""

    def write(key, value, key_cache, value_cache, slots):
        nb, h, bs, d = key_cache.shape
        for x, cache, order in ((key, key_cache, key_order), (value, value_cache, value_order)):
            for hh in range(h):
                o = order.roll(1) if head_shift and hh == 1 else order
                inv = torch.empty_like(o)
                inv[o] = torch.arange(o.numel())
                for i, s in enumerate(slots.tolist()):  # token i goes to slot s
                    blk, t = divmod(s, bs)
                    pos = inv[t * d + torch.arange(d)]
                    keep = pos != bs * d - 1 if drop else torch.ones(d, dtype=torch.bool)
                    cache[blk, hh, pos[keep] // d, pos[keep] % d] = x[i, hh][keep]

    return write


LAYOUTS = {
    "token-major": (_token_major, _token_major, "keys token-major, values token-major"),
    "vec": (_channel_major, _token_major, "keys channel-major, values token-major"),
    "amx": (_channel_pairs, _token_pairs, "keys packed, values packed"),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_probe_then_gather_and_scatter_round_trip(name):
    key_fn, value_fn, described = LAYOUTS[name]
    h, bs, d, nb = 3, 8, 6, 5
    write = make_writer(key_fn(bs, d), value_fn(bs, d))
    layout = probe_layout(write, kv_heads=h, block_size=bs, head_dim=d, dtype=torch.bfloat16)
    assert repr(layout) == f"PagedLayout({described})"
    assert (layout.key_order is None) == (name == "token-major")
    # the engine writes a request of 2.5 blocks into blocks 3, 0, 4 (slots in that order)
    g = torch.Generator().manual_seed(0)
    tokens, blocks = 20, [3, 0, 4]
    k = torch.randn(tokens, h, d, generator=g).to(torch.bfloat16)
    v = torch.randn(tokens, h, d, generator=g).to(torch.bfloat16)
    engine = torch.zeros(nb, h, bs, 2 * d, dtype=torch.bfloat16)
    view = engine.view(nb, h, 2 * bs, d)
    slots = torch.tensor([blocks[t // bs] * bs + t % bs for t in range(tokens)])
    write(k, v, view[:, :, :bs], view[:, :, bs:], slots)
    gk, gv = gather_blocks(engine, blocks, tokens, layout)
    assert gk.shape == (1, h, tokens, d) and gk.is_contiguous()
    assert torch.equal(gk[0], k.transpose(0, 1)) and torch.equal(gv[0], v.transpose(0, 1))
    # scatter the two whole blocks into another instance's blocks 1 and 2: the same memory as
    # the engine's own kernel writes there
    other = torch.zeros_like(engine)
    scatter_blocks(other, [1, 2], gk, gv, 0, 2 * bs, layout)
    want = torch.zeros_like(engine)
    wv = want.view(nb, h, 2 * bs, d)
    write(k[: 2 * bs], v[: 2 * bs], wv[:, :, :bs], wv[:, :, bs:], torch.arange(bs, 3 * bs))
    assert torch.equal(other, want)


@pytest.mark.parametrize("fault", ["drop", "head_shift"])
def test_probe_refuses_a_layout_that_is_not_one_permutation(fault):
    order = _channel_pairs(8, 4)
    write = make_writer(order, order, **{fault: True})
    with pytest.raises(ModelMismatchError, match="key blocks in a layout kvtune cannot read"):
        probe_layout(write, kv_heads=2, block_size=8, head_dim=4, dtype=torch.bfloat16)


def test_probe_refuses_blocks_its_values_cannot_name():
    with pytest.raises(ModelMismatchError, match="at most 256"):
        probe_layout(make_writer(None, None), kv_heads=1, block_size=512, head_dim=64, dtype=torch.bfloat16)


def test_layout_of_another_geometry_is_refused():
    layout = PagedLayout(None, None, block_size=16, head_dim=4)
    cache = torch.zeros(2, 1, 8, 8)  # blocks of 8 tokens x 4 channels
    with pytest.raises(ModelMismatchError, match="probed for blocks of 16 tokens x 4 channels, the cache has 8 x 4"):
        gather_blocks(cache, [0], 8, layout)
    with pytest.raises(ModelMismatchError, match="probed for blocks of 16"):
        scatter_blocks(cache, [0], torch.zeros(1, 1, 8, 4), torch.zeros(1, 1, 8, 4), 0, 8, layout)


def test_scatter_checks_range_and_shapes():
    layout = PagedLayout(None, None, block_size=4, head_dim=2)
    cache = torch.zeros(3, 2, 4, 4)
    kv = torch.zeros(1, 2, 8, 2)
    with pytest.raises(ModelMismatchError, match=r"token range \[2, 8\) is not aligned to blocks of 4"):
        scatter_blocks(cache, [0, 1], kv, kv, 2, 8, layout)
    with pytest.raises(ModelMismatchError, match=r"K of shape \(1, 3, 8, 2\) does not fit"):
        scatter_blocks(cache, [0, 1], torch.zeros(1, 3, 8, 2), kv, 0, 8, layout)
    assert paged_geometry(cache) == (3, 2, 4, 2)
    with pytest.raises(ModelMismatchError, match="unsupported paged KV layout"):
        paged_geometry(torch.zeros(3, 2, 4, 3))
