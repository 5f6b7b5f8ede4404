"""The executor actor of nsbox.ray: runs Ray jobs in sandboxes of one policy, on one node.

nsbox/ray/__init__.py documents the whole (and holds the client, ``Executors``). An executor refuses
to serve on a node that cannot run the policy safely (``_refusal``); it owns a warm pool for the
jobs that need nothing of their own, runs the others with nsbox.run or in a session of their
own (files in and out), and leaves a marker file per running job so that the executor Ray
starts in its place knows a job is a retry. What goes back is a ``_wire.JobResult``: plain data.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import stat
import tempfile
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import ray

import nsbox
from nsbox import cgroups, errors
from nsbox._sys.wire import ExecutorInfo, JobResult
from nsbox.doctor import run_doctor
from nsbox.errors import HostError, LaunchError, NsboxError, SetupError
from nsbox.host import isolation
from nsbox.plan.plan import WORKSPACE
from nsbox.policy.policy import Limits, Policy
from nsbox.result import Result
from nsbox.session.files import CopyLimits

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


def as_job(job: Job | dict[str, Any] | list[str] | tuple[str, ...]) -> Job:
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
    def info(self) -> ExecutorInfo:
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

    def run(self, job: Job) -> JobResult:
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
        data.update({"job": job.id, "attempts": attempts, "node": self.node,
                     "executor": self.name})
        return data

    def _run(self, job: Job) -> JobResult:
        """The one place where a job meets a sandbox."""
        options: dict[str, Any] = dict(stdin=job.stdin, timeout=job.timeout,
                                       output_limit=job.output_limit, env=dict(job.env) or None)
        try:
            # Inside: a bad limit value (PolicyError) is this job's XX result, not the map's end.
            policy = self.policy.with_limits(**dict(job.limits)) if job.limits else self.policy
            if job.files or job.collect:
                return self._run_in_session(job, policy, options)
            if self._pool is not None and not job.limits:
                return job_result(self._pool.run(job.command(), **options))
            return job_result(nsbox.run(job.command(), policy, **options))
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
                        ) -> JobResult:
        """Files in, the command, files out: all through the sandbox (nsbox.Session), whose
        workspace is a size-capped tmpfs and whose copy-out opens nothing on the host."""
        with nsbox.Session(policy, idle_timeout=None, copy_limits=self.copy_limits) as session:
            for name, content in job.files:
                session.write_file(name, content)
            data = job_result(session.run(job.command(), **options))
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
def remove_group(group: str, pids: list[int]) -> None:
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
    # Known by now: the refusal check (_refusal) launched once.
    if policy.network.mode == "allow" or isolation.mode_for(policy) == isolation.LANDLOCK:
        return None  # per run: allow mode's proxy; the Landlock mode has no pool
    return nsbox.Pool(policy, size=size)


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


def job_result(result: Result) -> JobResult:
    data = cast(JobResult, result.to_dict())  # the Result's fields, as JobResult has them
    data.update({"stdout": result.stdout, "stderr": result.stderr, "files": [],
                 "skipped_files": []})
    return data


def _failure(error: NsboxError) -> JobResult:
    """A job whose sandbox could not be built: status XX, naming the error's class and, for
    a setup step, the step (errors.to_wire: the one description of an error across
    processes)."""
    data = job_result(Result(status=nsbox.Status.XX, error=str(error)))
    wire = errors.to_wire(error)
    data["error_type"] = wire["type"]
    if wire.get("step") is not None:
        data["step"] = str(wire["step"])
    return data


# The actor: the executor's jobs run in a concurrency group of their own, so ``info`` and
# ``close`` are answered while every job slot is busy.
ExecutorActor = ray.remote(concurrency_groups={"control": 1})(Executor)  # type: ignore[call-overload]
