"""Search spaces: typed parameters in YAML whose Cartesian product is the candidate set.

A space file (version 2) looks like::

    version: 2
    name: default
    description: KIVI-style uniform quantization with and without Hadamard rotation
    fixed:                          # set on every candidate
      codec: bitpack
      key.name: uniform
    parameters:
      transforms:                   # categorical: unordered choices; "a+b" composes transforms
        type: categorical
        values: [identity, hadamard]
      key.bits:                     # ordinal: ordered numbers
        type: ordinal
        values: [2, 3, 4, 8]
        precision: increasing       # a larger value is more precise (used by pruning)
      key.group_size:
        type: ordinal
        values: [32, 64]
        precision: decreasing
      key.fraction:                 # float: a numeric grid, embedded on [low, high]
        type: float
        values: [0.125, 0.25, 0.5]
        when: {key.name: mixhq}     # conditional: only set when key.name is mixhq
    forbidden:                      # combinations that are dropped (every listed key matches)
      - {key.granularity: per_token, key.bits: 2}

A parameter may also be written as a bare list (version 1 files): strings make it
categorical, numbers ordinal without a precision direction.

Keys are dotted paths into a policy configuration (see :class:`kvtune.codecs.PolicyConfig`):
``transforms``, ``codec``, ``codec.<param>``, ``key.<param>``, ``value.<param>``, and
``kv.<param>`` which sets the key and the value quantizer alike, and ``keep.<param>`` which puts
a ``keep`` token-selection transform (:class:`kvtune.codecs.select.Keep`) before the others
(``keep.fraction: 1.0`` keeps every token: the identity, so no selection). A ``when`` condition compares
other keys (fixed or parameter) with a value or a list of accepted values; a parameter whose
condition fails is left unset, and candidates that become identical are kept once.

Every mistake — unknown or repeated keys, empty value lists, values of the wrong type,
conditions or forbidden rules on unknown keys or on values the key never takes, values the
components reject, an empty space, a file that is not UTF-8 — is a :class:`SpaceError` naming
the file, the line and the key.

A space is enumerated in full (every candidate becomes a policy and a GP feature row), so its
size is counted before anything is enumerated: more than :data:`MAX_COMBINATIONS` active
combinations (before forbidden rules and de-duplication) is a :class:`SpaceError` naming the
file, the count and the cap. Enumeration costs about 1.5 ms per combination (``full.yaml``,
2,064 candidates: 3 s on a 2-core machine), so the cap bounds loading to a few minutes.

The bundled spaces (``default``, ``full``, ``presets``) are package data in
``kvtune/search/spaces/`` (:data:`SPACES_DIR`), so they are found from a regular install too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from kvtune.core.errors import ConfigError, SpaceError

SPACES_DIR = Path(str(resources.files("kvtune.search").joinpath("spaces")))
"""The bundled spaces, package data of :mod:`kvtune` (``--space default|full|presets``)."""
MAX_COMBINATIONS = 100_000
"""Most active parameter combinations :func:`load_space` enumerates (~2.5 min at ~1.5 ms each)."""
TOP_LEVEL_KEYS = {"version", "name", "description", "fixed", "parameters", "forbidden"}
PARAM_KEYS = {"type", "values", "precision", "when", "low", "high"}
PARAM_TYPES = ("categorical", "ordinal", "float")
PRECISION = ("increasing", "decreasing", "none")
SUPPORTED_VERSIONS = {1, 2}


@dataclass(frozen=True)
class Parameter:
    """One searched parameter.

    Attributes:
        key: dotted path (``key.bits``).
        type: ``categorical`` (unordered), ``ordinal`` (ordered numbers) or ``float``.
        values: the enumerated values, in file order.
        precision: for numeric parameters, whether a larger value is more precise
            (``increasing``, e.g. bits), less precise (``decreasing``, e.g. group size) or
            neither (``none``). Bidirectional pruning only reasons along these directions.
        when: condition ``{other key: accepted values}``; empty = always active.
        low, high: embedding range of numeric parameters (default: min and max of values).
    """

    key: str
    type: str
    values: tuple[Any, ...]
    precision: str = "none"
    when: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    low: float | None = None
    high: float | None = None

    @property
    def is_numeric(self) -> bool:
        return self.type in ("ordinal", "float")

    def active(self, assignment: dict[str, Any]) -> bool:
        """Whether the condition holds for an assignment of the other keys."""
        return all(assignment.get(k) in accepted for k, accepted in self.when)

    def embed(self, value: Any) -> np.ndarray:
        """Feature vector of one value: one-hot for categoricals, min-max scaled numerics.

        An inactive parameter (``value is None``) embeds as zeros.

        Returns:
            float64 array of length :attr:`width`.
        """
        if self.type == "categorical":
            out = np.zeros(len(self.values))
            if value is not None:
                out[self.values.index(value)] = 1.0
            return out
        if value is None:
            return np.zeros(1)
        lo = float(min(self.values) if self.low is None else self.low)
        hi = float(max(self.values) if self.high is None else self.high)
        return np.array([0.0 if hi == lo else (float(value) - lo) / (hi - lo)])

    @property
    def width(self) -> int:
        return len(self.values) if self.type == "categorical" else 1


@dataclass(frozen=True)
class Candidate:
    """One point of a search space.

    Attributes:
        index: position in the space's enumeration order.
        params: the active ``{dotted key: value}`` assignment (fixed keys excluded).
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
    """A parsed search space: its parameters and de-duplicated candidates.

    Attributes:
        name, path, description: from the file.
        parameters: the searched :class:`Parameter` s, in file order.
        fixed: keys set on every candidate.
        candidates: the enumeration, duplicates (same policy id) removed.
    """

    name: str
    path: Path
    description: str
    parameters: list[Parameter]
    fixed: dict[str, Any]
    candidates: list[Candidate] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.candidates)

    def features(self) -> np.ndarray:
        """GP embedding of every candidate: ``(n_candidates, d)`` float64 in [0, 1].

        Concatenation over parameters of :meth:`Parameter.embed` (one-hot categoricals,
        min-max scaled numerics, zeros where a conditional parameter is inactive).
        """
        rows = [np.concatenate([p.embed(c.params.get(p.key)) for p in self.parameters]) for c in self.candidates]
        return np.vstack(rows) if rows else np.zeros((0, sum(p.width for p in self.parameters)))

    @property
    def needs_head_scores(self) -> bool:
        """Whether some candidate ranks KV heads (MixHQ) and still lacks calibration scores."""
        return any(c.config.needs_head_scores for c in self.candidates)

    def with_head_scores(self, scores) -> "SearchSpace":
        """A copy whose candidates carry MixHQ head scores from a calibration pass.

        Args:
            scores: ``scores[layer][kv_head]`` (see :mod:`kvtune.evaluate.calibrate`).
        """
        cands = [Candidate(index=c.index, params=c.params, config=c.config.with_head_scores(scores))
                 for c in self.candidates]
        return SearchSpace(name=self.name, path=self.path, description=self.description,
                           parameters=self.parameters, fixed=self.fixed, candidates=cands)

    @property
    def needs_codebooks(self) -> bool:
        """Whether some candidate has calibrated codebook levels and no codebooks yet."""
        return any(c.config.needs_codebooks for c in self.candidates)

    def with_codebooks(self, calibrate) -> "SearchSpace":
        """A copy whose candidates carry their calibrated codebooks.

        Args:
            calibrate: ``PolicyConfig -> PolicyConfig`` that fills a policy's missing codebooks
                (e.g. :func:`kvtune.evaluate.calibrate_codebook.calibrate_codebooks` on the
                run's calibration KV); called for every candidate that needs them.
        """
        cands = [Candidate(index=c.index, params=c.params, config=calibrate(c.config) if c.config.needs_codebooks else c.config)
                 for c in self.candidates]
        return SearchSpace(name=self.name, path=self.path, description=self.description,
                           parameters=self.parameters, fixed=self.fixed, candidates=cands)

    @property
    def pca_ropes_missing(self) -> frozenset[str]:
        """The ``rope`` modes of the ``pca`` transforms still without a basis, over all
        candidates (empty: no candidate needs a PCA calibration)."""
        return frozenset().union(*(c.config.pca_ropes_missing for c in self.candidates))

    @property
    def needs_pca_basis(self) -> bool:
        """Whether some candidate has a ``pca`` transform without a basis."""
        return bool(self.pca_ropes_missing)

    def with_pca_basis(self, bases) -> "SearchSpace":
        """A copy whose candidates carry PCA basis digests (:meth:`PolicyConfig.with_pca_basis`).

        Args:
            bases: a digest, or a mapping ``rope mode -> digest`` (see :mod:`kvtune.codecs.pca`).
        """
        cands = [Candidate(index=c.index, params=c.params, config=c.config.with_pca_basis(bases))
                 for c in self.candidates]
        return SearchSpace(name=self.name, path=self.path, description=self.description,
                           parameters=self.parameters, fixed=self.fixed, candidates=cands)

    def subset(self, policy_ids) -> "SearchSpace":
        """A copy with the candidates whose ``policy_id`` is in ``policy_ids`` only, in this
        space's order, renumbered from 0 (e.g. the candidates a replay table holds, when the
        space file gained candidates after the table was evaluated).

        Raises:
            SpaceError: no candidate is kept.
        """
        keep = set(policy_ids)
        cands = [Candidate(index=i, params=c.params, config=c.config)
                 for i, c in enumerate(c for c in self.candidates if c.policy_id in keep)]
        if not cands:
            raise SpaceError(f"{self.path}: none of the {len(self)} candidates of space {self.name!r} is kept")
        return SearchSpace(name=self.name, path=self.path, description=self.description,
                           parameters=self.parameters, fixed=self.fixed, candidates=cands)

    def family(self, candidate: Candidate) -> tuple:
        """Hashable family key: the candidate's categorical values and which parameters are
        active. Candidates of one family differ only in numeric parameters."""
        return tuple(
            (p.key, candidate.params.get(p.key) if p.type == "categorical" else p.key in candidate.params)
            for p in self.parameters
        )

    def at_most_as_precise(self, a: Candidate, b: Candidate) -> bool:
        """True when ``a`` is in ``b``'s family and no numeric parameter of ``a`` is more
        precise than ``b``'s, and parameters without a precision direction are equal.

        This is the partial order bidirectional pruning relies on: if ``b`` misses an accuracy
        floor, so (by assumption of monotonicity) does every ``a`` with this relation.
        """
        if self.family(a) != self.family(b):
            return False
        for p in self.parameters:
            if not p.is_numeric or p.key not in a.params:
                continue
            va, vb = a.params[p.key], b.params[p.key]
            if p.precision == "increasing" and va > vb:
                return False
            if p.precision == "decreasing" and va < vb:
                return False
            if p.precision == "none" and va != vb:
                return False
        return True

    def precision_groups(self, max_size: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
        """:meth:`at_most_as_precise` as blocks: ``[(positions, order), ...]``, one per group of
        candidates that can be compared (same family, same values of the numeric parameters
        without a precision direction). ``positions``: ``(m,)`` int64 positions in
        :attr:`candidates`; ``order``: ``(m, m)`` bool, ``[a, b]`` true when
        ``candidates[positions[a]]`` is at most as precise as ``candidates[positions[b]]`` (the
        diagonal is true). Candidates of different groups are never comparable. Memory is the
        sum of ``m ** 2`` bytes over the groups.

        Raises:
            SpaceError: a group has more than ``max_size`` candidates (checked before any block
                is built).
        """
        groups: dict[tuple, list[int]] = {}
        for pos, c in enumerate(self.candidates):
            free = tuple((p.key, c.params[p.key]) for p in self.parameters
                         if p.is_numeric and p.precision == "none" and p.key in c.params)
            groups.setdefault((self.family(c), free), []).append(pos)
        largest = max((len(m) for m in groups.values()), default=0)
        if max_size is not None and largest > max_size:
            raise SpaceError(f"space {self.name!r} has more than {max_size} comparable candidates in one family "
                             f"({largest})")
        out = []
        for members in groups.values():
            first = self.candidates[members[0]].params
            directed = [p for p in self.parameters if p.is_numeric and p.precision != "none" and p.key in first]
            order = np.ones((len(members), len(members)), dtype=bool)
            for p in directed:
                sign = 1.0 if p.precision == "increasing" else -1.0
                v = sign * np.array([float(self.candidates[i].params[p.key]) for i in members])
                order &= v[:, None] <= v[None, :]
            out.append((np.asarray(members, dtype=np.int64), order))
        return out


def resolve_space_path(spec: str) -> Path:
    """``--space`` value -> file: a path, or the name of a bundled space in :data:`SPACES_DIR`
    (``default``, ``full``, ``presets``).

    Raises:
        SpaceError: the path does not exist, or no bundled space has that name.
    """
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

    Raises:
        ConfigError: a key outside ``transforms``, ``codec``, ``key``, ``value``, ``kv``,
            ``keep``.
    """
    out: dict[str, Any] = {}
    keep: dict[str, Any] = {}
    for key, value in params.items():
        head, _, rest = key.partition(".")
        if head == "keep":
            if not rest:
                raise ConfigError(f"'keep' takes a parameter of the keep transform, e.g. keep.fraction (got {key!r})")
            keep[rest] = value
            continue
        if head == "transforms":
            if rest:
                raise ConfigError(f"'transforms' takes no sub-key (got {key!r})")
            names = value if isinstance(value, list) else [s for s in str(value).split("+") if s]
            out["transforms"] = [n if isinstance(n, (str, dict)) else str(n) for n in names]
            continue
        targets = ["key", "value"] if head == "kv" else [head]
        for t in targets:
            if t not in ("key", "value", "codec"):
                raise ConfigError(
                    f"unknown key {key!r}: expected transforms, codec[.param], key.<param>, value.<param>, kv.<param> "
                    "or keep.<param>"
                )
            slot = out.setdefault(t, {})
            slot["name" if not rest else rest] = value
    if keep:
        out["transforms"] = [{"name": "keep", **keep}, *out.get("transforms", [])]
    return out


# ----------------------------------------------------------------------------- YAML parsing


class _DuplicateKeyError(yaml.YAMLError):
    """A mapping lists the same key twice (raised by :class:`_UniqueKeyLoader`)."""

    def __init__(self, key: Any, line: int, first: int) -> None:
        super().__init__(f"duplicate key {key!r} (first at line {first})")
        self.key, self.line, self.first = key, line, first


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key repeated in one mapping (PyYAML silently keeps the
    last one, so a pasted parameter would quietly replace another). Keys brought in by a merge
    (``<<: *anchor``) may still be overridden."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue
            key, line = self.construct_object(key_node), key_node.start_mark.line + 1
            if key in seen:
                raise _DuplicateKeyError(key, line, seen[key])
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


class _Where:
    """File:line locator for keys (and list positions) of a composed YAML document."""

    def __init__(self, path: Path, root: yaml.Node | None) -> None:
        self.path, self.root = path, root

    def __call__(self, *keys: str | int) -> str:
        node, line = self.root, None
        for key in keys:
            if isinstance(node, yaml.SequenceNode) and isinstance(key, int) and 0 <= key < len(node.value):
                node = node.value[key]
                line = node.start_mark.line + 1
            elif isinstance(node, yaml.MappingNode):
                for k, v in node.value:
                    if getattr(k, "value", None) == str(key):  # scalar key nodes hold text
                        line, node = k.start_mark.line + 1, v
                        break
                else:
                    break
        return f"{self.path}:{line}" if line else str(self.path)


def _accepted(value: Any) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, list) else (value,)


def _parse_parameter(key: str, spec: Any, where: _Where) -> Parameter:
    loc = where("parameters", key)
    if not isinstance(key, str):
        raise SpaceError(f"{loc}: parameter name {key!r} must be a dotted key such as key.bits")
    if isinstance(spec, list):
        spec = {"values": spec}
        spec["type"] = "categorical" if any(isinstance(v, str) for v in spec["values"]) else "ordinal"
    if not isinstance(spec, dict):
        raise SpaceError(f"{loc}: parameter {key!r} must be a list of values or a mapping with 'values'")
    for k in spec:
        if k not in PARAM_KEYS:
            raise SpaceError(f"{loc}: parameter {key!r} has unknown field {k!r} (allowed: {', '.join(sorted(PARAM_KEYS))})")
    values = spec.get("values")
    if not isinstance(values, list) or not values:
        raise SpaceError(f"{loc}: parameter {key!r} must be a non-empty list of values")
    if any(isinstance(v, (dict, list)) for v in values):
        raise SpaceError(f"{loc}: parameter {key!r} has a non-scalar value; use scalars")
    if len(set(map(repr, values))) != len(values):
        raise SpaceError(f"{loc}: parameter {key!r} lists a value twice")
    ptype = spec.get("type", "categorical")
    if ptype not in PARAM_TYPES:
        raise SpaceError(f"{loc}: parameter {key!r} has type {ptype!r}; allowed: {', '.join(PARAM_TYPES)}")
    if ptype != "categorical" and not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise SpaceError(f"{loc}: {ptype} parameter {key!r} needs numeric values, got {values}")
    if ptype == "ordinal" and list(values) != sorted(values):
        raise SpaceError(f"{loc}: ordinal parameter {key!r} must list its values in increasing order")
    precision = spec.get("precision", "none")
    if precision not in PRECISION or (precision != "none" and ptype == "categorical"):
        raise SpaceError(f"{loc}: parameter {key!r}: precision must be one of {PRECISION} (numeric types only)")
    when = spec.get("when", {}) or {}
    if not isinstance(when, dict):
        raise SpaceError(f"{loc}: parameter {key!r}: 'when' must be a mapping of key -> value or list of values")
    low, high = spec.get("low"), spec.get("high")
    try:
        assignment_to_policy_dict({key: values[0]})
    except ConfigError as exc:
        raise SpaceError(f"{loc}: {exc}") from None
    return Parameter(key=key, type=ptype, values=tuple(values), precision=precision,
                     when=tuple((k, _accepted(v)) for k, v in when.items()), low=low, high=high)


def presets_space(path: Path) -> SearchSpace:
    """A space whose candidates are the named policies of a presets file (``--space presets``).

    Each candidate has the single categorical parameter ``preset`` = its name, so trials and
    reports can mark presets. The file format is :mod:`kvtune.codecs.presets`.

    Raises:
        SpaceError: the presets file is invalid (the message names file, line and preset).
    """
    from kvtune.codecs.presets import read_presets

    try:
        presets = read_presets(path)
        configs = {name: p.config() for name, p in presets.items()}
    except ConfigError as exc:
        raise SpaceError(str(exc)) from None
    names = tuple(configs)
    param = Parameter(key="preset", type="categorical", values=names)
    candidates = [Candidate(index=i, params={"preset": n}, config=configs[n]) for i, n in enumerate(names)]
    return SearchSpace(name=path.stem, path=path, description="published baselines as fixed policies",
                       parameters=[param], fixed={}, candidates=candidates)


def sorted_params(active: dict[str, Any], params: list[Parameter]) -> list[tuple[str, Any]]:
    """Active parameters in file order."""
    return [(p.key, active[p.key]) for p in params if p.key in active]


def _dependency_order(params: list[Parameter], where: _Where) -> list[Parameter]:
    """Parameters ordered so that every condition's keys are assigned before it is tested.

    Raises:
        SpaceError: conditions that depend on each other in a cycle.
    """
    keys = {p.key for p in params}
    ordered: list[Parameter] = []
    placed: set[str] = set()
    pending = list(params)
    while pending:
        ready = [p for p in pending if all(k in placed or k not in keys for k, _ in p.when)]
        if not ready:
            raise SpaceError(f"{where('parameters', pending[0].key)}: conditions form a cycle among "
                             f"{', '.join(p.key for p in pending)}")
        for p in ready:
            ordered.append(p)
            placed.add(p.key)
            pending.remove(p)
    return ordered


def _active_assignments(params: list[Parameter], fixed: dict[str, Any], where: _Where):
    """Yield each distinct active assignment once: a depth-first product in which a parameter
    whose condition fails takes no value (so it does not multiply the enumeration)."""
    order = _dependency_order(params, where)

    def walk(i: int, assigned: dict[str, Any]):
        if i == len(order):
            yield dict(assigned)
            return
        p = order[i]
        if not p.active({**fixed, **assigned}):
            yield from walk(i + 1, assigned)
            return
        for v in p.values:
            assigned[p.key] = v
            yield from walk(i + 1, assigned)
        del assigned[p.key]

    yield from walk(0, {})


def _count_active(params: list[Parameter], fixed: dict[str, Any], where: _Where) -> int:
    """Number of assignments :func:`_active_assignments` yields, counted without enumerating.

    Only the values of keys that some condition reads can change which parameters are active,
    so the recursion branches on those and multiplies by the value count of every other active
    parameter: the cost grows with the product of the *condition* keys' value counts only.

    Raises:
        SpaceError: conditions that depend on each other in a cycle.
    """
    order = _dependency_order(params, where)
    read = {k for p in params for k, _ in p.when}

    def count(i: int, assigned: dict[str, Any]) -> int:
        if i == len(order):
            return 1
        p = order[i]
        if not p.active({**fixed, **assigned}):
            return count(i + 1, assigned)
        if p.key not in read:
            return len(p.values) * count(i + 1, assigned)
        return sum(count(i + 1, {**assigned, p.key: v}) for v in p.values)

    return count(0, {})


def load_space(spec: str | Path) -> SearchSpace:
    """Parse and enumerate a search space (or a presets file, see :func:`presets_space`).

    Args:
        spec: a path to a YAML file, or the name of a bundled space (:func:`resolve_space_path`).

    Returns:
        The :class:`SearchSpace` with its candidates in enumeration order, duplicates (the same
        policy reached by two assignments) removed.

    Raises:
        SpaceError: unreadable YAML or non-UTF-8 file, a key repeated in a mapping, unknown or
            missing keys, bad types or values, conditions or forbidden rules on unknown keys
            or on values the key never takes, values the components reject, an empty space
            (the message names file, line and key), or more than :data:`MAX_COMBINATIONS`
            combinations (the message names the file, the count and the cap; raised before
            enumerating).
    """
    from kvtune.codecs import PolicyConfig

    path = resolve_space_path(str(spec))
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise SpaceError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.object[exc.start:exc.start + 1]!r}); "
                         "save the space file as UTF-8") from None
    except OSError as exc:
        raise SpaceError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        root = yaml.compose(text)
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except _DuplicateKeyError as exc:
        raise SpaceError(f"{path}:{exc.line}: duplicate key {exc.key!r} (first at line {exc.first}); "
                         "each key may appear once per mapping") from None
    except yaml.YAMLError as exc:
        raise SpaceError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise SpaceError(f"{path}: top level must be a mapping with keys {sorted(TOP_LEVEL_KEYS)}")
    if "presets" in data:
        return presets_space(path)
    where = _Where(path, root)
    for key in data:
        if key not in TOP_LEVEL_KEYS:
            raise SpaceError(f"{where(key)}: unknown key {key!r} (allowed: {', '.join(sorted(TOP_LEVEL_KEYS))})")
    version = data.get("version", 1)
    if isinstance(version, bool) or version not in SUPPORTED_VERSIONS:
        raise SpaceError(f"{where('version')}: unsupported space version {version!r} (supported: 1, 2)")
    raw_params = data.get("parameters")
    if not isinstance(raw_params, dict) or not raw_params:
        raise SpaceError(f"{where('parameters')}: 'parameters' must be a non-empty mapping of key -> values")
    fixed = data.get("fixed") or {}
    if not isinstance(fixed, dict):
        raise SpaceError(f"{where('fixed')}: 'fixed' must be a mapping of key -> value")
    for key in fixed:
        if not isinstance(key, str):
            raise SpaceError(f"{where('fixed')}: fixed key {key!r} must be a dotted key such as key.name")
        if key in raw_params:
            raise SpaceError(f"{where('fixed', key)}: {key!r} is both fixed and a parameter")
        try:
            assignment_to_policy_dict({key: fixed[key]})
        except ConfigError as exc:
            raise SpaceError(f"{where('fixed', key)}: {exc}") from None
    params = [_parse_parameter(k, v, where) for k, v in raw_params.items()]
    known = set(fixed) | set(raw_params)
    # values each key can take (None: a conditional parameter may be unset)
    possible = {**{k: (v,) for k, v in fixed.items()}, **{p.key: p.values + ((None,) if p.when else ()) for p in params}}
    for p in params:
        for k, accepted in p.when:
            if k not in known:
                raise SpaceError(f"{where('parameters', p.key)}: condition on unknown key {k!r}")
            never = [v for v in accepted if v not in possible[k]]
            if never:
                raise SpaceError(f"{where('parameters', p.key, 'when', k)}: parameter {p.key!r}: condition "
                                 f"{k}: {never[0]!r} can never hold; {k} takes {list(possible[k])}")
    forbidden = data.get("forbidden") or []
    if not isinstance(forbidden, list) or not all(isinstance(f, dict) and f for f in forbidden):
        raise SpaceError(f"{where('forbidden')}: 'forbidden' must be a list of non-empty mappings key -> value(s)")
    for i, rule in enumerate(forbidden):
        for k in rule:
            if k not in known:
                raise SpaceError(f"{where('forbidden', i)}: forbidden rule {rule} names unknown key {k!r}")
            never = [v for v in _accepted(rule[k]) if v not in possible[k]]
            if never:
                raise SpaceError(f"{where('forbidden', i, k)}: forbidden rule {rule}: {k}: {never[0]!r} never "
                                 f"occurs, so the rule drops nothing; {k} takes {list(possible[k])}")
    rules = [{k: _accepted(v) for k, v in rule.items()} for rule in forbidden]
    size = _count_active(params, fixed, where)
    if size > MAX_COMBINATIONS:
        raise SpaceError(f"{path}: the space has {size:,} parameter combinations, more than the cap of "
                         f"{MAX_COMBINATIONS:,} that kvtune enumerates; remove values, fix some keys, or split "
                         "it into several spaces")

    candidates: list[Candidate] = []
    seen: set[str] = set()
    for active in _active_assignments(params, fixed, where):
        assignment = {**fixed, **active}
        if any(all(assignment.get(k) in acc for k, acc in rule.items()) for rule in rules):
            continue
        try:
            config = PolicyConfig.from_dict(assignment_to_policy_dict(assignment))
        except ConfigError as exc:
            bad = next((p.key for p in params if p.key.split(".")[-1] in str(exc)), None)
            loc = where("parameters", bad) if bad else str(path)
            raise SpaceError(f"{loc}: candidate {assignment} is invalid: {exc}") from None
        if config.policy_id in seen:
            continue
        seen.add(config.policy_id)
        candidates.append(Candidate(index=len(candidates), params=dict(sorted_params(active, params)), config=config))
    if not candidates:
        raise SpaceError(f"{path}: the space is empty (every combination is forbidden or invalid)")
    return SearchSpace(name=str(data.get("name") or path.stem), path=path, description=str(data.get("description", "")),
                       parameters=params, fixed=fixed, candidates=candidates)
