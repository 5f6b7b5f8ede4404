"""``nsbox mcp``: a Model Context Protocol server whose tools run an agent's code in a sandbox.

One server process serves one MCP connection over stdio and owns one nsbox session for it: the
session is created before the handshake and destroyed when the client disconnects (end of
stdin), on SIGTERM, SIGHUP or SIGINT, and, because every sandbox is supervised by the launch
helper that kills it when this process's socket to it closes (nsbox/_helper.py), also when this
process is killed outright.

The tools' logic (``Workbench``) is plain, synchronous Python over the session; the MCP layer
(``build_server``) only validates arguments, runs a tool in a worker thread so that a long
command does not stall the protocol, and turns the reply into MCP content. The ``mcp`` SDK is
an optional extra (``pip install 'nsbox[mcp]'``): nothing here imports it at module level, so
the core never needs it.

Nothing the sandbox produced is trusted: file names and contents come back as data, paths the
agent gives are confined to /workspace before the session sees them, and the session's own
copy-out never follows a link the sandbox could have planted.
"""

# No `from __future__ import annotations`: the MCP SDK reads the tools' annotations at run
# time, and those name objects local to build_server.

import contextlib
import datetime
import hashlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nsbox.errors import NsboxError
from nsbox.policy import Policy
from nsbox.result import Result
from nsbox.session import Session

if TYPE_CHECKING:
    from mcp.server import MCPServer

EXTRA_HINT = "install the extra: pip install 'nsbox[mcp]'"
WORKSPACE = "/workspace"
PYTHON = "/usr/bin/python3"  # the host's interpreter, bound read-only with /usr
BASH = "/bin/bash"
DEFAULT_TIMEOUT = 30.0  # seconds, when the agent gives none
MAX_TIMEOUT_WITHOUT_LIMIT = 600.0  # when the profile sets no wall-clock limit at all
REPLY_STREAM_CAP = 32 * 1024  # bytes of each of stdout/stderr put in front of the model
READ_FILE_CAP = 256 * 1024  # bytes of a text file read_file returns
READ_FILE_MAX = 16 * 1024 * 1024  # larger files are refused: the agent can use head or tail
AUDIT_HEAD = 1024  # bytes of written content kept in the audit line
IMAGE_CAP = 4 * 1024 * 1024  # bytes of one PNG returned as image content
MAX_IMAGES = 4  # per reply
MAX_NETWORK_LINES = 20  # network attempts listed in a reply's text (all are in its data)
# A command given to bash -c is one argv string: execve(2) refuses one longer than
# MAX_ARG_STRLEN (32 pages), so longer scripts go through a file.
MAX_COMMAND = 100 * 1024
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class ToolInputError(NsboxError):
    """The agent's arguments to a tool are invalid; the reply says what to do instead."""


# What an agent's code needs, unless the profile says otherwise: no bytecode and config and cache
# directories outside the workspace (so caches do not show up as files the code produced), a
# plotting backend without a display, and Debian's matplotlib, which looks for its rc file in
# /etc (not bound into the sandbox), pointed at the copy in its data directory.
AGENT_ENV = (
    ("PYTHONDONTWRITEBYTECODE", "1"),
    ("MPLBACKEND", "Agg"),
    ("MPLCONFIGDIR", "/tmp/matplotlib"),
    ("MATPLOTLIBRC", "/usr/share/matplotlib/mpl-data"),
    ("XDG_CACHE_HOME", "/tmp/cache"),
)


def agent_policy(policy: Policy) -> Policy:
    """``policy`` plus the environment in AGENT_ENV for the names it does not set itself."""
    named = {name for name, _value in policy.env}
    extra = tuple(item for item in AGENT_ENV if item[0] not in named)
    return policy.replace(env=policy.env + extra)


@dataclass(frozen=True)
class ServerConfig:
    """What ``nsbox mcp`` was started with."""

    policy: Policy = field(default_factory=Policy)
    inputs: tuple[str, ...] = ()  # HOST_PATH[:NAME], mounted read-only under /input
    audit: str | None = None  # append one JSON line per tool call to this file
    # A host directory seen copy-on-write at /workspace: the agent gets the read-only tool
    # ``changes``; the user applies them (nsbox/mcp_review.py).
    project: str | None = None

    @property
    def max_timeout(self) -> float:
        return self.policy.limits.wall_time or MAX_TIMEOUT_WITHOUT_LIMIT


@dataclass
class Reply:
    """One tool's answer: data for the model (and for programs), plus PNG images."""

    data: dict[str, Any]
    text: str
    images: list[tuple[str, bytes]] = field(default_factory=list)  # (name, png bytes)


# --- paths -----------------------------------------------------------------------------------


def workspace_name(path: str) -> str:
    """The workspace-relative name of a path the agent gave, or ToolInputError.

    Lexical only: it keeps the agent's path inside /workspace by name. That no symlink inside
    the workspace leads out of it is the session's business when it reads or writes.
    """
    if not path or "\0" in path:
        raise ToolInputError("the path is empty or contains a NUL byte")
    given = path  # errors quote the path as the agent wrote it
    if path.startswith("/"):
        if path != WORKSPACE and not path.startswith(WORKSPACE + "/"):
            raise ToolInputError(f"{path!r} is outside the workspace; paths are relative to "
                                 f"{WORKSPACE} (or absolute below it)")
        path = path[len(WORKSPACE):]
    parts = [part for part in path.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise ToolInputError(f"{given!r} uses '..'; give a path inside {WORKSPACE}")
    if not parts:
        raise ToolInputError(f"{given!r} names the workspace itself, not a file in it")
    return "/".join(parts)


# --- the tools, over one session -------------------------------------------------------------


def _file_entry(info: Any) -> dict[str, Any]:
    """A session's FileInfo (path relative to /workspace) -> {name, size, sha256}."""
    return {"name": info.path, "size": info.size, "sha256": info.sha256}


def _head(data: bytes) -> dict[str, Any]:
    """What the audit line keeps of data the agent sent (like the session's own records)."""
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "head": data[:AUDIT_HEAD].decode("utf-8", "replace")}


def _text_head(data: bytes, cap: int) -> str | None:
    """The first ``cap`` bytes of ``data`` as text, or None when it is not UTF-8 text."""
    part = data[:cap]
    try:
        return part.decode("utf-8")
    except UnicodeDecodeError as error:
        # A cut through the last character is still text; an error before it is not.
        if len(data) > cap and error.start >= len(part) - 3 and error.reason.startswith(
                "unexpected end"):
            return part[:error.start].decode("utf-8")
        return None


def _clip(data: bytes, cap: int) -> tuple[str, bool]:
    text = data[:cap].decode("utf-8", "replace")
    return text, len(data) > cap


class Workbench:
    """The five tools over one session. One command at a time: calls are serialized, so two
    concurrent tool calls never race on the same workspace.

    ``audit`` (an nsbox.host.audit.AuditLog on the session's audit file) gets a line for each call
    of a file tool; the session itself writes the line of every command, with its code.
    """

    def __init__(self, session: Any, config: ServerConfig, audit: Any = None) -> None:
        self.session = session
        self.config = config
        self.audit = audit
        self._lock = threading.Lock()  # one tool at a time
        self._state = threading.Lock()  # guards _running
        self._running: object | None = None  # the call whose command runs now

    def cancel(self, call: object) -> None:
        """Kill the command of ``call`` if it is the one running; a later call's command is
        never touched."""
        with self._state:
            if self._running is call:
                self.session.cancel()

    def timeout(self, asked: float | None) -> tuple[float, str | None]:
        """The wall-clock limit to use, bounded by the profile, and a note when lowered."""
        if asked is None:
            asked = DEFAULT_TIMEOUT
        if not asked > 0:  # also NaN
            raise ToolInputError(f"timeout must be more than 0 seconds, not {asked}")
        limit = self.config.max_timeout
        if asked > limit:
            return limit, f"timeout lowered from {asked:g} s to the profile's limit of {limit:g} s"
        return asked, None

    # --- tools ---

    def run_python(self, code: str, timeout: float | None = None,
                   call: object | None = None) -> Reply:
        # The program comes on stdin (`python3 -`), so its size is not bounded by execve's
        # argument limit, and /workspace (the cwd) is on sys.path for the agent's own modules.
        return self._run([PYTHON, "-"], code.encode(), timeout, call)

    def run_bash(self, command: str, timeout: float | None = None,
                 call: object | None = None) -> Reply:
        if len(command.encode()) > MAX_COMMAND:
            raise ToolInputError(
                f"the command is longer than {MAX_COMMAND} bytes; write it to a file with "
                "write_file and run `bash FILE`")
        # bash -c, not a script on stdin: a command that reads stdin would eat the script.
        return self._run([BASH, "-c", command], None, timeout, call)

    def write_file(self, path: str, content: str) -> Reply:
        name = workspace_name(path)
        data = content.encode()
        entry = {"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        with self._lock, self._audited("write_file", name, content=_head(data)) as record:
            self.session.write_file(name, data)
            record["file"] = entry
        return Reply({"file": entry}, f"wrote {WORKSPACE}/{name} ({len(data)} bytes)")

    def read_file(self, path: str) -> Reply:
        name = workspace_name(path)
        with self._lock, self._audited("read_file", name) as record:
            data = self.session.read_file(name, max_size=READ_FILE_MAX)
            entry = {"name": name, "size": len(data),
                     "sha256": hashlib.sha256(data).hexdigest()}
            record["file"] = entry
        if data.startswith(PNG_MAGIC) and len(data) <= IMAGE_CAP:
            return Reply({"file": entry, "image": True},
                         f"{WORKSPACE}/{name}: PNG image, {len(data)} bytes", [(name, data)])
        text = _text_head(data, READ_FILE_CAP)
        if text is None:
            return Reply({"file": entry, "binary": True},
                         f"{WORKSPACE}/{name}: binary file, {len(data)} bytes, "
                         f"sha256 {entry['sha256']}; not shown")
        truncated = len(text.encode()) < len(data)
        note = (f"\n[{len(data)} bytes in all; the first {len(text.encode())} shown]"
                if truncated else "")
        return Reply({"file": entry, "content": text, "truncated": truncated}, text + note)

    def changes(self) -> Reply:
        from nsbox.mcp_review import agent_changes

        with self._lock, self._audited("changes", None):
            return agent_changes(self.session, self.session.id)

    def list_files(self) -> Reply:
        with self._lock, self._audited("list_files", None) as record:
            files = [_file_entry(info) for info in self.session.files()]
            record["files"] = len(files)
        lines = [f"{f['name']}  {f['size']} bytes  sha256 {f['sha256']}" for f in files]
        return Reply({"files": files}, "\n".join(lines) or f"{WORKSPACE} has no files")

    @contextlib.contextmanager
    def _audited(self, tool: str, path: str | None, **fields: Any) -> Iterator[dict[str, Any]]:
        """Write one audit line for a file tool's call, also when it fails."""
        record: dict[str, Any] = {
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="milliseconds"),
            "session": getattr(self.session, "id", None),
            "tool": tool,
            "path": path,
            **fields,
        }
        try:
            yield record
        except NsboxError as error:
            record["error"] = str(error)
            raise
        finally:
            if self.audit is not None:
                self.audit.write(record)

    # --- one command ---

    def _run(self, argv: list[str], stdin: bytes | None, asked: float | None,
             call: object | None) -> Reply:
        timeout, note = self.timeout(asked)
        with self._lock:
            before = {f["name"]: f["sha256"] for f in map(_file_entry, self.session.files())}
            with self._state:
                self._running = call
            try:
                result: Result = self.session.run(argv, stdin=stdin, timeout=timeout)
            finally:
                with self._state:
                    self._running = None
            after = [_file_entry(item) for item in self.session.files()]
            produced = [f for f in after if before.get(f["name"]) != f["sha256"]]
            images = self._images(produced)
        return self._reply(result, timeout, note, produced, images)

    def _images(self, produced: list[dict[str, Any]]) -> list[tuple[str, bytes]]:
        """PNG files the command wrote, read back through the session (never by host path)."""
        images: list[tuple[str, bytes]] = []
        for entry in produced:
            if len(images) >= MAX_IMAGES:
                break
            if not entry["name"].lower().endswith(".png") or entry["size"] > IMAGE_CAP:
                continue
            try:
                data = self.session.read_file(entry["name"], max_size=IMAGE_CAP)
            except NsboxError:
                continue  # no longer a regular file of that size: it is listed, not shown
            if data.startswith(PNG_MAGIC):
                images.append((entry["name"], data))
        return images

    def _reply(self, result: Result, timeout: float, note: str | None,
               produced: list[dict[str, Any]], images: list[tuple[str, bytes]]) -> Reply:
        stdout, out_cut = _clip(result.stdout, REPLY_STREAM_CAP)
        stderr, err_cut = _clip(result.stderr, REPLY_STREAM_CAP)
        data: dict[str, Any] = {
            "status": result.status.value,
            "exit_code": result.exit_code,
            "signal": result.signal,
            "wall_time": round(result.wall_time, 3),
            "timeout": timeout,
            "stdout": stdout,
            "stderr": stderr,
            # Bytes the command wrote; more than shown when the sandbox's output cap or this
            # reply's cap cut them.
            "stdout_bytes": result.stdout_bytes,
            "stderr_bytes": result.stderr_bytes,
            "stdout_truncated": result.stdout_truncated or out_cut,
            "stderr_truncated": result.stderr_truncated or err_cut,
            "files": produced,
        }
        network = result.extra.get("network")
        if network is not None:  # allow mode: every attempt through the proxy, as it logged it
            data["network"] = network
        notes = [note] if note else []
        notes += _status_notes(result, timeout)
        notes += result.degraded
        if notes:
            data["notes"] = notes
        return Reply(data, _render(data), images)


def _status_notes(result: Result, timeout: float) -> list[str]:
    status = result.status.value
    if status == "TO":
        return [f"the command was killed at its time limit of {timeout:g} s"]
    if status == "OL":
        return ["the command was stopped: its output passed the limit"]
    if status == "ML":
        return ["the command was killed: it used more memory than allowed"]
    return []


def _render(data: dict[str, Any]) -> str:
    """The run's reply as text for the model."""
    head = f"status: {data['status']}"
    if data["exit_code"] is not None:
        head += f" (exit code {data['exit_code']})"
    if data["signal"] is not None and data["status"] == "SG":
        head += f" (signal {data['signal']})"  # for TO, OL, ML the signal is nsbox's own kill
    lines = [head + f", {data['wall_time']:g} s"]
    for note in data.get("notes", []):
        lines.append(f"note: {note}")
    for stream in ("stdout", "stderr"):
        if data[stream] or data[f"{stream}_bytes"]:
            lines.append(f"--- {stream} ---")
            lines.append(data[stream].rstrip("\n"))
            if data[f"{stream}_truncated"]:
                lines.append(f"[{stream} truncated: {data[f'{stream}_bytes']} bytes written, "
                             f"{len(data[stream].encode())} shown]")
    attempts = (data.get("network") or {}).get("attempts", [])
    if attempts:
        lines.append("--- network ---")
        lines += [f"{a['method']} {a['host']}:{a['port']} "
                  + ("allowed" if a["allowed"] else f"refused: {a['reason']}")
                  for a in attempts[:MAX_NETWORK_LINES]]
        if len(attempts) > MAX_NETWORK_LINES:
            lines.append(f"[{len(attempts) - MAX_NETWORK_LINES} more attempts]")
    if data["files"]:
        lines.append("--- files written ---")
        lines += [f"{f['name']}  {f['size']} bytes  sha256 {f['sha256']}" for f in data["files"]]
    return "\n".join(lines)


# --- the MCP layer ---------------------------------------------------------------------------


def _require_sdk() -> None:
    try:
        import mcp.server  # noqa: F401
    except ImportError:
        raise NsboxError(f"`nsbox mcp` needs the MCP SDK (the `mcp` package, version 2); "
                         f"{EXTRA_HINT}") from None
    if not hasattr(mcp.server, "MCPServer"):
        raise NsboxError(f"`nsbox mcp` needs version 2 of the `mcp` package; {EXTRA_HINT}")


def instructions(policy: Policy) -> str:
    """What the server tells the agent about its sandbox."""
    network = policy.network
    if network.mode == "allow" and network.allow:
        reach = ("The only network is an HTTP(S) proxy (already set in HTTP_PROXY and "
                 "HTTPS_PROXY) to these hosts: " + ", ".join(network.allow) + ".")
    else:
        reach = "There is no network."
    return ("Runs Python and bash in an isolated sandbox. " + reach + " Files live in "
            "/workspace and persist between calls for this connection; input files are "
            "read-only under /input. PNG files a command writes come back as images.")


def build_server(bench: Workbench) -> "MCPServer":
    """The MCP server with the five tools, each one a call into ``bench``."""
    from typing import Annotated

    import anyio
    import anyio.to_thread
    import mcp_types as types
    from mcp.server import MCPServer
    from pydantic import Field

    server: MCPServer = MCPServer("nsbox", instructions=instructions(bench.config.policy),
                                  log_level="WARNING")
    limit = bench.config.max_timeout

    async def call(fn: Any, *args: Any) -> types.CallToolResult:
        try:
            # abandon_on_cancel: a client that cancels (or goes away) does not wait for the
            # sandbox. A command's non-zero exit is a result, not a tool error: only nsbox's
            # own errors are.
            reply = await anyio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)
        except NsboxError as error:
            return types.CallToolResult(
                content=[types.TextContent(type="text", text=f"error: {error}")], is_error=True)
        return _to_mcp(reply, types)

    async def run_command(fn: Any, text: str, timeout: float) -> types.CallToolResult:
        handle = object()  # this call, for cancel()
        try:
            return await call(fn, text, timeout, handle)
        except anyio.get_cancelled_exc_class():
            bench.cancel(handle)  # the client cancelled: the command stops now (status SG)
            raise

    Timeout = Annotated[float, Field(
        description=f"Wall-clock limit in seconds (at most {limit:g}); the command and "
                    "everything it started are killed at the limit.")]

    async def run_python(
        code: Annotated[str, Field(description="Python 3 source, run with /workspace as cwd")],
        timeout: Timeout = DEFAULT_TIMEOUT,
    ) -> types.CallToolResult:
        """Run Python code in the sandbox. Returns the status (OK, RE non-zero exit, TO time
        limit, ML memory limit, OL output limit, SG signal), the exit code, stdout and stderr,
        and the files the code wrote (PNG files also as images)."""
        return await run_command(bench.run_python, code, timeout)

    async def run_bash(
        command: Annotated[str, Field(description="A bash command, run with /workspace as cwd")],
        timeout: Timeout = DEFAULT_TIMEOUT,
    ) -> types.CallToolResult:
        """Run a bash command in the sandbox. Returns the same as run_python."""
        return await run_command(bench.run_bash, command, timeout)

    async def write_file(
        path: Annotated[str, Field(description="Path relative to /workspace")],
        content: Annotated[str, Field(description="The file's text")],
    ) -> types.CallToolResult:
        """Write a text file into the workspace (replacing it if it exists)."""
        return await call(bench.write_file, path, content)

    async def read_file(
        path: Annotated[str, Field(description="Path relative to /workspace")],
    ) -> types.CallToolResult:
        """Read a file from the workspace: text as text, a PNG as an image."""
        return await call(bench.read_file, path)

    async def list_files() -> types.CallToolResult:
        """List the workspace's regular files with their size and SHA-256."""
        return await call(bench.list_files)

    async def changes() -> types.CallToolResult:
        """List what your code changed in the project at /workspace (added, modified, deleted
        files, with diffs). The changes reach the project only when the user applies them."""
        return await call(bench.changes)

    tools: list[Any] = [run_python, run_bash, write_file, read_file, list_files]
    if bench.config.project is not None:
        tools.append(changes)  # read-only: applying is the user's (nsbox/mcp_review.py)
    for tool in tools:
        server.add_tool(tool, structured_output=False)
    return server


def _to_mcp(reply: Reply, types: Any) -> Any:
    import base64

    content: list[Any] = [types.TextContent(type="text", text=reply.text)]
    for _name, png in reply.images:
        content.append(types.ImageContent(type="image", data=base64.b64encode(png).decode(),
                                          mime_type="image/png"))
    return types.CallToolResult(content=content, structured_content=reply.data)


def serve(config: ServerConfig) -> None:
    """Serve one MCP connection on stdin/stdout until the client disconnects or a signal
    (SIGTERM, SIGHUP, SIGINT) ends the server."""
    _require_sdk()
    import anyio

    # No idle timeout: the session lives exactly as long as the connection.
    with Session(policy=agent_policy(config.policy), inputs=list(config.inputs),
                       audit=config.audit, idle_timeout=None,
                       project=config.project) as session:
        if config.project is not None:
            from nsbox.mcp_review import publish_for_review

            publish_for_review(session)
        tool_log = _audit_log(config.audit)
        try:
            server = build_server(Workbench(session, config, tool_log))
            anyio.run(_serve, server, lambda: _close(session, tool_log))
        finally:
            _close(session, tool_log)


async def _serve(server: "MCPServer", close: Any) -> None:
    import anyio

    async with anyio.create_task_group() as group:
        group.start_soon(_exit_on_signal, close)
        await server.run_stdio_async()  # returns at end-of-file on stdin
        group.cancel_scope.cancel()


async def _exit_on_signal(close: Any) -> None:
    """On a signal, destroy the session and exit at once.

    Unwinding the event loop instead would wait for the SDK's thread that reads stdin, which
    only returns when the client closes it, so a signalled server would hang.
    """
    import anyio

    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGHUP, signal.SIGINT) as signals:
        async for signum in signals:
            close()
            os._exit(128 + signum)


def _close(session: Any, tool_log: Any) -> None:
    session.close()  # idempotent: every process, mount and file of the sandbox is gone
    if tool_log is not None:
        tool_log.close()
    sys.stderr.flush()


def _audit_log(path: str | None) -> Any:
    if path is None:
        return None
    from nsbox.host.audit import AuditLog

    return AuditLog(path)
