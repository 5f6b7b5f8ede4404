"""nsbox as the sandbox executor of a Ray cluster (``pip install 'nsbox[ray]'``).

Ray places the work, retries it and scales the cluster; nsbox only runs it. On each node an
executor actor owns the sandboxes of one policy and runs jobs in them, several at a time; a
client (``Executors``) starts the actors, one or more per node, and hands them jobs::

    with nsbox.ray.Executors(policy, pool_size=2) as executors:
        ref = executors.submit(["python3", "-c", "print(6 * 7)"], timeout=10)
        print(ray.get(ref)["stdout"])                      # b'42\\n'
        for result in executors.map(jobs, max_in_flight=64):
            ...

What comes back is plain data: a dict holding the Result's fields, the captured output and the
files the job produced (bytes with their SHA-256), never an object that runs anything where it
is unpickled. A sandbox that times out, exits non-zero or hits a limit is a normal result; a job
whose sandbox cannot be built is a result with status XX and the failed step.

Failures of the executor itself are Ray's business: an executor process that dies is restarted
by Ray on the same node, and the jobs it was running are run again once (``max_task_retries``).
Each job leaves a marker file on the node while it runs, so the run after a restart knows it is
a retry and says so in ``attempts``. A node that cannot run the policy safely (nsbox doctor
fails for it, or a real probe launch does) refuses to serve instead of running weaker
sandboxes.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

try:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError as exc:  # the core must work without Ray; this module cannot
    raise ImportError(
        "nsbox.ray needs Ray, which is not installed: pip install 'nsbox[ray]'",
        name="ray") from exc

import nsbox
from nsbox._sys.wire import ExecutorInfo, JobResult
from nsbox.errors import HostError, NsboxError
from nsbox.policy.policy import Policy
from nsbox.ray.executor import (
    MAX_CODE,
    CopyLimits,
    Executor,
    ExecutorActor,
    Job,
    as_job,
    job_result,
    remove_group,
)
from nsbox.result import Result

__all__ = ["MAX_CODE", "CopyLimits", "Executor", "Executors", "Job", "NodeRefused"]


@dataclass
class _InFlight:
    job: Job
    actor: Any
    ref: Any


def _lost(job: Job, error: Exception) -> JobResult:
    data = job_result(Result(status=nsbox.Status.XX, error=f"the executor was lost: {error}"))
    data.update({"job": job.id, "attempts": job.attempt, "node": None, "executor": None,
                 "error_type": "ExecutorLost"})
    return data


# --- the client --------------------------------------------------------------------------------


class NodeRefused(HostError):
    """An executor refused to start because its node cannot run the policy safely."""


def _check_sizes(pool_size: int, per_node: int | str) -> None:
    if pool_size < 1:
        raise ValueError("pool_size must be at least 1")
    if per_node != "cpus" and (not isinstance(per_node, int) or per_node < 1):
        raise ValueError(f"per_node must be a positive number or 'cpus', not {per_node!r}")


def _candidates(nodes: Iterable[str] | None, per_node: int | str) -> list[tuple[str, int]]:
    """(node id, number) of each executor to start: ``per_node`` on each alive node wanted."""
    wanted = set(nodes) if nodes is not None else None
    candidates = []
    for node in ray.nodes():
        if not node["Alive"] or (wanted is not None and node["NodeID"] not in wanted):
            continue
        count = int(node["Resources"].get("CPU", 1)) if per_node == "cpus" else per_node
        candidates += [(node["NodeID"], i) for i in range(max(1, int(count)))]
    if not candidates:
        raise NsboxError("no alive Ray node to start an executor on")
    return candidates


class Executors:
    """Executor actors on the nodes of the connected Ray cluster, and the client side.

    ``per_node`` executors on each alive node (``"cpus"``: one per CPU of the node), each
    running up to ``concurrency`` jobs at once (default ``pool_size``) with its own
    ``pool_size`` warm sandboxes. ``nodes`` limits the nodes (Ray node ids). A node that refuses
    raises NodeRefused from the constructor, or with ``skip_refused`` is left out and named in
    ``refused``. ``actor_options`` go to Ray as they are (e.g. ``runtime_env``, ``num_cpus``).
    """

    def __init__(self, policy: Policy | None = None, *, pool_size: int = 2,
                 concurrency: int | None = None, per_node: int | str = 1,
                 nodes: Iterable[str] | None = None, skip_refused: bool = False,
                 max_restarts: int = -1,
                 copy_limits: CopyLimits | None = None,
                 actor_options: dict[str, Any] | None = None, timeout: float = 120.0) -> None:
        if not ray.is_initialized():
            raise NsboxError("Ray is not initialized: call ray.init(address=...) first")
        _check_sizes(pool_size, per_node)
        self.policy = policy or Policy()
        self.group = uuid.uuid4().hex[:12]
        self.refused: dict[str, str] = {}
        self._next = 0
        self._lock = threading.Lock()
        candidates = _candidates(nodes, per_node)
        self._nodes = {node_id for node_id, _ in candidates}
        self._node_of: dict[int, str] = {}
        self._actors: list[Any] = []
        self.executors: list[ExecutorInfo] = []
        slots = concurrency or pool_size
        started = [self._start(node_id, i, pool_size, slots, max_restarts,
                               copy_limits or CopyLimits(), actor_options or {})
                   for node_id, i in candidates]
        self._await(started, timeout)
        if self.refused and (not skip_refused or not self._actors):
            self.shutdown()
            raise NodeRefused("; ".join(sorted(set(self.refused.values()))),
                              feature="sandbox")

    def _start(self, node_id: str, i: int, pool_size: int, slots: int, max_restarts: int,
               copy_limits: CopyLimits, actor_options: dict[str, Any]) -> tuple[str, Any, Any]:
        """Start the executor actor number ``i`` on a node; (node, actor, its info's ref)."""
        name = f"nsbox-{self.group}-{node_id[:12]}-{i}"
        actor = ExecutorActor.options(
            name=name, max_restarts=max_restarts, max_task_retries=1,
            max_concurrency=slots,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            **{"num_cpus": 0, **actor_options},
        ).remote(self.policy, pool_size=pool_size, concurrency=slots, group=self.group,
                 name=name, copy_limits=copy_limits)
        self._node_of[id(actor)] = node_id
        return node_id, actor, actor.info.remote()

    def _await(self, started: list[tuple[str, Any, Any]], timeout: float) -> None:
        """Wait for each started executor: keep it, or note its node's refusal."""
        for node_id, actor, ready in started:
            try:
                info = ray.get(ready, timeout=timeout)
            except (ray.exceptions.RayError, TimeoutError) as error:
                self._actors = [other for _node, other, _ready in started]
                self.shutdown()
                raise NsboxError(f"the executor on node {node_id} did not start within "
                                 f"{timeout} s: {error}") from None
            if info["refusal"] is None:
                self.executors.append(info)
                self._actors.append(actor)
            else:
                self.refused[node_id] = info["refusal"]
                ray.kill(actor, no_restart=True)

    def __enter__(self) -> Executors:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.shutdown()

    def submit(self, argv: Iterable[str] | None = None, **job: Any) -> Any:
        """Run one job (see Job.make for the arguments); returns a Ray ObjectRef of its result
        dict."""
        return self._submit(as_job(job if argv is None else {"argv": argv, **job}))

    def _submit(self, job: Job, actor: Any = None) -> Any:
        if actor is None:
            with self._lock:
                actor = self._actors[self._next % len(self._actors)]
                self._next += 1
        return actor.run.remote(job)

    def map(self, jobs: Iterable[Job | dict[str, Any] | list[str]], *,
            max_in_flight: int | None = None, ordered: bool = True) -> Iterator[JobResult]:
        """Run ``jobs`` and yield their results (in input order, or as they finish), with at
        most ``max_in_flight`` submitted and not yet yielded: the caller's iterator is read
        only as fast as the cluster works, and results do not pile up.

        Each job goes to the executor with the fewest of this map's jobs. When an executor is
        gone for good (its node died, or Ray gave up restarting it), its jobs in flight run
        once more on another executor; a job that loses its executor twice comes back as XX.
        """
        limit = max_in_flight or 4 * self.slots
        source = iter(jobs)
        window: collections.OrderedDict[Any, _InFlight] = collections.OrderedDict()
        load: collections.Counter[int] = collections.Counter()
        exhausted = False
        while True:
            while not exhausted and len(window) < limit:
                try:
                    job = as_job(next(source))
                except StopIteration:
                    exhausted = True
                    break
                entry = self._place(job, load)
                window[entry.ref] = entry
            if not window:
                return
            if ordered:
                ref = next(iter(window))
            else:
                [ref], _ = ray.wait(list(window), num_returns=1)
            entry = window[ref]
            load[id(entry.actor)] -= 1
            try:
                result = ray.get(ref)
            except ray.exceptions.RayActorError as error:
                self._forget(entry.actor)
                if entry.job.attempt > 1 or not self._actors:
                    result = _lost(entry.job, error)
                else:
                    retry = self._place(dataclasses.replace(entry.job, attempt=2), load)
                    # The retry keeps the job's place in the order of results.
                    window = collections.OrderedDict(
                        (retry.ref, retry) if key == ref else (key, value)
                        for key, value in window.items())
                    continue
            del window[ref]
            yield result

    @property
    def slots(self) -> int:
        """Jobs the executors run at once, in all."""
        return sum(info["concurrency"] for info in self.executors)

    def _place(self, job: Job, load: collections.Counter[int]) -> _InFlight:
        if not self._actors:
            raise NsboxError("no executor is left: every one of them is gone")
        actor = min(self._actors, key=lambda a: load[id(a)])
        load[id(actor)] += 1
        return _InFlight(job, actor, self._submit(job, actor))

    def _forget(self, actor: Any) -> None:
        with self._lock:
            if actor in self._actors:
                index = self._actors.index(actor)
                del self._actors[index], self.executors[index]

    def shutdown(self) -> None:
        """Stop the executors (their sandboxes end with them) and remove their state on every
        node, also of those that died or refused."""
        actors, self._actors = self._actors, []
        nodes, self._nodes = self._nodes, set()
        if not ray.is_initialized():
            return  # the cluster is gone, and the executors with it
        pids: dict[str, list[int]] = {node: [] for node in nodes}
        for actor in actors:
            try:
                pids[self._node_of[id(actor)]] += ray.get(actor.close.remote(), timeout=30)
            except (ray.exceptions.RayError, TimeoutError):
                pass  # dead already
            ray.kill(actor, no_restart=True)
        cleanups = [remove_group.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
        ).remote(self.group, pids[node]) for node in nodes]
        try:
            ray.get(cleanups, timeout=30)
        except (ray.exceptions.RayError, TimeoutError):
            pass  # a node that is gone took its state with it
