"""Run ``python -m module ...`` or ``python script.py ...`` the way a user does, in a process of its own, without
paying for torch's, Lightning's and Hydra's imports (seconds each time) at every run.

A server process imports them once, then forks one child per command. The child starts from module state where
nothing but those libraries was imported, takes the command's working directory, environment and arguments, runs
the module or script as ``__main__`` (``runpy``: the same ``sys.argv``, ``sys.path[0]`` and ``__main__`` module as
the interpreter would set up, so ``ddp_spawn`` and joblib workers import it as they would), writes its output to
files and exits with the command's status; an alarm is its timeout. What still needs a truly fresh interpreter
(hash seeds, the set of modules an import loads, the installed console script) keeps a real subprocess.

The tests use the session fixture ``fork_runner`` (tests/conftest.py): ``fork_runner.run(args, cwd=..., env=...,
timeout=...)`` returns a :class:`subprocess.CompletedProcess`, as :func:`subprocess.run` with ``capture_output=True,
text=True`` does (``returncode`` -14 when the alarm killed it).

Protocol: one JSON line per command on stdin (``{"argv", "cwd", "env", "timeout", "out", "err"}``), one JSON line
back on stdout (``{"status"}``: the child's exit status; negative: killed by that signal).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]


def _child(request: dict) -> None:
    import atexit
    import runpy
    import signal
    import threading
    import traceback

    os.chdir(request["cwd"])
    if request["env"] is not None:
        os.environ.clear()
        os.environ.update(request["env"])
    stdin = os.open(os.devnull, os.O_RDONLY)  # the server's stdin carries the protocol: not the command's
    os.dup2(stdin, 0)
    for fd, name in ((1, request["out"]), (2, request["err"])):
        os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    sys.stdin = open(0, closefd=False)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    signal.alarm(int(request["timeout"]))
    args = request["argv"][1:]  # argv[0] is the interpreter
    status = 0
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]  # runpy sets argv[0] to the module's file, as python -m does
            sys.path.insert(0, os.getcwd())
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(args[0])
            sys.argv = list(args)
            sys.path.insert(0, os.path.dirname(script))
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if not isinstance(exit_.code, (int, type(None))):
            print(exit_.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        status = 1
    try:
        # What the interpreter does at exit: join the threads (the hook where concurrent.futures and joblib's loky
        # executors shut their workers down, or multiprocessing's exit function would wait for them to idle out),
        # then the atexit functions (logging's flush among them).
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def serve() -> None:
    # Imported once, before the forks: the point of this process.
    import hydra  # noqa: F401
    import lightning  # noqa: F401
    import torch  # noqa: F401

    import lightning_pin.app.train  # noqa: F401  (the app, its callbacks, reporting and torchmetrics)
    import lightning_pin.faults  # noqa: F401

    # What export (torch.onnx's exporter: about a CPU second of imports) and tune (Optuna's SQLite storage) import
    # when they run, if their extras are installed.
    for extra in ("onnx", "onnxscript", "torch.onnx._internal.exporter._core", "optuna", "sqlalchemy", "alembic"):
        try:
            importlib.import_module(extra)
        except ImportError:
            pass

    import gc

    gc.freeze()  # the imports' objects, never garbage: a child's collections skip them (and leave their pages shared)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        _, wait_status = os.waitpid(pid, 0)
        print(json.dumps({"status": os.waitstatus_to_exitcode(wait_status)}), flush=True)
    os._exit(0)  # no interpreter shutdown of everything imported above: seconds, for nothing


class ForkRunner:
    """The client: starts the server, sends it commands, reads their output back."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="fork_runner_")
        self._count = 0
        self._server: Optional[subprocess.Popen] = None
        if not hasattr(os, "fork"):  # Windows: every command in a fresh interpreter, as before
            return
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1",  # the tests' subprocesses ran with it: read when torch loads
        }
        self._server = subprocess.Popen(
            [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
        )
        ready = self._server.stdout.readline()
        assert ready, "the fork runner died while importing"

    def run(
        self, args: Sequence[str], cwd: Path | str, env: Optional[Mapping[str, str]] = None, timeout: float = 240
    ) -> subprocess.CompletedProcess:
        """``subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True)``, forked from the server.

        ``args[0]`` must be the interpreter (``sys.executable``), then ``-m module ...`` or ``script ...``.
        """
        assert args[0] == sys.executable, f"the fork runner runs Python commands only, not {args[0]!r}"
        if self._server is None:
            return subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        self._count += 1
        out, err = (os.path.join(self._dir, f"{self._count}.{name}") for name in ("out", "err"))
        request = {"argv": list(args), "cwd": str(cwd), "env": None if env is None else dict(env),
                   "timeout": max(1, round(timeout)), "out": out, "err": err}
        self._server.stdin.write(json.dumps(request) + "\n")
        self._server.stdin.flush()
        reply = self._server.stdout.readline()
        assert reply, "the fork runner died"
        texts = []
        for path in (out, err):
            with open(path, errors="replace") as file:
                texts.append(file.read())
            os.remove(path)
        return subprocess.CompletedProcess(list(args), json.loads(reply)["status"], *texts)

    def close(self) -> None:
        if self._server is not None:
            self._server.stdin.close()
            self._server.wait(timeout=60)
        os.rmdir(self._dir)


if __name__ == "__main__":
    serve()
