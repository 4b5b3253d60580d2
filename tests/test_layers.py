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


# ------------------------------------------------------------------------------------------------
# Layers inside core/: each module imports only modules of its own layer or below.

#: core/'s layers, lowest first. The spec, the kinds, the plan and the saved state form one layer:
#: Pin's checks and the plan's resolution ask the kinds, and the kinds build Pins and saved
#: selections (see _HIDDEN for the imports that carry that circle). Everything that executes the
#: pins sits above them; the front door on top.
CORE_LAYERS = [
    {"errors", "bitwords", "io", "backward_end"},
    {"sharding", "layouts", "modules"},
    {"kinds", "spec", "plan", "state"},
    {"parking", "buffers", "engine", "compiled_step"},
    {"driver", "handle"},
]

#: The function-local imports of lightning_pin allowed inside core/: each breaks the one import
#: circle left (spec <-> kinds, kinds -> state -> kinds), module -> what it imports locally.
#: A new hidden import fails the test: import at the top, or move the code to its layer.
_HIDDEN = {
    "spec": {"lightning_pin.core.kinds", "lightning_pin.core.kinds.quant_code"},
    "kinds/base": {"lightning_pin.core.spec", "lightning_pin.core.state"},
    "kinds/value": {"lightning_pin.core.state"},
    "kinds/interval": {"lightning_pin.core.spec"},
    "kinds/stuck_bits": {"lightning_pin.core.kinds.base"},
    "kinds/quant_code": {"lightning_pin.core.spec", "lightning_pin.core.state", "lightning_pin.core.kinds.base"},
}


def _core_module(dotted: str) -> str | None:
    """``lightning_pin.core.kinds.value`` -> ``kinds``; ``lightning_pin.core.engine`` -> ``engine``."""
    parts = dotted.split(".")
    return parts[2] if parts[:2] == ["lightning_pin", "core"] and len(parts) > 2 else None


def _layer(module: str) -> int:
    return next(i for i, layer in enumerate(CORE_LAYERS) if module in layer)


def _core_imports() -> dict[str, tuple[set[str], set[str]]]:
    """Per core file (``kinds/value``): (lightning_pin modules imported at module level, locally).
    Imports under ``if TYPE_CHECKING:`` are for annotations only and not counted."""
    found = {}
    for path in sorted((PACKAGE / "core").rglob("*.py")):
        top, local = set(), set()

        def visit(node, in_function):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                    continue
                if isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                    if child.module == "lightning_pin.core":  # from lightning_pin.core import kinds
                        (local if in_function else top).update(f"{child.module}.{a.name}" for a in child.names)
                    elif child.module.startswith("lightning_pin"):
                        (local if in_function else top).add(child.module)
                elif isinstance(child, ast.Import):
                    names = {a.name for a in child.names if a.name.startswith("lightning_pin")}
                    (local if in_function else top).update(names)
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        visit(ast.parse(path.read_text()), False)
        name = str(path.relative_to(PACKAGE / "core").with_suffix("")).removesuffix("/__init__")
        found[name] = (top, local)
    return found


def test_core_modules_import_only_their_layer_and_below():
    imports = _core_imports()
    unplaced = sorted({n.split("/")[0] for n in imports if n != "__init__"} - set().union(*CORE_LAYERS))
    assert not unplaced, f"core modules in no layer of CORE_LAYERS: {unplaced}"
    upward = {}
    for name, (top, local) in imports.items():
        if name == "__init__":
            continue
        mine = _layer(name.split("/")[0])
        above = sorted(m for m in top | local if (c := _core_module(m)) is not None and _layer(c) > mine)
        if above:
            upward[name] = above
    assert upward == {}


def test_core_has_no_hidden_imports_but_the_listed_ones():
    hidden = {name: local for name, (_, local) in _core_imports().items() if local}
    assert hidden == _HIDDEN


def test_the_layer_reader_sees_upward_and_hidden_imports(tmp_path, monkeypatch):
    core = tmp_path / "core"
    (core / "kinds").mkdir(parents=True)
    (core / "sharding.py").write_text("from lightning_pin.core.engine import PinEngine\n")
    (core / "kinds" / "value.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lightning_pin.core.engine import X\n"
        "def f():\n    from lightning_pin.core import spec\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path)
    assert _core_imports() == {
        "sharding": ({"lightning_pin.core.engine"}, set()),
        "kinds/value": (set(), {"lightning_pin.core.spec"}),
    }
    with pytest.raises(AssertionError):
        test_core_modules_import_only_their_layer_and_below()
    with pytest.raises(AssertionError):
        test_core_has_no_hidden_imports_but_the_listed_ones()


# ------------------------------------------------------------------------------------------------
# Public names on purpose


def _bound_names(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level (definitions, assignments, imports, try/if branches)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node in tree.body:
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def test_every_module_says_what_it_exports_and_binds_it():
    missing, unbound = [], {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        declared = [
            node.value for node in tree.body
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets)
        ]
        name = str(path.relative_to(PACKAGE))
        if not declared:
            missing.append(name)
            continue
        exported = ast.literal_eval(declared[0])
        lazy = {"PinCallback", "PinMonitor"} if name == "__init__.py" else set()  # module __getattr__
        absent = sorted(set(exported) - _bound_names(tree) - lazy)
        if absent:
            unbound[name] = absent
    assert missing == [] and unbound == {}


def test_the_package_exports_the_documented_api_and_nothing_else():
    code = (
        "import types, lightning_pin as lp; print(' '.join(sorted(n for n, v in vars(lp).items() "
        "if not n.startswith('_') and not isinstance(v, types.ModuleType)))); print(' '.join(sorted(lp.__all__)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    names, exported = out.split("\n")[:2]
    # PinCallback and PinMonitor load on first use (the Lightning layer): exported, not yet bound.
    assert set(names.split()) | {"PinCallback", "PinMonitor"} == set(exported.split()) == {
        "AccuracyGapError", "NeuronPin", "Pin", "PinCallback", "PinError", "PinHandle", "PinMonitor", "QuantCode", "pin",
    }


@pytest.mark.parametrize(
    "statement", ["import lightning_pin", "from lightning_pin import PinCallback, pin, Pin"]
)
def test_the_package_imports_neither_hydra_nor_omegaconf(statement):
    loaded = _modules_after(statement)
    assert "torch" in loaded  # the reader sees what was imported (it can fail)
    assert [m for m in loaded if m.split(".")[0] in ("hydra", "omegaconf")] == []
