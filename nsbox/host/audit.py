"""The audit record: one JSON line per command, appended to a file the caller names.

A line says what ran (argv, the code given on stdin or written into the sandbox by the caller),
under which policy (profile name and digest, limits), and what came of it (result, output sizes
and heads, files produced with their SHA-256, network attempts and seccomp denials where the
Result carries them). Values the caller set as environment variables are secrets by default:
they are replaced by ``<redacted>`` wherever they appear in the line.

Each line is written with a single write(2) on a descriptor opened with O_APPEND, so lines of
concurrent writers do not interleave (for lines below the filesystem's atomic size, in practice
any regular file on a local filesystem).
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import hashlib
import json
import os
import stat
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from nsbox import visible
from nsbox.errors import NsboxError
from nsbox.policy.policy import Policy
from nsbox.result import Result

HEAD = 1024  # bytes of stdin, outputs and written files kept in the record
REDACTED = "<redacted>"
MIN_SECRET = 4  # shorter values are not searched for inside text ("1" would be everywhere)


def head(data: bytes) -> str:
    return data[:HEAD].decode("utf-8", "replace")


def describe_data(data: bytes) -> dict[str, Any]:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "head": head(data)}


def set_env(policy: Policy, env: dict[str, str]) -> dict[str, str]:
    """The variables set for a command by someone: the policy's (a profile or --env), those
    passed through from the caller, and the call's own. Their values are secrets."""
    found = dict(policy.env)
    found.update({name: os.environ[name] for name in policy.env_passthrough
                  if name in os.environ})
    found.update(env)
    return found


def command_record(
    *,
    argv: Sequence[str],
    policy: Policy,
    session: str | None,
    env: dict[str, str],
    stdin: bytes | int | None,
    timeout: float | None,
    output_limit: int,
    result: Result | None,
    error: NsboxError | None = None,
    files_written: Iterable[dict[str, Any]] = (),
    files_produced: Iterable[dict[str, Any]] = (),
    heads: tuple[bytes, bytes] | None = None,
) -> dict[str, Any]:
    """The record of one command, before redaction. ``heads``: the first bytes of stdout and
    stderr when they were passed through instead of kept in the Result."""
    record: dict[str, Any] = {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
        "session": session,
        "argv": list(argv),
        "env": dict(env),
        "stdin": (describe_data(stdin) if isinstance(stdin, bytes)
                  else {"descriptor": stdin} if isinstance(stdin, int) else None),
        "files_written": list(files_written),
        "profile": policy.name,
        "policy_digest": policy.digest(),
        "limits": {"timeout": timeout, "output": output_limit,
                   **dataclasses.asdict(policy.limits)},
        "network_mode": policy.network.mode,
    }
    if error is not None:
        record["error"] = {"type": type(error).__name__, "message": str(error),
                           "step": getattr(error, "step", None)}
    if result is not None:
        data = result.to_dict()
        for name in ("extra", "stdout_bytes", "stderr_bytes", "stdout_truncated",
                     "stderr_truncated"):
            data.pop(name, None)
        record["result"] = data
        out, err = heads or (result.stdout, result.stderr)
        record["output"] = {
            "stdout": {"size": result.stdout_bytes, "truncated": result.stdout_truncated,
                       "head": head(out)},
            "stderr": {"size": result.stderr_bytes, "truncated": result.stderr_truncated,
                       "head": head(err)},
        }
        record["network"] = result.extra.get("network")
        record["seccomp_denied"] = result.extra.get("seccomp_denied")
    record.update(produced_files(list(files_produced)))
    return record


# The files a command produced, as the record lists them: a sandbox chooses how many and how
# long their names are (1000 names of escapes made a 15 MB line per command).
PRODUCED_LISTED = 100
PATH_KEPT = 512  # characters of a listed path


def produced_files(files: list[dict[str, Any]]) -> dict[str, Any]:
    """``files_produced``: the first PRODUCED_LISTED, each path cut at PATH_KEPT characters
    (``path_truncated``); past them ``files_produced_more`` (how many) and
    ``files_produced_digest``, the SHA-256 of the whole list (canonical JSON), which the
    workspace's listing can be checked against."""
    listed = []
    for entry in files[:PRODUCED_LISTED]:
        path = entry.get("path")
        if isinstance(path, str) and len(path) > PATH_KEPT:
            entry = {**entry, "path": path[:PATH_KEPT], "path_truncated": True}
        listed.append(entry)
    out: dict[str, Any] = {"files_produced": listed}
    if len(files) > PRODUCED_LISTED or len(listed) != len(files) or any(
            "path_truncated" in e for e in listed):
        whole = json.dumps(visible.json_ready(files), sort_keys=True).encode()
        out["files_produced_more"] = len(files) - len(listed)
        out["files_produced_digest"] = hashlib.sha256(whole).hexdigest()
    return out


def redact(value: Any, secrets: Iterable[str]) -> Any:
    """``value`` with every occurrence of a secret replaced, in keys and strings alike."""
    needles = sorted({s for s in secrets if len(s) >= MIN_SECRET}, key=len, reverse=True)
    if not needles:
        return value

    def walk(item: Any) -> Any:
        if isinstance(item, str):
            for needle in needles:
                item = item.replace(needle, REDACTED)
            return item
        if isinstance(item, dict):
            return {walk(k): walk(v) for k, v in item.items()}
        if isinstance(item, (list, tuple)):
            return [walk(v) for v in item]
        return item

    return walk(value)


class AuditLog:
    """An append-only JSON-lines file. The file is created 0600 and never followed if it is a
    symlink (open(2), O_NOFOLLOW)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        # O_NONBLOCK: a FIFO would block the open until a reader comes (fifo(7)); without one
        # it is ENXIO. A regular file ignores the flag.
        flags = (os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
                 | os.O_NONBLOCK | os.O_NOCTTY)
        try:
            self._fd = os.open(path, flags, 0o600)
        except OSError as exc:
            if exc.errno != errno.ENXIO:
                raise NsboxError(f"cannot open the audit file {path}: {exc.strerror}") from None
            self._fd = -1
        if self._fd < 0 or not stat.S_ISREG(os.fstat(self._fd).st_mode):
            # Checked before the run: a device such as /dev/full would fail only after it.
            if self._fd >= 0:
                os.close(self._fd)
            error = NsboxError(f"the audit file {path} is not a regular file (a FIFO, device "
                               "or socket)")
            error.hint = "give the path of a file (it is created if missing)"
            raise error

    def write(self, record: dict[str, Any], secrets: Iterable[str] = ()) -> None:
        record = dict(record)
        if "env" in record:
            record["env"] = {name: REDACTED for name in record["env"]}
        record = redact(record, secrets)
        # Names the sandbox made that are not UTF-8: text with U+FFFD and their bytes beside.
        line = json.dumps(visible.json_ready(record), sort_keys=False) + "\n"
        with self._lock:
            if self._fd < 0:
                raise NsboxError(f"the audit file {self.path} is closed")
            try:
                os.write(self._fd, line.encode())
            except OSError as exc:  # ENOSPC, EDQUOT, EIO
                raise NsboxError(f"cannot write the audit record to {self.path}: "
                                 f"{exc.strerror}") from None

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
