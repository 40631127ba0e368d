"""The leak check of tests/conftest.py: it fails the test that left a process behind, once, and
the tests after it pass."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

LEAKY_MODULE = textwrap.dedent("""
    import subprocess, sys, time

    KEPT = []  # so that no Popen finalizer reaps them before the check looks

    def test_leaves_a_sleeping_child():
        KEPT.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))

    def test_leaves_a_killed_child_unwaited():
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        proc.kill()
        time.sleep(0.5)  # a zombie by now
        KEPT.append(proc)

    def test_after_them():
        pass

    def test_last():
        assert all(p.wait(timeout=5) is not None for p in KEPT)  # reaped already: no hang
""")


@pytest.mark.processes  # a pytest process of its own, whose tests start children
def test_the_leak_check_names_the_leaking_test_once_and_spares_the_later_ones(tmp_path):
    (tmp_path / "conftest.py").write_text("from tests.conftest import no_leaks  # noqa: F401\n")
    (tmp_path / "test_leaky.py").write_text(LEAKY_MODULE)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rE", "-p", "no:cacheprovider", "-p", "no:randomly", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    out = proc.stdout + proc.stderr
    # Each leaking test fails once, at its teardown, naming what it left; the later tests pass.
    assert out.count("ERROR at teardown of") == 2, out
    first = out.index("ERROR at teardown of test_leaves_a_sleeping_child")
    second = out.index("ERROR at teardown of test_leaves_a_killed_child_unwaited")
    assert "time.sleep(60)" in out[first:second], out
    assert "never waited for (a zombie)" in out[second:], out
    assert "4 passed, 2 errors" in out, out
