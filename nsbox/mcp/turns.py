"""One tool call at a time, in the order they came: the queue of an MCP connection's calls
(``Turns``, held by nsbox/mcp/tools.py's ``Workbench``).

The server runs each call in a worker thread so that a long command does not stall the
protocol (nsbox/mcp/server.py). A call the client cancels is abandoned there, and its thread
would otherwise wait for its turn and then do what it was asked: here it leaves the queue at
once and never runs. The queue is bounded: a client that sends call after call behind a long
command gets SessionBusy past MAX_WAITING, not a thread each.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator

from nsbox.errors import NsboxError
from nsbox.launch.launcher import Cancel as Call  # one tool call: cancel() marks it, kills it

MAX_WAITING = 8  # calls that may wait for their turn behind the one served


class SessionBusy(NsboxError):
    """MAX_WAITING calls already wait for the session: this one is refused, not queued."""


class CallCancelled(NsboxError):
    """The client cancelled the call before its turn came or its command ran: it did
    nothing."""


class Turns:
    """Whose turn it is: one call served, the others waiting in the order they came."""

    def __init__(self) -> None:
        self._lock = threading.Condition()  # guards _serving and _waiting
        self._serving = False  # a call has its turn
        self._waiting: collections.deque[Call] = collections.deque()

    def cancel(self, call: Call) -> None:
        """The client cancelled ``call``: waiting, it leaves the queue and never runs; its
        command running, that is killed now (status SG). Another call is never touched."""
        with self._lock:
            call()  # marks it; kills its command if one runs (nsbox/host/output.py, Cancel)
            self._lock.notify_all()

    @contextlib.contextmanager
    def turn(self, call: Call | None) -> Iterator[None]:
        """Wait for this call's turn: after the calls that came before it, unless the client
        cancels it first (CallCancelled). Past MAX_WAITING waiting calls, SessionBusy."""
        me = call if call is not None else Call()
        with self._lock:
            if len(self._waiting) >= MAX_WAITING:
                raise SessionBusy(
                    f"the session is busy with another call, and {len(self._waiting)} more "
                    "wait for it: wait for their replies, then call again")
            self._waiting.append(me)
            try:
                while not me.cancelled and (self._serving or self._waiting[0] is not me):
                    self._lock.wait()
            finally:
                self._waiting.remove(me)
                self._lock.notify_all()  # the next in line may go
            if me.cancelled:
                raise CallCancelled("the call was cancelled before its turn: it did nothing")
            self._serving = True
        try:
            yield
        finally:
            with self._lock:
                self._serving = False
                self._lock.notify_all()
