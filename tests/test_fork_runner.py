"""tests/fork_runner.py behaves as ``subprocess.run`` does for the commands the tests give it."""

from __future__ import annotations

import os
import sys

import pytest

# Without fork (Windows) the runner runs each command in a fresh interpreter: subprocess.run itself.
pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the fork runner needs os.fork")


def test_a_module_runs_as_main_with_its_arguments_environment_and_directory(fork_runner, tmp_path):
    (tmp_path / "probe.py").write_text(
        "import os, sys\n"
        "if __name__ == '__main__':\n"
        "    print(sys.argv[1:], os.getcwd(), os.environ.get('PROBE'), sys.stdin.read() == '')\n"
        "    print('to stderr', file=sys.stderr)\n"
        "    sys.exit(3)\n"
    )
    env = {**os.environ, "PROBE": "yes"}
    done = fork_runner.run([sys.executable, "-m", "probe", "a", "b"], cwd=tmp_path, env=env)
    assert done.returncode == 3
    assert done.stdout == f"['a', 'b'] {tmp_path} yes True\n" and done.stderr == "to stderr\n"
    # ... the same file as a script; the environment is the server's when none is given.
    done = fork_runner.run([sys.executable, str(tmp_path / "probe.py"), "c"], cwd=tmp_path)
    assert (done.returncode, done.stdout) == (3, f"['c'] {tmp_path} None True\n")


def test_a_failure_and_a_timeout_come_back_as_their_status(fork_runner, tmp_path):
    (tmp_path / "fails.py").write_text("raise KeyError('nope')\n")
    done = fork_runner.run([sys.executable, "fails.py"], cwd=tmp_path)
    assert done.returncode == 1 and "KeyError: 'nope'" in done.stderr
    (tmp_path / "hangs.py").write_text("while True: pass\n")
    assert fork_runner.run([sys.executable, "hangs.py"], cwd=tmp_path, timeout=1).returncode == -14
    # The server survived both.
    (tmp_path / "ok.py").write_text("print('fine')\n")
    assert fork_runner.run([sys.executable, "ok.py"], cwd=tmp_path).stdout == "fine\n"
