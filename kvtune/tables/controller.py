"""Online policy controller: the KVServe request-time loop, plus two things the paper lacks.

KVServe's online step ("KVServe: Service-Aware KV Cache Compression for Communication-Efficient
Disaggregated LLM Serving", arXiv 2605.13734, Service-Aware Online Controller): read the service context
(bandwidth B, SLO, accuracy floor), look up the table interval for x = 1/B, take the optimal
policy and its runners-up, drop the runners-up with B >= B*, correct each predicted time by an
EWMA of measured-minus-predicted residuals, drop those over the SLO, choose the fastest
(epsilon-greedy exploration among the few), and after repeated SLO violations fall back to a
safer policy for a cool-down window. :class:`Controller` implements exactly that, and goes
beyond it in two ways:

1. **Bandwidth from feedback.** With ``estimate_bandwidth=True`` (default) the controller does
   not need a bandwidth figure per request: every feedback gives a wire-time sample
   ``wire_s = measured_s - codec_s`` and thus a sample of ``x = 1/B = wire_s / wire_bytes``
   (s/GB); the estimate is an EWMA of x (i.e. a harmonic mean of bandwidth samples, the right
   average for predicting times, which are linear in x).
2. **Re-selection between chunks.** :meth:`Controller.plan_chunks` splits one long transfer
   into chunks; before each chunk the controller re-selects with the bandwidth estimated from
   the previous chunks' feedback and the SLO budget left, so a transfer that starts on a fast
   link and hits congestion switches to a stronger compression mid-way (and back).

What the residual means. A single measured total time cannot tell a slower link from a slower
codec. In the paper's mode (``estimate_bandwidth=False``, bandwidth given per request) the
residual absorbs every error: ``r = (measured_s - predicted_s) / V``. In estimation mode the
link error goes to the bandwidth estimate, and the residual learns only the codec's error
``r = (codec_s - a V) / V`` when the caller reports the measured codec time ``codec_s`` (a
serving system can time its own encode/decode); without ``codec_s`` the residual is left
unchanged and the whole deviation is attributed to the link. Residuals are kept **per GB of
original KV** (s/GB), so they transfer between requests and chunks of different sizes.

Safer policy (fallback). After ``violation_limit`` (N) *unexpected* SLO violations, counted
with decay (each violation of a decision that was predicted to meet its SLO adds 1, each
feedback within the SLO multiplies the count by ``violation_decay``), the controller enters a
cool-down of ``cooldown_decisions`` decisions in which it does not explore and uses the
table's envelope policy at a pessimistic bandwidth,
``fallback_bandwidth_factor`` x the bandwidth it would otherwise use: the lowest-latency
policy if the link were that much slower. Compressed policies have smaller slopes ``b = 1/cr``
and lose less when the link degrades, so this hedges against the usual cause of repeated
violations (bandwidth overestimated); above the policies' B* even at that pessimistic
bandwidth it is "none". With ``fallback_bandwidth_factor=1`` the fallback is simply the
model-optimal policy without exploration or residual corrections. The count restarts at 0 when
the cool-down starts. Violations that were already predicted (no candidate could meet the SLO)
and violations during a cool-down are not counted: they say nothing about the model being
wrong, and counting them made the controller fall back again and again under a tight SLO
(``benchmarks/controller.py``, periodic congestion).

Units: volumes in bytes of original bf16 KV, times in seconds, link bandwidths in Gbps
(1e9 bits/s), x in s/GB (GB = 1e9 bytes).

>>> import pandas as pd
>>> from kvtune.tables import compile_policy_table
>>> front = pd.DataFrame({"policy_id": ["p1"], "label": ["4-bit"], "method": ["tqc"],
...     "config_json": ["{}"], "relative_accuracy": [0.99], "compression_ratio": [4.0],
...     "encode_gbps": [10.0], "decode_gbps": [10.0]})
>>> table = compile_policy_table(front, floors=[0.99], model="m", workload="w", device="d")
>>> ctl = Controller(table, q_min=0.99, epsilon=0.0, initial_bandwidth_gbps=10.0)
>>> d = ctl.decide(1e9)          # 1 GB at 10 Gbps: 4-bit takes 0.2 + 0.2 s, raw 0.8 s
>>> d.policy.policy_id, round(d.predicted_s, 3)
('p1', 0.4)
>>> _ = ctl.feedback(d, 0.2 + 0.25e9 / (5e9 / 8), codec_s=0.2)   # the link was 5 Gbps
>>> round(ctl.bandwidth_gbps, 3)   # x = 1/B EWMA, weight 0.5: 0.5 * 0.8 + 0.5 * 1.6 = 1.2 s/GB
6.667
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field
from typing import NamedTuple

from kvtune.core.errors import KvtuneError
from kvtune.tables.policy_table import (
    DEFAULT_KEY,
    STATUS_CHOSEN,
    STATUS_NO_GAIN,
    STATUS_OK,
    STATUS_OVER_SLO,
    CandidateTime,
    PolicyEntry,
    PolicyTable,
)

__all__ = [
    "ChunkedTransfer",
    "Controller",
    "ControllerConfig",
    "Decision",
    "Feedback",
    "Observation",
]

_UNSET = object()


@dataclass(frozen=True)
class ControllerConfig:
    """Settings of a :class:`Controller` (all keyword arguments of its constructor).

    Attributes:
        q_min: minimum relative accuracy (fraction); picks the table's accuracy bucket.
        slo_s: transfer-time SLO in seconds per decision (None = no SLO). For chunked
            transfers the SLO given to :meth:`Controller.plan_chunks` is used instead.
        epsilon: exploration probability: with this probability a decision picks uniformly
            among the *other* candidates predicted within the SLO (0 = greedy).
        residual_alpha: EWMA weight of a new residual sample, ``r <- r + alpha (s - r)``.
        bandwidth_alpha: EWMA weight of a new ``x = 1/B`` sample. Higher tracks a changing
            link faster, lower averages out more noise; 0.5 did best with per-chunk feedback
            and 10 % wire-time noise in ``benchmarks/controller.py`` (0.3: +8 % vs the
            oracle under periodic congestion, 0.5: +4 %, 1.0: +1 %, but 1.0 is noisy with
            one sample per request).
        estimate_bandwidth: learn the bandwidth from feedback (True) or take it from each
            :meth:`Controller.decide` call (False, KVServe).
        violation_limit: N; the fallback starts when the decayed count of unexpected
            violations (predicted within the SLO, measured over it) reaches it.
        violation_decay: factor applied to the violation count on every feedback within the
            SLO (0 < decay <= 1; 1 = never forget).
        cooldown_decisions: decisions spent in the fallback before normal operation resumes.
        fallback_bandwidth_factor: the fallback plans for ``factor x`` the bandwidth (0 < f <= 1).
        workload: if set, must match the table's workload.
        key: extra table key (``""`` = none).
        seed: seed of the exploration RNG.
    """

    q_min: float = 0.97
    slo_s: float | None = None
    epsilon: float = 0.05
    residual_alpha: float = 0.2
    bandwidth_alpha: float = 0.5
    estimate_bandwidth: bool = True
    violation_limit: float = 3.0
    violation_decay: float = 0.8
    cooldown_decisions: int = 20
    fallback_bandwidth_factor: float = 0.5
    workload: str | None = None
    key: str = DEFAULT_KEY
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            (0.0 <= self.epsilon <= 1.0, f"epsilon must be in [0, 1], got {self.epsilon}"),
            (0.0 < self.residual_alpha <= 1.0, f"residual_alpha must be in (0, 1], got {self.residual_alpha}"),
            (0.0 < self.bandwidth_alpha <= 1.0, f"bandwidth_alpha must be in (0, 1], got {self.bandwidth_alpha}"),
            (self.violation_limit > 0, f"violation_limit must be > 0, got {self.violation_limit}"),
            (0.0 < self.violation_decay <= 1.0, f"violation_decay must be in (0, 1], got {self.violation_decay}"),
            (self.cooldown_decisions >= 0, f"cooldown_decisions must be >= 0, got {self.cooldown_decisions}"),
            (
                0.0 < self.fallback_bandwidth_factor <= 1.0,
                f"fallback_bandwidth_factor must be in (0, 1], got {self.fallback_bandwidth_factor}",
            ),
            (self.slo_s is None or self.slo_s > 0, f"slo_s must be > 0 seconds, got {self.slo_s}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise KvtuneError(f"ControllerConfig: {msg}")


@dataclass(frozen=True, slots=True)
class Decision:
    """One choice of the controller, to be sent back with its measured time.

    Attributes:
        seq: decision number (0-based) of this controller.
        policy: the policy to use.
        kv_bytes: V, bytes of original KV this decision covers (a request or one chunk).
        bandwidth_gbps: link Gbps the prediction used (given, estimated, or the fallback's
            pessimistic figure).
        bandwidth_source: ``"given"`` (caller) or ``"estimate"`` (learned from feedback).
        predicted_s: model time ``(a + b x) V`` of the chosen policy, seconds.
        corrected_s: ``predicted_s`` plus the policy's residual EWMA x V, seconds.
        codec_s: predicted encode + decode seconds ``(a + r) V`` (residual-corrected).
        wire_bytes: predicted bytes on the wire, ``b V``.
        slo_s: the SLO this decision was screened against (None = none).
        predicted_violation: no candidate was predicted within ``slo_s``.
        explored: chosen by exploration rather than greedily.
        fallback: made during a cool-down (safer policy, no exploration).
        candidates: the screened candidates with corrected times and statuses.
    """

    seq: int
    policy: PolicyEntry
    kv_bytes: float
    bandwidth_gbps: float
    bandwidth_source: str
    predicted_s: float
    corrected_s: float
    codec_s: float
    wire_bytes: float
    slo_s: float | None
    predicted_violation: bool
    explored: bool
    fallback: bool
    candidates: tuple[CandidateTime, ...]

    @property
    def policy_id(self) -> str:
        """Id of the chosen policy."""
        return self.policy.policy_id


class Feedback(NamedTuple):
    """What happened to a decision's transfer.

    Attributes:
        measured_s: measured seconds of encode + send + decode.
        codec_s: measured encode + decode seconds (optional; lets the controller separate
            codec error from link error).
        wire_bytes: bytes actually sent (optional; default the decision's ``b V``).
    """

    measured_s: float
    codec_s: float | None = None
    wire_bytes: float | None = None


class Observation(NamedTuple):
    """What :meth:`Controller.feedback` learned from one feedback.

    Attributes:
        violated: measured time above the decision's SLO.
        counted: the violation counted towards the fallback (it was unexpected: the decision
            was predicted within its SLO and was not itself a fallback decision).
        residual_s_per_gb: the residual sample (s/GB), or None when none was taken.
        bandwidth_gbps_sample: the bandwidth sample (Gbps), or None.
        entered_fallback: this feedback started a cool-down.
    """

    violated: bool
    counted: bool
    residual_s_per_gb: float | None
    bandwidth_gbps_sample: float | None
    entered_fallback: bool


class Controller:
    """Request-time policy controller over a :class:`~kvtune.tables.policy_table.PolicyTable`.

    Use: ``d = ctl.decide(kv_bytes)``; run the transfer with ``d.policy``; then
    ``ctl.feedback(d, measured_s, codec_s=...)``. For a long transfer use
    :meth:`plan_chunks`. See the module docstring for the rules.

    Args:
        table: the compiled policy table.
        config: a :class:`ControllerConfig`; keyword arguments override its fields.
        initial_bandwidth_gbps: prior bandwidth estimate (Gbps) used until the first
            feedback; required in estimation mode unless every decide() passes a bandwidth.
        **overrides: fields of :class:`ControllerConfig` (``q_min=0.99, slo_s=0.2, ...``).

    Raises:
        KvtuneError: invalid settings; TableError: workload/key/floor not in the table.
    """

    def __init__(
        self,
        table: PolicyTable,
        config: ControllerConfig | None = None,
        *,
        initial_bandwidth_gbps: float | None = None,
        **overrides,
    ) -> None:
        cfg = config or ControllerConfig()
        if overrides:
            unknown = set(overrides) - {f.name for f in dataclasses.fields(ControllerConfig)}
            if unknown:
                raise KvtuneError(f"Controller: unknown setting(s) {sorted(unknown)}")
            cfg = dataclasses.replace(cfg, **overrides)
        self.table = table
        self.config = cfg
        # Validate the table context once (raises TableError on mismatch).
        table.floor_for(cfg.q_min, key=cfg.key)
        if cfg.workload is not None and cfg.workload != table.workload:
            table.select(1.0, cfg.q_min, workload=cfg.workload, key=cfg.key)
        self._rng = random.Random(cfg.seed)
        self._residual: dict[str, float] = {}
        self._x_hat: float | None = None
        if initial_bandwidth_gbps is not None:
            if not float(initial_bandwidth_gbps) > 0:
                raise KvtuneError(f"initial_bandwidth_gbps must be > 0, got {initial_bandwidth_gbps}")
            self._x_hat = 8.0 / float(initial_bandwidth_gbps)
        self._violations = 0.0
        self._cooldown_left = 0
        self._seq = 0
        self.fallbacks_entered = 0

    # ------------------------------------------------------------------ state

    @property
    def bandwidth_gbps(self) -> float | None:
        """Current bandwidth estimate in Gbps (``8 / x_hat``), or None before any prior or
        feedback."""
        return None if self._x_hat is None else 8.0 / self._x_hat

    @property
    def violations(self) -> float:
        """Decayed SLO-violation count."""
        return self._violations

    @property
    def in_fallback(self) -> bool:
        """True while a cool-down is running (the next decision is a fallback one)."""
        return self._cooldown_left > 0

    @property
    def cooldown_left(self) -> int:
        """Decisions left in the current cool-down (0 = none)."""
        return self._cooldown_left

    def residual_s_per_gb(self, policy_id: str) -> float:
        """EWMA of the residual (measured - predicted) of a policy, seconds per GB of KV
        (0.0 before any sample)."""
        return self._residual.get(policy_id, 0.0)

    # ------------------------------------------------------------------ decide

    def decide(self, kv_bytes: float, *, bandwidth_gbps: float | None = None, slo_s=_UNSET) -> Decision:
        """Choose the policy for a transfer of ``kv_bytes`` bytes of original KV.

        Args:
            kv_bytes: V (> 0), bytes of original bf16 KV.
            bandwidth_gbps: link Gbps for this decision; default the estimate (estimation
                mode). Required when ``estimate_bandwidth=False``.
            slo_s: SLO in seconds for this transfer; default ``config.slo_s``.

        Returns:
            :class:`Decision`.

        Raises:
            KvtuneError: no bandwidth available, or kv_bytes <= 0.
        """
        cfg = self.config
        v = float(kv_bytes)
        if not v > 0:
            raise KvtuneError(f"kv_bytes must be > 0, got {kv_bytes}")
        slo = cfg.slo_s if slo_s is _UNSET else slo_s
        if bandwidth_gbps is not None:
            bw, source = float(bandwidth_gbps), "given"
        elif self._x_hat is not None and cfg.estimate_bandwidth:
            bw, source = 8.0 / self._x_hat, "estimate"
        else:
            raise KvtuneError(
                "Controller.decide: no bandwidth; pass bandwidth_gbps=..., or give "
                "initial_bandwidth_gbps and keep estimate_bandwidth=True"
            )
        fallback = self._cooldown_left > 0
        if fallback:
            self._cooldown_left -= 1
            bw = bw * cfg.fallback_bandwidth_factor
            sel = self.table.select(bw, cfg.q_min, key=cfg.key)
            pool: tuple[PolicyEntry, ...] = (sel.envelope_policy,)
        else:
            sel = self.table.select(bw, cfg.q_min, key=cfg.key)
            pool = (sel.envelope_policy, *sel.alternatives)
        x = 8.0 / bw
        gb = v * 1e-9
        model_t, corr_t, status = [], [], []
        for k, p in enumerate(pool):
            t = (p.a_s_per_gb + p.b * x) * gb
            tc = t if fallback else t + self._residual.get(p.policy_id, 0.0) * gb
            model_t.append(t)
            corr_t.append(tc)
            if k and bw >= p.threshold_gbps:
                status.append(STATUS_NO_GAIN)
            elif slo is not None and tc > slo:
                status.append(STATUS_OVER_SLO)
            else:
                status.append(STATUS_OK)
        ok = [k for k, s in enumerate(status) if s == STATUS_OK]
        violation = not ok
        pick_from = ok or [k for k, s in enumerate(status) if s != STATUS_NO_GAIN]
        best = min(pick_from, key=lambda k: (corr_t[k], k))
        explored = False
        if not fallback and cfg.epsilon > 0 and len(ok) > 1 and self._rng.random() < cfg.epsilon:
            others = [k for k in ok if k != best]
            best = others[self._rng.randrange(len(others))]
            explored = True
        status[best] = STATUS_CHOSEN
        p = pool[best]
        r = 0.0 if fallback else self._residual.get(p.policy_id, 0.0)
        d = Decision(
            seq=self._seq,
            policy=p,
            kv_bytes=v,
            bandwidth_gbps=bw,
            bandwidth_source=source,
            predicted_s=model_t[best],
            corrected_s=corr_t[best],
            codec_s=(p.a_s_per_gb + r) * gb,
            wire_bytes=p.b * v,
            slo_s=slo,
            predicted_violation=violation,
            explored=explored,
            fallback=fallback,
            candidates=tuple(CandidateTime(q, t, s) for q, t, s in zip(pool, corr_t, status, strict=True)),
        )
        self._seq += 1
        return d

    # ------------------------------------------------------------------ feedback

    def feedback(
        self,
        decision: Decision,
        measured_s: float,
        *,
        codec_s: float | None = None,
        wire_bytes: float | None = None,
    ) -> Observation:
        """Learn from the measured time of a decision's transfer.

        Updates, in order: the bandwidth estimate (estimation mode: sample ``x = wire_s /
        wire_GB`` with ``wire_s = measured_s - codec_s``, the codec time being ``codec_s``
        if given else the decision's predicted ``codec_s``; skipped when ``wire_s <= 0``);
        the policy's residual EWMA (see the module docstring); the decayed count of unexpected
        violations and, when it reaches ``violation_limit``, the cool-down.

        Args:
            decision: what :meth:`decide` returned.
            measured_s: measured seconds of encode + send + decode (>= 0).
            codec_s: measured encode + decode seconds, if known.
            wire_bytes: bytes actually sent; default ``decision.wire_bytes``.

        Returns:
            :class:`Observation`.
        """
        cfg = self.config
        m = float(measured_s)
        if not m >= 0 or math.isinf(m):
            raise KvtuneError(f"measured_s must be finite and >= 0, got {measured_s}")
        gb = decision.kv_bytes * 1e-9
        p = decision.policy
        wb = decision.wire_bytes if wire_bytes is None else float(wire_bytes)
        bw_sample = None
        residual_sample = None
        if cfg.estimate_bandwidth:
            codec_est = decision.codec_s if codec_s is None else float(codec_s)
            wire_s = m - codec_est
            if wire_s > 0 and wb > 0:
                x_sample = wire_s / (wb * 1e-9)
                bw_sample = 8.0 / x_sample
                if self._x_hat is None:
                    self._x_hat = x_sample
                else:
                    self._x_hat += cfg.bandwidth_alpha * (x_sample - self._x_hat)
            if codec_s is not None:
                residual_sample = (float(codec_s) - p.a_s_per_gb * gb) / gb
        else:
            residual_sample = (m - decision.predicted_s) / gb
        if residual_sample is not None:
            r = self._residual.get(p.policy_id, 0.0)
            self._residual[p.policy_id] = r + cfg.residual_alpha * (residual_sample - r)
        violated = decision.slo_s is not None and m > decision.slo_s
        counted = violated and not decision.predicted_violation and not decision.fallback
        entered = False
        if counted:
            self._violations += 1.0
            if self._violations >= cfg.violation_limit - 1e-12 and self._cooldown_left == 0:
                self._cooldown_left = cfg.cooldown_decisions
                self._violations = 0.0
                self.fallbacks_entered += 1
                entered = True
        elif not violated:
            self._violations *= cfg.violation_decay
        return Observation(violated, counted, residual_sample, bw_sample, entered)

    # ------------------------------------------------------------------ chunks

    def plan_chunks(self, kv_bytes: float, chunk_bytes: float, *, slo_s=_UNSET) -> ChunkedTransfer:
        """Plan one long transfer of ``kv_bytes`` in chunks of ``chunk_bytes`` (the last one
        smaller), re-selecting the policy before each chunk.

        Args:
            kv_bytes: total bytes of original KV (> 0).
            chunk_bytes: bytes of original KV per chunk (> 0).
            slo_s: SLO for the whole transfer (default ``config.slo_s``); each chunk is
                screened against its share of the budget left,
                ``(slo_s - elapsed) x chunk / remaining``.

        Returns:
            :class:`ChunkedTransfer`; call its :meth:`~ChunkedTransfer.next_chunk`.
        """
        return ChunkedTransfer(self, kv_bytes, chunk_bytes, self.config.slo_s if slo_s is _UNSET else slo_s)


@dataclass
class ChunkedTransfer:
    """A long transfer split into chunks, each with its own decision (see
    :meth:`Controller.plan_chunks`).

    Loop::

        plan = ctl.plan_chunks(kv_bytes, chunk_bytes, slo_s=0.5)
        d = plan.next_chunk()
        while d is not None:
            measured, codec = send(d.policy, d.kv_bytes)
            d = plan.next_chunk(Feedback(measured, codec_s=codec))

    Attributes:
        controller: the controller making the decisions.
        kv_bytes: total bytes of original KV.
        chunk_bytes: bytes per chunk.
        slo_s: SLO of the whole transfer (None = none).
        decisions: decisions made so far, one per chunk.
        elapsed_s: sum of the measured times fed back so far.
    """

    controller: Controller
    kv_bytes: float
    chunk_bytes: float
    slo_s: float | None = None
    decisions: list[Decision] = field(default_factory=list)
    elapsed_s: float = 0.0
    _sent: float = 0.0
    _pending: Decision | None = None

    def __post_init__(self) -> None:
        if not (self.kv_bytes > 0 and self.chunk_bytes > 0):
            raise KvtuneError(f"kv_bytes and chunk_bytes must be > 0, got {self.kv_bytes}, {self.chunk_bytes}")
        if self.slo_s is not None and not self.slo_s > 0:
            raise KvtuneError(f"slo_s must be > 0 seconds, got {self.slo_s}")

    @property
    def remaining_bytes(self) -> float:
        """Bytes of original KV not yet assigned to a chunk."""
        return max(self.kv_bytes - self._sent, 0.0)

    @property
    def done(self) -> bool:
        """All chunks decided and the last feedback received."""
        return self.remaining_bytes <= 0 and self._pending is None

    @property
    def switches(self) -> int:
        """Number of policy changes between consecutive chunks."""
        ids = [d.policy.policy_id for d in self.decisions]
        return sum(a != b for a, b in zip(ids, ids[1:]))

    def next_chunk(self, feedback: Feedback | float | None = None) -> Decision | None:
        """Feed back the previous chunk (if any) and decide the next one.

        Args:
            feedback: measured result of the previous chunk: a :class:`Feedback` or just its
                measured seconds. Required after every chunk; must be None for the first.

        Returns:
            the next chunk's :class:`Decision` (``kv_bytes`` = the chunk size), or None when
            the transfer is complete.

        Raises:
            KvtuneError: feedback missing for a pending chunk, or given with none pending.
        """
        if self._pending is not None:
            if feedback is None:
                raise KvtuneError("next_chunk: feedback for the previous chunk is required")
            fb = feedback if isinstance(feedback, Feedback) else Feedback(float(feedback))
            self.controller.feedback(self._pending, fb.measured_s, codec_s=fb.codec_s, wire_bytes=fb.wire_bytes)
            self.elapsed_s += fb.measured_s
            self._pending = None
        elif feedback is not None:
            raise KvtuneError("next_chunk: feedback given but no chunk is pending")
        remaining = self.remaining_bytes
        if remaining <= 0:
            return None
        size = min(self.chunk_bytes, remaining)
        slo = None
        if self.slo_s is not None:
            # share of the budget left; a spent budget leaves a tiny positive SLO, so every
            # candidate is "over" and the fastest is taken
            slo = max(self.slo_s - self.elapsed_s, 1e-12) * size / remaining
        d = self.controller.decide(size, slo_s=slo)
        self._sent += size
        self._pending = d
        self.decisions.append(d)
        return d
