"""CPython's own tests of what used to differ, run inside nsbox (Debian's
libpython3.11-testsuite, installed by .ci/run). tools/cpython_tests.py runs the whole OS-facing
set against the host; docs/compatibility.md has its figures."""

from __future__ import annotations

import subprocess

import pytest
from conftest import PYTHON, Runner, require

from nsbox.result import Status

# (module, tests): each failed inside before its cause was fixed (docs/compatibility.md).
CASES = [
    ("test_subprocess", ["test_user", "test_group"]),  # EINVAL for an unmapped id
    ("test_os", ["test_chown_without_permission"]),  # the same, through chown
    ("test_resource", ["test_fsize_ismax", "test_setrusage_refcount"]),  # limits lifted
    ("test_epoll", ["test_add", "test_control_and_wait"]),  # loopback
]


def _have_test_suite() -> bool:
    done = subprocess.run([PYTHON, "-c", "import test.test_subprocess"], capture_output=True)
    return done.returncode == 0


@pytest.mark.parametrize(("module", "tests"), CASES, ids=[c[0] for c in CASES])
def test_cpython_tests_that_differed_pass_inside(sandbox: Runner, module: str,
                                                 tests: list[str]) -> None:
    require(_have_test_suite(), "CPython's test package is missing "
            "(apt-get install libpython3.11-testsuite)")
    selected = [arg for name in tests for arg in ("-m", name)]
    result = sandbox.run(
        [PYTHON, "-m", "test", "-v", module, *selected], timeout=300,
        # As tools/cpython_tests.py runs the suite: loopback, no CPU-time or file-size limit.
        policy_changes={"network": {"mode": "loopback"}},
        limit_changes={"cpu_time": None, "file_size": None, "wall_time": 300})
    out = result.stdout.decode(errors="replace")
    assert result.status is Status.OK, out[-3000:] + result.stderr.decode()[-2000:]
    assert "Tests result: SUCCESS" in out
    for name in tests:
        assert f"{name} (" in out and "skipped" not in out.split(f"{name} (", 1)[1][:200]
