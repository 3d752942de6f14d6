"""Reference presets: published KV-cache compression baselines as fixed kvtune policies.

The presets live in ``kvtune/search/spaces/presets.yaml``, package data read through
:mod:`importlib.resources` (issue 3). File format::

    version: 1                     # presets-file schema version
    name: presets
    description: one line
    presets:                       # a list, evaluated in this order
      - name: kivi-2               # unique; lowercase letters, digits, '.', '-', '_'
        description: one line      # what the preset does (shown in reports)
        reference: Liu et al. 2024, KIVI, sec. 3      # the paper / system it reproduces
        policy:                    # exactly what PolicyConfig.from_dict reads
          transforms: [hadamard]
          key:   {name: uniform, bits: 2, granularity: per_channel, group_size: 32, recent_tokens: 128}
          value: {name: uniform, bits: 2, granularity: per_token, group_size: 32, recent_tokens: 128}
          codec: bitpack

:func:`load_presets` returns ``{name: PolicyConfig}`` in file order. Some presets need a
calibration pass on the model's KV before they can encode, and are returned without it:
policies whose quantizer ranks heads (``mixhq``, the ``duo-like`` preset) need head scores
(:meth:`PolicyConfig.with_head_scores`); the ``kvtc-*`` presets (KVTC, "KV Cache Transform
Coding for Compact Storage in LLM Inference", arXiv 2511.01815, sec. 3) need a PCA basis
(:meth:`PolicyConfig.with_pca_basis`); ``kvquant-3c`` needs its codebooks (KVQuant, arXiv
2401.18079, sec. 3.3: fitted offline per layer; :meth:`PolicyConfig.with_codebooks`). A profile
run calibrates them all (``--space presets``);
code that uses a preset without a run refuses such presets up front
(:func:`calibration_needs`, :func:`check_calibrated`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

import yaml

from kvtune.codecs.base import CODECS, QUANTIZERS, TRANSFORMS
from kvtune.codecs.policy import PolicyConfig
from kvtune.core.errors import ConfigError

__all__ = ["PRESETS_PATH", "PRESETS_VERSION", "Preset", "read_presets", "load_presets", "missing_components",
           "calibration_needs", "check_calibrated"]

PRESETS_PATH = Path(str(resources.files("kvtune.search").joinpath("spaces", "presets.yaml")))
PRESETS_VERSION = 1
_TOP_KEYS = ("version", "name", "description", "presets")
_ENTRY_KEYS = ("name", "description", "reference", "policy")
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


@dataclass(frozen=True)
class Preset:
    """One entry of a presets file.

    Attributes:
        name: the preset's name (e.g. ``"kivi-2"``).
        description: what it does.
        reference: the published method it reproduces.
        policy: the raw policy dict (:meth:`PolicyConfig.from_dict` input).
        line: 1-based line of the entry in the file (for error messages).
    """

    name: str
    description: str
    reference: str
    policy: dict[str, Any]
    line: int | None = None

    def config(self) -> PolicyConfig:
        """The :class:`PolicyConfig` (without head scores for ``mixhq``).

        Raises:
            ConfigError: the policy is invalid or names an unregistered component.
        """
        return PolicyConfig.from_dict(self.policy)


def missing_components(policy: Mapping[str, Any]) -> list[str]:
    """Component names a policy dict uses that are not registered in this install.

    Example: ``["codec 'range'"]`` while the range codec is not available.
    """
    missing = []
    transforms = policy.get("transforms") or []
    if isinstance(transforms, str):
        transforms = [t for t in transforms.split("+") if t]
    elif isinstance(transforms, Mapping):
        transforms = [transforms]
    for t in transforms if isinstance(transforms, list) else []:
        name = t.get("name") if isinstance(t, Mapping) else t
        if isinstance(name, str) and name not in TRANSFORMS:
            missing.append(f"transform {name!r}")
    for slot, registry, default in (("key", QUANTIZERS, "uniform"), ("value", QUANTIZERS, "uniform"), ("codec", CODECS, "bitpack")):
        spec = policy.get(slot, default)
        name = spec.get("name", default) if isinstance(spec, Mapping) else spec
        if isinstance(name, str) and name not in registry:
            missing.append(f"{slot} {name!r}")
    return missing


def calibration_needs(config: PolicyConfig) -> list[str]:
    """What ``config`` still needs from a calibration pass on the model's KV before it can encode.

    Example: ``["MixHQ head scores"]`` (``duo-like``), ``["a PCA basis (pre-RoPE keys)"]``
    (``kvtc-2``), ``["calibrated codebooks"]`` (``kvquant-3c``); ``[]`` for a policy that can
    encode as it is.
    """
    needs = ["MixHQ head scores"] if config.needs_head_scores else []
    needs += [f"a PCA basis ({rope}-RoPE keys)" for rope in sorted(config.pca_ropes_missing)]
    return needs + (["calibrated codebooks"] if config.needs_codebooks else [])


def check_calibrated(name: str, config: PolicyConfig) -> PolicyConfig:
    """``config`` when it can encode without a calibration pass.

    Raises:
        ConfigError: it needs one (:func:`calibration_needs`); the message names the preset,
            what it needs and how to get it.
    """
    needs = calibration_needs(config)
    if needs:
        raise ConfigError(
            f"preset {name!r} needs {' and '.join(needs)} from a calibration pass on the model's KV, which is not "
            "done here: profile it in a run (--space presets; the run calibrates it and keeps the data in "
            "calibration.json) and use that run's policy table, or fill it in yourself "
            "(PolicyConfig.with_head_scores / with_pca_basis / with_codebooks)")
    return config


def _entry_lines(text: str) -> list[int | None]:
    """1-based line of every item of the top-level ``presets`` list (best effort)."""
    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return []
    if isinstance(root, yaml.MappingNode):
        for k, v in root.value:
            if getattr(k, "value", None) == "presets" and isinstance(v, yaml.SequenceNode):
                return [item.start_mark.line + 1 for item in v.value]
    return []


def read_presets(path: str | Path = PRESETS_PATH) -> dict[str, Preset]:
    """Parse and check the structure of a presets file (policies are not built).

    Raises:
        ConfigError: unreadable file or YAML, unknown or missing keys, wrong version,
            duplicate or malformed names; the message names the file, the line and the key.
    """
    path = Path(path)
    try:
        text = path.read_text()
        data = yaml.safe_load(text)
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read presets: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping with keys {', '.join(_TOP_KEYS)}")
    for key in data:
        if key not in _TOP_KEYS:
            raise ConfigError(f"{path}: unknown key {key!r} (allowed: {', '.join(_TOP_KEYS)})")
    if data.get("version", PRESETS_VERSION) != PRESETS_VERSION:
        raise ConfigError(f"{path}: unsupported presets version {data.get('version')!r} (supported: {PRESETS_VERSION})")
    entries = data.get("presets")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{path}: 'presets' must be a non-empty list of presets")
    lines = _entry_lines(text)
    out: dict[str, Preset] = {}
    for i, entry in enumerate(entries):
        line = lines[i] if i < len(lines) else None
        where = f"{path}:{line}" if line else f"{path}: presets[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: a preset must be a mapping with keys {', '.join(_ENTRY_KEYS)}")
        for key in entry:
            if key not in _ENTRY_KEYS:
                raise ConfigError(f"{where}: unknown key {key!r} (allowed: {', '.join(_ENTRY_KEYS)})")
        name = entry.get("name")
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ConfigError(f"{where}: 'name' must be lowercase letters, digits, '.', '-', '_'; got {name!r}")
        if name in out:
            raise ConfigError(f"{where}: duplicate preset name {name!r}")
        if not isinstance(entry.get("policy"), dict):
            raise ConfigError(f"{where}: preset {name!r} needs a 'policy' mapping (PolicyConfig.from_dict format)")
        out[name] = Preset(
            name=name,
            description=str(entry.get("description", "")),
            reference=str(entry.get("reference", "")),
            policy=entry["policy"],
            line=line,
        )
    return out


def load_presets(path: str | Path = PRESETS_PATH, *, skip_unavailable: bool = False) -> dict[str, PolicyConfig]:
    """The presets of a file as ``{name: PolicyConfig}``, in file order.

    Args:
        path: the presets file (default: the bundled ``kvtune/search/spaces/presets.yaml``).
        skip_unavailable: leave out presets that name components not registered in this
            install (e.g. the ``range`` codec before it is available) instead of raising.

    Raises:
        ConfigError: a malformed file (:func:`read_presets`) or an invalid policy; the message
            names the file, the line and the preset.
    """
    out: dict[str, PolicyConfig] = {}
    for name, preset in read_presets(path).items():
        where = f"{path}:{preset.line}" if preset.line else str(path)
        missing = missing_components(preset.policy)
        if missing and skip_unavailable:
            continue
        try:
            out[name] = preset.config()
        except ConfigError as exc:
            hint = f" (not registered: {', '.join(missing)})" if missing else ""
            raise ConfigError(f"{where}: preset {name!r}: {exc}{hint}") from None
    return out
