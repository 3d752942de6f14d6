"""Search-space YAML: enumeration, conditions, forbidden rules, embedding, and clear errors."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from kvtune.core.errors import ConfigError, SpaceError
from kvtune.search.space import assignment_to_policy_dict, load_space


def _write(tmp_path, body: str):
    p = tmp_path / "s.yaml"
    p.write_text(textwrap.dedent(body))
    return p


def test_default_space_enumerates_the_full_product():
    space = load_space("default")
    uniform = [c for c in space.candidates if c.params["kv.name"] == "uniform"]
    assert len(uniform) == 2 * 4 * 2 * 2 * 4 * 2
    assert all(c.config.codec.name == "bitpack" and c.config.value.granularity == "per_token" for c in uniform)
    pca = [c for c in space.candidates if c.params["kv.name"] == "dp-alloc"]
    assert all(c.config.key.grid == c.config.value.grid == "ecsq" and c.config.codec.name == "rans" for c in pca)
    assert all(c.config.key.budget == c.config.value.budget == "model" for c in pca)
    assert len(pca) == 4 * 4 * 3  # key budgets x value budgets x kept fractions
    assert {(c.config.key.bits, c.config.value.bits) for c in pca} == {(k, v) for k in (0.5, 0.75, 1, 1.5)
                                                                       for v in (1.5, 2, 2.5, 3)}
    assert {c.config.label for c in pca} >= {
        "pca:pre|K:dp0.75/ecsq/s1/model|V:dp2/ecsq/s1/model|rans",
        "keep(fraction=0.85,per_head=False)+pca:pre|K:dp1.5/ecsq/s1/model|V:dp2.5/ecsq/s1/model|rans"}
    codebook = [c for c in space.candidates if c.params["kv.name"] == "codebook"]
    assert len(codebook) == 2 * 3 * 3 * 3  # +- hadamard x key bits x value bits x kept fractions
    assert all(c.config.key.granularity == "per_channel" and c.config.key.group_size == 32 for c in codebook)
    assert len(space) == len(uniform) + len(pca) + len(codebook)
    assert space.needs_pca_basis and space.pca_ropes_missing == {"pre"}
    ids = [c.policy_id for c in space.candidates]
    assert len(set(ids)) == len(ids)
    first = space.candidates[0].config.to_dict()
    assert first["codec"]["name"] == "bitpack" and first["value"]["granularity"] == "per_token"


def test_full_space_has_the_pca_family_and_subset_keeps_the_replay_candidates():
    space = load_space("full")
    pca = [c for c in space.candidates if c.params["kv.name"] == "dp-alloc"]
    kept = lambda c: c.config.transforms[0].fraction if c.config.transforms[0].name == "keep" else 1.0  # noqa: E731
    assert sorted((c.config.key.bits, c.config.codec.name, kept(c)) for c in pca) == sorted(
        (b, codec, f) for b in (1.5, 2, 3, 4) for codec in ("bitpack", "range") for f in (0.7, 0.85, 1.0))
    assert all(c.config.transforms[-1].rope == "pre" and c.config.key.sink_tokens == 4 for c in pca)
    codebook = [c for c in space.candidates if c.params["kv.name"] == "codebook"]
    assert {(c.config.key.bits, c.config.value.bits) for c in codebook} == {(k, v) for k in (2, 3, 4) for v in (2, 3, 4)}
    assert len(space) == 1280 + 768 + 16 + 288 + 24
    others = [c.policy_id for c in space.candidates if c.params["kv.name"] not in ("dp-alloc", "codebook")]
    sub = space.subset(others + ["not-an-id"])
    assert [c.policy_id for c in sub.candidates] == others and [c.index for c in sub.candidates] == list(range(len(others)))
    with pytest.raises(SpaceError, match="none of the 2376 candidates"):
        space.subset([])


def test_assignment_paths():
    d = assignment_to_policy_dict({"transforms": "identity+hadamard", "kv.bits": 4, "codec": "bitpack", "key.group_size": 32})
    assert d == {"transforms": ["identity", "hadamard"], "key": {"bits": 4, "group_size": 32}, "value": {"bits": 4},
                 "codec": {"name": "bitpack"}}


def test_keep_path_puts_token_selection_first():
    d = assignment_to_policy_dict({"transforms": "pca", "keep.fraction": 0.7, "keep.score": "key-norm", "kv.bits": 2})
    assert d["transforms"] == [{"name": "keep", "fraction": 0.7, "score": "key-norm"}, "pca"]
    assert assignment_to_policy_dict({"keep.fraction": 0.5})["transforms"] == [{"name": "keep", "fraction": 0.5}]
    with pytest.raises(ConfigError, match="keep.fraction"):
        assignment_to_policy_dict({"keep": 0.5})


def test_kv_shortcut_sets_both_quantizers(tmp_path):
    p = _write(tmp_path, """\
        fixed: {codec: bitpack, kv.name: uniform}
        parameters:
          kv.bits: [2, 4]
        """)
    space = load_space(p)
    assert [(c.config.key.bits, c.config.value.bits) for c in space.candidates] == [(2, 2), (4, 4)]


def test_conditions_and_forbidden(tmp_path):
    p = _write(tmp_path, """\
        version: 2
        fixed: {codec: bitpack, value.name: uniform}
        parameters:
          key.name: {type: categorical, values: [uniform, none]}
          key.bits: {type: ordinal, values: [2, 4, 8], precision: increasing, when: {key.name: uniform}}
          key.granularity: {type: categorical, values: [per_channel, per_token], when: {key.name: uniform}}
        forbidden:
          - {key.granularity: per_token, key.bits: 2}
        """)
    space = load_space(p)
    # uniform: 3 bits x 2 granularities - 1 forbidden = 5; none: the conditional params collapse to 1
    assert len(space) == 6
    none = [c for c in space.candidates if c.params["key.name"] == "none"]
    assert len(none) == 1 and none[0].params == {"key.name": "none"}
    assert not any(c.params.get("key.granularity") == "per_token" and c.params.get("key.bits") == 2 for c in space.candidates)


def test_embedding_one_hot_and_min_max(tmp_path):
    p = _write(tmp_path, """\
        version: 2
        fixed: {codec: bitpack, kv.name: uniform}
        parameters:
          transforms: {type: categorical, values: [identity, hadamard]}
          kv.bits: {type: ordinal, values: [2, 4, 8], precision: increasing}
        """)
    space = load_space(p)
    feats = space.features()
    assert feats.shape == (6, 3)
    byparams = {(c.params["transforms"], c.params["kv.bits"]): f for c, f in zip(space.candidates, feats)}
    np.testing.assert_allclose(byparams[("hadamard", 4)], [0.0, 1.0, (4 - 2) / (8 - 2)])
    np.testing.assert_allclose(byparams[("identity", 8)], [1.0, 0.0, 1.0])


def test_precision_partial_order():
    space = load_space("default")
    by = {tuple(sorted(c.params.items())): c for c in space.candidates}

    def get(**kw):
        base = {"transforms": "identity", "kv.name": "uniform", "key.bits": 4, "key.granularity": "per_channel",
                "key.group_size": 32, "value.bits": 4, "value.granularity": "per_token", "value.group_size": 32}
        base.update({k.replace("_", ".", 1) if k.startswith(("key_", "value_")) else k: v for k, v in kw.items()})
        return by[tuple(sorted(base.items()))]

    ref = get()
    assert space.at_most_as_precise(get(key_bits=2), ref)
    assert space.at_most_as_precise(get(key_bits=2, value_group_size=64), ref)
    assert not space.at_most_as_precise(get(key_bits=8), ref)
    assert not space.at_most_as_precise(get(key_bits=2, value_bits=8), ref)
    assert not space.at_most_as_precise(get(key_bits=2, transforms="hadamard"), ref)  # other family
    assert space.at_most_as_precise(ref, ref)


@pytest.mark.parametrize(
    "body, pattern",
    [
        ("parameters: {kv.bits: [4]}\nbogus: 1\n", r"s\.yaml:2: unknown key 'bogus'"),
        ("parameters: {}\n", "non-empty mapping"),
        ("parameters:\n  kv.bits: []\n", r"s\.yaml:2: parameter 'kv.bits' must be a non-empty list"),
        ("parameters:\n  kv.bits: [4]\n  colour.bits: [2]\n", r"s\.yaml:3: unknown key 'colour.bits'"),
        ("fixed: {codec: bitpack, kv.name: uniform}\nparameters:\n  kv.bits: [4, 99]\n", r"s\.yaml:3: candidate .* invalid"),
        ("version: 7\nparameters: {kv.bits: [4]}\n", "unsupported space version 7"),
        ("parameters: [1, 2\n", "not valid YAML"),
        ("fixed: {kv.bits: 2}\nparameters: {kv.bits: [4]}\n", "both fixed and a parameter"),
        ("parameters:\n  kv.bits: {type: ordinal, values: [4, 2]}\n", r"s\.yaml:2: .*increasing order"),
        ("parameters:\n  kv.bits: {type: integer, values: [2]}\n", r"s\.yaml:2: .*has type 'integer'"),
        ("parameters:\n  kv.bits: {values: [2], colour: red}\n", r"s\.yaml:2: .*unknown field 'colour'"),
        ("parameters:\n  kv.bits: {type: ordinal, values: [2, x]}\n", "needs numeric values"),
        ("parameters:\n  kv.bits: {type: ordinal, values: [2], when: {kv.name: mixhq}}\n", "condition on unknown key 'kv.name'"),
        ("parameters:\n  kv.bits: [2, 4]\nforbidden:\n  - {kv.colour: 2}\n", "unknown key 'kv.colour'"),
        ("fixed: {codec: bitpack, kv.name: uniform}\nparameters:\n  kv.bits: [2]\nforbidden:\n  - {kv.bits: 2}\n", "space is empty"),
        ("parameters:\n  kv.bits: {type: categorical, values: [2], precision: increasing}\n", "precision must be"),
        # conditions and forbidden rules on values the key never takes were silently ignored
        ("fixed: {codec: bitpack}\nparameters:\n  kv.name: [uniform, none]\n"
         "  kv.bits: {type: ordinal, values: [2, 4], when: {kv.name: unifrom}}\n",
         r"s\.yaml:4: parameter 'kv.bits': condition kv.name: 'unifrom' can never hold; kv.name takes \['uniform', 'none'\]"),
        ("fixed: {codec: bitpack, kv.name: uniform}\nparameters:\n  kv.bits: {type: ordinal, values: [2], when: {kv.name: fp8}}\n",
         r"s\.yaml:3: .*condition kv.name: 'fp8' can never hold"),
        ("fixed: {codec: bitpack, kv.name: uniform}\nparameters:\n  kv.bits: [2, 4]\nforbidden:\n  - {kv.bits: 2}\n"
         "  - {kv.bits: 3}\n", r"s\.yaml:6: forbidden rule \{'kv.bits': 3\}: kv.bits: 3 never occurs"),
        # a repeated key silently replaced the first one
        ("fixed: {codec: bitpack, kv.name: uniform}\nparameters:\n  kv.bits: [2]\n  kv.bits: [4]\n",
         r"s\.yaml:4: duplicate key 'kv.bits' \(first at line 3\)"),
        ("fixed: {codec: bitpack, kv.name: uniform, codec: range}\nparameters:\n  kv.bits: [2]\n",
         r"s\.yaml:1: duplicate key 'codec'"),
        ("fixed: {codec: bitpack, kv.name: uniform}\nparameters:\n  5: [2]\n", r"s\.yaml:3: parameter name 5 must be"),
    ],
)
def test_bad_spaces_name_file_line_key(tmp_path, body, pattern):
    with pytest.raises(SpaceError, match=pattern):
        load_space(_write(tmp_path, body))


def test_condition_on_an_unset_parameter_and_merge_keys_still_load(tmp_path):
    p = _write(tmp_path, """\
        version: 2
        fixed: {codec: bitpack, value.name: uniform}
        parameters:
          key.name: &cat {type: categorical, values: [uniform, none]}
          key.bits: {<<: *cat, type: ordinal, values: [2, 4], when: {key.name: uniform}}
          value.bits: {type: ordinal, values: [2, 8], when: {key.bits: [4, null]}}
        """)
    assert len(load_space(p)) == 1 + 2 + 2  # key bits 2; key bits 4 x 2 value bits; key none x 2 value bits


def test_non_utf8_space_file_is_a_space_error(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_bytes(b"parameters:\n  kv.bits: [2]  # \xff\xfe caf\xe9\n")
    with pytest.raises(SpaceError, match=r"s\.yaml: not UTF-8 text \(byte 30"):
        load_space(p)


def test_unknown_space_name_lists_known():
    with pytest.raises(SpaceError, match="known: .*default"):
        load_space("nope")


def test_a_huge_space_is_refused_before_enumeration(tmp_path):
    """12 parameters of 10 values: 10^12 combinations; counted, not enumerated (used to hang)."""
    import time

    from kvtune.search.space import MAX_COMBINATIONS

    body = "fixed: {codec: bitpack, kv.name: uniform}\nparameters:\n" + "".join(
        f"  {key}: {{type: ordinal, values: [{', '.join(str(v) for v in vals)}]}}\n"
        for key, vals in [(f"{side}.{name}", vals) for side in ("key", "value") for name, vals in (
            ("bits", range(1, 9)), ("group_size", [8, 16, 32, 64, 128]), ("recent_tokens", range(0, 100, 10)),
            ("sink_tokens", range(0, 10)), ("shallow_layers", range(0, 10)), ("shallow_bits", range(1, 9)))]
    )
    p = tmp_path / "huge.yaml"
    p.write_text(body)
    expected = (8 * 5 * 10 * 10 * 10 * 8) ** 2
    assert expected > 10**11
    start = time.perf_counter()
    with pytest.raises(SpaceError, match=rf"huge\.yaml: the space has {expected:,} parameter combinations, "
                                         rf"more than the cap of {MAX_COMBINATIONS:,}"):
        load_space(p)
    assert time.perf_counter() - start < 2.0


def test_the_cap_counts_active_combinations_exactly(tmp_path, monkeypatch):
    """Conditional parameters that are inactive do not multiply the count: 3 x 2 uniform + 1 none = 7."""
    import kvtune.search.space as space_mod

    p = _write(tmp_path, """\
        fixed: {codec: bitpack, value.name: uniform}
        parameters:
          key.name: {type: categorical, values: [uniform, none]}
          key.bits: {type: ordinal, values: [2, 4, 8], when: {key.name: uniform}}
          key.granularity: {type: categorical, values: [per_channel, per_token], when: {key.name: uniform}}
        """)
    monkeypatch.setattr(space_mod, "MAX_COMBINATIONS", 7)
    assert len(load_space(p)) == 7
    monkeypatch.setattr(space_mod, "MAX_COMBINATIONS", 6)
    with pytest.raises(SpaceError, match="has 7 parameter combinations, more than the cap of 6"):
        load_space(p)


def test_precision_groups_refuse_a_group_above_max_size_before_building_it():
    space = load_space("default")
    largest = max(len(ix) for ix, _ in space.precision_groups())
    assert len(space.precision_groups(max_size=largest)) == len(space.precision_groups())
    with pytest.raises(SpaceError, match=f"more than {largest - 1} comparable candidates in one family \\({largest}\\)"):
        space.precision_groups(max_size=largest - 1)
