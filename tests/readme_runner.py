"""Runs README blocks for tests/test_readme.py, each in a process of its own, without paying for
torch's and Lightning's imports every time: this process imports them once, then forks one child per
block. The child starts from module state where nothing but those libraries was imported, and runs
the block as a script (``runpy``, fresh globals: a block still needs its own imports), in its own
directory, with its output in files there and an alarm as its timeout.

Protocol: one JSON line per block on stdin (``{"script", "cwd", "timeout"}``), one JSON line back
on stdout (``{"status"}``: the child's exit status; negative: killed by that signal, -14 the alarm).
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import traceback

import lightning  # noqa: F401  (the point: imported once, before the forks)
import torch  # noqa: F401

import lightning_pin  # noqa: F401
import lightning_pin.callbacks  # noqa: F401


def run_child(script: str, cwd: str, timeout: int) -> None:
    os.chdir(cwd)
    for fd, name in ((1, "stdout.txt"), (2, "stderr.txt")):
        os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    sys.argv = [script]
    sys.path.insert(0, cwd)
    signal.alarm(timeout)
    status = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def main() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run_child(request["script"], request["cwd"], int(request["timeout"]))
        _, wait_status = os.waitpid(pid, 0)
        status = os.waitstatus_to_exitcode(wait_status)
        print(json.dumps({"status": status}), flush=True)


if __name__ == "__main__":
    main()
