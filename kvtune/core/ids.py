"""The one policy-id function: every table row's ``policy_id`` is made here."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from kvtune.core.jsonio import canonical_json

__all__ = ["POLICY_ID_HEX", "config_policy_id", "policy_id"]

#: Hex characters of a policy id (48 bits of SHA-256).
POLICY_ID_HEX = 12


def policy_id(config_json: str, length: int = POLICY_ID_HEX) -> str:
    """First ``length`` hex characters of the SHA-256 of ``config_json`` (UTF-8).

    The same configuration text always gives the same id; T/Q/C policies hash their
    canonical JSON (:meth:`kvtune.codecs.PolicyConfig.policy_id` equals
    ``policy_id(config.to_json())``), SCD transfer methods their ``config_json()``.
    """
    return hashlib.sha256(config_json.encode("utf-8")).hexdigest()[:length]


def config_policy_id(config: Mapping[str, Any]) -> str:
    """:func:`policy_id` of ``config``'s :func:`~kvtune.core.jsonio.canonical_json`."""
    return policy_id(canonical_json(config))
