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
import hashlib
import os
import shutil
import stat
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

try:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError as exc:  # the core must work without Ray; this module cannot
    raise ImportError(
        "nsbox.ray needs Ray, which is not installed: pip install 'nsbox[ray]'",
        name="ray") from exc

import nsbox
from nsbox import cgroups
from nsbox.doctor import run_doctor
from nsbox.errors import HostError, LaunchError, NsboxError, SetupError
from nsbox.plan import WORKSPACE
from nsbox.policy import Limits, Policy
from nsbox.result import Result
from nsbox.session import CopyLimits

# execve(2): one argument string is at most MAX_ARG_STRLEN (32 pages).
MAX_CODE = 128 * 1024 - 1


@dataclass(frozen=True)
class Job:
    """One command for a sandbox: ``argv``, or ``code`` (Python source run with python3 -c).

    ``files`` (relative path -> bytes) are written into /workspace before the command runs;
    ``collect`` are glob patterns (relative to /workspace; ``*`` also matches ``/``) of the files
    to send back. A job with either runs in a session of its own (nsbox.Session), so that files
    move only through the sandbox. ``limits`` are fields of nsbox.Limits for this job only
    (e.g. ``{"pids": 16}``).
    """

    argv: tuple[str, ...] = ()
    code: str | None = None
    stdin: bytes | None = None
    timeout: float | None = None
    output_limit: int | None = None
    env: tuple[tuple[str, str], ...] = ()
    files: tuple[tuple[str, bytes], ...] = ()
    collect: tuple[str, ...] = ()
    limits: tuple[tuple[str, Any], ...] = ()
    attempt: int = 1  # 2 when the client runs it again after its executor was lost
    id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @classmethod
    def make(cls, argv: Iterable[str] | None = None, *, code: str | None = None,
             stdin: bytes | None = None, timeout: float | None = None,
             output_limit: int | None = None, env: dict[str, str] | None = None,
             files: dict[str, bytes | str] | None = None, collect: Iterable[str] = (),
             limits: dict[str, Any] | None = None, id: str | None = None) -> Job:
        """A job from keyword arguments, checked before it leaves the caller."""
        if (argv is None) == (code is None):
            raise ValueError("a job needs either argv or code, not both")
        if code is not None and len(code.encode()) > MAX_CODE:
            raise ValueError(f"code is longer than {MAX_CODE} bytes (the kernel's limit on one "
                             "argument); put it in files= and run it with argv")
        argv = tuple(argv) if argv is not None else ()
        if code is None and not argv:
            raise ValueError("argv is empty")
        for name in (files or {}):
            _check_relative(name)
        unknown = set(limits or {}) - {f.name for f in dataclasses.fields(Limits)}
        if unknown:
            raise ValueError(f"limits: no such limit {', '.join(sorted(unknown))} (the fields "
                             "of nsbox.Limits)")
        job = cls(
            argv=argv, code=code, stdin=stdin, timeout=timeout, output_limit=output_limit,
            env=tuple(sorted((env or {}).items())),
            files=tuple((k, v.encode() if isinstance(v, str) else v)
                        for k, v in (files or {}).items()),
            collect=tuple(collect), limits=tuple(sorted((limits or {}).items())))
        return dataclasses.replace(job, id=id) if id is not None else job

    def command(self) -> list[str]:
        return ["python3", "-c", self.code] if self.code is not None else list(self.argv)


def _as_job(job: Job | dict[str, Any] | list[str] | tuple[str, ...]) -> Job:
    if isinstance(job, Job):
        return job
    if isinstance(job, dict):
        return Job.make(**job)
    return Job.make(job)


def _check_relative(path: str) -> None:
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts) \
            or "\0" in path:
        raise ValueError(f"{path!r}: a workspace file needs a plain relative path")


# --- the executor: one Ray actor on one node ----------------------------------------------------


class Executor:
    """Runs jobs in sandboxes of one policy, ``concurrency`` at a time (Ray calls ``run`` from
    that many threads). Use through ``Executors``; Ray makes it an actor."""

    def __init__(self, policy: Policy, *, pool_size: int, concurrency: int, group: str,
                 name: str, copy_limits: CopyLimits) -> None:
        self.policy = policy
        self.concurrency = concurrency
        self.name = name
        self.copy_limits = copy_limits
        self.node = ray.get_runtime_context().get_node_id()
        # Jobs in flight leave a marker here; a restarted executor finds those of the
        # executor it replaces (same name, same node).
        self.group_dir = os.path.join(tempfile.gettempdir(), f"nsbox-ray-{os.geteuid()}", group)
        self.state_dir = os.path.join(self.group_dir, name)
        self.jobs_dir = os.path.join(self.state_dir, "jobs")
        self._pool: nsbox.Pool | None = None
        # A refusal is kept, not raised: the client reads it from info() and stops the actor
        # (an exception here would reach the client as a Ray traceback).
        self.refusal = self._prepare_state() or _refusal(policy)
        if self.refusal is None:
            self._pool = _warm_pool(policy, pool_size)

    def _prepare_state(self) -> str | None:
        try:
            _check_private(os.path.dirname(self.group_dir))
            os.makedirs(self.jobs_dir, mode=0o700, exist_ok=True)
        except (HostError, OSError) as error:
            return f"node {os.uname().nodename}: {error}"
        return None

    @ray.method(concurrency_group="control")
    def info(self) -> dict[str, Any]:
        return {"name": self.name, "node": self.node, "pid": os.getpid(),
                "state_dir": self.state_dir, "refusal": self.refusal,
                "concurrency": self.concurrency,
                "pool": self._pool.size if self._pool is not None else 0}

    @ray.method(concurrency_group="control")
    def close(self) -> list[int]:
        """Stop serving; returns this process and its children (the launch helper), so that
        the cleanup after them can wait for them to be gone."""
        if self._pool is not None:
            self._pool.close()
        shutil.rmtree(self.state_dir, ignore_errors=True)
        try:
            os.rmdir(self.group_dir)  # the last executor of the group on this node
        except OSError:
            pass
        return [os.getpid(), *_children()]

    def run(self, job: Job) -> dict[str, Any]:
        if self.refusal is not None:
            raise HostError(self.refusal, feature="sandbox")
        # The id comes from the caller: hashed, it is a file name whatever it holds.
        marker = os.path.join(self.jobs_dir, hashlib.sha256(job.id.encode()).hexdigest())
        attempts = job.attempt
        try:
            with open(marker) as f:
                attempts = max(attempts, int(f.read() or 0) + 1)
        except (FileNotFoundError, ValueError):
            pass
        with open(marker, "w") as f:
            f.write(str(attempts))
        try:
            data = self._run(job)
        finally:
            os.unlink(marker)
        data.update(job=job.id, attempts=attempts, node=self.node, executor=self.name)
        return data

    def _run(self, job: Job) -> dict[str, Any]:
        """The one place where a job meets a sandbox."""
        options: dict[str, Any] = dict(stdin=job.stdin, timeout=job.timeout,
                                       output_limit=job.output_limit, env=dict(job.env) or None)
        policy = self.policy.with_limits(**dict(job.limits)) if job.limits else self.policy
        try:
            if job.files or job.collect:
                return self._run_in_session(job, policy, options)
            if self._pool is not None and not job.limits:
                return _plain(self._pool.run(job.command(), **options))
            return _plain(nsbox.run(job.command(), policy, **options))
        except LaunchError:
            # This executor's launch helper is gone: it is killed with the executor (Ray may
            # run the exit handlers that close it before the process ends, and a result sent
            # meanwhile would count as the job's), or it crashed. The job did not run to its
            # end; ending the executor makes Ray restart it and run the job again
            # (max_task_retries), as for any executor lost mid-job.
            os._exit(75)
        except NsboxError as error:
            return _failure(error)

    def _run_in_session(self, job: Job, policy: Policy, options: dict[str, Any]
                        ) -> dict[str, Any]:
        """Files in, the command, files out: all through the sandbox (nsbox.Session), whose
        workspace is a size-capped tmpfs and whose copy-out opens nothing on the host."""
        with nsbox.Session(policy, idle_timeout=None, copy_limits=self.copy_limits) as session:
            for name, content in job.files:
                session.write_file(name, content)
            data = _plain(session.run(job.command(), **options))
            if not job.collect:
                return data
            skipped: list[tuple[str, str]] = []
            for info in session.files(job.collect, skipped=skipped):
                content = session.read_file(f"{WORKSPACE}/{info.path}", max_size=info.size)
                if hashlib.sha256(content).hexdigest() != info.sha256:
                    skipped.append((info.path, "changed while it was read"))
                    continue
                data["files"].append({"path": info.path, "size": len(content),
                                      "sha256": info.sha256, "data": content})
            data["skipped_files"] = [{"path": path, "reason": reason} for path, reason in skipped]
        return data


def _check_private(path: str) -> None:
    """Make ``path`` for this user's executor state, and check that no other user of the node
    planted it (or a link in its place) beforehand in the shared temporary directory."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise HostError(f"{path} is not a private directory of uid {os.geteuid()} (a link, "
                        "another owner, or open to others); remove it and start again",
                        feature="state directory")


def _children() -> list[int]:
    pids = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids += [int(pid) for pid in f.read().split()]
        except OSError:
            continue
    return pids


@ray.remote(num_cpus=0)
def _remove_group(group: str, pids: list[int]) -> None:
    """On one node, once the executors' processes ``pids`` are gone: remove what the executors
    of ``group`` kept there, and the run cgroups of their launch helpers. (Ray kills an
    actor's child processes with it, so a helper may not have removed the cgroups of the
    sandboxes it was running; nsbox reclaims the cgroups of dead owners.)"""
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    cgroups.detect().reclaim()
    base = os.path.join(tempfile.gettempdir(), f"nsbox-ray-{os.geteuid()}")
    try:
        _check_private(base)
    except (HostError, OSError):
        return  # not ours to touch: the executors refused to use it
    shutil.rmtree(os.path.join(base, group), ignore_errors=True)


def _warm_pool(policy: Policy, size: int) -> nsbox.Pool | None:
    """Sandboxes prepared ahead for the jobs that need nothing of their own (no files, no
    limits); None (network allow mode, whose proxy is per run): every job uses nsbox.run."""
    return nsbox.Pool(policy, size=size) if policy.network.mode != "allow" else None


@dataclass
class _InFlight:
    job: Job
    actor: Any
    ref: Any


def _lost(job: Job, error: Exception) -> dict[str, Any]:
    data = _plain(Result(status=nsbox.Status.XX, error=f"the executor was lost: {error}"))
    data.update(job=job.id, attempts=job.attempt, node=None, executor=None,
                error_type="ExecutorLost")
    return data


def _refusal(policy: Policy) -> str | None:
    """Why this node must not run the policy; None when it may.

    First nsbox doctor's verdict for the policy (a check that fails: the policy cannot run
    safely here; a warning is a weaker guarantee the policy accepts, e.g. rlimits instead of
    cgroups unless limits.require_cgroup, and every Result names it in ``degraded``). Then one
    real launch with the policy, which also finds what the doctor does not look at, such as a
    bind source missing on this node.
    """
    host = os.uname().nodename
    report = run_doctor(policy=policy)
    if not report.ok:
        failed = [f"{c.name}: {c.detail}" + (f" ({c.remedy})" if c.remedy else "")
                  for c in report.checks if c.status == "fail"]
        return (f"node {host} cannot run the sandbox policy {policy.name!r} safely "
                f"(nsbox doctor): {'; '.join(failed)}")
    try:
        result = nsbox.run(["true"], policy, timeout=30)
    except NsboxError as error:
        reason = f"{error.step}: {error.message}" if isinstance(error, SetupError) else error
        hint = f" ({error.hint})" if error.hint else ""
        return f"node {host} cannot run the sandbox policy {policy.name!r}: {reason}{hint}"
    if result.status.value != "OK":
        return (f"node {host}: the probe launch of policy {policy.name!r} ended with "
                f"{result.status.value}: {result.stderr.decode(errors='replace').strip()}")
    return None


def _plain(result: Result) -> dict[str, Any]:
    data = result.to_dict()
    data["stdout"], data["stderr"] = result.stdout, result.stderr
    data["files"], data["skipped_files"] = [], []
    return data


def _failure(error: NsboxError) -> dict[str, Any]:
    """A job whose sandbox could not be built: status XX, naming the step."""
    data = _plain(Result(status=nsbox.Status.XX, error=str(error)))
    data["error_type"] = type(error).__name__
    if isinstance(error, SetupError):
        data["step"] = error.step
    return data


# The actor: the executor's jobs run in a concurrency group of their own, so ``info`` and
# ``close`` are answered while every job slot is busy.
_ExecutorActor = ray.remote(concurrency_groups={"control": 1})(Executor)  # type: ignore[call-overload]


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
        self.executors: list[dict[str, Any]] = []
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
        actor = _ExecutorActor.options(
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
        return self._submit(_as_job(job if argv is None else {"argv": argv, **job}))

    def _submit(self, job: Job, actor: Any = None) -> Any:
        if actor is None:
            with self._lock:
                actor = self._actors[self._next % len(self._actors)]
                self._next += 1
        return actor.run.remote(job)

    def map(self, jobs: Iterable[Job | dict[str, Any] | list[str]], *,
            max_in_flight: int | None = None, ordered: bool = True) -> Iterator[dict[str, Any]]:
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
                    job = _as_job(next(source))
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
        cleanups = [_remove_group.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
        ).remote(self.group, pids[node]) for node in nodes]
        try:
            ray.get(cleanups, timeout=30)
        except (ray.exceptions.RayError, TimeoutError):
            pass  # a node that is gone took its state with it
