"""The detached supervisor of one command-line session: ``python -m nsbox.cli.supervisor``.

``nsbox session start`` starts it with a ``_wire.SupervisorStart`` pickled on stdin (not in
argv, which every user can read in /proc) and reads one line back: ``ok ID`` or ``error
{"error": ...}``. It then serves the session until ``nsbox session stop``, the idle timeout, or
the end of the session's sandbox; nsbox/session/supervisor.py holds the protocol and both its ends.
Its command line is how a client knows it still runs (``supervisor.TITLES``): keep the name.
"""

from __future__ import annotations

import json
import os
import pickle
import sys

from nsbox._sys.wire import SupervisorStart
from nsbox.errors import NsboxError
from nsbox.session.session import Session
from nsbox.session.supervisor import error_reply, publish


def main() -> int:
    # From `nsbox session start`, this user's own process, through a private pipe.
    spec: SupervisorStart = pickle.loads(sys.stdin.buffer.read())
    try:
        session = Session(spec["policy"], idle_timeout=spec["idle_timeout"],
                          audit=spec["audit"])
    except NsboxError as exc:
        print("error " + json.dumps(error_reply(exc)), flush=True)
        return 1
    try:
        supervisor = publish(session, spec["idle_timeout"])
    except NsboxError as exc:
        session.close()
        print("error " + json.dumps(error_reply(exc)), flush=True)
        return 1
    print("ok " + session.id, flush=True)
    null = os.open(os.devnull, os.O_RDWR)
    for target in (0, 1, 2):
        os.dup2(null, target)
    if null > 2:  # one of them itself when it was closed: it stays
        os.close(null)
    supervisor.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
