"""Run at start-up by every interpreter that the tests start (app and CLI commands, DDP and FSDP2 ranks, the
benchmarks' processes, the launchers' workers), never by a test process itself: tests/conftest.py puts this
directory on the ``PYTHONPATH`` of the whole run, and the xdist workers (the main process's direct children, named
by ``LIGHTNING_PIN_TESTS_FULL_IMPORTS_PARENT``) skip what follows.

Lightning imports torchmetrics, and torchmetrics imports transformers (for BERTScore), scipy.signal (for its
audio metrics) and matplotlib (for Metric.plot) whenever they are installed: about 2 s of CPU in every such
process, for metrics and plots none of them uses. Here torchmetrics skips those imports: its own flags for the
packages read False. Nothing else changes: the packages stay importable (lightning_pin's figures import
matplotlib themselves), and lightning_pin's code is the same as in any other process.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

#: torchmetrics' availability flags that gate the imports of transformers, scipy.signal and matplotlib
#: (torchmetrics 1.x).
_FLAGS = ("_TRANSFORMERS_GREATER_EQUAL_4_4", "_SCIPI_AVAILABLE", "_MATPLOTLIB_AVAILABLE")


def _run_torchmetrics(run):
    def exec_module(module):
        # torchmetrics/__init__.py: `if package_available("scipy"): import scipy.signal`
        import lightning_utilities.core.imports as imports

        real = imports.package_available
        imports.package_available = lambda name: name != "scipy" and real(name)
        try:
            run(module)
        finally:
            imports.package_available = real

    return exec_module


def _run_flags(run):
    def exec_module(module):
        run(module)
        for flag in _FLAGS:
            if hasattr(module, flag):
                setattr(module, flag, False)

    return exec_module


class _LeanTorchmetrics(importlib.abc.MetaPathFinder):
    wraps = {"torchmetrics": _run_torchmetrics, "torchmetrics.utilities.imports": _run_flags}

    def find_spec(self, name, path, target=None):
        wrap = self.wraps.get(name)
        if wrap is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader.exec_module = wrap(spec.loader.exec_module)
        return spec


# The xdist workers are the main test process's direct children: they run the tests and import in full.
_TEST_PROCESS = os.environ.get("LIGHTNING_PIN_TESTS_FULL_IMPORTS_PARENT") == str(os.getppid())
if not _TEST_PROCESS:
    sys.meta_path.insert(0, _LeanTorchmetrics())


def _collect_after_start_up() -> None:
    """A spawned process (a DDP rank, a launcher's worker) imports torch and Lightning while unpickling its
    target; the collector's passes over those ~400k new objects cost it 0.5-0.8 CPU s (measured). Collection
    stays off until the target runs, then the start-up's objects are frozen out of every later pass."""
    import gc
    from multiprocessing import process

    bootstrap = process.BaseProcess._bootstrap

    def _bootstrap(self, *args, **kwargs):
        gc.freeze()
        gc.enable()
        return bootstrap(self, *args, **kwargs)

    gc.disable()
    process.BaseProcess._bootstrap = _bootstrap


if not _TEST_PROCESS and "--multiprocessing-fork" in getattr(sys, "orig_argv", ()):
    _collect_after_start_up()
