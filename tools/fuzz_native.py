"""Fuzz the native core's flat-plan parser and report writer under sanitizers.

Builds tools/fuzz/fuzz_native.c with the real nsbox/native/*.c (but the Python module), using gcc's
AddressSanitizer and UndefinedBehaviorSanitizer (any report aborts), makes a seed corpus from
real flattened plans (nsbox/sandbox/native.py, flatten and flatten_command, of plans built for a
few policies) and runs a bounded number of mutated cases from a fixed seed, so that a run is
deterministic and takes seconds. Exit status 0: no finding.

    .venv/bin/python tools/fuzz_native.py [--cases N] [--seed S] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nsbox.launch import launcher  # noqa: E402
from nsbox.policy.policy import Bind, Dir, File, Network, Policy, Symlink, Tmpfs  # noqa: E402
from nsbox.sandbox import native  # noqa: E402

CFLAGS = ["-std=gnu11", "-O1", "-g", "-fno-omit-frame-pointer",
          "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
          "-Wall", "-Wextra", "-Wvla", "-Werror"]
SOURCES = [ROOT / "tools/fuzz/fuzz_native.c",
           *sorted(p for p in (ROOT / "nsbox/native").glob("*.c")
                   if p.name not in ("module.c", "engine.c"))]  # the engine's main: not here


def seed_policies() -> list[tuple[Policy, list[str], dict[str, object]]]:
    """Policies whose flat plans hold every kind of item: each mount kind, rlimits, a
    network mode, names with escapes and characters of several bytes, a pooled plan, a
    terminal (--tty)."""
    odd = "/data/caf\u00e9/\x01\"q\\/" + "x" * 200
    mounts = (*Policy().mounts, Tmpfs("/scratch", size=1 << 20, mode=0o1777),
              File("/etc/motd", "hello\n\u202e", mode=0o600), Symlink("/link", "/usr"),
              Dir(odd, mode=0o700), Bind("/etc/hostname", "/etc/hn"))
    return [
        (Policy(), ["/bin/true"], {}),
        (Policy(mounts=mounts), ["sh", "-c", "echo \u00e9"], {"env": {"A": "b\x02"}}),
        (Policy(network=Network(mode="loopback")), ["python3", "-c", "1"],
         {"cwd": "/tmp", "wall_time": 5.0}),
        (Policy(), ["/usr/bin/env"], {"pooled": True, "trace": True}),
        (Policy(), ["bash", "-i"], {"tty": [65535, 80]}),
    ]


def make_seeds(directory: Path) -> list[Path]:
    paths = []
    for index, (policy, argv, extra) in enumerate(seed_policies()):
        flags = {key: extra.pop(key) for key in ("pooled", "trace", "tty") if key in extra}
        plan = launcher.build_plan(policy, argv, env=extra.get("env", {"PATH": "/usr/bin:/bin"}),
                                   cwd=extra.get("cwd"), wall_time=extra.get("wall_time"))
        wire = dict(plan.to_wire(), **flags)
        wire["rlimits"] = [[7, 1024, 1024], [1, -1, -1]]  # as the helper adds them
        sources = {0: 3} if index == 1 else {}
        net = 9 if index == 2 else None
        blob, _fds = native.flatten(wire, [0, 1, 2], 4, 5, sources, 6 if index == 3 else -1,
                                    net, 40, "comm" if index else "")
        path = directory / f"P{index}"
        path.write_bytes(blob)
        paths.append(path)
        command = native.flatten_command(wire, wire["setid_bpf"])
        path = directory / f"C{index}"
        path.write_bytes(command)
        paths.append(path)
        if not flags:  # the launch engine takes one-shot launches only
            path = directory / f"E{index}"
            path.write_bytes(engine_request(wire, sorted(sources)))
            paths.append(path)
    return paths


def engine_request(wire: dict[str, object], bound: list[int]) -> bytes:
    """The launch engine's request for ``wire`` (nsbox/host/engine.py, encode), with the
    cgroup files of this host and a mapper's id maps."""
    from nsbox.host import engine
    from nsbox.policy.identity import SandboxIds

    plan = {**wire, "cgroup": dict(wire["cgroup"], memory=64 << 20, pids=32, cpus=0.5,  # type: ignore[call-overload]
                                   cpu_time=2.0)}
    cgroup = engine._RunCgroup(plan["cgroup"], plan["rlimits"])  # type: ignore[arg-type]
    ids = SandboxIds(65534, 65534, 65534, 65534, True)
    flat = engine.flat_plan(plan, cgroup, bound)  # type: ignore[arg-type]
    return engine.encode(plan, cgroup, ids, os.getpid(), bound, flat)  # type: ignore[arg-type]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep", type=Path, help="keep the binary and seeds here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="nsbox-fuzz-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        seeds = make_seeds(work)
        binary = work / "fuzz_native"
        subprocess.run(["gcc", *CFLAGS, f"-I{ROOT / 'nsbox/native'}",
                        *map(str, SOURCES), "-o", str(binary)], check=True)
        env = dict(os.environ, ASAN_OPTIONS="abort_on_error=1:detect_leaks=1",
                   UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
        started = time.monotonic()
        proc = subprocess.run([str(binary), str(args.seed), str(args.cases), *map(str, seeds)],
                              env=env)
        print(f"fuzz_native: {time.monotonic() - started:.1f} s", flush=True)
        return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
