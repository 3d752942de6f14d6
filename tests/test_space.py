"""Search-space YAML: enumeration and clear errors naming file, line and key."""

from __future__ import annotations

import textwrap

import pytest

from kvtune.errors import SpaceError
from kvtune.space import assignment_to_policy_dict, load_space


def _write(tmp_path, body: str):
    p = tmp_path / "s.yaml"
    p.write_text(textwrap.dedent(body))
    return p


def test_default_space_enumerates_the_full_product():
    space = load_space("default")
    assert len(space) == 2 * 4 * 2 * 2 * 4 * 2
    ids = [c.policy_id for c in space.candidates]
    assert len(set(ids)) == len(ids)
    first = space.candidates[0].config.to_dict()
    assert first["codec"]["name"] == "bitpack" and first["value"]["granularity"] == "per_token"


def test_assignment_paths():
    d = assignment_to_policy_dict({"transforms": "identity+hadamard", "kv.bits": 4, "codec": "bitpack", "key.group_size": 32})
    assert d == {"transforms": ["identity", "hadamard"], "key": {"bits": 4, "group_size": 32}, "value": {"bits": 4},
                 "codec": {"name": "bitpack"}}


def test_kv_shortcut_sets_both_quantizers(tmp_path):
    p = _write(tmp_path, """\
        fixed: {codec: bitpack, kv.name: uniform}
        parameters:
          kv.bits: [2, 4]
        """)
    space = load_space(p)
    assert [(c.config.key.bits, c.config.value.bits) for c in space.candidates] == [(2, 2), (4, 4)]


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
    ],
)
def test_bad_spaces_name_file_line_key(tmp_path, body, pattern):
    with pytest.raises(SpaceError, match=pattern):
        load_space(_write(tmp_path, body))


def test_unknown_space_name_lists_known():
    with pytest.raises(SpaceError, match="known: .*default"):
        load_space("nope")
