import gc
import os
import warnings

import pytest
import torch

# Tiny models on 2-core machines run far faster single-threaded.
torch.set_num_threads(1)
os.environ.setdefault("PL_DISABLE_FORK", "1")
warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*GPU available but not used.*")


def pytest_collection_finish(session):
    """Every test module, torch, Lightning and the rest are imported: hundreds of thousands of objects that live
    as long as the worker. Move them out of the collector's generations once, so that a full collection (Python's
    own, and the gc.collect() that torch.onnx and the benchmarks call) scans only what the tests made since: such
    a collection took seconds on a loaded 2-core machine."""
    gc.freeze()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def fork_runner():
    """Runs ``python -m ...`` / ``python script.py`` commands in processes forked from one that imported torch,
    Lightning and Hydra once (tests/fork_runner.py): a subprocess without seconds of imports each time."""
    from fork_runner import ForkRunner

    runner = ForkRunner()
    yield runner
    runner.close()
