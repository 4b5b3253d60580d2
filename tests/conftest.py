import gc
import os
import platform
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

# Before torch is imported, so before torch._inductor.config reads it: inductor compiles each graph's C++ in this
# process instead of starting a pool of compile workers (a sidecar interpreter and its workers). On 2 cores the
# pool's start-up costs more than its parallel compiles save (the compile_step docs block, cold, on a loaded
# machine: 28 s wall instead of 54 s; idle, about the same). The processes the tests start (ranks, doc-block
# runners, app runs) inherit it.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def _compiler_builds_every_vec_isa() -> bool:
    """Whether g++ (inductor's compiler on Linux, CXX unset) is 11 or newer: it has the intrinsics of every vector
    ISA inductor picks on x86-64 (AVX2, AVX-512, VNNI, AMX since GCC 11)."""
    if sys.platform != "linux" or platform.machine() != "x86_64" or os.environ.get("CXX"):
        return False
    compiler = shutil.which("g++")
    try:
        done = subprocess.run([compiler, "-dumpversion"], capture_output=True, text=True, timeout=30)
        return int(done.stdout.split(".")[0]) >= 11
    except (TypeError, OSError, ValueError, subprocess.SubprocessError):
        return False


# Inductor's first compile with an empty cache (a new user's) otherwise builds a test program per vector ISA the
# CPU has and dlopens each in a fresh interpreter, to pick the widest the compiler builds: about 10 CPU s here
# (three builds of ATen's vector headers). Where the compiler builds them all, the pick is the same without the
# test (the first the CPU reports) and so is every kernel inductor writes (the same code hashes, checked). Set
# TORCHINDUCTOR_VEC_ISA_OK yourself to override.
if _compiler_builds_every_vec_isa():
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

# Collection imports every test module, torch, Lightning and the rest: the collector's passes over those objects
# while they are made cost about 4.5 CPU s a worker (19 against 14.5 s to collect the suite). It runs again once
# they are all made (_collect_from_now_on).
gc.disable()
import torch  # noqa: E402

# The start-up file of the interpreters the tests start (see LEAN_IMPORTS below): not a test module, and never
# imported by a test process.
collect_ignore = ["lean_imports"]

# Tiny models on 2-core machines run far faster single-threaded.
torch.set_num_threads(1)
os.environ.setdefault("PL_DISABLE_FORK", "1")
warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*GPU available but not used.*")


def _collect_from_now_on() -> None:
    """The imports' hundreds of thousands of objects live as long as the worker. Move them out of the collector's
    generations once, so that a full collection (Python's own, and the gc.collect() that torch.onnx and the
    benchmarks call) scans only what the tests made since: such a collection took seconds on a loaded 2-core
    machine."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def pytest_collection_finish(session):
    _collect_from_now_on()


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    _collect_from_now_on()  # xdist's main process collects nothing


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """A module whose tests share a module-scoped fixture (one training run, one docs build, one spawn) runs on
    one worker under ``--dist loadgroup``, as if marked ``xdist_group(<module>)``: spread over two workers, each
    would pay the run. Its tests still run next to every other test of the suite."""
    for item in items:
        if next(item.iter_markers("xdist_group"), None) is not None:
            continue
        module = item.nodeid.split("::")[0]
        info = getattr(item, "_fixtureinfo", None)
        shared = (
            definition.baseid == module and definition.scope in ("module", "class")
            for definitions in (info.name2fixturedefs.values() if info is not None else ())
            for definition in definitions
        )
        if any(shared):
            item.add_marker(pytest.mark.xdist_group(module))


class _GroupSuffix:
    """``--dist loadgroup`` sends the tests of one ``xdist_group`` to one worker by the ``@group`` suffix that
    pytest-xdist's worker appends to their node ids. From pytest 9.2 on a node keeps its id in ``_id`` and xdist
    (3.8) still writes ``_nodeid``: the suffix is lost, the group's tests spread over the workers, and each worker
    pays the module-scoped runs again (a second ddp_spawn, FSDP2 run or inductor warm-up). Appended here, after
    xdist's own hook, where xdist could not."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        if not getattr(config.option, "loadgroup", False):
            return
        for item in items:
            marks = item.iter_markers("xdist_group")
            names = {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in marks}
            suffix = "@" + "_".join(sorted(names))
            if names and not item.nodeid.endswith(suffix) and hasattr(item, "_id"):
                item._id = type(item._id).parse(item.nodeid + suffix)


def pytest_configure(config):
    config.pluginmanager.register(_GroupSuffix(), "lightning_pin_group_suffix")
    _lean_children(config)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


#: On the PYTHONPATH of every interpreter the tests start: its torchmetrics skips transformers, scipy.signal and
#: matplotlib (tests/lean_imports/sitecustomize.py).
LEAN_IMPORTS = Path(__file__).with_name("lean_imports")
#: The pid whose direct children import in full: the xdist workers, which run the tests themselves.
FULL_IMPORTS_PARENT = "LIGHTNING_PIN_TESTS_FULL_IMPORTS_PARENT"


def _lean_children(config) -> None:
    """Every interpreter the tests start (an app or CLI command, a DDP rank, a launcher's worker, a doc block's
    runner) imports Lightning without the transformers, scipy.signal and matplotlib that torchmetrics imports for
    metrics none of them uses: about 2-3.5 CPU s less each, over a hundred of them a run. The test processes
    themselves import in full, as a user's does: this process started before, and the xdist workers it starts
    are its direct children, which the start-up file leaves alone."""
    if hasattr(config, "workerinput"):  # an xdist worker: the environment came from the main process
        return
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(LEAN_IMPORTS), os.environ.get("PYTHONPATH")]))
    if getattr(config.option, "numprocesses", None):
        os.environ[FULL_IMPORTS_PARENT] = str(os.getpid())


@pytest.fixture(scope="session")
def fork_runner():
    """Runs ``python -m ...`` / ``python script.py`` commands in processes forked from one that imported torch,
    Lightning and Hydra once (tests/fork_runner.py): a subprocess without seconds of imports each time."""
    from fork_runner import ForkRunner

    runner = ForkRunner()
    yield runner
    runner.close()
