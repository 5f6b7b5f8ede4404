"""What untrusted code sees inside nsbox: run it with

    nsbox run --ro-bind examples:/examples -- python3 /examples/try_to_escape.py

Every attempt below is one a prompt-injected agent might make; each should fail.
"""

import os
import socket


def attempt(what: str, action) -> None:
    try:
        print(f"{what:45} -> {action()!r}  (NOT BLOCKED)")
    except OSError as exc:
        print(f"{what:45} -> blocked: {exc.strerror or exc}")


secrets = sorted(k for k in os.environ if k not in {"PATH", "HOME", "LANG", "PWD"})
print(f"{'environment variables besides PATH/HOME/LANG':45} -> {secrets}")
attempt("read /etc/shadow", lambda: open("/etc/shadow").read(100))
attempt("read /root/.ssh/id_rsa", lambda: open("/root/.ssh/id_rsa").read(100))
attempt("resolve pypi.org", lambda: socket.getaddrinfo("pypi.org", 443))
attempt("connect to the host's 127.0.0.1:22",
        lambda: socket.create_connection(("127.0.0.1", 22), 1))
attempt("write /usr/bin/evil", lambda: open("/usr/bin/evil", "w"))
with open("/proc/1/cmdline", "rb") as f:
    init = f.read().replace(b"\0", b" ").decode().strip()
print(f"{'pid 1 (the host init?)':45} -> {init!r}: this sandbox itself")
print(f"{'processes visible':45} -> {sorted(p for p in os.listdir('/proc') if p.isdigit())}")
print(f"{'user':45} -> uid {os.getuid()}, workspace {os.getcwd()}")
