"""The filter in front of the set-id filter: EPERM, not EINVAL, for another id, in every door
(nsbox/host/idfilter.py). tests/test_compatibility.py shows the difference that is left."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
from conftest import require
from sessiontools import UserRunner, user_runner

from nsbox.host import idfilter


@pytest.fixture(params=["caller", "unprivileged"])
def user(request: pytest.FixtureRequest, public_tree: Path) -> UserRunner:
    return user_runner(request, public_tree)


PROBE = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def errno_of(call):
    try:
        call()
        return 0
    except OSError as exc:
        return exc.errno
open("/tmp/f", "w").close()
chown = {"x86_64": 92}.get(os.uname().machine)
print(errno_of(lambda: os.setuid(0)), errno_of(lambda: os.setgid(65534)),
      errno_of(lambda: os.chown("/tmp/f", 0, -1)), errno_of(lambda: os.chown("/tmp/f", -1, 0)),
      errno_of(lambda: os.chown("/tmp/f", os.getuid(), os.getgid())),
      errno_of(lambda: os.setreuid(-1, os.getuid())),
      # an id with its upper half set goes to the kernel, which reads 32 bits: unmapped
      libc.syscall(chown, b"/tmp/f", ctypes.c_long(1 << 32), ctypes.c_long(-1)) == -1
      and ctypes.get_errno() if chown else 22)
"""


def test_another_id_is_eperm_in_run_session_and_pool(user: UserRunner) -> None:
    require(idfilter.prefix(1000, 1000) != b"", f"no id filter for {platform.machine()}")
    out = user.script(f"""
probe = ["python3", "-c", {PROBE!r}]
with nsbox.Session() as s:
    session = s.run(probe).stdout.decode()
with nsbox.Pool(size=1) as p:
    pool = p.run(probe).stdout.decode()
other = nsbox.run(probe, nsbox.Policy().replace(uid=2000, gid=2000)).stdout.decode()
emit(run=nsbox.run(probe).stdout.decode(), session=session, pool=pool, other=other)
""")
    expected = "1 1 1 1 0 0 22\n"
    assert out == {"run": expected, "session": expected, "pool": expected, "other": expected}


def test_the_prefix_is_empty_where_the_numbers_are_unknown() -> None:
    assert idfilter.prefix(1000, 1000, "riscv64") == b""
    code = idfilter.prefix(1000, 1000, "x86_64")
    assert len(code) % 8 == 0 and len(code) // 8 < 255  # short jumps reach the end
