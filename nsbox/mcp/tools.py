"""The tools of ``nsbox mcp``, plain and synchronous: ``Workbench`` over one nsbox session.

An agent's MCP connection (nsbox/mcp/server.py) calls these; the user's review server
(nsbox/mcp/review.py) answers with the same ``Reply``. Nothing here needs the ``mcp`` SDK, and
nothing here imports it at module level: ``require_sdk`` and ``to_mcp`` take it when a server
runs.

Nothing the sandbox produced is trusted: file names and contents come back as data, paths the
agent gives are confined to /workspace before the session sees them, and the session's own
copy-out never follows a link the sandbox could have planted.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from nsbox import visible
from nsbox.errors import NsboxError
from nsbox.host import netlog
from nsbox.mcp import files_written
from nsbox.mcp.files_written import IMAGE_CAP, PNG_MAGIC, file_entry
from nsbox.mcp.turns import Call, CallCancelled, Turns
from nsbox.policy.policy import Policy
from nsbox.result import Result, Status
from nsbox.session.policy import INPUT_DIR
from nsbox.session.run import run_command

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
# A command given to bash -c is one argv string: execve(2) refuses one longer than
# MAX_ARG_STRLEN (32 pages), so longer scripts go through a file.
MAX_COMMAND = 100 * 1024


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
    # ``changes``; the user applies them (nsbox/mcp/review.py).
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


DIFF_CAP = 64 * 1024  # characters of diff put in front of a model


# --- paths -----------------------------------------------------------------------------------


def _below(path: str, top: str) -> bool:
    return path == top or path.startswith(top + "/")


def workspace_name(path: str, inputs: bool = False) -> str:
    """The workspace-relative name of a path the agent gave, or ToolInputError. With
    ``inputs``, a path below /input (read-only, ``--input``) is taken too and stays absolute.

    Lexical only: it keeps the agent's path inside /workspace (or /input) by name. That no
    symlink there leads out of it is the session's business when it reads or writes.
    """
    if not path or "\0" in path:
        raise ToolInputError("the path is empty or contains a NUL byte")
    given = path  # errors quote the path as the agent wrote it
    top = WORKSPACE
    if path.startswith("/"):
        if inputs and _below(path, INPUT_DIR):
            top = INPUT_DIR
        elif not _below(path, WORKSPACE):
            also = f" or below {INPUT_DIR}" if inputs else ""
            raise ToolInputError(f"{path!r} is outside the workspace; paths are relative to "
                                 f"{WORKSPACE} (or absolute below it{also})")
        path = path[len(top):]
    parts = [part for part in path.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise ToolInputError(f"{given!r} uses '..'; give a path inside {top}")
    if not parts:
        what = "the workspace" if top == WORKSPACE else top
        raise ToolInputError(f"{given!r} names {what} itself, not a file in it")
    name = "/".join(parts)
    return name if top == WORKSPACE else f"{top}/{name}"


def shown_path(name: str) -> str:
    """A name of workspace_name as the sandbox sees it."""
    return name if name.startswith("/") else f"{WORKSPACE}/{name}"


# --- the tools, over one session -------------------------------------------------------------


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
    """The five tools over one session. One call at a time, in the order they came: two
    concurrent tool calls never race on the same workspace. Each tool takes ``call`` (a
    ``Call``), which ``cancel`` marks: a cancelled call that waits never runs.

    ``audit`` (an nsbox.host.audit.AuditLog on the session's audit file) gets a line for each call
    of a file tool; the session itself writes the line of every command, with its code.
    """

    def __init__(self, session: Any, config: ServerConfig, audit: Any = None) -> None:
        self.session = session
        self.config = config
        self.audit = audit
        self._turns = Turns()

    def cancel(self, call: Call) -> None:
        """The client cancelled ``call`` (nsbox/mcp/turns.py): waiting, it never runs; its
        command running, that is killed now (status SG). Another call is never touched."""
        self._turns.cancel(call)

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
                   call: Call | None = None) -> Reply:
        # The program comes on stdin (`python3 -`), so its size is not bounded by execve's
        # argument limit, and /workspace (the cwd) is on sys.path for the agent's own modules.
        return self._run([PYTHON, "-"], code.encode(), timeout, call)

    def run_bash(self, command: str, timeout: float | None = None,
                 call: Call | None = None) -> Reply:
        if len(command.encode()) > MAX_COMMAND:
            raise ToolInputError(
                f"the command is longer than {MAX_COMMAND} bytes; write it to a file with "
                "write_file and run `bash FILE`")
        # bash -c, not a script on stdin: a command that reads stdin would eat the script.
        return self._run([BASH, "-c", command], None, timeout, call)

    def write_file(self, path: str, content: str, call: Call | None = None) -> Reply:
        name = workspace_name(path)
        data = content.encode()
        entry = {"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        with self._turns.turn(call), self._audited("write_file", name,
                                                   content=_head(data)) as record:
            self.session.write_file(name, data)
            record["file"] = entry
        return Reply({"file": entry}, f"wrote {WORKSPACE}/{name} ({len(data)} bytes)")

    def read_file(self, path: str, call: Call | None = None) -> Reply:
        name = workspace_name(path, inputs=bool(self.config.inputs))
        shown = shown_path(name)
        with self._turns.turn(call), self._audited("read_file", name) as record:
            data = self.session.read_file(name, max_size=READ_FILE_MAX)
            entry = {"name": name, "size": len(data),
                     "sha256": hashlib.sha256(data).hexdigest()}
            record["file"] = entry
        if data.startswith(PNG_MAGIC) and len(data) <= IMAGE_CAP:
            return Reply({"file": entry, "image": True},
                         f"{shown}: PNG image, {len(data)} bytes", [(name, data)])
        text = _text_head(data, READ_FILE_CAP)
        if text is None:
            return Reply({"file": entry, "binary": True},
                         f"{shown}: binary file, {len(data)} bytes, "
                         f"sha256 {entry['sha256']}; not shown")
        truncated = len(text.encode()) < len(data)
        note = (f"\n[{len(data)} bytes in all; the first {len(text.encode())} shown]"
                if truncated else "")
        return Reply({"file": entry, "content": text, "truncated": truncated}, text + note)

    def changes(self, call: Call | None = None) -> Reply:
        """The agent's read-only ``changes`` tool: applying is the user's (mcp/review.py)."""
        with self._turns.turn(call), self._audited("changes", None):
            found = [c.to_dict() for c in self.session.changes()]
        note = (f"\nThese changes are not in the project yet: the user reviews and applies them "
                f"(session {self.session.id}); no tool of yours can.")
        return Reply({"changes": found, "session": self.session.id},
                     render_changes(found) + note)

    def list_files(self, call: Call | None = None) -> Reply:
        with self._turns.turn(call), self._audited("list_files", None) as record:
            listing = self.session.files()
            files = [file_entry(info) for info in listing]
            inputs = ([{**file_entry(info), "name": f"{INPUT_DIR}/{info.path}"}
                       for info in self.session.files(root=INPUT_DIR)]
                      if self.config.inputs else None)
            record["files"] = len(files)
        lines = [f"{visible.name(f['name'])}  {f['size']} bytes  sha256 {f['sha256']}"
                 for f in files + (inputs or [])]
        data: dict[str, Any] = {"files": files}
        if inputs is not None:
            data["inputs"] = inputs
        if getattr(listing, "truncated", False):
            data["truncated"] = True
            lines.append(f"[the listing of {WORKSPACE} was cut (its names passed the "
                         "listing's size): the files after these are not listed]")
        return Reply(data, "\n".join(lines) or f"{WORKSPACE} has no files")

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
             call: Call | None) -> Reply:
        timeout, note = self.timeout(asked)
        call = call if call is not None else Call()
        with self._turns.turn(call):
            # A listing that fails or is cut does not keep the command from running: the
            # reply says what of the files written is not known (nsbox/mcp/files_written.py).
            before, _entries = files_written.snapshot(self.session)
            if call.cancelled:  # while the workspace was listed
                raise CallCancelled("the call was cancelled before its command ran")
            result: Result = run_command(self.session, argv, stdin=stdin, timeout=timeout,
                                         cancel=call)
            after, entries = files_written.snapshot(self.session)
            produced, listing_notes = files_written.written(before, after, entries)
            images = files_written.images(self.session, produced)
        return self._reply(result, timeout, [note] if note else [], produced, images,
                           listing_notes)

    def _reply(self, result: Result, timeout: float, notes: list[str],
               produced: list[dict[str, Any]], images: list[tuple[str, bytes]],
               listing_notes: list[str]) -> Reply:
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
            # The files written, capped like the output: the first of them, and their number.
            "files": files_written.shown(produced),
            "files_total": len(produced),
        }
        network = result.extra.get("network")
        if network is not None:  # allow mode: every attempt through the proxy, as it logged it
            data["network"] = network
        memory = self.config.policy.limits.memory
        if memory is not None and memory_killed(result, memory):
            # A session's commands share its cgroup, which counts its OOM kills only for the
            # whole session: a SIGKILL of a process as large as the limit is the OOM killer's.
            data["status"] = Status.ML.value
            notes.append(f"the command was killed by the kernel at the memory limit of "
                         f"{_mib(memory)} (its largest process reached "
                         f"{_mib(result.peak_memory)})")
        notes += _status_notes(result, timeout)
        notes += result.degraded
        notes += listing_notes
        if notes:
            data["notes"] = notes
        return Reply(data, _render(data), images)


# The share of the memory limit a SIGKILLed process must have reached to count as killed by
# it: the OOM killer acts on the cgroup's total, of which the largest process is most.
MEMORY_KILL_SHARE = 0.9


def memory_killed(result: Result, memory: int | None) -> bool:
    """Whether ``result`` (a command of a session) is a kill at the memory limit ``memory``."""
    return (result.status is Status.SG and result.signal == 9 and memory is not None
            and result.peak_memory >= MEMORY_KILL_SHARE * memory)


def _mib(size: int) -> str:
    return f"{size / (1 << 30):.1f} GiB" if size >= 1 << 30 else f"{size / (1 << 20):.0f} MiB"


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
    shown = netlog.summary(data["network"]) if data.get("network") else []
    if shown:  # bounded (nsbox/host/netlog.py); the reply's data has the whole report
        lines += ["--- network ---", *shown]
    lines += files_written.render(data)
    return "\n".join(lines)


def render_changes(changes: list[dict[str, Any]]) -> str:
    """The changes as text: one line each, then the diffs (capped)."""
    if not changes:
        return "no changes to the project"
    lines = []
    for item in changes:
        mark = "! " if item.get("runs_on_host") or "(rule git-dir)" in str(item.get("reason")) \
            else ""
        line = f"{mark}{item['kind']}: {visible.name(item['path'])}" + (
            "/" if item.get("is_dir") else "")
        if item.get("mode") and item["kind"] in ("added", "mode", "modified") and item.get(
                "mode") != item.get("old_mode"):
            line += f" (mode {item.get('old_mode') or 'new'} -> {item['mode']})"
        if item.get("conflict"):
            line += " (conflict: changed on the host since the session started)"
        if item.get("reason"):
            line += f" (not applicable: {visible.name(item['reason'])})"
        if item.get("no_diff"):
            line += f" (no diff: {visible.name(item['no_diff'])}; sha256 {item.get('sha256')})"
        if item.get("runs_on_host"):
            line += f" [runs on the host: {visible.name(item['runs_on_host'])}]"
        lines.append(line)
    diffs = visible.text("".join(item.get("diff") or "" for item in changes))
    if diffs:
        shown = diffs[:DIFF_CAP]
        lines += ["--- diff ---", shown.rstrip("\n")]
        if len(diffs) > DIFF_CAP:
            lines.append(f"[diff truncated: {len(diffs)} characters, {DIFF_CAP} shown]")
    return "\n".join(lines)


# --- the MCP SDK, when a server runs ---------------------------------------------------------


def require_sdk() -> None:
    try:
        import mcp.server  # noqa: F401
    except ImportError:
        raise NsboxError(f"`nsbox mcp` needs the MCP SDK (the `mcp` package, version 2); "
                         f"{EXTRA_HINT}") from None
    if not hasattr(mcp.server, "MCPServer"):
        raise NsboxError(f"`nsbox mcp` needs version 2 of the `mcp` package; {EXTRA_HINT}")


def to_mcp(reply: Reply, types: Any) -> Any:
    import base64

    content: list[Any] = [types.TextContent(type="text", text=reply.text)]
    for _name, png in reply.images:
        content.append(types.ImageContent(type="image", data=base64.b64encode(png).decode(),
                                          mime_type="image/png"))
    # A name the sandbox made that is not UTF-8 cannot be serialized as it is (the SDK's
    # JSON refuses surrogates): text with U+FFFD and its bytes beside it (visible.json_ready).
    return types.CallToolResult(content=content,
                                structured_content=visible.json_ready(reply.data))
