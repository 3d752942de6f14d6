"""The one Registry type: clashes and unknown names are typed errors, everywhere."""

from __future__ import annotations

import pytest

from kvtune.core.registry import DuplicateNameError, Registry, UnknownNameError
from kvtune.core.errors import KvtuneError, RegistryError


class A:
    pass


class B:
    pass


def test_register_lookup_and_dict_behaviour():
    reg = Registry("widget", [("a", A)])
    assert reg.decorator("b", "bee")(B) is B
    assert reg["a"] is A and reg["bee"] is B and sorted(reg) == ["a", "b", "bee"] and "b" in reg
    assert reg.get("nope") is None and reg.known() == "a, b, bee"
    reg.register("a", A)  # the same object again: no-op


def test_unknown_name_lists_the_known_ones():
    reg = Registry("widget", {"a": A, "b": B})
    with pytest.raises(UnknownNameError, match=r"^unknown widget 'c'; known: a, b$") as info:
        reg["c"]
    assert isinstance(info.value, KeyError) and isinstance(info.value, KvtuneError)


@pytest.mark.parametrize("how", ["register", "setitem", "update", "decorator", "init"])
def test_a_name_clash_is_an_error(how):
    reg = Registry("widget", {"a": A})
    with pytest.raises(DuplicateNameError, match=r"widget 'a' is already registered \(A\); cannot register B"):
        if how == "register":
            reg.register("a", B)
        elif how == "setitem":
            reg["a"] = B
        elif how == "update":
            reg.update(a=B)
        elif how == "decorator":
            reg.decorator("a")(B)
        else:
            Registry("widget", [("a", A), ("a", B)])
    assert reg["a"] is A and issubclass(DuplicateNameError, RegistryError)


def test_every_kvtune_registry_is_a_registry():
    from kvtune.methods.bicache.adapters import ADAPTERS
    from kvtune.methods.bicache.api import CODEC_POLICIES
    from kvtune.codecs.base import CODECS, QUANTIZERS, TRANSFORMS
    from kvtune.evaluate.workloads import WORKLOADS
    from kvtune.methods import METHODS as RUN_METHODS
    from kvtune.search.optimizers import OPTIMIZERS
    from kvtune.methods.scd.methods import METHODS as TRANSFER_METHODS

    for reg in (ADAPTERS, CODEC_POLICIES, CODECS, QUANTIZERS, TRANSFORMS, WORKLOADS, RUN_METHODS, OPTIMIZERS,
                TRANSFER_METHODS):
        assert isinstance(reg, Registry), reg
        name = next(iter(reg))
        with pytest.raises(DuplicateNameError):
            reg.register(name, object())
        with pytest.raises(UnknownNameError, match="known: "):
            reg["no-such-name"]
    assert {"tqc", "scd", "bicache"} <= set(RUN_METHODS)
