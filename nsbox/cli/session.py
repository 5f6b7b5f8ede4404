"""``nsbox session ...``: the commands of a session that outlives one command line.

A command-line session outlives ``nsbox session start``: a detached supervisor process holds it
(nsbox/cli/supervisor.py); the other subcommands talk to that supervisor over a unix socket in
the user's private runtime directory (nsbox/session/supervisor.py documents the protocol). The
project review commands (diff, apply, discard) are in nsbox/cli/review.py.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import socket
import stat
import subprocess
import sys
import time
from typing import Any

import click

from nsbox import errors, visible
from nsbox._sys import paths
from nsbox._sys.wire import FileEntry, SupervisorReply, SupervisorRequest, SupervisorStart
from nsbox.cli import lines, review, shared
from nsbox.cli import options as _options
from nsbox.cli import run as _cli_run
from nsbox.errors import NsboxError
from nsbox.result import Result, Status
from nsbox.session.session import input_mount
from nsbox.session.supervisor import forget_stale, records, request, runtime_dir

REMOTE_RE = re.compile(r"^([0-9a-f]{12}):(.*)$", re.S)


def _supervisor_env() -> dict[str, str] | None:
    """The supervisor's environment: this one, plus the one-file CLI's archive on the path.

    ``python -m nsbox.cli.supervisor`` finds the package on the interpreter's own path; when nsbox
    runs from nsbox.pyz, the package lives inside that file, which the new interpreter would
    not look into.
    """
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(_cli_run.__file__))))
    if not os.path.isfile(root):
        return None  # an installed or checked-out package: found as usual
    paths = [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


# --- the commands ----------------------------------------------------------------------------


@click.group()
def session() -> None:
    """Sandboxes that keep their workspace across several commands.

    \b
    Example:
      ID=$(nsbox session start --time 30)
      nsbox session cp main.py $ID:main.py
      nsbox session exec $ID -- python3 main.py
      nsbox session cp $ID:out.csv ./out.csv
      nsbox session stop $ID
    """


def _parse_env(items: tuple[str, ...]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not key or not sep:
            raise click.BadParameter(f"{item!r}: expected KEY=VAL" + (
                f" (to pass the caller's {key}: --pass-env {key}, an option of session start)"
                if key and not sep else ""), param_hint="--env")
        env[key] = value
    return env


def _duration_opt(ctx: Any, param: click.Parameter, value: str | None) -> float | None:
    return shared.duration(ctx, param, value)  # type: ignore[no-any-return]


def _size_opt(ctx: Any, param: click.Parameter, value: str | None) -> int | None:
    return shared.size(ctx, param, value)  # type: ignore[no-any-return]


def _start_options(command: Any) -> Any:
    """The options of ``nsbox session start``: those of ``nsbox run`` that describe the sandbox
    (applied over the profile the same way), and the session's own."""
    options = [
        click.option("-p", "--profile", default="default", show_default=True,
                     metavar="NAME|FILE", help="A shipped profile's name or a profile file."),
        click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
                     help="Override any profile key (as for nsbox run)."),
        click.option("--allow-rule", "allow_rules", multiple=True, metavar="NAME",
                     help="Lift one rule of the rule book (as for nsbox run)."),
        click.option("-t", "--time", "wall_time", callback=_duration_opt, metavar="SECONDS",
                     help="Default wall-clock limit of each command."),
        click.option("--output-limit", callback=_size_opt, metavar="BYTES",
                     help="Default cap on each command's stdout+stderr."),
        click.option("-w", "--workspace", type=click.Path(file_okay=False),
                     help="Host directory bound read-write at /workspace (default: a tmpfs)."),
        click.option("--project", type=click.Path(file_okay=False),
                     help="Host directory seen copy-on-write at /workspace: review with "
                     "`nsbox session diff`, write with `nsbox session apply`."),
        click.option("--input", "inputs", multiple=True, metavar="HOST_PATH[:NAME]",
                     help="Mount a host file or directory read-only at /input/NAME."),
        click.option("--ro-bind", multiple=True, metavar="SRC[:DST]",
                     help="Bind a host path read-only."),
        click.option("--bind", "rw_bind", multiple=True, metavar="SRC[:DST]",
                     help="Bind a host path read-write."),
        click.option("-e", "--env", multiple=True, metavar="KEY=VAL",
                     help="Set a variable for every command (redacted in the audit record)."),
        click.option("--pass-env", multiple=True, metavar="NAME",
                     help="Pass the caller's variable NAME through."),
        click.option("--net", "net_mode", type=click.Choice(["none", "loopback", "allow"]),
                     help="Network mode, as for nsbox run."),
        click.option("--allow-host", multiple=True, metavar="HOST[:PORT]",
                     help="Reachable through the session's proxy (implies --net allow)."),
        click.option("--isolation", type=click.Choice(list(_options.ISOLATION_MODES)),
                     help="auto, namespaces or landlock, as for nsbox run."),
        click.option("--idle-timeout", callback=_duration_opt, default="600",
                     metavar="SECONDS", show_default=True,
                     help="End the session after this long without a command."),
        click.option("--audit", type=click.Path(dir_okay=False), metavar="FILE",
                     help="Append one JSON line per command to FILE."),
    ]
    for option in reversed(options):
        command = option(command)
    return shared.limit_options(command)


@session.command()
@_start_options
def start(profile: str, settings: tuple[str, ...], allow_rules: tuple[str, ...],
          wall_time: float | None,
          output_limit: int | None, workspace: str | None, project: str | None,
          inputs: tuple[str, ...],
          ro_bind: tuple[str, ...], rw_bind: tuple[str, ...], env: tuple[str, ...],
          pass_env: tuple[str, ...], net_mode: str | None, allow_host: tuple[str, ...],
          isolation: str | None, idle_timeout: float | None, audit: str | None,
          **limit_values: Any) -> None:
    """Start a session and print its id.

    \b
    Example:
      ID=$(nsbox session start --time 30 --memory 512M)
    """
    from nsbox.host.network import from_options

    overrides: dict[str, Any] = {
        "limits.wall_time": wall_time, "limits.output": output_limit,
        "workspace.path": os.path.abspath(workspace) if workspace else None,
        "workspace.project": os.path.abspath(project) if project else None,
        "environment.set": _parse_env(env) or None,
        "environment.passthrough": pass_env or None,
        "allow_rules": list(allow_rules) or None, "isolation": isolation,
    }
    binds = [("--ro-bind", spec, False) for spec in ro_bind]
    binds += [("--bind", spec, True) for spec in rw_bind]
    given = {"settings": settings, "allow_rules": allow_rules, "workspace": workspace,
             "project": project, "inputs": inputs, "ro_bind": ro_bind, "rw_bind": rw_bind,
             "env": env, "pass_env": pass_env}  # for errors in these options' terms
    try:
        policy = shared.with_limits(shared.load_policy(profile, overrides, settings, binds),
                                  limit_values, settings)
        policy = policy.replace(network=from_options(policy.network, net_mode, allow_host))
        policy = policy.replace(mounts=policy.mounts + tuple(input_mount(s) for s in inputs))
        runtime_dir()
        forget_stale()
    except NsboxError as error:
        shared.fail(error, given)
    settings_for_supervisor: SupervisorStart = {
        "policy": policy, "idle_timeout": idle_timeout,
        "audit": os.path.abspath(audit) if audit else None,
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "nsbox.cli.supervisor"], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True, cwd="/",
        env=_supervisor_env())
    assert proc.stdin is not None and proc.stdout is not None
    # A pickle through a private pipe: the Policy arrives whole, and --env values never show
    # in the supervisor's command line (which every user can read).
    proc.stdin.write(pickle.dumps(settings_for_supervisor))
    proc.stdin.close()
    line = proc.stdout.readline().decode().strip()
    proc.stdout.close()
    if line.startswith("ok "):
        click.echo(line[3:])
        return
    proc.wait()
    if line.startswith("error "):
        shared.fail(errors.from_wire(json.loads(line[6:])["error"]), given, policy)
    shared.fail(NsboxError("the session supervisor failed to start"))


def _exec_on_terminal(session_id: str, message: SupervisorRequest) -> SupervisorReply:
    """exec --tty: the command on a pty of the session's own, relayed to this terminal."""
    from nsbox.host.terminal import Relay

    # The output limit holds on a terminal too. The output does not pass the supervisor, so
    # the relay counts it; past the cap it shuts the request's connection, which cancels the
    # command (supervisor.watch_client), and the run reports OL as one with pipes does.
    cap = message.get("output_limit")
    if cap is None:
        cap = request(session_id, {"op": "info"}).get("output_limit")
    connection: list[socket.socket] = []

    def cancel() -> None:
        for conn in connection:
            try:
                conn.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the command has ended: its reply is in

    with Relay(cap=cap, on_cap=cancel) as relay:
        message["tty"] = list(relay.size)
        reply = request(session_id, message, [relay.sandbox_end, 1, 2], connection.append)
    if relay.cut:
        reply["result"].update(status=Status.OL.value, stdout_truncated=True)
    return reply


# Options stop at ID: everything after it is the command's (as for nsbox run).
@session.command(name="exec", context_settings={"ignore_unknown_options": False,
                                                "allow_interspersed_args": False})
@_options.click_options(_options.EXEC)
@click.argument("session_id", metavar="ID")
@click.argument("command", nargs=-1, required=True)
def exec_(wall_time: float | None, output_limit: int | None, env: tuple[str, ...],
          cwd: str | None, as_json: bool, quiet: bool, session_id: str,
          command: tuple[str, ...], tty: bool = False) -> None:
    """Run COMMAND in session ID; the output streams through, the exit code is as for run.

    Options go before ID; every argument after ID is the command's own (a "--" between ID
    and COMMAND is accepted).

    \b
    Example:
      nsbox session exec $ID -- python3 main.py
    """
    if command[:1] == ("--",):
        # Option parsing stopped at ID, so click leaves the separator in the command.
        command = command[1:]
    if not command:
        raise click.UsageError("Missing argument 'COMMAND...'.")
    if command[0].startswith("-"):  # no program is named so: an option put after ID
        raise click.UsageError(f"{visible.quoted(command[0])} after ID: options go before "
                               "ID (nsbox session exec [OPTIONS] ID COMMAND...)")
    if wall_time == "none":
        raise click.BadParameter("'none' is not allowed: a command of a session ends by its "
                                 "deadline (leave --time out for the session's own)",
                                 param_hint="'-t' / '--time'")
    if tty:
        try:
            _cli_run.check_tty(as_json)
        except _cli_run.OptionError as exc:
            raise click.BadParameter(str(exc), param_hint=exc.param_hint) from None
    message: SupervisorRequest = {"op": "exec", "argv": list(command), "env": _parse_env(env),
               "timeout": wall_time, "output_limit": output_limit, "cwd": cwd}
    sinks: list[int] = []
    try:
        if as_json:
            sinks = [os.memfd_create("nsbox-out"), os.memfd_create("nsbox-err")]
            stdin = os.open(os.devnull, os.O_RDONLY) if os.isatty(0) else 0
            # --json changes what is printed, not what the command reads
            reply = request(session_id, message, [stdin, *sinks])
        elif tty:
            reply = _exec_on_terminal(session_id, message)
        else:
            # The caller's terminal is never handed in (nsbox/cli/run.py, _launch).
            stdin = os.open(os.devnull, os.O_RDONLY) if os.isatty(0) else 0
            reply = request(session_id, message, [stdin, 1, 2])
    except NsboxError as error:
        if as_json:
            click.echo(visible.json_text(_cli_run.failure_json(error)))
        shared.fail(error)
        return
    if reply.get("controlled"):  # the command's output reached these raw (docs/cli.md)
        from nsbox.host import terminal

        terminal.settle_after_output(reply["controlled"])
    data = reply["result"]
    result = Result(**{**data, "status": Status(data["status"])})
    if as_json:
        out = result.to_dict()
        for name, fd in zip(("stdout", "stderr"), sinks, strict=True):
            os.lseek(fd, 0, os.SEEK_SET)
            out[name] = os.read(fd, 1 << 30).decode("utf-8", "replace")
        click.echo(visible.json_text(out))
        sys.exit(lines.exit_code(result))
    _report(result, quiet)
    sys.exit(lines.exit_code(result))


def _report(result: Result, quiet: bool) -> None:
    """What the user should know about a command of the session, on stderr."""
    if result.degraded and not quiet:
        click.echo(lines.degraded_line(result), err=True)
    for line in lines.disk_full_lines(result):
        click.echo(line, err=True)
    if result.status is Status.SG and result.signal is not None:
        click.echo(lines.signal_line(result.signal), err=True)
    elif result.status in (Status.TO, Status.OL):
        click.echo(f"nsbox: {result.status.value}: "
                   + ("wall-clock limit reached; raise it with --time" if result.status is Status.TO
                      else "output limit reached; raise it with --output-limit"), err=True)


@session.command()
@click.argument("source")
@click.argument("dest")
def cp(source: str, dest: str) -> None:
    """Copy a file into or out of a session: `cp ID:PATH DEST` or `cp SRC ID:PATH`.

    Relative sandbox paths are under /workspace. Only regular files are copied out.

    \b
    Example:
      nsbox session cp main.py $ID:main.py
    """
    remote_src, remote_dest = REMOTE_RE.match(source), REMOTE_RE.match(dest)
    try:
        if remote_src and not remote_dest:
            session_id, path = remote_src.groups()
            memfd = os.memfd_create("nsbox-cp")
            reply = request(session_id, {"op": "get", "path": path}, [memfd])
            if os.path.isdir(dest):
                dest = os.path.join(dest, os.path.basename(path.rstrip("/")))
            try:
                _write_out(memfd, dest)
            finally:
                os.close(memfd)
            click.echo(f"{dest}: {reply['size']} bytes, sha256 {reply['sha256']}", err=True)
        elif remote_dest and not remote_src:
            session_id, path = remote_dest.groups()
            memfd = _read_in(source)
            if path.endswith("/") or not path:
                path += os.path.basename(source)
            request(session_id, {"op": "put", "path": path, "mode": 0o644}, [memfd])
            os.close(memfd)
        else:
            raise click.UsageError("exactly one of SOURCE and DEST must be ID:PATH")
    except NsboxError as error:
        shared.fail(error)


# The most `session cp SRC ID:PATH` copies in: the file is held in memory on its way (the
# session's workspace, 256M by default, refuses more than it holds anyway).
MAX_COPY_IN = 1 << 30


def _read_in(source: str) -> int:
    """A memfd with the host file ``source``: a regular file of at most MAX_COPY_IN bytes. A
    FIFO (it would block), a device (/dev/zero never ends) or a directory is refused."""
    memfd = os.memfd_create("nsbox-cp")
    try:
        fd = os.open(source, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise NsboxError(f"cannot copy {visible.name(source)}: not a regular file (a "
                                 "directory, FIFO, device or socket); only a file's content "
                                 "is copied in")
            too_large = NsboxError(f"cannot copy {visible.name(source)}: larger than "
                                   f"{MAX_COPY_IN >> 20} MiB, the most `session cp` copies in")
            if st.st_size > MAX_COPY_IN:
                raise too_large
            copied = 0
            while chunk := os.read(fd, 1 << 20):  # it may grow while it is read
                copied += len(chunk)
                if copied > MAX_COPY_IN:
                    raise too_large
                os.write(memfd, chunk)
        finally:
            os.close(fd)
    except OSError as exc:
        os.close(memfd)
        raise NsboxError(f"cannot read {visible.name(source)}: {exc.strerror}") from None
    except NsboxError:
        os.close(memfd)
        raise
    return memfd


def _write_out(memfd: int, dest: str) -> None:
    """The file a session sent (in ``memfd``) as the host file ``dest``: a new file renamed
    over the name, never written into an existing one, whose set-id bit or hard link would
    take the sandbox's bytes (nsbox/_sys/paths.py, replace_file)."""
    try:
        dir_fd = os.open(os.path.dirname(os.path.abspath(dest)),
                         os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.lseek(memfd, 0, os.SEEK_SET)
            chunks = iter(lambda: os.read(memfd, 1 << 20), b"")
            paths.replace_file(dir_fd, os.path.basename(dest), chunks,
                               0o666 & ~paths.caller_umask())
        finally:
            os.close(dir_fd)
    except OSError as exc:
        raise NsboxError(f"cannot write {visible.name(dest)}: {exc.strerror or exc}") from None


@session.command(name="ls")
@click.argument("session_id", metavar="[ID]", required=False)
@click.option("--files", "patterns", multiple=True, metavar="GLOB",
              help="With ID: list the session's files matching GLOB (default: all).")
def ls_(session_id: str | None, patterns: tuple[str, ...]) -> None:
    """List your sessions, or with ID the files in its workspace (path, size, sha256).

    \b
    Example:
      nsbox session ls $ID
    """
    try:
        if session_id:
            reply = request(session_id, {"op": "files", "patterns": list(patterns) or ["*"]})
            for item in reply["files"]:
                click.echo(_file_line(item))
            for skip in reply["skipped"]:
                click.echo(f"skipped {visible.quoted(skip['path'])}: "
                           f"{visible.name(skip['reason'])}", err=True)
            return
        forget_stale()
        for record in records():
            started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record["started"]))
            click.echo(f"{record['id']}  pid {record['pid']}  started {started}  "
                       f"workspace {record.get('workspace') or 'tmpfs'}")
    except NsboxError as error:
        shared.fail(error)


@session.command()
@click.argument("session_id", metavar="ID")
@click.argument("patterns", metavar="[GLOB]...", nargs=-1)
@click.option("--dest", default="nsbox-output", show_default=True, metavar="DIR",
              help="Host directory to copy into (created if missing).")
def collect(session_id: str, patterns: tuple[str, ...], dest: str) -> None:
    """Copy the regular files of session ID's workspace matching GLOB (default: all) to DIR.

    \b
    Example:
      nsbox session collect $ID '*.png' ./plots
    """
    try:
        reply = request(session_id, {"op": "collect", "dest": os.path.abspath(dest),
                                     "patterns": list(patterns) or ["*"]})
    except NsboxError as error:
        shared.fail(error)
        return
    for item in reply["files"]:
        click.echo(_file_line(item))
    for skip in reply["skipped"]:
        click.echo(f"nsbox: not collected: {visible.quoted(skip['path'])}: "
                   f"{visible.name(skip['reason'])}", err=True)


@session.command()
@click.argument("session_id", metavar="ID")
def stop(session_id: str) -> None:
    """End session ID: its processes, mounts and workspace are gone when this returns.

    \b
    Example:
      nsbox session stop $ID
    """
    try:
        request(session_id, {"op": "stop"})
    except NsboxError as error:
        shared.fail(error)


def _file_line(item: FileEntry) -> str:
    """One file of a listing: size, sha256 (both checked on the host) and the path, escaped."""
    return f"{int(item['size']):>10}  {item['sha256']}  {visible.quoted(item['path'])}"


for _command in (review.diff, review.apply, review.discard):
    session.add_command(_command)
