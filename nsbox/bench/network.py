"""Measure the network modes: launch cost of none / loopback / allow, and proxy throughput.

    python -m nsbox.bench.network [rounds]

Launch figures are medians of ``nsbox.run(["/bin/true"])`` in this process after a warm-up
(the launch helper already running). Throughput: a 64 MiB download by curl inside the sandbox
from a loopback HTTP server on the host, through the proxy (plain HTTP and a CONNECT tunnel),
against the same download by curl on the host without any proxy.
"""

from __future__ import annotations

import http.server
import statistics
import subprocess
import sys
import threading
import time

import nsbox
from nsbox.policy.policy import Network, Policy

SIZE = 64 * 1024 * 1024
BLOCK = b"x" * (1024 * 1024)


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Length", str(SIZE))
        self.end_headers()
        for _ in range(SIZE // len(BLOCK)):
            self.wfile.write(BLOCK)

    def log_message(self, *args: object) -> None:
        pass


def launch_ms(policies: dict[str, Policy], rounds: int) -> dict[str, float]:
    """Median launch time per policy; the policies take turns so that drift in the machine's
    load spreads evenly over them."""
    times: dict[str, list[float]] = {name: [] for name in policies}
    for policy in policies.values():
        nsbox.run(["/bin/true"], policy)
    for _ in range(rounds):
        for name, policy in policies.items():
            t0 = time.perf_counter()
            result = nsbox.run(["/bin/true"], policy)
            times[name].append((time.perf_counter() - t0) * 1000)
            assert result.ok, result
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    allow = Network(mode="allow", allow=(f"127.0.0.1:{port}",))
    policies = {
        "none": Policy(),
        "loopback": Policy(network=Network(mode="loopback")),
        "allow": Policy(network=allow),
    }
    for name, median in launch_ms(policies, rounds).items():
        print(f"launch /bin/true, net {name:8}: {median:6.2f} ms (median of {rounds})")

    url = f"http://127.0.0.1:{port}/"
    curl = ["/usr/bin/curl", "-s", "-o", "/dev/null", "-w", "%{speed_download}"]
    t0 = time.perf_counter()
    subprocess.run([*curl, "--noproxy", "*", url], check=True, capture_output=True)
    direct = SIZE / (time.perf_counter() - t0)
    print(f"64 MiB, curl on the host, no proxy     : {direct / 2**20:7.0f} MiB/s")
    for label, extra in (("plain HTTP", []), ("CONNECT   ", ["--proxytunnel"])):
        result = nsbox.run([*curl, *extra, url], Policy(network=allow), timeout=60)
        assert result.ok, result.stderr
        speed = float(result.stdout)
        print(f"64 MiB, curl in the sandbox, {label}: {speed / 2**20:7.0f} MiB/s")
    server.shutdown()


if __name__ == "__main__":
    main()
