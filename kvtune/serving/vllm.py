"""kvtune's KV connector for vLLM (v1 connector API): disaggregated prefill and remote prefix fetch.

Implements the transfer path of KVServe ("KVServe: Service-Aware KV Cache Compression for
Communication-Efficient Disaggregated LLM Serving", arXiv 2605.13734, sec. 2 and 4): the
prefill instance (``kv_role="kv_producer"``) gathers each request's KV cache from vLLM's paged
blocks, encodes it with the policy kvtune selected, and ships the stream; the decode instance
(``kv_role="kv_consumer"``) decodes it into its own paged blocks, so its prefill only computes
the tokens past the loaded blocks. Two modes:

* ``"p2p"``: the producer sends the stream over one TCP connection to the consumer
  (:mod:`kvtune.serving.transport` frames); the consumer's worker receives it into a local
  spool directory, where its scheduler finds it.
* ``"store"``: the producer parks the stream in a pool (a directory both instances see, or a
  pool served over TCP: ``store_path="tcp://host:port"``, ``python -m
  kvtune.serving.transport DIR``): the "KV parked in a remote pool" case; the consumer fetches
  the longest stored prefix of a prompt.

Only whole blocks are moved (vLLM's CPU block size is 128 tokens), and never the block holding
a prompt's last token, which the consumer computes to produce the first output token: a prompt
of ``n`` tokens moves ``(n - 1) // block_size * block_size`` tokens.

Use (the connector class is loaded from this module; keys of ``kv_connector_extra_config`` are
the fields of :class:`ConnectorSettings`; the producer is configured the same way with
``kv_role="kv_producer"``, and ``vllm serve --kv-transfer-config '{...}'`` takes the same
fields as JSON)::

    from vllm import LLM
    from vllm.config import KVTransferConfig
    llm = LLM(model=..., kv_transfer_config=KVTransferConfig(
        kv_connector="KvtuneConnector", kv_connector_module_path="kvtune.serving.vllm",
        kv_role="kv_consumer", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"mode": "p2p", "peer_host": "10.0.0.2", "peer_port": 18600,
                                   "table": "profiles/run/policy_table.json", "q_min": 0.97}))

Faults: a stream that fails its checks (CRC, shapes; with a shared key its HMAC seal, so an
unsealed or forged stream is refused), a connection dropped mid-transfer and a prefix missing
from the store are logged with their typed error, and the consumer recomputes the request: a
missing stream is reported as no matched tokens; a stream that fails while loading is reported
through :meth:`KvtuneConnector.get_block_ids_with_load_errors`, which vLLM answers by
recomputing those blocks when ``kv_load_failure_policy="recompute"``.

vLLM API used: ``KVConnectorBase_V1`` (``vllm.distributed.kv_transfer.kv_connector.v1.base``),
overriding ``get_num_new_matched_tokens``, ``update_state_after_alloc``,
``build_connector_meta``, ``request_finished``, ``on_new_request`` (scheduler side),
``register_kv_caches``,
``start_load_kv``, ``wait_for_layer_load``, ``save_kv_layer``, ``wait_for_save``,
``get_block_ids_with_load_errors`` and ``shutdown`` (worker side). The paged blocks are read
and written by :mod:`kvtune.serving.paged`, which learns their layout (token-major,
channel-major or AMX-packed, by the attention kernels' ISA) at start-up from the engine's own
cache-write kernel (``vllm._custom_ops.cpu_attn_reshape_and_cache``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvtune.codecs import PolicyConfig, decode_kv, encode_kv, original_nbytes
from kvtune.core.errors import ConfigError, KvtuneError
from kvtune.serving.artifacts import ModelMismatchError, basis_problem, selection_problem
from kvtune.serving.auth import MAX_KEY_BYTES, load_key, seal, unseal
from kvtune.serving.paged import PagedLayout, gather_blocks, paged_geometry, probe_layout, scatter_blocks
from kvtune.serving.transport import (
    DEFAULT_MAX_FRAME_BYTES,
    FrameClient,
    FrameServer,
    KVStore,
    PrefixNotFoundError,
    open_store,
)

__all__ = [
    "ConnectorSettings",
    "StaticPolicy",
    "EncodedStream",
    "KvtuneConnector",
    "KvtuneConnectorMetadata",
    "TransferItem",
    "prefix_key",
    "movable_tokens",
]

logger = logging.getLogger(__name__)

MODES = ("p2p", "store")
REQUEST_PARAMS = ("kvtune_policy", "kvtune_bandwidth_gbps", "kvtune_debug_zero_kv")
"""Per-request keys of ``SamplingParams(extra_args={"kv_transfer_params": {...}})``:
``kvtune_policy`` (producer: a preset name or policy dict used for this request instead of the
configured policy, e.g. to compare static choices), ``kvtune_bandwidth_gbps`` (producer with a
table: the bandwidth the stream will cross, e.g. the link of the instance that will fetch a
pooled prefix; default: the bandwidth learned from this producer's transfers, or in store mode
the ``bandwidth_gbps`` setting) and ``kvtune_debug_zero_kv`` (consumer: load zeros instead of
the decoded KV, a control)."""


# ----------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class ConnectorSettings:
    """The connector's ``kv_connector_extra_config``.

    Attributes:
        mode: ``"p2p"`` (TCP from producer to consumer) or ``"store"`` (shared directory).
        policy: a static policy: a preset name (``kvtune/search/spaces/presets.yaml``) or a
            policy dict (:meth:`PolicyConfig.from_dict`). Exactly one of ``policy`` / ``table``
            is needed on the producer (the consumer decodes any stream).
        table: a kvtune policy table (``policy_table.json`` / ``.parquet``): the policy is
            picked per transfer from the measured bandwidth (needs ``kvtune.serving.runtime``).
        q_min: accuracy floor for the table (fraction).
        slo_s: transfer-time SLO for the table's controller (seconds), or None.
        bandwidth_gbps: bandwidth (Gbps) assumed for the first transfer, before any is measured.
        peer_host, peer_port: p2p: the consumer's receiver (the consumer listens there).
        store_path: store mode: the pool, a directory both instances see or ``tcp://host:port``
            of a pool server (``python -m kvtune.serving.transport DIR``).
        spool_path: p2p consumer: local directory of received streams (default: under the
            system temp directory, named by the port).
        allow_dtype_mismatch: with ``table``, accept serving KV of another dtype than the one
            the table was profiled on (e.g. bfloat16 KV, a table profiled on float32 KV).
        key_file: file whose bytes are the shared key that seals streams (else
            ``KVTUNE_KV_KEY_FILE`` / ``KVTUNE_KV_KEY`` from the environment,
            :func:`kvtune.serving.auth.load_key`; none: streams are not sealed). With a key, a
            consumer refuses unsealed or forged streams (and recomputes).
        timeout_s: seconds without progress before a transfer is abandoned.
        max_stream_bytes: largest stream received or read from the store.
        metrics_path: append one JSON line per transfer (producer) / load (consumer) here.
        debug_zero_loaded_kv: consumer: write zeros instead of the decoded KV (a control that
            shows the decoded KV is what the engine uses).
        debug_dump_dir: producer: also save each gathered KV (kvtune layout) as a ``.pt`` file.
    """

    mode: str = "p2p"
    policy: Any = None
    table: str | None = None
    q_min: float = 0.99
    slo_s: float | None = None
    bandwidth_gbps: float | None = None
    allow_dtype_mismatch: bool = False
    peer_host: str = "127.0.0.1"
    peer_port: int = 18600
    store_path: str | None = None
    spool_path: str | None = None
    key_file: str | None = None
    timeout_s: float = 30.0
    max_stream_bytes: int = DEFAULT_MAX_FRAME_BYTES
    metrics_path: str | None = None
    debug_zero_loaded_kv: bool = False
    debug_dump_dir: str | None = None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> "ConnectorSettings":
        """Validate ``kv_connector_extra_config``.

        Raises:
            ConfigError: an unknown key (the message lists the known ones), a value of the
                wrong type or range, or a missing one (``store_path`` in store mode).
        """
        extra = dict(extra or {})
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(extra) - set(names))
        if unknown:
            raise ConfigError(f"kvtune connector: unknown kv_connector_extra_config keys {unknown}; known: {names}")
        s = cls(**extra)
        if s.mode not in MODES:
            raise ConfigError(f"kvtune connector: mode must be one of {MODES}, got {s.mode!r}")
        if s.policy is not None and s.table is not None:
            raise ConfigError("kvtune connector: give either 'policy' or 'table', not both")
        for name in ("q_min", "timeout_s"):
            v = getattr(s, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
                raise ConfigError(f"kvtune connector: {name} must be a number > 0, got {v!r}")
        for name in ("slo_s", "bandwidth_gbps"):
            v = getattr(s, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
                raise ConfigError(f"kvtune connector: {name} must be a number > 0 or null, got {v!r}")
        if isinstance(s.peer_port, bool) or not isinstance(s.peer_port, int) or not 0 <= s.peer_port <= 65535:
            raise ConfigError(f"kvtune connector: peer_port must be a TCP port, got {s.peer_port!r}")
        if isinstance(s.max_stream_bytes, bool) or not isinstance(s.max_stream_bytes, int) or s.max_stream_bytes <= 0:
            raise ConfigError(f"kvtune connector: max_stream_bytes must be an int > 0, got {s.max_stream_bytes!r}")
        if s.mode == "store" and not s.store_path:
            raise ConfigError("kvtune connector: mode 'store' needs store_path (the shared directory)")
        return s

    def spool_dir(self) -> Path:
        """Where a p2p consumer keeps received streams (shared by its scheduler and worker):
        ``spool_path``, else ``kvtune-spool-<port>`` in ``/dev/shm`` (memory) when it exists,
        else in the system temp directory."""
        if self.spool_path:
            return Path(self.spool_path)
        shm = Path("/dev/shm")
        root = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
        return root / f"kvtune-spool-{self.peer_port}"


# ----------------------------------------------------------------------------- policy seam


@dataclass
class EncodedStream:
    """One encoded request, as :class:`kvtune.serving.EncodedKV` for a table: ``stream``
    (bytes, sealed with a key), ``policy_id``, ``encode_s`` (seconds, sealing included),
    ``kv_bytes`` (bytes of the KV in bfloat16), ``decision`` (None: no controller)."""

    stream: bytes
    policy_id: str
    encode_s: float
    kv_bytes: int
    decision: Any = None


class StaticPolicy:
    """One fixed policy for every transfer: the ``policy`` setting (a preset or a policy dict).

    Same calls as the table-driven :class:`kvtune.serving.ServingPolicy` (``check_model``,
    ``encode``, ``decode``, ``feedback``), so the connector uses either.

    Args:
        config: the policy.
        key: shared stream key: streams are sealed on encode and must authenticate on decode
            (:mod:`kvtune.serving.auth`), or None.

    Raises:
        ConfigError: a token-selecting (``keep``) policy, which vLLM's paged cache cannot hold
            (:func:`kvtune.serving.artifacts.selection_problem`), or a ``pca`` policy whose basis
            is not loaded (:func:`kvtune.serving.artifacts.basis_problem`).
    """

    def __init__(self, config: PolicyConfig, key: bytes | None = None) -> None:
        problem = selection_problem(config) or basis_problem(config)
        if problem is not None:
            raise ConfigError(f"kvtune connector: {problem}")
        self.config = config
        self._key = key

    @classmethod
    def from_setting(cls, policy: Any, key: bytes | None = None) -> "StaticPolicy":
        """Build from a preset name or a policy dict.

        Raises:
            ConfigError: an unknown preset, a preset that needs a calibration pass (MixHQ head
                scores, a PCA basis: :func:`kvtune.codecs.presets.check_calibrated`), a malformed
                policy dict, or neither.
        """
        if isinstance(policy, str):
            from kvtune.codecs.presets import check_calibrated, load_presets

            presets = load_presets(skip_unavailable=True)
            if policy not in presets:
                raise ConfigError(f"kvtune connector: unknown preset {policy!r}; known: {sorted(presets)}")
            return cls(check_calibrated(policy, presets[policy]), key)
        if isinstance(policy, Mapping):
            return cls(PolicyConfig.from_dict(dict(policy)), key)
        raise ConfigError(f"kvtune connector: policy must be a preset name or a policy dict, got {type(policy).__name__}")

    def check_model(self, *, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                    allow_dtype_mismatch: bool = False) -> None:
        """A static policy applies to any geometry (head-ranking policies check their scores
        on encode)."""

    def encode(self, kv: list[tuple[torch.Tensor, torch.Tensor]], *, bandwidth_gbps: float | None = None) -> EncodedStream:
        """Encode (and seal) ``kv``: per layer ``(K, V)``, each ``(1, kv_heads, tokens, head_dim)``."""
        t0 = time.perf_counter()
        stream = encode_kv(kv, self.config)
        if self._key is not None:
            stream = seal(stream, self._key)
        return EncodedStream(stream, self.config.policy_id, time.perf_counter() - t0, original_nbytes(kv))

    def decode(self, stream: bytes | bytearray | memoryview, *, device=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Decode any kvtune stream (self-describing), after authenticating it with a key.

        Raises:
            AuthenticationError: with a key, an unsealed, truncated, edited or wrongly keyed stream.
            KVStreamError: a stream that fails its checks.
        """
        return decode_kv(stream if self._key is None else unseal(stream, self._key), device=device)

    def feedback(self, encoded: EncodedStream, *, transfer_s: float, decode_s: float | None = None) -> None:
        """A static policy ignores measurements."""


def make_policy(settings: ConnectorSettings, key: bytes | None):
    """The policy object of ``settings``: :class:`StaticPolicy` for ``policy``,
    :class:`kvtune.serving.ServingPolicy` for ``table``, and :class:`StaticPolicy` of ``none``
    when neither is given (a consumer only decodes: streams name their policy).

    Raises:
        ConfigError, TableError, CalibrationError: a bad policy setting or table.
    """
    if settings.table is not None:
        from kvtune.serving.runtime import ServingPolicy

        return ServingPolicy.load(settings.table, q_min=settings.q_min, slo_s=settings.slo_s, key=key,
                                  initial_bandwidth_gbps=settings.bandwidth_gbps)
    return StaticPolicy.from_setting(settings.policy if settings.policy is not None else "none", key)


def load_shared_key(settings: ConnectorSettings) -> bytes | None:
    """The key that seals streams: the bytes of ``key_file`` if set (read bounded), else
    :func:`kvtune.serving.auth.load_key` (environment), else None. Never logged.

    Raises:
        ConfigError: ``key_file`` is unreadable; KeyConfigError: an unusable key.
    """
    if not settings.key_file:
        return load_key()
    try:
        with open(settings.key_file, "rb") as fh:
            key = fh.read(MAX_KEY_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"kvtune connector: cannot read key_file {settings.key_file}: {exc.strerror}") from None
    seal(b"", key)  # KeyConfigError (naming the problem, not the key) for an unusable key
    return key


# ----------------------------------------------------------------------------- pure helpers

_KEY_DOMAIN = b"kvtune-prefix-v1\0"


def prefix_key(token_ids) -> str:
    """Key of the KV of a token prefix: BLAKE2b-128 (hex) of the token ids (int32 LE).

    The same tokens give the same key on every instance, so the consumer finds the stream the
    producer sent or stored for a prompt (or for a prompt sharing its first blocks)."""
    h = hashlib.blake2b(_KEY_DOMAIN, digest_size=16)
    h.update(torch.as_tensor(list(token_ids), dtype=torch.int32).numpy().astype("<i4").tobytes())
    return h.hexdigest()


def movable_tokens(prompt_tokens: int, block_size: int) -> int:
    """Tokens of a prompt whose KV is moved: whole blocks, never the block holding the last
    prompt token (the consumer computes it): ``(prompt_tokens - 1) // block_size * block_size``."""
    if prompt_tokens <= 0:
        return 0
    return (prompt_tokens - 1) // block_size * block_size


def _layer_index(name: str) -> int:
    nums = re.findall(r"\d+", name)
    if not nums:
        raise ModelMismatchError(f"cannot tell the layer index of KV cache {name!r}")
    return int(nums[0])


# ----------------------------------------------------------------------------- metadata


@dataclass
class TransferItem:
    """One request's save or load in one engine step (scheduler -> worker).

    ``key``: the prefix key; ``block_ids``: the request's blocks in token order; ``start``,
    ``end``: the token range to load (load) or ``0, tokens`` (save); ``req_id``: vLLM's id;
    ``policy``: the request's own static policy (save), ``bandwidth_gbps``: the bandwidth
    hint of the save, ``zero``: load zeros (debug)."""

    req_id: str
    key: str
    block_ids: list[int]
    start: int
    end: int
    policy: Any = None
    bandwidth_gbps: float | None = None
    zero: bool = False


@dataclass
class KvtuneConnectorMetadata(KVConnectorMetadata):
    """What the scheduler asks the worker to do this step."""

    loads: list[TransferItem] = field(default_factory=list)
    saves: list[TransferItem] = field(default_factory=list)


@dataclass
class _Tracked:
    tokens: list[int]
    block_ids: list[int]
    computed: int


# ----------------------------------------------------------------------------- connector


class KvtuneConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector that moves each request's KV as a kvtune stream (see the module
    docstring for the modes, the vLLM methods overridden and the fault handling).

    Args:
        vllm_config: the engine's ``VllmConfig`` (its ``kv_transfer_config`` carries the role
            and the :class:`ConnectorSettings` in ``kv_connector_extra_config``).
        role: scheduler or worker side.
        kv_cache_config: the engine's KV cache configuration.

    Raises:
        ConfigError: bad settings (see :meth:`ConnectorSettings.from_extra`).
    """

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        self.settings = ConnectorSettings.from_extra(tc.kv_connector_extra_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.is_producer = bool(tc.is_kv_producer)
        self.is_consumer = bool(tc.is_kv_consumer)
        s = self.settings
        if self.is_consumer and getattr(tc, "kv_load_failure_policy", "recompute") != "recompute":
            logger.warning("kvtune connector: kv_load_failure_policy=%r: a KV stream that fails to load fails its "
                           "request; set kv_load_failure_policy='recompute' to recompute it instead",
                           tc.kv_load_failure_policy)
        if s.mode == "store":
            self.store = open_store(s.store_path, max_entry_bytes=s.max_stream_bytes, timeout_s=s.timeout_s)
        elif self.is_consumer:
            self.store = KVStore(s.spool_dir(), max_entry_bytes=s.max_stream_bytes, durable=False)
        else:
            self.store = None
        # scheduler side
        self._tracked: dict[str, _Tracked] = {}
        self._matched: dict[str, tuple[str, int]] = {}
        self._pending_loads: dict[str, tuple[str, int, int]] = {}
        self._reported: set[str] = set()
        self._params: dict[str, dict[str, Any]] = {}
        # worker side
        self._caches: list[torch.Tensor] = []
        self._layout: PagedLayout | None = None
        self._invalid_blocks: set[int] = set()
        self._server: FrameServer | None = None
        self._client: FrameClient | None = None
        self._policy = None
        self._request_policies: dict[str, StaticPolicy] = {}
        self._key: bytes | None = None
        self._metrics_lock = threading.Lock()
        if role == KVConnectorRole.WORKER:
            self._key = load_shared_key(s)
            self._policy = make_policy(s, self._key)
            from kvtune.codecs.fastpath import available

            if available():  # compile / load the codec kernels now, not on the first request
                from kvtune.codecs.kernels.warmup import warm_up

                warm_up()
            if self.is_consumer and s.mode == "p2p":
                for stale in self.store.root.glob(f"*{KVStore.SUFFIX}"):
                    stale.unlink(missing_ok=True)
                self._server = FrameServer(s.peer_host, s.peer_port, self.store,
                                           max_frame_bytes=s.max_stream_bytes, timeout_s=s.timeout_s)
                logger.info("kvtune connector: receiving KV streams on %s:%d into %s", s.peer_host, self._server.port, self.store.root)
            if self.is_producer and s.mode == "p2p":
                self._client = FrameClient(s.peer_host, s.peer_port, timeout_s=s.timeout_s)

    # ------------------------------------------------------------------ scheduler side

    def on_new_request(self, request) -> None:
        """Keep the request's kvtune parameters (``kv_transfer_params`` keys
        :data:`REQUEST_PARAMS`); unknown ``kvtune_*`` keys are logged and ignored (raising
        here would stop the engine)."""
        params = getattr(request, "kv_transfer_params", None) or {}
        ours = {k: v for k, v in params.items() if str(k).startswith("kvtune_")}
        unknown = sorted(set(ours) - set(REQUEST_PARAMS))
        if unknown:
            err = ConfigError(f"unknown kv_transfer_params {unknown} of request {request.request_id}; known: {list(REQUEST_PARAMS)}")
            logger.warning("kvtune connector: %s: %s; ignored", type(err).__name__, err)
            ours = {k: v for k, v in ours.items() if k in REQUEST_PARAMS}
        if ours:
            self._params[request.request_id] = ours

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens of ``request`` whose KV this consumer can load beyond ``num_computed_tokens``:
        the whole blocks of the prompt (the longest stored prefix in store mode) when their
        stream is here, else 0 (the engine computes them). Producers load nothing."""
        if not self.is_consumer:
            return 0, False
        tokens = list(request.prompt_token_ids or [])
        n = movable_tokens(len(tokens), self.block_size)
        found = None
        candidates = [n] if self.settings.mode == "p2p" else list(range(n, 0, -self.block_size))
        for m in candidates:
            if m <= num_computed_tokens:
                break
            key = prefix_key(tokens[:m])
            if self.store.contains(key):
                found = (key, m)
                break
        rid = request.request_id
        if found is None:
            if n > num_computed_tokens and rid not in self._reported:
                self._reported.add(rid)
                if self.settings.mode == "store":
                    err = PrefixNotFoundError(f"no stored KV for any prefix of request {rid} ({len(tokens)} tokens)")
                    logger.warning("kvtune connector: %s: %s; recomputing", type(err).__name__, err)
                else:
                    logger.warning("kvtune connector: no KV stream arrived for request %s (%d tokens, key %s); "
                                   "recomputing", rid, len(tokens), prefix_key(tokens[:n]))
            return 0, False
        self._matched[rid] = found
        return found[1] - num_computed_tokens, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """Remember the load of a request the engine allocated blocks for."""
        rid = request.request_id
        if num_external_tokens > 0 and rid in self._matched:
            key, end = self._matched.pop(rid)
            self._pending_loads[rid] = (key, end - num_external_tokens, end)

    def build_connector_meta(self, scheduler_output) -> KvtuneConnectorMetadata:
        """This step's loads (requests scheduled with external tokens) and saves (producer
        requests whose movable tokens are all computed by the end of this step)."""
        meta = KvtuneConnectorMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            rid = new.req_id
            block_ids = list(new.block_ids[0])
            params = self._params.get(rid, {})
            if rid in self._pending_loads:
                key, start, end = self._pending_loads.pop(rid)
                meta.loads.append(TransferItem(rid, key, block_ids, start, end,
                                               zero=bool(params.get("kvtune_debug_zero_kv", False))))
            if self.is_producer:
                self._tracked[rid] = _Tracked(list(new.prompt_token_ids or []), block_ids, new.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            tr = self._tracked.get(rid)
            if tr is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                tr.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                tr.block_ids.extend(new_ids[0])
            tr.computed = cached.num_computed_tokens[i]
        if self.is_producer:
            for rid, tr in list(self._tracked.items()):
                n = movable_tokens(len(tr.tokens), self.block_size)
                done = tr.computed + scheduler_output.num_scheduled_tokens.get(rid, 0)
                if n == 0:
                    del self._tracked[rid]
                elif done >= n and rid in scheduler_output.num_scheduled_tokens:
                    params = self._params.get(rid, {})
                    meta.saves.append(TransferItem(rid, prefix_key(tr.tokens[:n]), tr.block_ids[: n // self.block_size],
                                                   0, n, policy=params.get("kvtune_policy"),
                                                   bandwidth_gbps=params.get("kvtune_bandwidth_gbps")))
                    del self._tracked[rid]
        self._pending_loads.clear()
        return meta

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; blocks are freed at once (saves finish inside the step)."""
        rid = request.request_id
        self._tracked.pop(rid, None)
        self._matched.pop(rid, None)
        self._pending_loads.pop(rid, None)
        self._reported.discard(rid)
        self._params.pop(rid, None)
        return False, None

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep the paged caches (ordered by layer index), find their block layout with the
        engine's own cache-write kernel, and check the policy fits them.

        Raises:
            ModelMismatchError: a layout or cache dtype this connector cannot read, or layers
                that differ.
        """
        cache_dtype = getattr(self._vllm_config.cache_config, "cache_dtype", "auto")
        if cache_dtype != "auto":
            raise ModelMismatchError(f"kvtune connector: kv_cache_dtype={cache_dtype!r} is not supported (use 'auto')")
        named = sorted(kv_caches.items(), key=lambda kv: _layer_index(kv[0]))
        self._caches = [t for _, t in named]
        geos = {paged_geometry(t)[1:] for t in self._caches}
        if len(geos) != 1:
            raise ModelMismatchError(f"layers have different KV geometries {sorted(geos)}")
        (h, bs, d), = geos
        if bs != self.block_size:
            raise ModelMismatchError(f"cache block size {bs} differs from the configured {self.block_size}")
        dtype = self._caches[0].dtype
        self._layout = probe_layout(self._cache_writer([name for name, _ in named]), kv_heads=h, block_size=bs,
                                    head_dim=d, dtype=dtype)
        logger.info("kvtune connector: %d layers, %d KV heads x %d, blocks of %d, %s, %s", len(self._caches), h, d,
                    bs, dtype, self._layout)
        self._policy.check_model(num_layers=len(self._caches), kv_heads=h, head_dim=d, dtype=dtype,
                                 allow_dtype_mismatch=self.settings.allow_dtype_mismatch)

    def _cache_writer(self, layer_names: list[str]):
        """The engine's cache-write kernel bound to the ISA its attention layers use."""
        from vllm import _custom_ops as ops

        layers = getattr(self._vllm_config.compilation_config, "static_forward_context", {}) or {}
        isas = {getattr(layers.get(n), "isa", None) for n in layer_names}
        if len(isas) != 1 or None in isas:
            raise ModelMismatchError(f"kvtune connector: cannot tell the attention kernels' ISA of the layers ({isas}); "
                                     "only the CPU attention backend is supported")
        isa = isas.pop()

        def write(key, value, key_cache, value_cache, slots):
            ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)

        return write

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """Load this step's streams into the paged cache, before the forward pass. A stream
        that is missing or fails any check marks its blocks invalid (logged with its typed
        error): vLLM recomputes them."""
        meta = self._connector_metadata
        if not isinstance(meta, KvtuneConnectorMetadata):
            return
        for item in meta.loads:
            t0 = time.perf_counter()
            record: dict[str, Any] = {"event": "load", "key": item.key, "req_id": item.req_id,
                                      "tokens": item.end, "start": item.start, "mode": self.settings.mode}
            try:
                record.update(self._load(item))
                record["ok"] = True
            except Exception as exc:  # a bad stream must never take the engine down
                bs = self.block_size
                self._invalid_blocks.update(item.block_ids[item.start // bs: item.end // bs])
                kind = type(exc).__name__
                level = logging.WARNING if isinstance(exc, KvtuneError) else logging.ERROR
                logger.log(level, "kvtune connector: loading the KV of request %s failed (%s: %s); recomputing",
                           item.req_id, kind, exc)
                record.update(ok=False, error=kind, message=str(exc)[:300])
            finally:
                if self.settings.mode == "p2p":
                    self.store.remove(item.key)
            record["load_s"] = time.perf_counter() - t0
            self._metric(record)

    def _load(self, item: TransferItem) -> dict[str, Any]:
        t0 = time.perf_counter()
        data = self.store.get(item.key)
        t1 = time.perf_counter()
        kv = self._policy.decode(data)
        t2 = time.perf_counter()
        if len(kv) != len(self._caches):
            raise ModelMismatchError(f"stream {item.key} has {len(kv)} layers, the engine {len(self._caches)}")
        for i, (k, v) in enumerate(kv):
            if k.shape[2] != item.end or v.shape[2] != item.end:
                raise ModelMismatchError(f"stream {item.key} layer {i} holds {k.shape[2]} tokens, expected {item.end}")
        for cache, (k, v) in zip(self._caches, kv):
            if self.settings.debug_zero_loaded_kv or item.zero:
                k, v = torch.zeros_like(k), torch.zeros_like(v)
            scatter_blocks(cache, item.block_ids, k, v, item.start, item.end, self._layout)
        t3 = time.perf_counter()
        return {"stream_bytes": len(data), "read_s": t1 - t0, "decode_s": t2 - t1, "scatter_s": t3 - t2}

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are synchronous (done in :meth:`start_load_kv`)."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        """Saving happens once per step in :meth:`wait_for_save`, from the registered caches."""

    def wait_for_save(self) -> None:
        """Gather, encode and ship the KV of this step's finished prefills. A failed transfer
        is logged with its typed error (the consumer then recomputes); the engine goes on."""
        meta = self._connector_metadata
        if not isinstance(meta, KvtuneConnectorMetadata):
            return
        for item in meta.saves:
            record: dict[str, Any] = {"event": "save", "key": item.key, "req_id": item.req_id,
                                      "tokens": item.end, "mode": self.settings.mode}
            try:
                record.update(self._save(item))
                record["ok"] = True
            except Exception as exc:
                kind = type(exc).__name__
                level = logging.WARNING if isinstance(exc, KvtuneError) else logging.ERROR
                logger.log(level, "kvtune connector: sending the KV of request %s failed (%s: %s)", item.req_id, kind, exc)
                record.update(ok=False, error=kind, message=str(exc)[:300])
            self._metric(record)

    def _save(self, item: TransferItem) -> dict[str, Any]:
        t0 = time.perf_counter()
        kv = [gather_blocks(c, item.block_ids, item.end, self._layout) for c in self._caches]
        t1 = time.perf_counter()
        if self.settings.debug_dump_dir:
            Path(self.settings.debug_dump_dir).mkdir(parents=True, exist_ok=True)
            torch.save(kv, Path(self.settings.debug_dump_dir) / f"{item.key}.pt")
        policy = self._policy if item.policy is None else self._static(item.policy)
        p2p = self.settings.mode == "p2p"
        hint = item.bandwidth_gbps if item.bandwidth_gbps is not None else (None if p2p else self.settings.bandwidth_gbps)
        enc = policy.encode(kv, bandwidth_gbps=None if hint is None else float(hint))
        data = enc.stream
        t2 = time.perf_counter()
        if p2p:
            self._client.send(item.key, data)
        else:
            self.store.put(item.key, data)
        t3 = time.perf_counter()
        if p2p:  # the wire time of this link teaches the controller its bandwidth; a pool put does not
            policy.feedback(enc, transfer_s=t3 - t2)
        return {"policy_id": enc.policy_id, "kv_bytes": enc.kv_bytes, "stream_bytes": len(data),
                "gather_s": t1 - t0, "encode_s": enc.encode_s, "seal_encode_s": t2 - t1, "send_s": t3 - t2,
                "decision": _decision_summary(enc.decision)}

    def _static(self, setting: Any) -> StaticPolicy:
        name = json.dumps(setting, sort_keys=True)
        if name not in self._request_policies:
            self._request_policies[name] = StaticPolicy.from_setting(setting, self._key)
        return self._request_policies[name]

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes them)."""
        out, self._invalid_blocks = self._invalid_blocks, set()
        return out

    def shutdown(self) -> None:
        """Stop the receiver and close the connection."""
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._client is not None:
            self._client.close()
            self._client = None

    def _metric(self, record: dict[str, Any]) -> None:
        path = self.settings.metrics_path
        if not path:
            return
        record["time"] = time.time()
        line = json.dumps(record, default=str, allow_nan=False) + "\n"
        with self._metrics_lock, open(path, "a", encoding="utf-8") as fh:
            fh.write(line)


def _decision_summary(decision: Any) -> Any:
    """The controller decision's key fields for the metrics line (None without a controller)."""
    if decision is None:
        return None
    fields = ("seq", "bandwidth_gbps", "bandwidth_source", "predicted_s", "corrected_s", "explored", "fallback")
    out = {f: getattr(decision, f) for f in fields if hasattr(decision, f)}
    policy = getattr(decision, "policy", None)
    if policy is not None:
        out["policy_id"] = getattr(policy, "policy_id", None)
    return out
