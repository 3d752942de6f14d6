"""The calibrated PCA (Karhunen-Loeve) basis of a model's KV cache and the ``pca`` transform.

KVTC ("KV Cache Transform Coding for Compact Storage in LLM Inference", arXiv 2511.01815,
sec. 3) decorrelates the KV cache with a PCA basis fitted once, offline, on calibration
contexts: per layer and per K/V, one basis ACROSS the KV heads (``D = kv_heads * head_dim``
dimensions, 192 for SmolLM2-135M), keys fitted *before* RoPE (the rotation by position mixes
channel pairs differently at every position, which smears the key covariance); then a bit
allocation over the components under a per-layer budget (:mod:`kvtune.codecs.bitalloc`) and
entropy coding. The basis is a run artifact, not stream data: a stream names it by its digest.

Pieces:

* :class:`PCABasis`: per layer and kind (``"key"``/``"value"``) a :class:`BasisLayer` (mean
  ``(D,)``, orthonormal components ``(D, D)`` as rows sorted by eigenvalue, eigenvalues
  ``(D,)``, all float32), the fitting ``mode`` (``"joint"``: one basis across heads;
  ``"per_head"``: one per head, block diagonal, each head's components sorted), ``key_rope``
  (``"pre"``: keys were un-rotated before fitting, the basis then holds the rotary inverse
  frequencies and attention scaling of every layer; ``"post"``: fitted on the cached keys as
  they are). :attr:`PCABasis.digest` is the SHA-256 of a canonical serialization.
* :func:`fit_pca_basis`: the basis from calibration KV (float64 covariance, ``torch.linalg.eigh``).
* :func:`save_basis` / :func:`load_basis`: one safetensors file (atomic write; the load checks
  every size against bounds and the file before reading tensors, then the digest).
* :func:`register_basis` / :func:`lookup`: the process registry the transform and the
  ``dp-alloc`` quantizer read bases from.
* the ``pca`` transform (:class:`PCA`).

Coefficient layout: a K or V tensor ``(batch, kv_heads, tokens, head_dim)`` is read per token
as the ``D`` vector ``x[b, :, t, :].flatten()`` (index ``j = head * head_dim + channel``);
coefficient ``j`` (the projection on component ``j``) is written back at the same place, so
the transform keeps the tensor's shape and the quantizer finds component ``j`` at head
``j // head_dim``, channel ``j % head_dim``.

RoPE: pre-RoPE keys are obtained by rotating the cached keys back by their position (the
inverse of HF's ``x * cos + rotate_half(x) * sin`` with ``cos, sin`` of ``position *
inv_freq`` times the attention scaling); positions are the cache rows ``0 .. tokens - 1``
(the stream format has no position offset: it carries a prefix's KV from position 0). Wrong
positions (e.g. a sliding-window layer holding the last positions only) cost compression,
never correctness: the decoder re-rotates by the same positions.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence

import torch

from kvtune.codecs.base import Transform, param, register_transform
from kvtune.core.atomic import atomic_write_bytes
from kvtune.core.errors import ConfigError
from kvtune.core.jsonio import is_finite_number

__all__ = [
    "BasisError",
    "BasisNotLoadedError",
    "BasisLayer",
    "RopeSpec",
    "PCABasis",
    "PCA",
    "fit_pca_basis",
    "save_basis",
    "load_basis",
    "register_basis",
    "lookup",
    "registered_digests",
    "forget_basis",
    "unrotate_keys",
    "rotate_keys",
    "project",
    "unproject",
    "centered_rows",
    "leading_width",
    "project_leading",
    "unproject_leading",
    "linear",
    "onednn_linear_available",
    "missing_pca_ropes",
    "fill_pca_bases",
    "check_digest",
    "KINDS",
    "FIT_MODES",
    "ROPE_MODES",
    "MAX_BASIS_LAYERS",
    "MAX_BASIS_DIM",
    "MAX_BASIS_FILE_BYTES",
]

KINDS = ("key", "value")
FIT_MODES = ("joint", "per_head")
ROPE_MODES = ("pre", "post")
BASIS_FORMAT = 1
MAX_BASIS_LAYERS = 1024
"""Most layers a basis file may declare."""
MAX_BASIS_DIM = 8192
"""Most dimensions ``D = kv_heads * head_dim`` of one layer (a ``(D, D)`` float32 matrix of 256 MiB)."""
MAX_BASIS_FILE_BYTES = 4 << 30
"""Largest basis file :func:`load_basis` reads (4 GiB)."""
_MAX_HEADER_BYTES = 16 << 20
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")


class BasisError(ConfigError):
    """A PCA basis is malformed (shapes, values, file), does not fit the tensor it is applied
    to, or is not the basis a policy names."""


class BasisNotLoadedError(BasisError):
    """A policy names a PCA basis (by digest) that is not registered in this process."""


def check_digest(digest: Any, what: str) -> str:
    """``digest`` if it is ``""`` or 64 lowercase hex characters (a SHA-256).

    Raises:
        ConfigError: anything else; the message names ``what``.
    """
    if not isinstance(digest, str) or not (digest == "" or _DIGEST_RE.fullmatch(digest)):
        raise ConfigError(f"{what} = {digest!r} must be '' (filled by calibration) or a 64-hex-digit sha256 digest")
    return digest


# ----------------------------------------------------------------------------- the artifact


@dataclass(frozen=True, eq=False)
class BasisLayer:
    """The basis of one layer and kind.

    Attributes:
        heads, head_dim: the geometry it applies to (``D = heads * head_dim``).
        mean: float32 ``(D,)`` calibration mean.
        components: float32 ``(D, D)``, row ``j`` is component ``j`` (orthonormal rows).
        eigenvalues: float32 ``(D,)``, the variance of coefficient ``j`` on the calibration
            data (``>= 0``), in the order of ``components``.
    """

    heads: int
    head_dim: int
    mean: torch.Tensor
    components: torch.Tensor
    eigenvalues: torch.Tensor

    @property
    def dim(self) -> int:
        """``D = heads * head_dim``."""
        return self.heads * self.head_dim

    def problem(self) -> str | None:
        """Why the tensors are not a basis of this geometry, or ``None``: shapes and dtypes,
        finite values, eigenvalues ``>= 0``, and orthonormal rows (checked on four fixed probe
        vectors, ``O(D^2)``: ``C^T (C v) == v`` within 1e-3 relative)."""
        d = self.dim
        for name, t, shape in (("mean", self.mean, (d,)), ("components", self.components, (d, d)),
                               ("eigenvalues", self.eigenvalues, (d,))):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != torch.float32:
                return f"{name} must be a float32 tensor of shape {shape}"
            if not bool(torch.isfinite(t).all()):
                return f"{name} has NaN or inf values"
        if bool((self.eigenvalues < 0).any()):
            return "eigenvalues must be >= 0"
        c = self.components.double()
        probe = torch.cos(torch.arange(4 * d, dtype=torch.float64).reshape(4, d) * 0.7 + 0.3)
        back = (probe @ c.T) @ c
        if not torch.allclose(back, probe, rtol=0, atol=1e-3 * float(probe.norm(dim=1).max())):
            return "components are not orthonormal rows"
        return None


@dataclass(frozen=True, eq=False)
class RopeSpec:
    """The rotary embedding of one layer, as the model applies it to keys.

    Attributes:
        inv_freq: float32 ``(rotary_dim / 2,)`` inverse frequencies (``rotary_dim <= head_dim``;
            the first ``rotary_dim`` channels rotate, as in HF's ``rotate_half`` convention).
        scaling: the attention scaling multiplied into ``cos`` and ``sin`` (1.0 for plain RoPE).
    """

    inv_freq: torch.Tensor
    scaling: float = 1.0


@dataclass(frozen=True, eq=False)
class PCABasis:
    """A calibrated PCA basis of a model's KV cache (see the module docstring).

    Attributes:
        layers: per absolute layer index, ``(key, value)`` :class:`BasisLayer` s.
        mode: ``"joint"`` (across heads) or ``"per_head"``.
        key_rope: ``"pre"`` or ``"post"``: how the key bases were fitted.
        rope: per layer a :class:`RopeSpec` (required, one per layer, when ``key_rope == "pre"``;
            empty otherwise).
        info: free JSON-able provenance (model, contexts, tokens); part of the digest.
        sensitivity: per layer ``(key, value)``: how much the model's loss grows per unit of
            squared error in one coefficient of that layer's keys / values (finite, > 0; units
            of loss per squared coefficient, only ratios matter), measured on the calibration
            contexts (:func:`kvtune.evaluate.calibrate_pca.layer_sensitivity`); ``()`` when
            not measured. ``dp-alloc`` with ``budget="model"`` weighs each layer's distortion
            by it (:func:`kvtune.codecs.bitalloc.allocate_across_layers`). Part of the digest
            when present.

    Raises:
        BasisError: on construction, a malformed basis (the message names the layer and kind).
    """

    layers: tuple[tuple[BasisLayer, BasisLayer], ...]
    mode: str = "joint"
    key_rope: str = "post"
    rope: tuple[RopeSpec, ...] = ()
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    sensitivity: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in FIT_MODES:
            raise BasisError(f"PCA basis mode {self.mode!r} is not one of {FIT_MODES}")
        if self.key_rope not in ROPE_MODES:
            raise BasisError(f"PCA basis key_rope {self.key_rope!r} is not one of {ROPE_MODES}")
        if not 0 < len(self.layers) <= MAX_BASIS_LAYERS:
            raise BasisError(f"PCA basis has {len(self.layers)} layers; allowed 1..{MAX_BASIS_LAYERS}")
        for i, pair in enumerate(self.layers):
            for kind, entry in zip(KINDS, pair):
                problem = entry.problem()
                if problem:
                    raise BasisError(f"PCA basis layer {i} {kind}: {problem}")
        if self.key_rope == "pre":
            if len(self.rope) != len(self.layers):
                raise BasisError(f"a pre-RoPE PCA basis needs one RoPE spec per layer: {len(self.rope)} for "
                                 f"{len(self.layers)} layers")
            for i, (spec, (key, _)) in enumerate(zip(self.rope, self.layers)):
                n = spec.inv_freq.numel()
                if spec.inv_freq.dtype != torch.float32 or spec.inv_freq.dim() != 1 or not 0 < 2 * n <= key.head_dim:
                    raise BasisError(f"PCA basis layer {i}: RoPE inv_freq must be float32 (rotary_dim / 2,) with "
                                     f"0 < rotary_dim <= head_dim {key.head_dim}")
                if not (bool(torch.isfinite(spec.inv_freq).all()) and math.isfinite(spec.scaling) and spec.scaling > 0):
                    raise BasisError(f"PCA basis layer {i}: RoPE inv_freq must be finite and scaling > 0")
        elif self.rope:
            raise BasisError("a post-RoPE PCA basis carries no RoPE specs")
        problem = _sensitivity_problem(self.sensitivity, len(self.layers))
        if problem:
            raise BasisError(f"PCA basis sensitivity: {problem}")
        object.__setattr__(self, "sensitivity", tuple((float(k), float(v)) for k, v in self.sensitivity))
        json.dumps(dict(self.info))  # JSON-able (TypeError otherwise)

    def layer(self, layer: int, kind: str, heads: int, head_dim: int) -> BasisLayer:
        """The basis of ``layer`` / ``kind``, checked against the tensor's geometry.

        Raises:
            BasisError: no such layer, or another ``heads x head_dim``.
        """
        if not 0 <= layer < len(self.layers):
            raise BasisError(f"PCA basis covers layers 0..{len(self.layers) - 1}; got layer {layer}")
        entry = self.layers[layer][KINDS.index(kind)]
        if (entry.heads, entry.head_dim) != (heads, head_dim):
            raise BasisError(f"PCA basis layer {layer} {kind} is for {entry.heads} heads x {entry.head_dim} channels; "
                             f"the tensor has {heads} x {head_dim}")
        return entry

    # ------------------------------------------------------------------ serialization

    def header(self) -> dict[str, Any]:
        """The canonical JSON-able description (everything but the tensors' values; the
        ``sensitivity`` pairs only when measured, so that older bases keep their digests)."""
        out = {
            "format": BASIS_FORMAT,
            "mode": self.mode,
            "key_rope": self.key_rope,
            "layers": [[k.heads, k.head_dim, v.heads, v.head_dim] for k, v in self.layers],
            "rope": [[int(s.inv_freq.numel()), float(s.scaling)] for s in self.rope],
            "info": dict(self.info),
        }
        if self.sensitivity:
            out["sensitivity"] = [[float(k), float(v)] for k, v in self.sensitivity]
        return out

    def layer_sensitivity(self, kind: str) -> tuple[float, ...]:
        """Per layer, the :attr:`sensitivity` of ``kind`` (``"key"`` / ``"value"``).

        Raises:
            BasisError: the basis has no sensitivity (fitted before it was measured, or without
                it); the message says how to get one.
        """
        if kind not in KINDS:
            raise BasisError(f"kind must be one of {KINDS}, got {kind!r}")
        if not self.sensitivity:
            raise BasisError(f"PCA basis {self.digest[:12]} has no per-layer sensitivity, which dp-alloc "
                             "budget='model' needs: refit it with kvtune.evaluate.calibrate_pca.calibrate_pca_basis "
                             "(a new profile run does)")
        return tuple(float(pair[KINDS.index(kind)]) for pair in self.sensitivity)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor by its file name, in canonical order."""
        out: dict[str, torch.Tensor] = {}
        for i, pair in enumerate(self.layers):
            for kind, entry in zip(KINDS, pair):
                out[f"layer{i}.{kind}.mean"] = entry.mean
                out[f"layer{i}.{kind}.components"] = entry.components
                out[f"layer{i}.{kind}.eigenvalues"] = entry.eigenvalues
        for i, spec in enumerate(self.rope):
            out[f"layer{i}.rope_inv_freq"] = spec.inv_freq
        return out

    @functools.cached_property
    def digest(self) -> str:
        """SHA-256 (hex) of the canonical header JSON, a NUL byte, then every tensor's
        little-endian float32 bytes in :meth:`tensors` order."""
        h = hashlib.sha256(json.dumps(self.header(), sort_keys=True, separators=(",", ":")).encode() + b"\0")
        for t in self.tensors().values():
            h.update(t.contiguous().numpy().astype("<f4", copy=False).tobytes())
        return h.hexdigest()


def _expected_shapes(header: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape a (bounded, checked) header declares."""
    out: dict[str, tuple[int, ...]] = {}
    for i, (kh, kd, vh, vd) in enumerate(header["layers"]):
        for kind, d in (("key", kh * kd), ("value", vh * vd)):
            out[f"layer{i}.{kind}.mean"] = (d,)
            out[f"layer{i}.{kind}.components"] = (d, d)
            out[f"layer{i}.{kind}.eigenvalues"] = (d,)
    for i, (n, _) in enumerate(header["rope"]):
        out[f"layer{i}.rope_inv_freq"] = (n,)
    return out


def _sensitivity_problem(pairs: Any, layers: int) -> str | None:
    """Why ``pairs`` is not empty or one ``(key, value)`` pair of finite numbers > 0 per layer."""
    if not isinstance(pairs, (list, tuple)) or len(pairs) not in (0, layers):
        return f"must be empty or one (key, value) pair per layer ({layers})"
    for pair in pairs:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2
                and all(is_finite_number(v) and float(v) > 0 for v in pair)):
            return f"every entry must be a (key, value) pair of finite numbers > 0, got {repr(pair)[:80]}"
    return None


def _tensor_entry_problem(entry: Any, shape: tuple[int, ...]) -> str | None:
    """Why a safetensors header entry is not a float32 tensor of ``shape`` with integer
    ``data_offsets``, or ``None``."""
    if not isinstance(entry, dict):
        return f"is {type(entry).__name__}, not a tensor entry"
    dims, offsets = entry.get("shape"), entry.get("data_offsets")
    if entry.get("dtype") != "F32" or not isinstance(dims, list) or any(type(v) is not int for v in dims) \
            or tuple(dims) != shape:
        return f"is {entry.get('dtype')} {dims}, expected F32 {list(shape)}"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(v) is int for v in offsets)):
        return f"has data_offsets {offsets!r}, expected [begin, end] integers"
    return None


def _check_header(header: Any, where: str) -> dict[str, Any]:
    """The basis header of a file, its sizes bounded; raises :class:`BasisError`."""
    def bad(msg: str) -> BasisError:
        return BasisError(f"{where}: {msg}")

    if not isinstance(header, dict) or header.get("format") != BASIS_FORMAT:
        raise bad(f"not a kvtune PCA basis of format {BASIS_FORMAT}")
    layers, rope = header.get("layers"), header.get("rope")
    if not isinstance(layers, list) or not 0 < len(layers) <= MAX_BASIS_LAYERS:
        raise bad(f"'layers' must be a list of 1..{MAX_BASIS_LAYERS} entries")
    for row in layers:
        if not (isinstance(row, list) and len(row) == 4 and all(type(v) is int and v > 0 for v in row)):
            raise bad("every layer entry must be [key_heads, key_head_dim, value_heads, value_head_dim], positive ints")
        if row[0] * row[1] > MAX_BASIS_DIM or row[2] * row[3] > MAX_BASIS_DIM:
            raise bad(f"a layer of more than MAX_BASIS_DIM = {MAX_BASIS_DIM} dimensions")
    if not isinstance(rope, list) or len(rope) not in (0, len(layers)):
        raise bad("'rope' must be a list with one [rotary_dim / 2, scaling] per layer, or empty")
    for row in rope:
        if not (isinstance(row, list) and len(row) == 2 and type(row[0]) is int and 0 < row[0] <= MAX_BASIS_DIM
                and is_finite_number(row[1])):
            raise bad("every rope entry must be [rotary_dim / 2, scaling], scaling a finite number")
    if header.get("mode") not in FIT_MODES or header.get("key_rope") not in ROPE_MODES:
        raise bad(f"'mode' must be one of {FIT_MODES} and 'key_rope' one of {ROPE_MODES}")
    if not isinstance(header.get("info"), dict):
        raise bad("'info' must be an object")
    problem = _sensitivity_problem(header.get("sensitivity", []), len(layers))
    if problem:
        raise bad(f"'sensitivity' {problem}")
    return header


def save_basis(basis: PCABasis, path: str | os.PathLike[str]) -> Path:
    """Write ``basis`` to one safetensors file, atomically (the header JSON goes in the file's
    metadata under ``kvtune_pca_basis``). Returns the path."""
    from safetensors.torch import save

    data = save({k: v.contiguous().clone() for k, v in basis.tensors().items()},  # clone: no shared storage
                metadata={"kvtune_pca_basis": json.dumps(basis.header(), sort_keys=True)})
    return atomic_write_bytes(path, data)


def load_basis(path: str | os.PathLike[str], *, expect: str | None = None) -> PCABasis:
    """Read a basis written by :func:`save_basis`, bounding every size before allocating.

    The file must be a regular file (a symlink is followed; a FIFO, device or directory is
    refused before opening) of at most :data:`MAX_BASIS_FILE_BYTES`; its safetensors header at most 16 MiB
    and declare exactly the float32 tensors the basis header names, with the declared shapes
    (integers; layers and dimensions within :data:`MAX_BASIS_LAYERS` / :data:`MAX_BASIS_DIM`), packed
    back to back up to the end of the file; only then are the tensors read.

    Args:
        path: the file.
        expect: the digest the caller expects (e.g. from ``calibration.json``), or None.

    Raises:
        BasisError: unreadable, malformed or oversized file, an invalid basis, or a digest
            other than ``expect``; the message names the file.
    """
    from safetensors.torch import load

    from safetensors import SafetensorError

    path = Path(path)
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block the open, a directory fail it, a device never end
            raise BasisError(f"{path}: not a regular file")
        size = st.st_size
        if size > MAX_BASIS_FILE_BYTES:
            raise BasisError(f"{path}: {size} bytes; a PCA basis file is at most {MAX_BASIS_FILE_BYTES}")
        with path.open("rb") as fh:
            head = fh.read(8)
            if len(head) != 8:
                raise BasisError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > min(_MAX_HEADER_BYTES, size - 8):
                raise BasisError(f"{path}: safetensors header of {n} bytes in a file of {size}")
            meta = json.loads(fh.read(n))
            declared = _check_header(json.loads(meta["__metadata__"]["kvtune_pca_basis"]), str(path))
            shapes = _expected_shapes(declared)
            entries = {k: v for k, v in meta.items() if k != "__metadata__"}
            if set(entries) != set(shapes):
                raise BasisError(f"{path}: tensors {sorted(set(entries) ^ set(shapes))[:5]} differ from the basis header")
            total = 0
            for name, shape in shapes.items():
                problem = _tensor_entry_problem(entries[name], shape)
                if problem:
                    raise BasisError(f"{path}: tensor {name} {problem}")
                total += 4 * math.prod(shape)
            if total != size - 8 - n:
                raise BasisError(f"{path}: tensors of {total} bytes declared, the file holds {size - 8 - n}")
            fh.seek(0)
            tensors = load(fh.read(size))  # the bounded size, even if the file grew since the stat
    except OSError as exc:
        raise BasisError(f"{path}: cannot read ({exc})") from None
    except (ValueError, KeyError, TypeError, struct.error, RecursionError, SafetensorError) as exc:
        raise BasisError(f"{path}: not a kvtune PCA basis file ({exc})") from None
    basis = _basis_from(declared, tensors, str(path))
    if expect is not None and basis.digest != expect:
        raise BasisError(f"{path}: holds PCA basis {basis.digest}, expected {expect}")
    return basis


def _basis_from(header: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], where: str) -> PCABasis:
    layers = []
    for i, (kh, kd, vh, vd) in enumerate(header["layers"]):
        pair = tuple(BasisLayer(h, d, tensors[f"layer{i}.{kind}.mean"], tensors[f"layer{i}.{kind}.components"],
                                tensors[f"layer{i}.{kind}.eigenvalues"])
                     for kind, h, d in (("key", kh, kd), ("value", vh, vd)))
        layers.append(pair)
    rope = tuple(RopeSpec(tensors[f"layer{i}.rope_inv_freq"], float(s)) for i, (_, s) in enumerate(header["rope"]))
    try:
        return PCABasis(layers=tuple(layers), mode=header["mode"], key_rope=header["key_rope"], rope=rope,
                        info=header["info"],
                        sensitivity=tuple((float(k), float(v)) for k, v in header.get("sensitivity", [])))
    except BasisError as exc:
        raise BasisError(f"{where}: {exc}") from None


# ----------------------------------------------------------------------------- registry

_REGISTRY: dict[str, PCABasis] = {}


def register_basis(basis: PCABasis) -> str:
    """Make ``basis`` available to the ``pca`` transform and ``dp-alloc`` in this process;
    returns its digest (registering the same basis twice is a no-op)."""
    _REGISTRY.setdefault(basis.digest, basis)
    return basis.digest


def forget_basis(digest: str) -> PCABasis | None:
    """Remove a basis from this process' registry; returns it (None when it was not registered)."""
    return _REGISTRY.pop(digest, None)


def registered_digests() -> tuple[str, ...]:
    """Digests of the bases registered in this process."""
    return tuple(_REGISTRY)


def lookup(digest: str) -> PCABasis:
    """The registered basis of ``digest``.

    Raises:
        BasisNotLoadedError: ``digest`` is empty (the policy was never calibrated) or not
            registered in this process; the message says how to load it.
    """
    if not digest:
        raise BasisNotLoadedError(
            "this policy has a pca transform / dp-alloc quantizer without a basis: fit one on calibration KV "
            "(kvtune.codecs.pca.fit_pca_basis, or a profile run's calibration) and fill it in with "
            "PolicyConfig.with_pca_basis(digest)")
    basis = _REGISTRY.get(digest)
    if basis is None:
        raise BasisNotLoadedError(
            f"PCA basis {digest} is not loaded in this process: load its file with "
            f"kvtune.codecs.pca.register_basis(kvtune.codecs.pca.load_basis(path, expect='{digest}')) (a profile run "
            "keeps it in its run folder as pca_basis*.safetensors, named in calibration.json; kvtune.serving "
            "loads it from there)")
    return basis


# ----------------------------------------------------------------------------- pure math


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 input stays float64 (calibration); anything else is computed in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _rope_cos_sin(tokens: int, spec: RopeSpec, positions: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 cos and sin of ``position * inv_freq`` (the product rounded in float32, as HF
    computes the angles), times the attention scaling: ``(tokens, rotary_dim / 2)`` for
    positions ``0 .. tokens - 1``, or ``(*positions.shape, rotary_dim / 2)`` for int64
    ``positions``."""
    pos = torch.arange(tokens) if positions is None else positions
    angles = (pos.to(torch.float32)[..., None] * spec.inv_freq).double()
    return angles.cos() * spec.scaling, angles.sin() * spec.scaling


_ROPE_CACHE_ELEMENTS = 1 << 17
"""Tables of at most this many ``tokens x rotary_dim / 2`` entries are cached (0.5 MB each in
float32; 128 of them at most); longer contexts recompute theirs, a small cost next to the tensor."""


@functools.lru_cache(maxsize=128)
def _rope_table(tokens: int, spec: RopeSpec, dtype: torch.dtype, inverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` at positions ``0 .. tokens - 1`` in ``dtype`` (divided by ``s^2`` for the
    inverse rotation), cached: the encoder and decoder rotate every key tensor."""
    return _rotation(_rope_cos_sin(tokens, spec), dtype, inverse)


def _rotation(cs: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype, inverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cs
    if inverse:  # R^-1 = R^T / s^2
        norm = cos.square() + sin.square()
        cos, sin = cos / norm, -sin / norm
    return cos.to(dtype), sin.to(dtype)


def _rotate(x: torch.Tensor, spec: RopeSpec, positions: torch.Tensor | None, inverse: bool) -> torch.Tensor:
    """``(x1 cos - x2 sin, x2 cos + x1 sin, rest)`` on the rotary channel pairs (with the inverse
    rotation's tables when ``inverse``), written into one new tensor without concatenating."""
    x = x.to(_work_dtype(x))
    tokens, half = int(x.shape[2]), spec.inv_freq.numel()
    if positions is None:
        span, known = tokens, True
    else:  # a table over 0 .. the last kept position serves integer positions >= 0
        integral = not positions.is_floating_point() and not positions.is_complex() and positions.dtype != torch.bool
        span = int(positions.max()) + 1 if integral and positions.numel() else 0
        known = integral and (not positions.numel() or int(positions.min()) >= 0)
    if known and span * half <= _ROPE_CACHE_ELEMENTS:
        cos, sin = _rope_table(span, spec, x.dtype, inverse)
        if positions is not None:  # the kept tokens' rows of the table (each entry depends on its position only)
            at = positions.long()
            cos, sin = cos[at], sin[at]
    else:
        cos, sin = _rotation(_rope_cos_sin(tokens, spec, positions), x.dtype, inverse)
    out = torch.empty(x.shape, dtype=x.dtype)
    x1, x2, o1, o2 = x[..., :half], x[..., half : 2 * half], out[..., :half], out[..., half : 2 * half]
    torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=o2).addcmul_(x1, sin)
    out[..., 2 * half :] = x[..., 2 * half :]
    return out


def unrotate_keys(x: torch.Tensor, spec: RopeSpec, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Pre-RoPE keys from cached (post-RoPE) keys ``x`` ``(batch, heads, tokens, head_dim)``.

    Inverts ``y1 = s (x1 cos - x2 sin)``, ``y2 = s (x2 cos + x1 sin)`` on the channel pairs
    ``(i, i + r/2)`` of the first ``r = rotary_dim`` channels, at ``positions`` (int64
    ``(batch, heads, tokens)``, e.g. the kept tokens of a ``keep`` policy; default ``0 ..
    tokens - 1``). Computed and returned in float64 for float64 ``x``, else in float32 (the
    codec path: float32 rounding is ~1e-7 of a value, far below any quantization step).
    """
    return _rotate(x, spec, positions, inverse=True)


def rotate_keys(x: torch.Tensor, spec: RopeSpec, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`unrotate_keys` (the model's rotation at ``positions``), in the same
    dtype rule (float64 for float64 ``x``, else float32)."""
    return _rotate(x, spec, positions, inverse=False)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``(batch, heads, tokens, head_dim)`` -> ``(batch, tokens, heads * head_dim)``."""
    b, h, t, d = x.shape
    return x.permute(0, 2, 1, 3).reshape(b, t, h * d)


def _unrows(y: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    b, t, _ = y.shape
    return y.reshape(b, t, heads, head_dim).permute(0, 2, 1, 3)


def centered_rows(x: torch.Tensor, entry: BasisLayer) -> torch.Tensor:
    """Token rows ``(batch * tokens, heads * head_dim)`` of ``x`` ``(batch, heads, tokens,
    head_dim)`` (any float dtype) minus the layer's calibration mean, contiguous: one pass (the
    permute, the cast and the subtraction fused); float64 for float64 ``x``, else float32."""
    dt = _work_dtype(x)
    b, h, t, d = x.shape
    rows = torch.empty((b, t, h, d), dtype=dt)
    torch.sub(x.permute(0, 2, 1, 3), entry.mean.to(dt).view(h, d), out=rows)
    return rows.view(b * t, h * d)


def project(x: torch.Tensor, entry: BasisLayer) -> torch.Tensor:
    """Coefficients ``(batch, heads, tokens, head_dim)`` of ``x`` (same shape): coefficient
    ``j = head * head_dim + channel`` of a token is ``(x_t - mean) . components[j]``; float64
    for float64 ``x``, else float32."""
    return _unrows(project_leading(x, entry, entry.dim, 0)[0], entry.heads, entry.head_dim)


def unproject(y: torch.Tensor, entry: BasisLayer) -> torch.Tensor:
    """Inverse of :func:`project` (the components are orthonormal), same dtype rule."""
    b = y.shape[0]
    return unproject_leading(_rows(y.to(_work_dtype(y))), y.new_empty((b, 0, entry.dim), dtype=_work_dtype(y)), entry)


def _sink_rows(rows: torch.Tensor, batch: int, tokens: int, sink: int) -> torch.Tensor:
    """The rows of the first ``sink`` tokens of every batch row of ``(batch * tokens, D)``
    ``rows``: ``(batch * sink, D)`` (a view for one batch row)."""
    dim = rows.shape[-1]
    return rows.view(batch, tokens, dim)[:, :sink].reshape(batch * sink, dim)


def _sink_product(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`linear` of a few rows, padded with zero rows to two (one row takes a
    matrix-vector route whose sums can round differently); the product's first ``len(rows)``."""
    n = rows.shape[0]
    if n >= 2:
        return linear(rows, weight, bias)
    padded = torch.zeros((2, rows.shape[1]), dtype=rows.dtype)
    padded[:n] = rows
    return linear(padded, weight, bias)[:n]


@functools.lru_cache(maxsize=512)
def _leading_exact(batch: int, tokens: int, dim: int, count: int, sink: int, threads: int) -> bool:
    gen = torch.Generator().manual_seed(0)
    weight, mean = torch.randn(dim, dim, generator=gen), torch.randn(dim, generator=gen)
    rows = torch.randn(batch * tokens, dim, generator=gen)
    rest = torch.ones(batch, tokens, dtype=torch.bool)
    rest[:, :sink] = False
    rest = rest.view(batch * tokens)
    try:
        full = linear(rows, weight)  # encode: the first `count` coefficients, and the sink rows' all
        if not (torch.equal(linear(rows, weight[:count]), full[:, :count])
                and torch.equal(_sink_product(_sink_rows(rows, batch, tokens, sink), weight),
                                _sink_rows(full, batch, tokens, sink))):
            return False
        coeffs = rows.clone()  # decode: trailing coefficients 0 except in the sink rows
        coeffs[rest, count:] = 0
        full = linear(coeffs, weight.T, mean)
        return (torch.equal(linear(coeffs[:, :count], weight[:count].T, mean)[rest], full[rest])
                and torch.equal(_sink_product(_sink_rows(coeffs, batch, tokens, sink), weight.T, mean),
                                _sink_rows(full, batch, tokens, sink)))
    except (RuntimeError, NotImplementedError):
        return False


_PROBE_TOKENS = 48
"""Token rows per batch row of :func:`leading_width`'s probe (plus the sink tokens)."""


def leading_width(batch: int, tokens: int, dim: int, count: int, sink: int) -> int:
    """How many leading coefficients :meth:`PCA.forward_leading` / :meth:`PCA.inverse_leading`
    compute for a ``(batch, heads, tokens, head_dim)`` tensor (``dim = heads * head_dim``) whose
    quantizer keeps components ``< count`` only, plus all ``dim`` for the first ``sink`` tokens.

    ``count`` when :func:`linear` on the first ``count`` components gives the full product's
    bits on this machine, else ``dim``. The probe runs once per ``(batch, dim, count, sink)``
    and thread count, on random data of :data:`_PROBE_TOKENS` tokens (the kernels' order of
    summation does not change with the number of rows past one, so a request of another
    length does not probe again): the encoder's first ``count`` columns, the decoder's
    reconstruction from rows whose trailing coefficients are 0, and the sink rows on their
    own. oneDNN's kernels (the route on x86 CPUs) sum each output in the order of the reduced
    index, so truncation holds there; one row or one column takes a matrix-vector route that
    does not (``count < 2``, or fewer than two token rows, give ``dim``). Tokens times
    components is what the projections cost, so this is the saving of a bit allocation that
    drops trailing components (KVTC, arXiv 2511.01815, sec. 3.2).
    """
    if count >= dim or count < 2 or tokens <= sink or batch * tokens < 2:
        return dim
    exact = _leading_exact(batch, max(_PROBE_TOKENS, sink + 2), dim, count, sink, torch.get_num_threads())
    return count if exact else dim


def project_leading(x: torch.Tensor, entry: BasisLayer, width: int, sink: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The coefficients :func:`project` gives, of the first ``width`` components only:
    ``(batch, tokens, width)`` token rows (component ``j`` in column ``j``), and all ``D`` of
    the first ``sink`` tokens, ``(batch, sink, D)``; float64 for float64 ``x``, else float32.
    Bit for bit the same values as :func:`project` when ``width`` is :func:`leading_width`'s."""
    b, h, t, d = x.shape
    rows = centered_rows(x, entry)
    y = linear(rows, entry.components[:width].to(rows.dtype))
    ys = _sink_rows(y if width == h * d else rows, b, t, sink)
    ys = ys if width == h * d else _sink_product(ys, entry.components.to(rows.dtype))
    return y.view(b, t, width), ys.reshape(b, sink, h * d)


def unproject_leading(y: torch.Tensor, ysink: torch.Tensor, entry: BasisLayer) -> torch.Tensor:
    """Inverse of :func:`project_leading`: ``x`` ``(batch, heads, tokens, head_dim)`` (a
    permuted view of token rows, as :func:`unproject` returns) from ``y`` ``(batch, tokens,
    width)`` and ``ysink`` ``(batch, sink, D)``, in their dtype (float32 or float64). The
    coefficients beyond ``width`` are 0 except in the sink tokens; with ``width == D`` the sink
    rows of ``y`` must hold the sink tokens' coefficients. Bit for bit :func:`unproject` of the
    same coefficients when ``width`` is :func:`leading_width`'s."""
    b, t, width = y.shape
    sink, dim = ysink.shape[1], entry.dim
    comps, mean = entry.components.to(y.dtype), entry.mean.to(y.dtype)
    x = linear(y.reshape(b * t, width), comps[:width].T, mean)
    if width < dim and sink:
        x.view(b, t, dim)[:, :sink] = _sink_product(ysink.reshape(b * sink, dim), comps.T, mean).view(b, sink, dim)
    return _unrows(x.view(b, t, dim), entry.heads, entry.head_dim)


@functools.cache
def onednn_linear_available() -> bool:
    """Whether this torch build runs oneDNN's linear on float32 CPU tensors (the op is
    registered and a 2 x 2 product through it equals ``matmul``'s); probed once."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    try:
        got = torch.ops.mkldnn._linear_pointwise(a, a, None, "none", [], "")
    except (RuntimeError, NotImplementedError):
        return False
    return bool(torch.equal(got, a @ a.T))


def linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``rows @ weight.T`` (``+ bias``) for ``rows`` ``(n, D)``, ``weight`` ``(D, D)`` (any
    strides), ``bias`` ``(D,)``, all of one dtype; returns ``(n, D)`` in that dtype.

    float32 on the CPU goes through oneDNN's linear (``torch.ops.mkldnn._linear_pointwise``,
    what ``torch.compile`` emits for ``nn.Linear``) where this torch build has it, else through
    ``torch.addmm`` / ``matmul`` (MKL's sgemm on x86 builds). On the 2-vCPU AMD EPYC (Zen 5) this
    project is built on, one thread, a ``(1024 x 192) @ (192 x 192)`` product (one K or V tensor
    of SmolLM2-135M) took 0.34 ms through oneDNN against 0.77 ms through ``matmul``
    (2026-12-03, ``benchmarks/pca_matmul.py``). Encoders and decoders of every path call this
    function, so they compute the same bits on one machine. Tested in ``tests/test_pca.py``
    (``test_linear_matches_matmul_on_both_routes``).
    """
    if rows.dtype == torch.float32 and rows.device.type == "cpu" and rows.numel() and onednn_linear_available():
        # oneDNN reads the bias as a packed (D,) array whatever its strides (the weight's it honours)
        return torch.ops.mkldnn._linear_pointwise(rows.contiguous(), weight, None if bias is None else bias.contiguous(),
                                                  "none", [], "")
    if bias is None:
        return rows @ weight.T
    return torch.addmm(bias, rows, weight.T)


def _eig_sorted(cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (descending, clamped at 0) and eigenvectors as rows of a float64 symmetric
    matrix; each row's sign makes its largest-magnitude entry positive (deterministic)."""
    vals, vecs = torch.linalg.eigh(cov)
    vals, rows = vals.flip(0).clamp_min(0), vecs.flip(1).T
    lead = rows.gather(1, rows.abs().argmax(dim=1, keepdim=True))
    return vals, rows * torch.where(lead < 0, -1.0, 1.0).to(rows.dtype)


def _basis_layer(total: torch.Tensor, outer: torch.Tensor, n: int, heads: int, head_dim: int, mode: str) -> BasisLayer:
    mean = total / max(n, 1)
    cov = outer / max(n, 1) - torch.outer(mean, mean)
    cov = (cov + cov.T) / 2
    d = heads * head_dim
    if mode == "joint":
        vals, rows = _eig_sorted(cov)
    else:
        vals, rows = torch.zeros(d, dtype=torch.float64), torch.zeros(d, d, dtype=torch.float64)
        for h in range(heads):
            s = slice(h * head_dim, (h + 1) * head_dim)
            vals[s], rows[s, s] = _eig_sorted(cov[s, s])
    return BasisLayer(heads, head_dim, mean.float(), rows.float(), vals.float())


def fit_pca_basis(kv_list: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]], *, mode: str = "joint",
                  key_rope: str = "post", rope: Sequence[RopeSpec] = (), info: Mapping[str, Any] | None = None
                  ) -> PCABasis:
    """Fit a :class:`PCABasis` on calibration KV (KVTC, arXiv 2511.01815, sec. 3).

    Per layer and kind, the float64 mean and covariance of the ``D``-vectors of every token of
    every context and batch row, then ``torch.linalg.eigh`` (``mode="joint"``: one ``D x D``
    problem; ``"per_head"``: one ``head_dim x head_dim`` problem per head, block diagonal).

    Args:
        kv_list: calibration contexts; each one ``(K, V)`` pair per layer, each
            ``(batch, kv_heads, tokens, head_dim)`` (any float dtype, any device). Every context
            has the same number of layers and geometry.
        mode: ``"joint"`` or ``"per_head"``.
        key_rope: ``"pre"``: un-rotate keys (:func:`unrotate_keys`, positions ``0..tokens-1``)
            before fitting, ``rope`` then gives one :class:`RopeSpec` per layer; ``"post"``:
            fit the keys as cached.
        rope: per layer RoPE specs (for ``key_rope="pre"``).
        info: provenance stored in the basis (JSON-able).

    Raises:
        BasisError: no contexts, inconsistent geometry, a bad mode, missing RoPE specs, or
            contexts without tokens.
    """
    if mode not in FIT_MODES or key_rope not in ROPE_MODES:
        raise BasisError(f"fit_pca_basis: mode must be one of {FIT_MODES}, key_rope one of {ROPE_MODES}")
    if not kv_list or not kv_list[0]:
        raise BasisError("fit_pca_basis needs at least one calibration context with at least one layer")
    num_layers = len(kv_list[0])
    rope = tuple(rope) if key_rope == "pre" else ()
    if key_rope == "pre" and len(rope) != num_layers:
        raise BasisError(f"key_rope='pre' needs one RoPE spec per layer: got {len(rope)} for {num_layers} layers")
    layers = []
    for i in range(num_layers):
        pair = []
        for j, kind in enumerate(KINDS):
            geometry = {(int(ctx[i][j].shape[1]), int(ctx[i][j].shape[3])) for ctx in kv_list}
            if len(geometry) != 1 or any(len(ctx) != num_layers for ctx in kv_list):
                raise BasisError(f"fit_pca_basis: layer {i} {kind} has geometries {sorted(geometry)} across contexts")
            heads, head_dim = geometry.pop()
            d = heads * head_dim
            total, outer, n = torch.zeros(d, dtype=torch.float64), torch.zeros(d, d, dtype=torch.float64), 0
            for ctx in kv_list:
                x = ctx[i][j].detach().to("cpu", torch.float64)
                if kind == "key" and key_rope == "pre":
                    x = unrotate_keys(x, rope[i])
                rows = _rows(x).reshape(-1, d)
                total += rows.sum(0)
                outer += rows.T @ rows
                n += rows.shape[0]
            if n == 0:
                raise BasisError(f"fit_pca_basis: layer {i} {kind} has no calibration tokens")
            pair.append(_basis_layer(total, outer, n, heads, head_dim, mode))
        layers.append(tuple(pair))
    return PCABasis(layers=tuple(layers), mode=mode, key_rope=key_rope, rope=rope, info=dict(info or {}))


# ----------------------------------------------------------------------------- transform


@register_transform("pca")
@dataclass(frozen=True)
class PCA(Transform):
    """Project every token of a K or V tensor on a calibrated PCA basis (KVTC, arXiv 2511.01815,
    sec. 3): ``y_t = C (x_t - mean)`` per layer and kind, ``x_t`` the token's ``kv_heads *
    head_dim`` vector; keys first un-rotated by their position when ``rope == "pre"``. The
    output keeps the input's shape (coefficient ``j`` at head ``j // head_dim``, channel
    ``j % head_dim``: the module docstring), so any quantizer codes it; ``dp-alloc``
    (:mod:`kvtune.codecs.bitalloc`) allocates bits per coefficient from the basis' eigenvalues.

    The basis is not in the stream (no transform state): the policy names it by ``basis``, its
    digest, which is part of the policy id; encoder and decoder look it up in the process
    registry (:func:`lookup`). Arithmetic is float32 (float64 took twice as long and changed
    nothing a quantizer can see: the projection's rounding is ~1e-7 of a coefficient), so
    ``inverse(forward(x)) == x`` to a few float32 roundings.

    Args:
        basis: the :attr:`PCABasis.digest`; ``""`` until a calibration fills it in
            (:meth:`~kvtune.codecs.PolicyConfig.with_pca_basis`).
        rope: ``"pre"`` (keys un-rotated before projecting, re-rotated after decoding; needs a
            basis fitted with ``key_rope="pre"``) or ``"post"`` (keys as cached, a basis with
            ``key_rope="post"``). Values are never rotated.

    Raises:
        BasisError (a ConfigError): on use, an empty or unregistered basis, a basis fitted with
            the other ``rope``, or a tensor whose layer / geometry the basis does not cover.
    """

    basis: str = param("", doc="sha256 digest of the PCA basis ('' = filled in by calibration)")
    rope: str = param("pre", choices=ROPE_MODES, doc="keys projected before ('pre') or after ('post') RoPE")

    def validate(self) -> None:
        check_digest(self.basis, "transform 'pca': parameter 'basis'")

    def _entry(self, shape: tuple[int, ...], layer: int, kind: str) -> tuple[BasisLayer, RopeSpec | None]:
        if kind not in KINDS:
            raise ValueError(f"kind must be 'key' or 'value', got {kind!r}")
        basis = lookup(self.basis)
        if basis.key_rope != self.rope:
            raise BasisError(f"pca(rope={self.rope!r}) cannot use PCA basis {self.basis[:12]}, fitted on "
                             f"{basis.key_rope}-RoPE keys")
        entry = basis.layer(layer, kind, int(shape[1]), int(shape[3]))
        spec = basis.rope[layer] if kind == "key" and self.rope == "pre" else None
        return entry, spec

    uses_positions: ClassVar[bool] = True
    mixes_heads: ClassVar[bool] = True

    def forward(self, x: torch.Tensor, *, layer: int, kind: str, state=None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Coefficients of float32 ``(batch, kv_heads, tokens, head_dim)`` ``x``, same shape, float32.

        ``positions``: int64 ``(batch, kv_heads, tokens)`` positions of the rows, where pre-RoPE
        keys are un-rotated (the kept tokens after ``keep``); default ``0 .. tokens - 1``."""
        entry, spec = self._entry(tuple(x.shape), layer, kind)
        return project(x if spec is None else unrotate_keys(x, spec, positions), entry).to(torch.float32)

    def inverse(self, y: torch.Tensor, *, layer: int, kind: str, state=None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Undo :meth:`forward`: unproject, then re-rotate pre-RoPE keys at ``positions``; float32,
        contiguous (the projection works on ``(batch, tokens, heads * head_dim)`` rows)."""
        entry, spec = self._entry(tuple(y.shape), layer, kind)
        x = unproject(y, entry)
        return (x if spec is None else rotate_keys(x, spec, positions)).to(torch.float32).contiguous()

    def forward_leading(self, x: torch.Tensor, width: int, sink: int, *, layer: int, kind: str,
                        positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward`'s coefficients of ``(batch, kv_heads, tokens, head_dim)`` ``x`` (any
        float dtype) as :func:`project_leading` returns them: float32 token rows ``(batch,
        tokens, width)`` of the first ``width`` components and ``(batch, sink, D)`` of the first
        ``sink`` tokens; the same bits as :meth:`forward` with ``width`` from
        :func:`leading_width` (the codec fast path's route)."""
        entry, spec = self._entry(tuple(x.shape), layer, kind)
        return project_leading(x if spec is None else unrotate_keys(x, spec, positions), entry, width, sink)

    def inverse_leading(self, y: torch.Tensor, ysink: torch.Tensor, shape: tuple[int, ...], *, layer: int, kind: str,
                        positions: torch.Tensor | None = None) -> torch.Tensor:
        """Undo :meth:`forward_leading` for a tensor of ``shape`` ``(batch, kv_heads, tokens,
        head_dim)`` (:func:`unproject_leading`, then the keys' rotation): float32, the values
        of :meth:`inverse` (a permuted view of token rows for values, contiguous for keys)."""
        entry, spec = self._entry(tuple(shape), layer, kind)
        x = unproject_leading(y, ysink, entry)
        return x if spec is None else rotate_keys(x, spec, positions)

    def short_label(self) -> str:
        """``pca:{pre|post}[@<first 8 digest digits>]``."""
        return f"pca:{self.rope}" + (f"@{self.basis[:8]}" if self.basis else "")


# ----------------------------------------------------------------------------- calibration fill


def missing_pca_ropes(transforms: Sequence[Transform]) -> frozenset[str]:
    """The ``rope`` modes of the ``pca`` transforms that still lack a basis."""
    return frozenset(t.rope for t in transforms if isinstance(t, PCA) and not t.basis)


def fill_pca_bases(transforms: Sequence[Transform], bases: str | Mapping[str, str]) -> tuple[Transform, ...]:
    """``transforms`` with every basis-less ``pca`` transform given a digest: ``bases`` itself
    (a digest) or ``bases[t.rope]`` (a mapping rope mode -> digest; modes it lacks stay empty).

    Raises:
        ConfigError: a digest that is not 64 hex digits.
    """
    out = []
    for t in transforms:
        if isinstance(t, PCA) and not t.basis:
            digest = bases if isinstance(bases, str) else bases.get(t.rope, "")
            t = dataclasses.replace(t, basis=check_digest(digest, "pca basis"))
        out.append(t)
    return tuple(out)
