"""Measure `nsbox mcp` as an agent sees it: connecting, each tool's round trip, disconnecting.

    python -m nsbox.bench.mcp_server [rounds]

Starts `nsbox mcp` with this interpreter and talks to it with the mcp SDK's stdio client.
"connect" is spawn + SDK import + session start + MCP handshake; each tool figure is the
median (and minimum) round trip of ``rounds`` calls; "disconnect" is the time from leaving the
client until the server has exited and the session is gone. Needs the extra: pip install
'nsbox[mcp]'.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

CALLS = [
    ("run_bash", {"command": "true"}),
    ("run_python", {"code": "pass"}),
    ("write_file", {"path": "a.txt", "content": "x" * 1024}),
    ("read_file", {"path": "a.txt"}),
    ("list_files", {}),
]


async def measure(rounds: int) -> None:
    from mcp import Client
    from mcp.client.stdio import StdioServerParameters

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    server = StdioServerParameters(command=sys.executable, args=["-m", "nsbox", "mcp"],
                                   env={"PYTHONPATH": root})
    started = time.monotonic()
    async with Client(server) as client:
        print(f"connect          {time.monotonic() - started:8.3f} s")
        for tool, arguments in CALLS:
            times = []
            for _ in range(rounds):
                begin = time.monotonic()
                await client.call_tool(tool, arguments)
                times.append(time.monotonic() - begin)
            print(f"{tool:<16} {statistics.median(times) * 1000:8.1f} ms median, "
                  f"{min(times) * 1000:.1f} ms min")
        leaving = time.monotonic()
    print(f"disconnect       {time.monotonic() - leaving:8.3f} s")


def main() -> None:
    import anyio

    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    anyio.run(measure, rounds)


if __name__ == "__main__":
    main()
