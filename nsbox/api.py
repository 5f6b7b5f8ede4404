"""``nsbox.run``: one command in a new sandbox, plain or with an audit record.

The only module that imports both the launch (nsbox/launcher.py) and the session
(nsbox/session.py): an audited run is a session of one command, so that the files it produced
are listed before the sandbox goes away, and a session launches through the launcher.
"""

from __future__ import annotations

from collections.abc import Sequence

from nsbox import inputs, launcher
from nsbox.errors import NsboxError
from nsbox.policy import Policy
from nsbox.result import Result


def run(
    argv: list[str],
    policy: Policy | None = None,
    *,
    stdin: bytes | str | int | None = None,
    timeout: float | None = None,
    output_limit: int | None = None,
    env: dict[str, str] | None = None,
    workspace: str | None = None,
    cwd: str | None = None,
    passthrough: bool = False,
    audit: str | None = None,
    profile: str | None = None,
) -> Result:
    """Run ``argv`` in a new sandbox and return its Result.

    The sandbox is ``policy``, or the profile ``profile`` names (a shipped profile or a TOML
    file), or the default policy.

    ``stdin`` is bytes (or str) to feed, a descriptor to pass, or None for /dev/null. With
    ``passthrough`` the output goes to this process's stdout/stderr as it arrives (still
    capped) instead of into the Result. Raises SetupError when the sandbox cannot be built
    (CommandNotFound when the command does not exist inside it). ``audit`` names a file that
    gets one JSON line for the run (nsbox/host/audit.py). A bad argument raises PolicyError
    naming it (nsbox/inputs.py), before anything starts.
    """
    if audit is None:
        return launcher.run(argv, policy, stdin=stdin, timeout=timeout,
                            output_limit=output_limit, env=env, workspace=workspace, cwd=cwd,
                            passthrough=passthrough, profile=profile)
    cmd = inputs.command(argv, stdin_=stdin, timeout=timeout, output_limit_=output_limit,
                         env_=env, cwd=cwd, passthrough=passthrough)
    workspace = inputs.optional_path(workspace, "workspace")
    audit = inputs.path(audit, "audit")
    policy = launcher.choose_policy(policy, profile)
    return run_audited(cmd.argv, policy, audit=audit, stdin=cmd.stdin, timeout=cmd.timeout,
                       output_limit=cmd.output_limit, env=cmd.env, workspace=workspace,
                       cwd=cmd.cwd, passthrough=passthrough)


def run_audited(argv: Sequence[str], policy: Policy, *, audit: str, stdin: bytes | int | None,
                timeout: float | None, output_limit: int | None, env: dict[str, str] | None,
                workspace: str | None, cwd: str | None, passthrough: bool) -> Result:
    """``nsbox.run`` with an audit record: one command in a session of its own, so that the
    files it produced can be listed (and hashed) before the sandbox goes away."""
    if policy.seccomp.log_denied:
        # Learning mode needs a launch of its own; the record then lists no produced files.
        return _run_audited_plain(argv, policy, audit=audit, stdin=stdin, timeout=timeout,
                                  output_limit=output_limit, env=env, workspace=workspace,
                                  cwd=cwd, passthrough=passthrough)
    from nsbox.session import Session  # not on the plain run's path

    with Session(policy, workspace=workspace, env=env, audit=audit, idle_timeout=None,
                 timeout=timeout, output_limit=output_limit) as session:
        return session.run(argv, stdin=stdin, cwd=cwd, passthrough=passthrough)


def _run_audited_plain(argv: Sequence[str], policy: Policy, *, audit: str,
                       stdin: bytes | int | None, timeout: float | None,
                       output_limit: int | None, env: dict[str, str] | None,
                       workspace: str | None, cwd: str | None, passthrough: bool) -> Result:
    from nsbox.host import audit as auditmod  # not on the plain run's path

    log = auditmod.AuditLog(audit)
    result: Result | None = None
    error: NsboxError | None = None
    try:
        result = launcher.run(list(argv), policy, stdin=stdin, timeout=timeout,
                              output_limit=output_limit, env=env, workspace=workspace, cwd=cwd,
                              passthrough=passthrough)
        return result
    except NsboxError as exc:
        error = exc
        raise
    finally:
        cap = output_limit if output_limit is not None else policy.limits.output
        shown = auditmod.set_env(policy, env or {})
        record = auditmod.command_record(
            argv=argv, policy=policy, session=None, env=shown, stdin=stdin,
            timeout=timeout if timeout is not None else policy.limits.wall_time,
            output_limit=cap, result=result, error=error)
        record["files_produced"] = None  # not listed: the sandbox is gone
        log.write(record, secrets=shown.values())
        log.close()
