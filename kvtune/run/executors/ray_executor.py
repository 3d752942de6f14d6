"""Trials evaluated by Ray actors (``kvtune profile --executor ray --workers N``).

Each worker is a Ray actor (:class:`TrialWorker`) that builds the method's context once, with
the method's own :meth:`~kvtune.run.method.Method.prepare` (load the model, capture the KV and
the baseline), in a scratch folder of its own holding copies of the run folder's JSON and
safetensors files (``run.json``, ``calibration.json``, PCA bases: what a ``prepare`` reads back
on a resume), and then
evaluates the candidates it is sent. The actors build their contexts at the same time; when
the method's setup splits (:meth:`~kvtune.run.method.Method.setup_parts`: T/Q/C on the
``continuation`` workload splits its prefill and baseline by forward batch,
:mod:`kvtune.evaluate.workloads.parts`), each actor first builds one part, the parts travel
through Ray's object store, and every actor builds its context from all of them, so N workers
do the setup's work once, not N times. The driver builds none (it loads no model): from the first actor ready it takes the
:meth:`~kvtune.run.method.Method.driver_view` of its context (what the method's stages and
``run.json`` need: e.g. T/Q/C's space with its calibrated MixHQ head scores and the ratio
estimates) and the files its ``prepare`` wrote into its scratch folder (e.g.
``calibration.json``, SCD's maps), written into the run folder (:func:`keep_files`). A
worker's :meth:`~kvtune.run.method.Method.evaluate` sees the stage's ``name`` and ``title``
only (no candidates, no optimizer); everything a trial needs beyond its context travels with
the candidate (e.g. MixHQ head scores in its policy). Every worker's context must read the
candidates alike: their :meth:`~kvtune.run.method.Method.context_fingerprint` (T/Q/C: the
calibrated space's policy ids) must equal the first one's, or the run stops.

Placement: when the cluster has GPUs and the settings' ``device`` is ``cuda`` or ``auto``, one
actor per GPU (``num_gpus=1``; more workers than GPUs is an error); otherwise the cluster's CPUs
are split evenly between the ``N`` actors (``num_cpus``) and each sets
``torch.set_num_threads`` to its share (at least 1).

Faults, with Ray's own mechanisms: an actor whose process dies is restarted by Ray
(``max_restarts``) and its trial in flight retried on it (``max_task_retries``); an actor that
is gone for good (``ActorDiedError``: restarts used up, ``ray.kill``) is dropped and its trial
is submitted again to another one. A candidate is returned by the pool once, so nothing is
recorded twice; one that kills :data:`MAX_ATTEMPTS` workers stops the run with
:class:`~kvtune.run.executors.base.ExecutorError`.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import tempfile
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvtune.core.errors import ConfigError
from kvtune.run.executors.base import Executor, ExecutorError, RunJob, TrialPool, Workers

__all__ = ["HANDOFF_FILE_BYTES", "Handoff", "MAX_ATTEMPTS", "PROBE_SECONDS", "Placement", "RayExecutor",
           "TrialWorker", "WORKER_FILE_BYTES", "auth_hint", "check_address", "cluster_is_this_machine", "connect", "keep_files", "placement",
           "restarted", "worker_files", "written_files"]

#: Workers one candidate may take down (each dying while evaluating it) before the run stops.
MAX_ATTEMPTS = 3
#: Seconds to wait for a TCP connection to ``--ray-address`` before calling it unreachable.
PROBE_SECONDS = 5.0
#: Largest run-folder file copied to a worker (bytes; larger ones are not the prepare's inputs).
WORKER_FILE_BYTES = 1 << 20
#: Largest file a worker's ``prepare`` may write for the run folder (bytes).
HANDOFF_FILE_BYTES = 1 << 30


@dataclass(frozen=True)
class Placement:
    """Resources of one worker actor: ``num_cpus`` (Ray's CPU share; a fraction below 1),
    ``num_gpus`` (0 or 1) and ``threads`` (its ``torch.set_num_threads``)."""

    num_cpus: float
    num_gpus: int
    threads: int


def placement(resources: Mapping[str, float], workers: int, device: str) -> Placement:
    """One worker's resources for ``workers`` actors on a cluster with ``resources``
    (``ray.cluster_resources()``: ``CPU``, ``GPU`` totals) running a method on ``device``.

    Raises:
        ConfigError: ``device`` is ``cuda`` and the cluster has no GPU, or GPUs are used and
            ``workers`` exceeds their number; or a cluster without CPUs.
    """
    gpus, cpus = int(resources.get("GPU", 0)), float(resources.get("CPU", 0))
    on_gpu = device.startswith("cuda") or (device == "auto" and gpus > 0)
    if on_gpu and gpus < workers:
        raise ConfigError(f"--workers {workers}: the Ray cluster has {gpus} GPU(s) and a worker takes one "
                          f"(lower --workers, or --device cpu)")
    if cpus <= 0:
        raise ConfigError(f"the Ray cluster has no CPUs ({dict(resources)})")
    share = cpus / workers
    num_cpus = float(math.floor(share)) if share >= 1 else math.floor(share * 1e4) / 1e4
    return Placement(num_cpus=num_cpus, num_gpus=1 if on_gpu else 0, threads=max(1, math.floor(share)))


def check_address(address: str) -> None:
    """Fail fast when ``--ray-address`` (``host:port``, ``ray://host:port``; ``auto`` and
    ``local`` are left to Ray) names no listening host and port.

    Raises:
        ConfigError: not of that form, or no TCP connection within :data:`PROBE_SECONDS`.
    """
    if address in ("auto", "local"):
        return
    rest = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = rest.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--ray-address {address!r}: expected host:port (the head's GCS, e.g. 10.0.0.5:6379), "
                          "ray://host:10001 or auto")
    try:
        socket.create_connection((host, int(port)), timeout=PROBE_SECONDS).close()
    except OSError as exc:
        raise ConfigError(f"--ray-address {address}: cannot reach {host}:{port} ({exc}); start the cluster "
                          "(ray start --head) or leave --ray-address out for a Ray on this machine") from None


def connect(address: str | None) -> bool:
    """Connect this process to Ray: the cluster at ``address`` (checked with
    :func:`check_address` first), or a new Ray on this machine when ``address`` is None. A
    process already connected keeps its connection. Returns whether a connection was made now.

    Raises:
        ConfigError: see :func:`check_address`; Ray refused to connect or start.
    """
    import ray

    if address is not None:
        check_address(address)
    if ray.is_initialized():
        return False
    try:
        ray.init(address=address, include_dashboard=False, logging_level="warning")
    except Exception as exc:  # ConnectionError, RuntimeError, ValueError...: one clear line
        where = f"the Ray cluster at {address}" if address else "a Ray on this machine"
        raise ConfigError(f"cannot connect to {where}: {type(exc).__name__}: {exc}{auth_hint(address)}") from None
    return True


def auth_hint(address: str | None) -> str:
    """What to check when connecting to ``address`` failed: Ray >= 2.59 starts clusters with
    token authentication, and a driver given an explicit address sends its token only with
    ``RAY_AUTH_MODE=token`` (``auto`` finds the local cluster's mode by itself)."""
    if address in (None, "auto", "local") or os.environ.get("RAY_AUTH_MODE"):
        return ""
    return ("; if the cluster uses token authentication (the default of `ray start` since Ray 2.59), set "
            "RAY_AUTH_MODE=token and give this machine the head's token (~/.ray/auth_token, or RAY_AUTH_TOKEN; "
            "`ray get-auth-token` on the head prints it)")


def worker_files(run_dir: Path, limit: int = WORKER_FILE_BYTES, tensors_limit: int = HANDOFF_FILE_BYTES
                 ) -> dict[str, bytes]:
    """The run folder's top-level JSON files of at most ``limit`` bytes each (``run.json``,
    ``calibration.json``...) and safetensors files of at most ``tensors_limit`` bytes (the
    calibration's PCA bases), by name: copied into each worker's scratch folder, whose
    ``prepare`` reads them back. Sizes are checked before anything is read."""
    out: dict[str, bytes] = {}
    for pattern, most in (("*.json", limit), ("*.safetensors", tensors_limit)):
        for path in sorted(Path(run_dir).glob(pattern)):
            if path.name.startswith(".") or path.is_symlink() or not path.is_file() or path.stat().st_size > most:
                continue
            out[path.name] = path.read_bytes()
    return out


def written_files(folder: Path, given: Mapping[str, bytes], limit: int = HANDOFF_FILE_BYTES) -> dict[str, bytes]:
    """The top-level files of ``folder`` (a worker's scratch folder) that its ``prepare``
    wrote: those not in ``given`` (the copies it started with, by name) or whose bytes
    differ from them. Sizes are checked before anything is read.

    Raises:
        ExecutorError: a file larger than ``limit`` bytes (the message names it).
    """
    out: dict[str, bytes] = {}
    for path in sorted(Path(folder).iterdir()):
        if path.name.startswith(".") or path.is_symlink() or not path.is_file():
            continue
        size = path.stat().st_size
        if size > limit:
            raise ExecutorError(f"{path.name}: {size} bytes written by the method's prepare, more than the "
                                f"{limit} a worker hands to the driver")
        if path.name in given and len(given[path.name]) == size and given[path.name] == path.read_bytes():
            continue
        out[path.name] = path.read_bytes()
    return out


def keep_files(run_dir: Path, files: Mapping[str, bytes]) -> tuple[list[str], list[str]]:
    """Write the files a worker's ``prepare`` wrote (:func:`written_files`) into the run
    folder, each atomically. A file the run folder already holds is never replaced: with the
    same bytes it is left as it is, with other bytes too (it is reported).

    Returns:
        ``(written, kept)``: names written now, and names kept with content other than the
        worker's.
    """
    from kvtune.core.atomic import atomic_write_bytes

    written: list[str] = []
    kept: list[str] = []
    for name, data in files.items():
        path = Path(run_dir) / Path(name).name
        if not path.exists():
            atomic_write_bytes(path, data)
            written.append(path.name)
        elif path.stat().st_size != len(data) or path.read_bytes() != data:
            kept.append(path.name)
    return written, kept


@dataclass(frozen=True)
class Handoff:
    """What the driver takes from one worker once its context is built: ``view`` (the
    method's :meth:`~kvtune.run.method.Method.driver_view`) and ``files`` (:func:`written_files`)."""

    view: Any
    files: dict[str, bytes]


class TrialWorker:
    """The body of a worker actor: the method's context built once, then trials on demand.

    Args:
        method: the registered :class:`~kvtune.run.method.Method` (pickled by reference).
        settings: its settings.
        files: ``{name: bytes}`` written into the actor's scratch folder first
            (:func:`worker_files`); the folder is ``prepare``'s ``run_dir``.
        given: objects passed to ``prepare`` (already loaded models), or {}.
        threads: ``torch.set_num_threads`` of the actor.
        build: build the context now (``prepare``); False: the driver splits the setup
            (:meth:`prepare_part`, then :meth:`build` with every part). An actor restarted
            by Ray builds its whole context alone either way.
    """

    def __init__(self, method: Any, settings: Any, files: Mapping[str, bytes], given: Mapping[str, Any],
                 threads: int, build: bool = True) -> None:
        import torch

        torch.set_num_threads(threads)
        self.folder = Path(tempfile.mkdtemp(prefix="kvtune-worker-"))
        for name, data in files.items():
            (self.folder / Path(name).name).write_bytes(data)
        self.files = dict(files)
        self.method, self.settings, self.given = method, settings, dict(given)
        self.context: Any = None
        if build or restarted():
            self.build()

    def prepare_part(self, index: int, count: int) -> Any:
        """Part ``index`` of ``count`` of the method's setup
        (:meth:`~kvtune.run.method.Method.prepare_part`), for every worker's :meth:`build`."""
        from kvtune.run.method import Hooks

        part, given = self.method.prepare_part(self.settings, self.folder, Hooks(), index, count, **self.given)
        self.given.update(given)
        return part

    def build(self, *parts: Any) -> int:
        """Build the context (``prepare``, from ``parts`` when given) unless built already;
        returns the actor's process id."""
        from kvtune.run.method import Hooks

        if self.context is None:
            extra = {"parts": list(parts)} if parts else {}
            self.context = self.method.prepare(self.settings, self.folder, Hooks(), **extra, **self.given)
            self.given = {}  # what the context needs of them, it holds
        return os.getpid()

    def ready(self) -> int:
        """The actor's process id (once its context is built)."""
        return os.getpid()

    def handoff(self) -> Handoff:
        """The driver's view of the context and the files ``prepare`` wrote (:class:`Handoff`).

        Raises:
            ExecutorError: see :func:`written_files`.
        """
        return Handoff(self.method.driver_view(self.context), written_files(self.folder, self.files))

    def fingerprint(self) -> str:
        """The method's :meth:`~kvtune.run.method.Method.context_fingerprint` of this context:
        workers whose fingerprints differ would read the driver's candidates differently."""
        return self.method.context_fingerprint(self.context)

    def evaluate(self, stage_name: str, title: str, candidate: Any) -> dict[str, Any]:
        """One trial row: ``method.evaluate`` with the actor's context."""
        from kvtune.run.method import Stage

        return self.method.evaluate(self.context, candidate, Stage(stage_name, (), None, 0, title=title))

    def shutdown(self) -> None:
        """Release the context (``method.close``) and remove the scratch folder."""
        try:
            self.method.close(self.context)
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


def cluster_is_this_machine() -> bool:
    """Whether the connected Ray cluster has one live node, this process's machine."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    return len(nodes) == 1 and nodes[0].get("NodeManagerAddress") == ray.util.get_node_ip_address()


def restarted() -> bool:
    """Whether this process is a Ray actor restarted after its process died."""
    import ray

    if not ray.is_initialized():
        return False
    context = ray.get_runtime_context()
    return context.get_actor_id() is not None and bool(context.was_current_actor_reconstructed)


class RayExecutor(Executor):
    """``workers`` Ray actors evaluating a run's trials in parallel (module docstring).

    Args:
        workers: actors (>= 1).
        address: an existing cluster (``ray start --head`` prints it), or None for a Ray
            started on this machine (a process already connected to Ray keeps its connection).
        max_restarts: Ray restarts of a dead actor (its trial in flight retried on it).

    Raises:
        ConfigError: ``workers`` is not an integer >= 1.
    """

    name = "ray"

    def __init__(self, workers: int = 1, *, address: str | None = None, max_restarts: int = 1) -> None:
        super().__init__(workers)
        self.address = address
        self.max_restarts = max_restarts
        self.placement: Placement | None = None
        self.setup_parts: int | None = None

    def check(self, method: Any, settings: Any) -> None:
        """Connect to Ray (:func:`connect`) and place the workers (:func:`placement`).

        On a cluster of this machine alone every worker's context is held here: the method
        checks that they fit (:meth:`~kvtune.run.method.Method.check_workers`).

        Raises:
            ConfigError: see :func:`connect` and :func:`placement`; workers that do not fit in
                this machine's memory.
        """
        import ray

        connect(self.address)
        self.placement = placement(ray.cluster_resources(), self.workers, str(getattr(settings, "device", "cpu")))
        if cluster_is_this_machine():
            method.check_workers(settings, self.workers)

    def start(self, job: RunJob) -> Workers:
        """Start the actors and wait until each has built its context; the driver's context
        is the first one's :meth:`~kvtune.run.method.Method.driver_view`, and the files its
        ``prepare`` wrote go into the run folder (:func:`keep_files`).

        Raises:
            ConfigError: see :meth:`check` (when it was not called first).
            ExecutorError: an actor failed to build its context or to hand it over (the
                message holds its error).
        """
        if self.placement is None:
            self.check(job.method, job.settings)
        workers = RayWorkers(job, self.workers, self.placement, self.max_restarts)
        self.setup_parts = workers.parts
        return workers

    def describe(self) -> dict[str, Any]:
        """The base keys plus ``address``, ``worker`` (:class:`Placement`) and ``setup_parts``
        (parts the setup was split into; 1: each worker built it all; None before :meth:`start`)."""
        return {**super().describe(), "address": self.address or "local",
                "worker": None if self.placement is None else asdict(self.placement),
                "setup_parts": self.setup_parts}


class RayWorkers(Workers):
    """The actors of one run; idle ones take the next candidate of the current stage's pool."""

    def __init__(self, job: RunJob, workers: int, where: Placement, max_restarts: int) -> None:
        import ray

        actor = ray.remote(TrialWorker).options(num_cpus=where.num_cpus, num_gpus=where.num_gpus,
                                                max_restarts=max_restarts, max_task_retries=max_restarts)
        files = worker_files(job.run_dir)
        self.given = ray.put(dict(job.given))  # held for the run: a restarted actor is built from it again
        self.parts = parts = max(1, job.method.setup_parts(job.settings, workers))
        self.live = [actor.remote(job.method, job.settings, files, self.given, where.threads, build=parts < 2)
                     for _ in range(workers)]
        self.idle: deque[Any] = deque()
        hooks = job.run_hooks
        if parts < 2:
            hooks.on_stage(f"start {workers} Ray worker(s)", workers)
            pending = {a.ready.remote(): a for a in self.live}
        else:  # each of the first `parts` actors builds one part; every actor builds its context from all
            hooks.on_stage(f"start {workers} Ray worker(s), setup split in {parts} parts", workers)
            built = [a.prepare_part.remote(i, parts) for i, a in enumerate(self.live[:parts])]
            pending = {a.build.remote(*built): a for a in self.live}
            del built  # the parts leave the object store once every actor has its context
        first = ""
        try:
            while pending:
                (ref,), _ = ray.wait(list(pending), num_returns=1)
                actor = pending.pop(ref)
                ray.get(ref)
                fingerprint = ray.get(actor.fingerprint.remote())
                if not self.idle:  # the first one ready: the driver's context
                    self.take_handoff(ray.get(actor.handoff.remote()), job.run_dir, hooks)
                    first = fingerprint
                elif fingerprint != first:
                    raise ExecutorError(f"workers calibrated differently (context fingerprints {first[:12]} and "
                                        f"{fingerprint[:12]}); give every worker the same hardware and threads, or "
                                        "run the calibration once in-process and resume the run with Ray")
                self.idle.append(actor)
                hooks.on_progress(1)
        except (ray.exceptions.RayError, ExecutorError) as exc:
            self.close()
            raise ExecutorError(f"a Ray worker could not build the run's context: {exc}") from None

    def take_handoff(self, handoff: Handoff, run_dir: Path, hooks: Any) -> None:
        """Keep ``handoff.view`` as the driver's context and its files in ``run_dir``."""
        self.context = handoff.view
        _written, kept = keep_files(run_dir, handoff.files)
        for name in kept:
            hooks.say(f"{Path(run_dir) / name}: kept as stored; the Ray worker's prepare wrote other content")

    def pool(self, stage: Any) -> TrialPool:
        return RayPool(self, stage)

    def lose(self, actor: Any) -> None:
        """Stop using ``actor`` (gone for good)."""
        self.live = [a for a in self.live if a is not actor]

    def close(self) -> None:
        import ray

        actors, self.live = self.live, []
        self.idle.clear()
        try:
            ray.get([a.shutdown.remote() for a in actors], timeout=30)
        except ray.exceptions.RayError:  # a dead actor has nothing to release
            pass
        for a in actors:
            ray.kill(a)


class RayPool(TrialPool):
    """The candidates of one stage on :class:`RayWorkers` (results in order of completion)."""

    overlaps = True

    def __init__(self, workers: RayWorkers, stage: Any) -> None:
        self.workers = workers
        self.stage = stage
        self.waiting: deque[Any] = deque()
        self.running: dict[Any, tuple[Any, Any]] = {}  # ObjectRef -> (candidate, actor)
        self.attempts: Counter[str] = Counter()

    @property
    def slots(self) -> int:  # type: ignore[override]
        return len(self.workers.live)

    def submit(self, candidate: Any) -> None:
        self.waiting.append(candidate)
        self._dispatch()

    def _dispatch(self) -> None:
        while self.waiting and self.workers.idle:
            actor = self.workers.idle.popleft()
            cand = self.waiting.popleft()
            ref = actor.evaluate.remote(self.stage.name, self.stage.title, cand)
            self.running[ref] = (cand, actor)

    def next_finished(self) -> tuple[Any, dict[str, Any]]:
        import ray

        while True:
            if not self.running:
                raise ExecutorError(f"every Ray worker died; {len(self.waiting)} trial(s) not evaluated "
                                    "(resume the run with --resume)")
            (ref,), _ = ray.wait(list(self.running), num_returns=1)
            cand, actor = self.running.pop(ref)
            try:
                row = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                self._retry(cand, actor, exc)
                continue
            except BaseException:
                self.workers.idle.append(actor)
                raise
            self.workers.idle.append(actor)
            self._dispatch()
            return cand, row

    def _retry(self, cand: Any, actor: Any, exc: Exception) -> None:
        """Submit ``cand`` again after its worker died (dropped when gone for good)."""
        import ray

        if isinstance(exc, ray.exceptions.ActorDiedError):
            self.workers.lose(actor)
        else:  # unavailable for now (restarting): it may take trials again
            self.workers.idle.append(actor)
        self.attempts[cand.policy_id] += 1
        if self.attempts[cand.policy_id] >= MAX_ATTEMPTS:
            raise ExecutorError(f"candidate {cand.policy_id} took down {MAX_ATTEMPTS} Ray workers; "
                                f"the last error: {exc}")
        self.waiting.appendleft(cand)
        self._dispatch()

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)
