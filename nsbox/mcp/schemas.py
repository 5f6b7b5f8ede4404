"""How the MCP tools describe themselves: the shapes of their structured replies (each tool's
``outputSchema``), their annotations and their descriptions.

The data itself is built by nsbox/mcp/tools.py (``Reply.data``) and nsbox/mcp/review.py; these
models only describe it, and the SDK checks every successful reply against its tool's model
before it leaves the server. Imported by the servers only, when the ``mcp`` extra (and so
pydantic) is installed.
"""

from __future__ import annotations

import inspect
from typing import Any

from pydantic import BaseModel, Field


class FileEntry(BaseModel):
    name: str = Field(description="Path relative to /workspace, or absolute under /input")
    size: int = Field(description="Size in bytes")
    sha256: str = Field(description="SHA-256 of the content, hex")
    name_truncated: bool | None = Field(
        default=None, description="The name was too long to show whole: its start and end")


class RunOutput(BaseModel):
    """What run_python and run_bash return."""

    status: str = Field(description="OK (exit 0), RE (non-zero exit), TO (time limit), ML "
                        "(memory limit), OL (output limit), SG (killed by a signal), XX (the "
                        "sandbox failed)")
    exit_code: int | None = Field(description="The exit status, when the command exited")
    signal: int | None = Field(description="The signal that killed it, if one did")
    wall_time: float = Field(description="Seconds the command ran")
    timeout: float = Field(description="The wall-clock limit it ran under, in seconds")
    stdout: str
    stderr: str
    stdout_bytes: int = Field(description="Bytes written to stdout, also those not shown")
    stderr_bytes: int = Field(description="Bytes written to stderr, also those not shown")
    stdout_truncated: bool
    stderr_truncated: bool
    files: list[FileEntry] = Field(description="Files of /workspace the command created or "
                                   "changed (the first 50)")
    files_total: int | None = Field(default=None, description="How many files it created or "
                                    "changed, also those not in files")
    network: dict[str, Any] | None = Field(
        default=None, description="Every connection through the proxy, when there is one")
    notes: list[str] | None = Field(default=None,
                                    description="Why the command stopped, limits lowered")


class WriteOutput(BaseModel):
    file: FileEntry


class ReadOutput(BaseModel):
    file: FileEntry
    content: str | None = Field(default=None, description="The text, when it is text")
    truncated: bool | None = Field(default=None, description="Only the start of the text "
                                   "is in content")
    image: bool | None = Field(default=None, description="A PNG, returned as an image")
    binary: bool | None = Field(default=None, description="Neither text nor PNG: not shown")


class ListOutput(BaseModel):
    files: list[FileEntry] = Field(description="The regular files below /workspace")
    inputs: list[FileEntry] | None = Field(
        default=None, description="The read-only input files below /input")
    truncated: bool | None = Field(default=None, description="The listing of /workspace was "
                                   "cut at its size: the files after these are not in it")


class ChangesOutput(BaseModel):
    changes: list[dict[str, Any]] = Field(description="One entry per changed path: kind "
                                          "(added, modified, deleted, mode), path, diff")
    session: str | None = Field(default=None, description="The session the user reviews")
    review: str | None = Field(default=None, description="The review token of exactly these "
                               "changes: apply with it writes them, or nothing")


class Refusal(BaseModel):
    path: str
    reason: str


class ApplyOutput(BaseModel):
    applied: list[str]
    conflicts: list[str] = Field(description="Changed on the host since the session started: "
                                 "not written")
    refused: list[Refusal]


class DiscardOutput(BaseModel):
    discarded: list[str]


def describe(fn: Any, *more: str) -> str:
    """A tool's description: its docstring as one paragraph (no source indentation), then
    ``more``."""
    return " ".join(part for part in (" ".join(inspect.cleandoc(fn.__doc__ or "").split()),
                                      *more) if part)


def tool_hints(title: str, *, read_only: bool, destructive: bool = False,
               idempotent: bool = False, open_world: bool = False) -> Any:
    """The MCP tool annotations (hints for the client: which tools it may call unasked)."""
    import mcp_types as types

    return types.ToolAnnotations(title=title, read_only_hint=read_only,
                                 destructive_hint=destructive, idempotent_hint=idempotent,
                                 open_world_hint=open_world)
