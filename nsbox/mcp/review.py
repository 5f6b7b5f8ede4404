"""Review of an agent's project changes over MCP, split so that the agent cannot approve them.

``nsbox mcp --project DIR`` gives the agent's connection one more tool, ``changes``: read-only,
it lists what the agent's code changed in the project (with diffs). It has no tool that writes
to the project. The session is also published, like one of ``nsbox session start``, in this
user's private runtime directory, and the server says its id on stderr; approving is done from
there, by the user:

- ``nsbox session diff|apply|discard ID`` on the user's terminal, or
- ``nsbox mcp --review ID``: an MCP server for the user's own client (a review pane, a second
  client the model does not drive) with the tools ``changes``, ``apply`` and ``discard``.

The agent's code cannot reach that socket (it is not mounted in the sandbox, and the sandbox
has no network to the host), and the agent's MCP connection does not carry those tools. What
remains is the host: an agent that is also given a shell on the host outside nsbox can run
``nsbox session apply`` itself; give it nsbox's tools only.
"""

# No `from __future__ import annotations`: the MCP SDK reads the tools' annotations at run
# time, and those name objects local to build_review_server.

import sys
import threading
from typing import TYPE_CHECKING, Any

from nsbox import visible
from nsbox._sys.wire import SupervisorReply
from nsbox.errors import NsboxError
from nsbox.mcp.tools import Reply, render_changes, require_sdk, to_mcp
from nsbox.session.supervisor import publish, request

if TYPE_CHECKING:
    from mcp.server import MCPServer

    from nsbox.session.session import Session

AGENT_TOOLS = ("changes",)  # added to the agent's tools with --project (mcp_tools.Workbench)
REVIEW_TOOLS = ("changes", "apply", "discard")  # nsbox mcp --review ID


class Reviewer:
    """The user's tools over a published session (through its socket, as this user)."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self._lock = threading.Lock()

    def _request(self, op: str, paths: list[str] | None = None,
                 reviewed: str | None = None) -> SupervisorReply:
        with self._lock:
            return request(self.session_id, {"op": op, "paths": paths or None,
                                             **({"reviewed": reviewed} if reviewed else {})})

    def changes(self, paths: list[str] | None = None) -> Reply:
        reply = self._request("changes", paths)
        found = reply["changes"]
        token = (f"\nreview token {reply['review']}: apply with it to write exactly these "
                 "changes, or nothing" if found else "")
        return Reply({"changes": found, "review": reply["review"]},
                     render_changes(found) + token)

    def apply(self, paths: list[str] | None = None, reviewed: str | None = None) -> Reply:
        report = self._request("apply", paths, reviewed)
        lines = [f"applied: {visible.name(p)}" for p in report["applied"]]
        lines += [f"conflict (not written): {visible.name(p)}" for p in report["conflicts"]]
        lines += [f"not applied: {visible.name(r['path'])}: {visible.name(r['reason'])}"
                  for r in report["refused"]]
        return Reply(dict(report), "\n".join(lines) or "nothing to apply")

    def discard(self, paths: list[str] | None = None) -> Reply:
        dropped = self._request("discard", paths)["discarded"]
        return Reply({"discarded": dropped},
                     "\n".join(f"discarded: {visible.name(p)}" for p in dropped)
                     or "nothing to discard")


def build_review_server(reviewer: Reviewer) -> "MCPServer":
    """The user's MCP server: ``changes``, ``apply`` and ``discard`` of one session."""
    from typing import Annotated

    import anyio.to_thread
    import mcp_types as types
    from mcp.server import MCPServer
    from pydantic import Field

    from nsbox.mcp import schemas as schemas
    from nsbox.mcp.schemas import describe, tool_hints
    from nsbox.version import VERSION

    server: MCPServer = MCPServer(
        "nsbox-review", version=VERSION, log_level="WARNING",
        instructions=f"Review the changes an agent made to a project in nsbox session "
                     f"{reviewer.session_id}, and apply or discard them.")

    async def call(fn: Any, *args: Any) -> Any:
        try:
            reply = await anyio.to_thread.run_sync(fn, *args)
        except NsboxError as error:
            return types.CallToolResult(
                content=[types.TextContent(type="text", text=f"error: {visible.text(str(error))}")],
                is_error=True)
        return to_mcp(reply, types)

    Paths = Annotated[list[str] | None, Field(
        description="Paths relative to the project (a directory means everything below it); "
                    "none: every change")]

    Reviewed = Annotated[str | None, Field(
        description="The review token `changes` gave for the same paths: nothing is written "
                    "unless the changes are still exactly those")]

    async def changes(paths: Paths = None
                      ) -> Annotated[types.CallToolResult, schemas.ChangesOutput]:
        """List the agent's changes to the project, with unified diffs of text files, and
        the review token that makes apply write exactly these."""
        return await call(reviewer.changes, paths)

    async def apply(paths: Paths = None, reviewed: Reviewed = None
                    ) -> Annotated[types.CallToolResult, schemas.ApplyOutput]:
        """Write the chosen changes into the project; a file changed on the host since the
        session started is reported as a conflict and not written. With ``reviewed`` (the
        token of `changes`), nothing is written if the agent changed them since."""
        return await call(reviewer.apply, paths, reviewed)

    async def discard(paths: Paths = None
                      ) -> Annotated[types.CallToolResult, schemas.DiscardOutput]:
        """Drop the chosen changes: they are never written to the project."""
        return await call(reviewer.discard, paths)

    # apply writes into the user's project on the host; discard drops the agent's work.
    hints = {
        changes: tool_hints("Project changes", read_only=True, idempotent=True),
        apply: tool_hints("Apply changes", read_only=False, destructive=True),
        discard: tool_hints("Discard changes", read_only=False, destructive=True,
                             idempotent=True),
    }
    for tool, hint in hints.items():
        server.add_tool(tool, description=describe(tool), annotations=hint,
                        structured_output=True)
    return server


def serve_review(session_id: str) -> None:
    """``nsbox mcp --review ID``: serve the user's review tools on stdin/stdout."""
    require_sdk()
    import anyio

    request(session_id, {"op": "info"})  # a session of this user, before the handshake
    server = build_review_server(Reviewer(session_id))
    anyio.run(server.run_stdio_async)


def publish_for_review(session: "Session") -> None:
    """Make the agent's session reachable by the user's review tools, served by a thread of
    this process until the session ends; its id goes to stderr (stdout is the protocol)."""
    supervisor = publish(session, None)
    threading.Thread(target=supervisor.serve, name="nsbox-review", daemon=True).start()
    print(f"nsbox mcp: review the agent's changes with `nsbox session diff {session.id}`, "
          f"`nsbox session apply {session.id}` or `nsbox mcp --review {session.id}`",
          file=sys.stderr, flush=True)
