"""The layers stay plain: core imports torch only, reporting imports neither the engine nor
Lightning, and ``from lightning_pin import pin`` loads no Lightning (checked in fresh processes)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_pin"
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities")


def _imports(folder: str) -> dict[str, set[str]]:
    """Top-level and dotted module names each file of ``folder`` imports (lazy imports included)."""
    found = {}
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        found[str(path.relative_to(PACKAGE))] = names
    return found


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [
        ("core", LIGHTNING + ("hydra", "omegaconf", "torchmetrics", "lightning_pin.callbacks", "lightning_pin.app",
                              "lightning_pin.reporting")),
        ("reporting", LIGHTNING + ("hydra", "lightning_pin.core.engine", "lightning_pin.core.plan",
                                   "lightning_pin.callbacks", "lightning_pin.app")),
        ("callbacks", ("hydra", "omegaconf", "lightning_pin.app")),
        # Task ownership sits on core too: torch only.
        ("tasks", LIGHTNING + ("hydra", "omegaconf", "torchmetrics", "lightning_pin.callbacks", "lightning_pin.app",
                               "lightning_pin.reporting")),
        # The fault generators sit on core: torch only, usable from plain loops.
        ("faults", LIGHTNING + ("hydra", "omegaconf", "torchmetrics", "lightning_pin.callbacks", "lightning_pin.app",
                                "lightning_pin.reporting")),
        # Deployment sits on core and faults: torch only (torchao / onnx inside the functions that need them).
        ("deploy", LIGHTNING + ("hydra", "omegaconf", "torchmetrics", "lightning_pin.callbacks", "lightning_pin.app",
                                "lightning_pin.reporting")),
    ],
)
def test_layer_imports_nothing_above_it(folder, forbidden):
    offending = {
        file: sorted(n for n in names if any(n == f or n.startswith(f + ".") for f in forbidden))
        for file, names in _imports(folder).items()
    }
    assert {f: n for f, n in offending.items() if n} == {}


def _modules_after(statement: str) -> list[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return out.split()


def test_front_door_imports_no_lightning():
    loaded = _modules_after("from lightning_pin import pin, PinHandle, Pin, PinError")
    assert [m for m in loaded if m.split(".")[0] in LIGHTNING + ("hydra", "torchmetrics")] == []
    # Nor torch's DTensor (seconds of import, sympy included): only sharded training needs it.
    assert [m for m in loaded if m.startswith("torch.distributed.tensor") or m == "sympy"] == []


def _runtime_imports(path: Path) -> set[str]:
    """Modules a file imports when it runs: every import but those under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    hints = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
        for inner in ast.walk(node)
    }
    names = set()
    for node in ast.walk(tree):
        if id(node) in hints:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_kinds_import_nothing_reporting_may_not():
    # check / diff (reporting) compare stored tensors by asking the kinds (core/kinds), so the
    # kinds may import neither the plan nor the engine (nor what sits on them), hints aside.
    above = ("lightning_pin.core.plan", "lightning_pin.core.engine", "lightning_pin.core.handle",
             "lightning_pin.core.buffers", "lightning_pin.core.compiled_step", "lightning_pin.callbacks",
             "lightning_pin.app", "lightning_pin.reporting", *LIGHTNING)
    offending = {
        str(path.relative_to(PACKAGE)): sorted(n for n in _runtime_imports(path) if any(n == f or n.startswith(f + ".")
                                                                                        for f in above))
        for path in sorted((PACKAGE / "core" / "kinds").rglob("*.py"))
    }
    assert offending and {f: n for f, n in offending.items() if n} == {}


def test_lightning_layer_loads_on_first_use():
    loaded = _modules_after("from lightning_pin import PinCallback, PinMonitor")
    assert "lightning.pytorch" in loaded and "lightning_pin.callbacks.pin_callback" in loaded
