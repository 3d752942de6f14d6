"""Typed errors raised by kvtune.

Every error a user can trigger with bad input derives from :class:`KvtuneError`, so the CLI
can print it as one clear line instead of a traceback.
"""

from __future__ import annotations


class KvtuneError(Exception):
    """Base class of every error kvtune raises on purpose."""


class AssetError(KvtuneError):
    """A named asset (model, text) could not be fetched, verified or read."""


class ModelLayoutError(KvtuneError):
    """The model loaded, but kvtune cannot read or inject its KV cache layout."""


class ConfigError(KvtuneError):
    """A policy configuration, component name or parameter value is invalid."""


class SpaceError(KvtuneError):
    """A search-space YAML file is malformed (unknown key, bad value, empty space)."""


class TableError(KvtuneError):
    """A policy table is malformed (unknown version, missing columns, bad breakpoints)."""


class KVStreamError(KvtuneError):
    """Base class of errors raised while decoding a KV bitstream.

    A stream that is truncated, corrupted, of another format version or for another policy
    never decodes to tensors: one of the subclasses below is raised instead.
    """


class TruncatedStreamError(KVStreamError):
    """The stream ends before the lengths recorded in its header say it should."""


class CorruptStreamError(KVStreamError):
    """The stream's checksum or magic does not match: bytes were altered."""


class StreamVersionError(KVStreamError):
    """The stream was written with a wire-format version this kvtune cannot read."""


class PolicyMismatchError(KVStreamError):
    """The stream was encoded with a different policy than the one the caller expects."""


class BiCacheError(KvtuneError):
    """A BiCache (shared-prefix reuse) request is invalid: a reuse depth outside ``0..L``, a
    cached prefix state that belongs to another prefix or covers fewer layers, an unsupported
    encoder family, or a malformed prefix-state payload."""


class RunFolderError(KvtuneError):
    """A run folder cannot be used: its name is not a single safe path component, ``--out``
    names a file, or the folder is not a kvtune run folder."""


class RunLockedError(RunFolderError):
    """Another live kvtune process holds the run folder's lock (its pid is in the message)."""


class RegistryError(KvtuneError):
    """A registry lookup or registration failed: an unknown name (the message lists the known
    ones) or a name registered twice."""


class KVInputError(KvtuneError, ValueError):
    """A KV cache handed to the encoder cannot be coded faithfully: a degenerate shape (no
    batch, heads or channels), an unsupported dtype or a meta tensor, values beyond the range a
    quantizer represents (e.g. beyond the float16 range of its scales), or non-finite values;
    or the ``out`` buffers / ``device`` handed to the decoder cannot receive a stream's KV. A
    ``ValueError`` as well."""


class KVInputTypeError(KVInputError, TypeError):
    """A KV cache argument of the wrong structure: not a list of ``(K, V)`` pairs of tensors.
    A ``TypeError`` (and a :class:`KVInputError`) as well."""
