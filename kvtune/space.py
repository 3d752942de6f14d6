"""Search spaces: YAML files whose Cartesian product of parameter values is the candidate set.

A space file looks like::

    version: 1
    name: default
    description: KIVI-style uniform quantization with and without Hadamard rotation
    fixed:                       # set on every candidate
      codec: bitpack
      key.name: uniform
    parameters:                  # every combination of these values is a candidate
      transforms: [identity, hadamard]     # "a+b" composes transforms in order
      key.bits: [2, 3, 4, 8]
      key.granularity: [per_channel, per_token]

Keys are dotted paths into a policy configuration (see :class:`kvtune.codecs.PolicyConfig`):
``transforms``, ``codec``, ``codec.<param>``, ``key.<param>``, ``value.<param>``, and
``kv.<param>`` which sets the key and the value quantizer alike. Unknown top-level keys, empty
value lists, values of the wrong kind and parameter values the components reject are
:class:`SpaceError` naming the file, the line and the key.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvtune.errors import ConfigError, SpaceError

SPACES_DIR = Path(__file__).resolve().parent.parent / "search_spaces"
TOP_LEVEL_KEYS = {"version", "name", "description", "fixed", "parameters"}
SUPPORTED_VERSIONS = {1}


@dataclass(frozen=True)
class Candidate:
    """One point of a search space.

    Attributes:
        index: position in the space's enumeration order.
        params: the flat ``{dotted key: value}`` assignment that produced it.
        config: the :class:`~kvtune.codecs.PolicyConfig`.
    """

    index: int
    params: dict[str, Any]
    config: Any

    @property
    def policy_id(self) -> str:
        return self.config.policy_id


@dataclass
class SearchSpace:
    """A parsed search space: its name, source file and de-duplicated candidates."""

    name: str
    path: Path
    description: str
    parameters: dict[str, list[Any]]
    fixed: dict[str, Any]
    candidates: list[Candidate] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.candidates)


def resolve_space_path(spec: str) -> Path:
    """``--space`` value -> file: a path, or a name in ``search_spaces/`` (``default``)."""
    path = Path(spec).expanduser()
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise SpaceError(f"--space {spec!r}: file not found")
        return path
    named = SPACES_DIR / f"{spec}.yaml"
    if not named.is_file():
        known = ", ".join(sorted(p.stem for p in SPACES_DIR.glob("*.yaml")))
        raise SpaceError(f"--space {spec!r}: no such file and no space of that name (known: {known})")
    return named


def assignment_to_policy_dict(params: dict[str, Any]) -> dict[str, Any]:
    """Turn flat dotted keys into the nested dict :meth:`PolicyConfig.from_dict` reads.

    ``{"transforms": "affine+hadamard", "kv.bits": 4, "codec": "bitpack"}`` ->
    ``{"transforms": ["affine", "hadamard"], "key": {"bits": 4}, "value": {"bits": 4},
    "codec": {"name": "bitpack"}}``.
    """
    out: dict[str, Any] = {}
    for key, value in params.items():
        head, _, rest = key.partition(".")
        if head == "transforms":
            if rest:
                raise ConfigError(f"'transforms' takes no sub-key (got {key!r})")
            names = value if isinstance(value, list) else [s for s in str(value).split("+") if s]
            out["transforms"] = [n if isinstance(n, (str, dict)) else str(n) for n in names]
            continue
        targets = ["key", "value"] if head == "kv" else [head]
        for t in targets:
            if t not in ("key", "value", "codec"):
                raise ConfigError(f"unknown key {key!r}: expected transforms, codec[.param], key.<param>, value.<param> or kv.<param>")
            slot = out.setdefault(t, {})
            slot["name" if not rest else rest] = value
    return out


def _line_of(node: yaml.Node | None, key: str) -> int | None:
    """1-based line of ``key`` inside a composed YAML mapping node, if found."""
    if isinstance(node, yaml.MappingNode):
        for k, _ in node.value:
            if getattr(k, "value", None) == key:
                return k.start_mark.line + 1
    return None


def _child(node: yaml.Node | None, key: str) -> yaml.Node | None:
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            if getattr(k, "value", None) == key:
                return v
    return None


def load_space(spec: str | Path) -> SearchSpace:
    """Parse and enumerate a search space.

    Args:
        spec: a path to a YAML file, or the name of a file in ``search_spaces/``.

    Returns:
        The :class:`SearchSpace` with its candidates in enumeration order, duplicates (the same
        policy reached by two assignments) removed.

    Raises:
        SpaceError: unreadable YAML, unknown or missing keys, empty value lists, values the
            components reject, or an empty space; the message names file, line and key.
    """
    from kvtune.codecs import PolicyConfig

    path = resolve_space_path(str(spec))
    text = path.read_text()
    try:
        root = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpaceError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise SpaceError(f"{path}: top level must be a mapping with keys {sorted(TOP_LEVEL_KEYS)}")

    def where(parent: yaml.Node | None, key: str) -> str:
        line = _line_of(parent, key)
        return f"{path}:{line}" if line else str(path)

    for key in data:
        if key not in TOP_LEVEL_KEYS:
            raise SpaceError(f"{where(root, key)}: unknown key {key!r} (allowed: {', '.join(sorted(TOP_LEVEL_KEYS))})")
    version = data.get("version", 1)
    if version not in SUPPORTED_VERSIONS:
        raise SpaceError(f"{where(root, 'version')}: unsupported space version {version!r} (supported: 1)")
    params = data.get("parameters")
    if not isinstance(params, dict) or not params:
        raise SpaceError(f"{where(root, 'parameters')}: 'parameters' must be a non-empty mapping of key -> list of values")
    fixed = data.get("fixed") or {}
    if not isinstance(fixed, dict):
        raise SpaceError(f"{where(root, 'fixed')}: 'fixed' must be a mapping of key -> value")
    pnode, fnode = _child(root, "parameters"), _child(root, "fixed")
    for key, values in params.items():
        if not isinstance(values, list) or not values:
            raise SpaceError(f"{where(pnode, key)}: parameter {key!r} must be a non-empty list of values")
        for v in values:
            if isinstance(v, dict):
                raise SpaceError(f"{where(pnode, key)}: parameter {key!r} has a mapping value {v!r}; use scalars")
        try:
            assignment_to_policy_dict({key: values[0]})
        except ConfigError as exc:
            raise SpaceError(f"{where(pnode, key)}: {exc}") from None
    for key in fixed:
        if key in params:
            raise SpaceError(f"{where(fnode, key)}: {key!r} is both fixed and a parameter")

    keys = list(params)
    candidates: list[Candidate] = []
    seen: set[str] = set()
    for combo in itertools.product(*(params[k] for k in keys)):
        assignment = {**fixed, **dict(zip(keys, combo))}
        try:
            config = PolicyConfig.from_dict(assignment_to_policy_dict(assignment))
        except ConfigError as exc:
            bad = next((k for k in keys if k.split(".")[-1] in str(exc)), None)
            loc = where(pnode, bad) if bad else str(path)
            raise SpaceError(f"{loc}: candidate {assignment} is invalid: {exc}") from None
        if config.policy_id in seen:
            continue
        seen.add(config.policy_id)
        candidates.append(Candidate(index=len(candidates), params=dict(zip(keys, combo)), config=config))
    if not candidates:
        raise SpaceError(f"{path}: the space is empty")
    return SearchSpace(
        name=str(data.get("name") or path.stem), path=path, description=str(data.get("description", "")),
        parameters=params, fixed=fixed, candidates=candidates,
    )
