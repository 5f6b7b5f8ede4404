"""The proxy's log, bounded, so that what a sandbox sends can never hide what it did.

Kept per report window (a run, or each command of a session, docs/network.md "The log"):

- every admitted connection is summed per destination (host, port): connections and bytes
  both ways, so an upload to a listed host is in the log whatever else the sandbox did;
- the attempts themselves, allowed and refused each capped at ``max_records`` (a flood of
  refused requests cannot push an allowed connection out), with counts of the rest;
- the answers of ``ask``, capped the same way, and how many requests were refused without
  asking because the proxy's limit of questions was reached.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from nsbox import visible

MAX_ADDRESSES = 8  # distinct addresses kept per destination of the summary


class _Window:
    """What one report covers."""

    def __init__(self) -> None:
        self.allowed: list[tuple[float, dict[str, Any]]] = []  # (start time, record)
        self.refused: list[tuple[float, dict[str, Any]]] = []
        self.allowed_dropped = 0
        self.refused_dropped = 0
        self.destinations: dict[tuple[str | None, int | None], dict[str, Any]] = {}
        self.answers: list[dict[str, Any]] = []
        self.answers_dropped = 0
        self.not_asked = 0


class ProxyLog:
    """Thread-safe; ``report(reset=True)`` hands the window out and starts a new one."""

    def __init__(self, max_records: int, asking: bool) -> None:
        self._max = max_records
        self._asking = asking
        self._lock = threading.Lock()
        self._window = _Window()

    def attempt(
        self,
        method: str | None,
        host: str | None,
        port: int | None,
        allowed: bool,
        reason: str,
        up: int,
        down: int,
        started: float,
        address: str | None = None,
    ) -> None:
        record = {
            "time": round(started, 3),
            "method": method,
            "host": host,
            "port": port,
            "address": address,
            "allowed": allowed,
            "reason": reason,
            "bytes_up": up,
            "bytes_down": down,
            "duration": round(time.time() - started, 3),
        }
        with self._lock:
            w = self._window
            if record["allowed"]:
                self._count(w, record)
                kept, full = w.allowed, len(w.allowed) >= self._max
                if full:
                    w.allowed_dropped += 1
            else:
                kept, full = w.refused, len(w.refused) >= self._max
                if full:
                    w.refused_dropped += 1
            if not full:
                kept.append((started, record))

    def _count(self, w: _Window, record: dict[str, Any]) -> None:
        """Add an admitted connection to its destination's sum; past ``max_records``
        destinations, to one last sum whose host and port are None."""
        key: tuple[str | None, int | None] = (record["host"], record["port"])
        if key not in w.destinations and len(w.destinations) >= self._max:
            key = (None, None)
        dest = w.destinations.setdefault(key, {
            "host": key[0], "port": key[1], "addresses": [],
            "connections": 0, "bytes_up": 0, "bytes_down": 0,
        })
        dest["connections"] += 1
        dest["bytes_up"] += record["bytes_up"]
        dest["bytes_down"] += record["bytes_down"]
        address = record["address"]
        if address not in dest["addresses"] and len(dest["addresses"]) < MAX_ADDRESSES:
            dest["addresses"].append(address)

    def answer(self, host: str, port: int, approved: bool, when: float) -> None:
        with self._lock:
            w = self._window
            if len(w.answers) < self._max:
                w.answers.append({"time": round(when, 3), "host": host, "port": port,
                                  "approved": approved})
            else:
                w.answers_dropped += 1

    def not_asked(self) -> None:
        """A host refused without a question: the limit of questions was reached."""
        with self._lock:
            self._window.not_asked += 1

    def report(self, reset: bool = False) -> dict[str, Any]:
        with self._lock:
            w = self._window
            if reset:
                self._window = _Window()
            # In the order the connections began (the log's times are rounded to milliseconds).
            records = sorted(w.allowed + w.refused, key=lambda r: r[0])
            data: dict[str, Any] = {
                "attempts": [record for _, record in records],
                "attempts_dropped": w.allowed_dropped + w.refused_dropped,
                "refused_dropped": w.refused_dropped,
                "destinations": [dict(d, addresses=list(d["addresses"]))
                                 for d in w.destinations.values()],
            }
            if self._asking:
                data.update(answers=list(w.answers), answers_dropped=w.answers_dropped,
                            not_asked=w.not_asked)
            return data


# --- the log as a person reads it ------------------------------------------------------------
# ``nsbox run``'s stderr and the MCP run tool's text show this much of a report; the report
# itself (``--json``, the MCP reply's data, the audit record) keeps all the log kept.
SHOWN_REFUSED = 20  # refused attempts listed, then how many more were refused
SHOWN_DESTINATIONS = 20  # destinations reached listed, then the rest summed in a line


def summary(report: dict[str, Any], refused: int = SHOWN_REFUSED,
            destinations: int = SHOWN_DESTINATIONS) -> list[str]:
    """A report as lines for a person: the first ``refused`` refused attempts with the reason,
    then ``... and N more refused (not listed)`` counting both those cut here and those the
    log itself did not keep (``refused_dropped``); then each destination reached, with its
    connections and bytes, the first ``destinations`` of them and the rest summed (and the
    log's own sum of those past its limit). Names, methods and reasons are the sandbox's
    making: each is shown by nsbox/visible.py's rule."""
    lines = []
    kept = [a for a in report.get("attempts", []) if not a.get("allowed")]
    for attempt in kept[:refused]:
        host = attempt.get("host")
        where = f"{host}:{attempt.get('port')}" if host else "?"
        lines.append(f"refused {visible.name(attempt.get('method') or 'request')} "
                     f"{visible.name(where)}: {visible.name(attempt.get('reason'))}")
    more = len(kept) - min(len(kept), refused) + int(report.get("refused_dropped") or 0)
    if more:
        lines.append(f"... and {more} more refused (not listed)")
    reached = report.get("destinations", [])
    named = [d for d in reached if d.get("host") is not None]
    for dest in named[:destinations]:
        where = f"{dest['host']}:{dest['port']}"
        lines.append(f"reached {visible.name(where)}: {_traffic([dest])}")
    if len(named) > destinations:
        rest = named[destinations:]
        lines.append(f"... and {len(rest)} more destinations reached (not listed): "
                     f"{_traffic(rest)}")
    unnamed = [d for d in reached if d.get("host") is None]  # past the log's own limit
    if unnamed:
        lines.append(f"reached more destinations than the log names, summed: "
                     f"{_traffic(unnamed)}")
    return lines


def _traffic(dests: list[dict[str, Any]]) -> str:
    connections = sum(int(d.get("connections") or 0) for d in dests)
    up = sum(int(d.get("bytes_up") or 0) for d in dests)
    down = sum(int(d.get("bytes_down") or 0) for d in dests)
    return (f"{connections} connection{'' if connections == 1 else 's'}, "
            f"{up} bytes sent, {down} bytes received")
