"""Tensors spooled to an unlinked temporary file (the continuation baseline's log-probabilities)."""

from __future__ import annotations

import os

import pytest
import torch

from kvtune.evaluate.metrics import ContinuationBaseline, continuation_scores, continuation_token_stats
from kvtune.evaluate.metrics import summarize_continuation
from kvtune.evaluate.spool import DiskTensor, SpoolError


def test_rows_written_in_batches_read_back_exactly_and_leave_no_file(tmp_path):
    data = torch.randn(5, 3, 7)
    t = DiskTensor.empty((5, 3, 7), folder=str(tmp_path))
    assert list(tmp_path.iterdir()) == []  # unlinked at once: nothing to clean up after a kill
    t.write(0, data[:2])
    t.write(2, data[2:])
    assert torch.equal(t.read(), data) and t.nbytes == 5 * 3 * 7 * 4
    view = t[1:4]
    assert len(view) == 3 and torch.equal(view.read(), data[1:4]) and torch.equal(view[1:2].read(), data[2:3])
    assert len(t[4:2]) == 0 and t[4:2].read().shape == (0, 3, 7)
    view.close()  # a view does not own the file
    assert torch.equal(t.read(), data)
    with pytest.raises(ValueError, match="do not fit"):
        t.write(4, data[:2])
    with pytest.raises(ValueError, match="do not fit"):
        t.write(0, data[:1].double())
    with pytest.raises(TypeError, match="contiguous row ranges"):
        t[::2]


def test_a_cut_file_raises_instead_of_returning_zeros(tmp_path):
    t = DiskTensor.empty((4, 8), folder=str(tmp_path))
    t.write(0, torch.ones(4, 8))
    os.ftruncate(t.fd, 3 * 8 * 4 + 5)
    assert torch.equal(t[:3].read(), torch.ones(3, 8))
    with pytest.raises(SpoolError, match="ends 27 bytes early"):
        t.read()
    t.close()
    with pytest.raises(SpoolError, match="reading"):
        t.read()


def test_a_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(SpoolError, match=r"cannot keep 0\.00 GB of baseline in .*nowhere.*\$TMPDIR"):
        DiskTensor.empty((2, 2), folder=str(tmp_path / "nowhere"))


def test_a_spooled_baseline_scores_exactly_like_one_in_memory():
    torch.manual_seed(0)
    base_logits, logits = torch.randn(6, 5, 11) * 3, torch.randn(6, 5, 11) * 3
    ids = torch.randint(0, 11, (6, 5))
    parts = [ContinuationBaseline.from_logits(base_logits[a : a + 4], ids[a : a + 4]) for a in (0, 4)]
    spooled = ContinuationBaseline.from_batches(iter(parts), 6, spool=True)
    assert isinstance(spooled.logp, DiskTensor)
    stats = [continuation_token_stats(spooled.rows(a, b), logits[a:b]) for a, b in ((0, 4), (4, 6))]
    got = summarize_continuation({k: torch.cat([s[k] for s in stats]) for k in stats[0]})
    want = continuation_scores(base_logits, logits, ids)
    assert all(torch.equal(got[k], want[k]) if torch.is_tensor(want[k]) else got[k] == want[k] for k in want)
    with pytest.raises(ValueError, match="hold 4 contexts, not 6"):
        ContinuationBaseline.from_batches(iter(parts[:1]), 6, spool=True)
