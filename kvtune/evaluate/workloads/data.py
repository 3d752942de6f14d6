"""Workload data: named dataset assets or a user's JSONL file, validated record by record.

Every record of a JSONL file is one JSON object per line (blank lines are allowed and
ignored). The fields each workload reads are documented on the workload class and checked
here: a line that is not a JSON object, a missing field, a field of the wrong type or an
empty string stops the run with a :class:`DataError` naming the file, the line and the
field. No record is skipped silently.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtune.evaluate.assets import ASSETS, file_sha256, resolve_asset
from kvtune.core.errors import KvtuneError


class DataError(KvtuneError):
    """A workload's data file is missing, unreadable or has a malformed record."""


@dataclass(frozen=True)
class Field:
    """A field a workload reads from each JSONL record.

    Attributes:
        name: the JSON key.
        kind: ``"str"`` (non-empty string), ``"str_list"`` (a non-empty string or a non-empty
            list of non-empty strings; read as a list) or ``"bool"`` (JSON true/false, or one
            of the strings true/false/yes/no in any case).
        required: whether a record must have it.
        allow_empty: a ``str`` field may be empty or blank (context fields: a workload passes
            over such a record when it picks samples and counts it in ``describe()``).
    """

    name: str
    kind: str
    required: bool = True
    allow_empty: bool = False


_BOOL_WORDS = {"true": True, "yes": True, "false": False, "no": False}


def _convert(value: Any, field: Field) -> Any:
    """The field's value in its canonical Python type, or raise ``ValueError(reason)``."""
    if field.kind == "str":
        if not isinstance(value, str):
            raise ValueError(f"must be a string, got {type(value).__name__}")
        if not value.strip() and not field.allow_empty:
            raise ValueError("is an empty string")
        return value
    if field.kind == "str_list":
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not items:
            raise ValueError(f"must be a string or a non-empty list of strings, got {type(value).__name__}")
        for i, item in enumerate(items):
            if not isinstance(item, str) or not item.strip():
                raise ValueError(f"item {i} must be a non-empty string, got {item!r}")
        return list(items)
    if field.kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _BOOL_WORDS:
            return _BOOL_WORDS[value.strip().lower()]
        raise ValueError(f"must be true/false (or the string true, false, yes or no), got {value!r}")
    raise AssertionError(f"unknown field kind {field.kind!r}")  # pragma: no cover - programming error


def read_jsonl(path: Path, fields: tuple[Field, ...], *, label: str | None = None) -> list[dict[str, Any]]:
    """Read and validate every record of a JSONL file.

    Args:
        path: the file.
        fields: the fields each record must (or may) have; other keys are ignored.
        label: how errors name the file (default: the path).

    Returns:
        One dict per non-blank line, holding the declared fields converted to their kind
        (missing optional fields are absent), plus ``"_line"`` (1-based line number).

    Raises:
        DataError: unreadable file, no records, or a bad record (names file, line and field).
    """
    where = label or str(path)
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{where}: cannot read ({exc})") from None
    records = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise DataError(f"{where}, line {n}: not valid JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise DataError(f"{where}, line {n}: a record must be a JSON object, got {type(obj).__name__}")
        rec: dict[str, Any] = {"_line": n}
        for f in fields:
            if f.name not in obj:
                if f.required:
                    raise DataError(f"{where}, line {n}: field {f.name!r} is missing")
                continue
            try:
                rec[f.name] = _convert(obj[f.name], f)
            except ValueError as exc:
                raise DataError(f"{where}, line {n}: field {f.name!r} {exc}") from None
        records.append(rec)
    if not records:
        raise DataError(f"{where}: no records (expected one JSON object per line)")
    return records


@dataclass(frozen=True)
class DataSource:
    """Where a workload's records came from, for ``describe()`` and the run record.

    Attributes:
        spec: the ``--data`` value (asset name or path).
        path: the local file.
        sha256: the file's sha256 (the pin for a named asset, computed for a user file).
        asset: the named asset's wheel (``NAME==VERSION``) or None for a user file.
    """

    spec: str
    path: Path
    sha256: str
    asset: str | None

    def describe(self) -> dict[str, Any]:
        return {"data": self.spec, "path": str(self.path), "sha256": self.sha256, "wheel": self.asset}


def resolve_data(spec: str, fields: tuple[Field, ...], *, workload: str) -> tuple[DataSource, list[dict[str, Any]]]:
    """Resolve ``--data`` (a named ``data`` asset or a JSONL path) and read its records.

    Raises:
        DataError: the spec is neither a named data asset nor an existing file, or a record is bad.
        AssetError: the named asset cannot be fetched or verified.
    """
    if spec in ASSETS:
        asset = ASSETS[spec]
        if asset.kind != "data":
            raise DataError(f"--data {spec!r} is a {asset.kind} asset, not a dataset (workload {workload!r})")
        path = resolve_asset(spec)
        source = DataSource(spec, path, asset.sha256, f"{asset.package}=={asset.version}")
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            known = ", ".join(a.name for a in ASSETS.values() if a.kind == "data")
            raise DataError(f"--data {spec!r} is neither a named dataset ({known}) nor an existing JSONL file")
        source = DataSource(spec, path, file_sha256(path), None)
    return source, read_jsonl(path, fields, label=str(path) if source.asset is None else f"{spec} ({path})")


def stable_seed(*parts: Any) -> int:
    """A seed derived from ``parts`` that does not depend on Python's hash randomization."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


def select_fitting(records: list[dict[str, Any]], n: int, *, fits, group_key: str | None, seed: Any,
                   where: str, limit_hint: str) -> list[tuple[dict[str, Any], Any]]:
    """Pick ``n`` records in a seeded order, spreading over groups, keeping those that fit.

    Records are grouped by ``group_key`` (e.g. the passage, so that many questions on one
    story do not crowd out the others); groups are shuffled with a fixed seed and visited
    round-robin, one record per group per round. ``fits(record)`` returns ``None`` when a
    record does not fit the context budget, else its prepared form.

    Returns:
        ``(record, prepared)`` pairs, exactly ``n``.

    Raises:
        DataError: fewer than ``n`` records fit (the message says how many did).
    """
    groups: dict[Any, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(r[group_key] if group_key else r["_line"], []).append(r)
    order = list(groups)
    random.Random(stable_seed(seed)).shuffle(order)
    chosen: list[tuple[dict[str, Any], Any]] = []
    rejected: set[Any] = set()
    depth = 0
    while len(chosen) < n:
        progressed = False
        for g in order:
            if g in rejected or depth >= len(groups[g]):
                continue
            progressed = True
            rec = groups[g][depth]
            prepared = fits(rec)
            if prepared is None:
                rejected.add(g)  # same group, same context: no other record of it fits either
                continue
            chosen.append((rec, prepared))
            if len(chosen) == n:
                break
        if not progressed:
            break
        depth += 1
    if len(chosen) < n:
        raise DataError(f"{where}: only {len(chosen)} records fit, {n} requested; {limit_hint}")
    return chosen
