"""Every optimizer respects the budget, never repeats a candidate and is reproducible."""

from __future__ import annotations

import pytest

from kvtune.core.errors import ConfigError
from kvtune.search.optimizers import OPTIMIZERS, make_optimizer
from kvtune.search.space import Candidate, SearchSpace


def _cands(n):
    return [Candidate(index=i, params={"i": i}, config=None) for i in range(n)]


def _space(n):
    return SearchSpace(name="t", path=None, description="", parameters=[], fixed={}, candidates=_cands(n))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_no_repeats_until_exhausted(name):
    opt = make_optimizer(name, _space(20), seed=3)
    seen = []
    while (c := opt.ask()) is not None:
        assert c.index not in seen
        seen.append(c.index)
        opt.tell(c, {"compression_ratio": 1.0})
    assert sorted(seen) == list(range(20))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_seed_reproducible_and_resume_skips_told(name):
    a = make_optimizer(name, _space(30), seed=7)
    order = []
    for _ in range(10):
        c = a.ask()
        order.append(c.index)
        a.tell(c, {})
    b = make_optimizer(name, _space(30), seed=7)
    for i in order[:4]:  # a resumed run replays stored trials first
        b.tell(_cands(30)[i], {})
    rest = []
    for _ in range(6):
        c = b.ask()
        rest.append(c.index)
        b.tell(c, {})
    assert rest == order[4:]


def test_unknown_optimizer():
    with pytest.raises(ConfigError, match="known: .*random"):
        make_optimizer("gridsearch", _space(3))
