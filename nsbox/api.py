"""``nsbox.run``: one command in a new sandbox, plain or with an audit record.

The only module that imports both the launch (nsbox/launcher.py) and the session
(nsbox/session.py): an audited run is a session of one command, so that the files it produced
are listed before the sandbox goes away, and a session launches through the launcher.
"""

from __future__ import annotations

from nsbox import inputs, launcher
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
    from nsbox.session import run_audited  # a session lists the files before teardown

    return run_audited(cmd.argv, policy, audit=audit, stdin=cmd.stdin, timeout=cmd.timeout,
                       output_limit=cmd.output_limit, env=cmd.env, workspace=workspace,
                       cwd=cmd.cwd, passthrough=passthrough)
