"""The launchers compared, each with the closest isolation to nsbox's default policy it offers.

Every method is a callable that runs one payload (an argv) to completion from this process and
raises if the payload did not succeed. ``describe`` gives the exact command line or call, shown
in the report. A peer that is not installed, or that fails its probe run here, is skipped with
the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

import nsbox


@dataclass
class Method:
    name: str
    describe: str  # the command line (or call) one launch makes
    run: Callable[[list[str]], None]
    isolation: str = ""  # what it isolates, in a few words
    close: Callable[[], None] = field(default=lambda: None)
    after: Callable[[], None] | None = None  # after each timed launch, untimed (pool refill)


def run_checked(argv: list[str], **kwargs: object) -> None:
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, **kwargs)  # type: ignore[call-overload]
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[0]} exited with {proc.returncode}")


def _wrap(prefix: list[str]) -> Callable[[list[str]], None]:
    return lambda argv: run_checked([*prefix, *argv])


BWRAP_FLAGS = [
    "--unshare-all", "--die-with-parent", "--new-session",
    "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
    "--symlink", "usr/lib64", "/lib64", "--symlink", "usr/sbin", "/sbin",
    "--ro-bind", "/etc", "/etc", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
    "--clearenv",
]


def _ok(api_result: nsbox.Result) -> None:
    if not api_result.ok:
        raise RuntimeError(f"nsbox: {api_result.status.value} {api_result.stderr[-200:]!r}")


def peers(skipped: dict[str, str]) -> list[Method]:
    found: list[Method] = [
        Method("subprocess", "subprocess.run(argv)", lambda argv: run_checked(argv),
               "none (plain fork/exec)"),
    ]
    if shutil.which("unshare"):
        prefix = ["unshare", "-Urmnpif", "--mount-proc"]
        found.append(Method("unshare", " ".join(prefix) + " ARGV", _wrap(prefix),
                            "user, mnt, pid, net, ipc namespaces; host root fs visible"))
    else:
        skipped["unshare"] = "unshare(1) not installed"
    bwrap = shutil.which("bwrap")
    if bwrap:
        found.append(Method("bwrap", "bwrap " + " ".join(BWRAP_FLAGS) + " ARGV",
                            _wrap([bwrap, *BWRAP_FLAGS]),
                            "all namespaces, tmpfs root, /usr+/etc ro, /proc, /dev, /tmp; "
                            "no seccomp; as root, capabilities kept inside"))
        found.append(_bwrap_like_nsbox(bwrap))
        in_cgroup = _bwrap_in_cgroup(bwrap, skipped)
        if in_cgroup:
            found.append(in_cgroup)
    else:
        skipped["bwrap"] = "bubblewrap not installed (apt-get install bubblewrap)"
    firejail = shutil.which("firejail")
    if firejail:
        prefix = [firejail, "--noprofile", "--quiet", "--net=none", "--private", "--private-tmp",
                  "--private-dev", "--ipc-namespace"]
        found.append(Method("firejail", " ".join(prefix) + " ARGV", _wrap(prefix),
                            "mnt, pid, net, ipc; no user namespace as root; no seccomp"))
    else:
        skipped["firejail"] = "firejail not installed"
    nsjail = shutil.which("nsjail")
    if nsjail:
        prefix = [nsjail, "-Mo", "-Q", "-R", "/usr", "-R", "/lib", "-R", "/lib64", "-R", "/bin",
                  "-R", "/etc", "-T", "/tmp", "-R", "/dev/null", "-R", "/dev/urandom", "--"]
        found.append(Method("nsjail", " ".join(prefix) + " ARGV", _wrap(prefix),
                            "all namespaces, tmpfs root, ro binds, /proc; no seccomp"))
    else:
        skipped["nsjail"] = "nsjail not installed (no Debian package)"
    crun = _crun(skipped)
    if crun:
        found.append(crun)
    return found


SECCOMP_FLAGS = [*BWRAP_FLAGS, "--cap-drop", "ALL", "--seccomp"]


def _seccomp_blob() -> str:
    """A file holding nsbox's default seccomp program (BPF), for bwrap's --seccomp FD."""
    from nsbox.host import seccomp

    program = seccomp.load(nsbox.Policy().seccomp)
    blob = tempfile.NamedTemporaryFile(prefix="nsbox-bench-", suffix=".bpf", delete=False)
    blob.write(program.bpf)
    blob.close()
    return blob.name


def _bwrap_seccomp(bwrap: str, blob: str, argv: list[str], **popen: object) -> None:
    fd = os.open(blob, os.O_RDONLY)  # bwrap reads the program from this fd
    try:
        run_checked([bwrap, *SECCOMP_FLAGS, str(fd), *argv], pass_fds=(fd,), **popen)
    finally:
        os.close(fd)


def _bwrap_like_nsbox(bwrap: str) -> Method:
    """bwrap plus what nsbox adds by default: its seccomp program and no capabilities."""
    blob = _seccomp_blob()
    return Method("bwrap+seccomp", "bwrap " + " ".join(SECCOMP_FLAGS) + " FD ARGV  (FD: nsbox's "
                  "BPF)", lambda argv: _bwrap_seccomp(bwrap, blob, argv),
                  "as bwrap, plus nsbox's seccomp program and all capabilities dropped",
                  close=lambda: os.unlink(blob))


def _bwrap_in_cgroup(bwrap: str, skipped: dict[str, str]) -> Method | None:
    """bwrap+seccomp in a fresh cgroup with the default policy's memory and pids limits, made
    by the caller (bench/cgroup_peer.py): the work of nsbox's default policy."""
    from nsbox.bench import cgroup_peer

    found = cgroup_peer.bases()
    if isinstance(found, str):
        skipped["bwrap+seccomp+cgroup"] = found
        return None
    version, bases = found
    blob = _seccomp_blob()

    def run(argv: list[str]) -> None:
        cgroup_peer.in_fresh_cgroup(version, bases, lambda attach: _bwrap_seccomp(
            bwrap, blob, argv, preexec_fn=attach))

    limits = nsbox.Policy().limits
    return Method("bwrap+seccomp+cgroup",
                  f"mkdir a cgroup ({version}) below ours in {sorted(set(bases.values()))}, "
                  f"write memory {limits.memory} (no swap) and pids {limits.pids}, "
                  "subprocess.run(bwrap+seccomp ..., preexec_fn=<write own pid to "
                  "cgroup.procs>), rmdir", run,
                  "as bwrap+seccomp, in a cgroup of its own with the default policy's memory "
                  "and pids limits", close=lambda: os.unlink(blob))


def _crun(skipped: dict[str, str]) -> Method | None:
    crun = shutil.which("crun")
    if not crun:
        skipped["crun"] = "crun not installed"
        return None
    bundle = tempfile.mkdtemp(prefix="nsbox-bench-crun-")
    os.makedirs(os.path.join(bundle, "rootfs", "usr"))
    os.makedirs(os.path.join(bundle, "rootfs", "etc"))
    for name in ("bin", "lib", "lib64", "sbin"):
        os.symlink(f"usr/{name}", os.path.join(bundle, "rootfs", name))
    spec = subprocess.run([crun, "spec", "--rootless"], cwd=bundle, capture_output=True)
    if spec.returncode != 0:
        shutil.rmtree(bundle)
        skipped["crun"] = f"crun spec failed: {spec.stderr.decode().strip()[:200]}"
        return None
    import json

    path = os.path.join(bundle, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["process"]["terminal"] = False
    config["root"]["readonly"] = True
    config["mounts"] += [
        {"destination": "/usr", "type": "bind", "source": "/usr",
         "options": ["rbind", "ro"]},
        {"destination": "/etc", "type": "bind", "source": "/etc", "options": ["rbind", "ro"]},
    ]
    config["linux"].pop("resources", None)
    with open(path, "w") as f:
        json.dump(config, f)
    counter = iter(range(1 << 30))

    def run(argv: list[str]) -> None:
        with open(path) as f:
            current = json.load(f)
        if current["process"]["args"] != argv:
            current["process"]["args"] = argv
            with open(path, "w") as f:
                json.dump(current, f)
        name = f"nsbox-bench-{os.getpid()}-{next(counter)}"
        run_checked([crun, "--cgroup-manager=disabled", "run", "-b", bundle, name],
                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    try:
        run(["/bin/true"])
    except RuntimeError:
        probe = subprocess.run([crun, "--cgroup-manager=disabled", "run", "-b", bundle,
                                "nsbox-bench-probe"], capture_output=True)
        shutil.rmtree(bundle)
        skipped["crun"] = ("crun fails on this host: "
                           + probe.stderr.decode().strip().splitlines()[-1][:200]
                           if probe.stderr else "crun fails on this host")
        return None
    return Method("crun", f"crun --cgroup-manager=disabled run -b BUNDLE ID ({path})", run,
                  "user, mnt, pid, net, ipc, uts; ro root + /usr, /etc binds; no seccomp",
                  close=lambda: shutil.rmtree(bundle, ignore_errors=True))


def nsbox_methods(pool_size: int) -> list[Method]:
    def cold(argv: list[str]) -> None:
        # A fresh Policy and plan per call; the helper process is warm (started by the warm-up
        # call), nothing is prepared ahead: every namespace, mount, the seccomp load and the
        # limits happen inside this call.
        _ok(nsbox.run(argv, nsbox.Policy()))

    def by_helper(argv: list[str]) -> None:
        # The same launch through the Python launch helper instead of the launch engine
        # (NSBOX_ENGINE=0, read per launch): the two side by side in one run.
        before = os.environ.get("NSBOX_ENGINE")
        os.environ["NSBOX_ENGINE"] = "0"
        try:
            _ok(nsbox.run(argv, nsbox.Policy()))
        finally:
            if before is None:
                os.environ.pop("NSBOX_ENGINE", None)
            else:
                os.environ["NSBOX_ENGINE"] = before

    # Limits switched off: no cgroup at all (memory, pids and the CPU-time accounting are what
    # make one), the same isolation work as bwrap+seccomp.
    unlimited = nsbox.Policy().with_limits(memory=None, pids=None, cpu_time=None)

    def no_limits(argv: list[str]) -> None:
        _ok(nsbox.run(argv, unlimited))

    # Made on first use: a method picked by name alone (bench/meter.py) starts no pool.
    pools: list[nsbox.Pool] = []

    def pooled(argv: list[str]) -> None:
        if not pools:
            pools.append(nsbox.Pool(nsbox.Policy(), size=pool_size))
        _ok(pools[0].run(argv))

    def refill() -> None:
        if pools:
            pools[0].wait_ready()

    def close_pool() -> None:
        if pools:
            pools.pop().close()

    cli = _nsbox_cli()
    methods = [
        Method("nsbox API cold", "nsbox.run(argv, nsbox.Policy())  # helper warm, nothing "
               "prepared", cold, "all namespaces, tmpfs root, /proc, /dev, seccomp, the policy's "
               "limits, no capabilities"),
        Method("nsbox API cold, Python helper", "NSBOX_ENGINE=0: nsbox.run(argv, "
               "nsbox.Policy())  # the Python launch helper instead of the engine", by_helper,
               "as nsbox API cold"),
        Method("nsbox API no limits", "nsbox.run(argv, nsbox.Policy().with_limits(memory=None, "
               "pids=None, cpu_time=None))  # helper warm", no_limits,
               "as nsbox API cold, without a cgroup (no memory, pids or CPU-time limit)"),
        Method("nsbox pool", f"nsbox.Pool(nsbox.Policy(), size={pool_size}).run(argv)  "
               "# measured with the pool refilled (wait_ready, untimed)",
               pooled, "as nsbox API cold", close=close_pool, after=refill),
        Method("nsbox CLI", " ".join(cli) + " -- ARGV", _wrap([*cli, "--"]),
               "as nsbox API cold, as a whole process: the installed command"),
        Method("nsbox CLI -I -S", " ".join(LEAN_CLI) + " ARGV", _wrap(LEAN_CLI),
               "the same command, without site-packages: what a '#!/usr/bin/python3 -I -S' "
               "launcher script costs"),
    ]
    return methods


def by_name(name: str, pool_size: int = 2) -> Method:
    """The one method called ``name`` (the others made for it are closed again); KeyError if
    there is none here."""
    skipped: dict[str, str] = {}
    found = None
    for method in [*peers(skipped), *nsbox_methods(pool_size)]:
        if method.name == name and found is None:
            found = method
        else:
            method.close()
    if found is None:
        raise KeyError(f"{name}: {skipped.get(name, 'no such launcher')}")
    return found


def _lean_paths() -> list[str]:
    """The package, and cgroupspy (the cgroup v1 backend) as the helper gets it."""
    from nsbox import cgroups

    return [os.path.dirname(os.path.dirname(os.path.abspath(nsbox.__file__))),
            *cgroups.helper_paths()]


LEAN_CLI = [sys.executable, "-I", "-S", "-c",
            f"import sys; sys.path[:0] = {_lean_paths()!r}; sys.argv[0] = 'nsbox'; "
            "from nsbox.cli.fast import main; main()", "run", "--"]


def _nsbox_cli() -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), "nsbox")
    if os.path.exists(script):
        return [script, "run"]
    return [sys.executable, "-m", "nsbox", "run"]
