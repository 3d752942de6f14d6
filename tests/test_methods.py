"""The shared matrix every registered method passes: settings style, registration, protocol."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvtune.core.errors import KvtuneError
from kvtune.methods import METHODS
from kvtune.run.method import Method
from kvtune.run.settings import RunSettings, parse_overrides


def test_the_three_methods_are_registered_by_their_own_packages():
    assert {"tqc", "scd", "bicache"} <= set(METHODS)
    for name, method in METHODS.items():
        assert type(method).__module__.startswith(f"kvtune.methods.{name}."), (name, type(method).__module__)


@pytest.mark.parametrize("name", sorted(METHODS))  # a new method package is covered without edits here
def test_settings_are_frozen_versioned_and_round_trip_through_json(name):
    cls = METHODS[name].settings_class
    assert issubclass(cls, RunSettings) and dataclasses.is_dataclass(cls)
    settings = cls()
    stored = json.loads(json.dumps(settings.to_dict()))
    assert stored["version"] == cls.VERSION and cls.from_dict(stored) == settings
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.version = 99
    assert dataclasses.replace(settings, seed=7).seed == 7


@pytest.mark.parametrize("name", sorted(METHODS))  # a new method package is covered without edits here
def test_set_options_come_from_the_settings_class(name):
    cls = METHODS[name].settings_class
    assert parse_overrides(cls, {"seed": "3"}) == {"seed": 3}
    with pytest.raises(KvtuneError, match="not a setting of this method; known: .*seed"):
        parse_overrides(cls, {"no_such_setting": "1"})


@pytest.mark.parametrize("name", sorted(METHODS))  # a new method package is covered without edits here
def test_methods_supply_context_stages_evaluate_and_compile(name):
    method = METHODS[name]
    for hook in ("prepare", "stages", "evaluate", "compile"):
        assert getattr(type(method), hook) is not getattr(Method, hook), (name, hook)
