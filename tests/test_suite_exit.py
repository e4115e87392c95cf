"""The test process's own exit (tests/conftest.py: ``pytest_unconfigure``) keeps pytest's status and
still runs the exit handlers: a suite whose process skips the interpreter's teardown must not turn a
failure into a green CI, nor lose what an exit handler writes."""
import subprocess
import sys
import textwrap

import pytest

from tests.runs import REPO


def pytest_with_this_conftest(tmp_path, test_file: str) -> subprocess.CompletedProcess:
    """``pytest -q tmp_path/test_file`` in a process of its own, with tests/conftest.py as a plugin."""
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "--rootdir", str(tmp_path),
                           "-p", "no:cacheprovider", str(tmp_path / test_file)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("body, status", [("assert True", 0), ("assert 1 == 2", 1)])
def test_the_suite_exits_with_pytest_status_after_running_the_exit_handlers(tmp_path, body, status):
    marker = tmp_path / "exit-handler-ran"
    (tmp_path / "test_one.py").write_text(textwrap.dedent(f"""
        import atexit
        import pathlib

        def test_one():
            atexit.register(pathlib.Path({str(marker)!r}).write_text, "yes")
            {body}
    """))
    run = pytest_with_this_conftest(tmp_path, "test_one.py")
    assert run.returncode == status, run.stdout[-2000:] + run.stderr[-2000:]
    assert ("1 passed" if status == 0 else "1 failed") in run.stdout, run.stdout[-2000:]
    assert marker.read_text() == "yes", "the exit handlers did not run"


def test_a_run_that_collects_nothing_keeps_pytest_status(tmp_path):
    run = pytest_with_this_conftest(tmp_path, "test_missing.py")
    assert run.returncode == 4, run.stdout[-2000:] + run.stderr[-2000:]  # pytest's usage error
