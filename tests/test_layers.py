"""The layers stay plain: core imports torch only, reporting imports neither the engine nor
Lightning, and ``from lightning_pin import pin`` loads no Lightning (checked in a fresh interpreter)."""

import ast
import json
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


#: What a fresh interpreter is asked to do, in this order (:func:`fresh`). Each statement imports ``lightning_pin``
#: first (a package's ``__init__`` runs before any of its names or submodules), so running them one after
#: another loads, by each one, exactly what it loads alone in a fresh interpreter, plus what the statements
#: before it loaded: the Lightning layer comes last, after every statement that must not load it.
EXPORTS = (
    "import types, lightning_pin as lp; print(' '.join(sorted(n for n, v in vars(lp).items() "
    "if not n.startswith('_') and not isinstance(v, types.ModuleType)))); print(' '.join(sorted(lp.__all__)))"
)
FRONT_DOOR = "from lightning_pin import pin, PinHandle, Pin, PinError"
REGISTRY = (
    "from lightning_pin.core.spec import Pin\nfrom lightning_pin.core.errors import PinError\n"
    "try:\n    Pin('w', bounds=(1.0, 0.0))\nexcept PinError as err:\n    print('refused', err)\n"
    "print(Pin('w', code={'bits': 4, 'scale': 0.5}, stuck_at_one=1).kind)"
)
LIGHTNING_LAYER = "from lightning_pin import PinCallback, PinMonitor"
STATEMENTS = ("import lightning_pin", EXPORTS, FRONT_DOOR, REGISTRY, "from lightning_pin import PinCallback, pin, Pin",
              LIGHTNING_LAYER)
_FRESH = """
import contextlib, io, json, sys
done = {}
for statement in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        exec(statement, {})
    done[statement] = {"modules": sorted(sys.modules), "stdout": out.getvalue()}
print(json.dumps(done))
"""


@pytest.fixture(scope="module")
def fresh() -> dict[str, dict]:
    """One fresh interpreter runs :data:`STATEMENTS` in order (seconds of torch's and Lightning's imports once, not
    per statement): per statement, the modules loaded after it and what it printed."""
    out = subprocess.run([sys.executable, "-c", _FRESH, json.dumps(STATEMENTS)], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out)


def _modules_after(fresh: dict[str, dict], statement: str) -> list[str]:
    return fresh[statement]["modules"]


def test_front_door_imports_no_lightning(fresh):
    loaded = _modules_after(fresh, FRONT_DOOR)
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


def test_lightning_layer_loads_on_first_use(fresh):
    loaded = _modules_after(fresh, LIGHTNING_LAYER)
    assert "lightning.pytorch" in loaded and "lightning_pin.callbacks.pin_callback" in loaded
    # Loaded by the first use, not before it (the statements before it loaded neither).
    before = _modules_after(fresh, REGISTRY)
    assert "lightning.pytorch" not in before and "lightning_pin.callbacks.pin_callback" not in before


# ------------------------------------------------------------------------------------------------
# Layers inside core/: each module imports only modules of its own layer or below, at its top; the
# imports form no circle, hidden or not.

#: core/'s layers, lowest first. The selection types and the spec are plain data below the kinds;
#: what they ask about the kinds (a pin's kind, its field checks, a payload field by name) they ask
#: the registry, which the kinds fill on import (core/__init__ imports them). The plan and the saved
#: state call the kinds; everything that executes the pins sits above them; the front door on top.
CORE_LAYERS = [
    {"errors", "bitwords", "io", "backward_end", "rules"},
    {"sharding", "layouts", "modules", "registry"},
    {"selection", "spec"},
    {"kinds"},
    {"plan", "state"},
    {"parking", "buffers", "engine", "compiled_step"},
    {"driver", "handle"},
]

#: The only imports inside functions in core/: packages kept lazy on purpose, with why. Anything
#: else (a module of lightning_pin above all: that is how an import circle hides) goes at the top.
LAZY_IMPORTS = {
    # DTensor: seconds of import (sympy included), and only sharded training (FSDP2, tensor
    # parallel) has DTensors; `from lightning_pin import pin` must not load it (see above).
    "torch.distributed.tensor": "sharding.local_part",
    "torch.distributed.tensor._utils": "sharding.local_part",
    "torch.distributed._tensor": "sharding.local_part (torch 2.3's name)",
    "torch.distributed._tensor._utils": "sharding.local_part (torch 2.3's name)",
    # The compiler stack: only compile_step=True needs it.
    "torch._inductor": "compiled_step._has_cxx",
    "torch._dynamo": "compiled_step._is_compile_error",
    # An optional package: only .safetensors files need it.
    "safetensors.torch": "io.load_tensors",
}


def _core_module(dotted: str) -> str | None:
    """``lightning_pin.core.kinds.value`` -> ``kinds``; ``lightning_pin.core.engine`` -> ``engine``."""
    parts = dotted.split(".")
    return parts[2] if parts[:2] == ["lightning_pin", "core"] and len(parts) > 2 else None


def _layer(module: str) -> int:
    return next(i for i, layer in enumerate(CORE_LAYERS) if module in layer)


def _dotted(path: Path) -> str:
    """``core/kinds/value.py`` -> ``lightning_pin.core.kinds.value``; ``core/kinds/__init__.py`` -> ``...kinds``."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _core_files() -> dict[str, Path]:
    return {_dotted(path): path for path in sorted((PACKAGE / "core").rglob("*.py"))}


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules one import statement of ``module`` loads: ``from pkg import sub`` names ``pkg.sub`` when
    that is a module, relative imports resolved."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    found = set()
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        found.add(sub if sub in known else base)
    return found


def _all_imports(path: Path, module: str, known: set[str]) -> list[tuple[str, bool, int]]:
    """Every import a core file runs: (module imported, inside a function, line). Imports under
    ``if TYPE_CHECKING:`` run never and are left out."""
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                visit(ast.Module(body=child.orelse, type_ignores=[]), in_function)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend((name, in_function, child.lineno)
                             for name in sorted(_imported(child, module, path.name == "__init__.py", known)))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text()), False)
    return found


def _import_graph() -> dict[str, set[str]]:
    """core's runtime import graph: module -> the core modules it imports (at its top or inside a
    function: a function-local import closes a circle too, only later). Importing ``pkg.sub`` runs
    ``pkg/__init__`` first, so it is an edge to ``pkg`` too, unless ``pkg`` is the importer's own
    package (then it is already being imported)."""
    files = _core_files()
    known = set(files)
    graph = {module: set() for module in files}
    for module, path in files.items():
        own = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 2)}
        for name, _, _ in _all_imports(path, module, known):
            parts = name.split(".")
            graph[module].update(p for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1))
                                 if p in known and p not in own)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_core_imports_form_no_circle():
    graph = _import_graph()
    assert "lightning_pin.core.spec" in graph and any(graph.values())  # the reader sees core and its imports
    circle = _cycle(graph)
    assert circle is None, "import circle in core/: " + " -> ".join(circle)


def test_core_has_no_function_local_imports_but_optional_packages():
    hidden = {
        f"{path.relative_to(PACKAGE)}:{line}": name
        for module, path in _core_files().items()
        for name, local, line in _all_imports(path, module, set(_core_files()))
        if local and name not in LAZY_IMPORTS
    }
    assert hidden == {}, "import these at the top of the module (or add a lazy package to LAZY_IMPORTS, with why)"


def test_core_modules_import_only_their_layer_and_below():
    files = _core_files()
    placed = {_core_module(m) for m in files} - {None}
    unplaced = sorted(placed - set().union(*CORE_LAYERS))
    assert not unplaced, f"core modules in no layer of CORE_LAYERS: {unplaced}"
    upward = {}
    for module, targets in _import_graph().items():
        mine = _core_module(module)
        if mine is None:  # core/__init__: imports the kinds, to fill the registry
            continue
        above = sorted(t for t in targets if (c := _core_module(t)) is not None and _layer(c) > _layer(mine))
        if above:
            upward[module] = above
    assert upward == {}


def test_the_kinds_fill_the_registry_in_a_fresh_process(fresh):
    # Pin's field checks ask the registry: whichever module comes first, the kinds are registered.
    out = fresh[REGISTRY]["stdout"]
    assert out.startswith("refused Pin(params='w', bounds=(1.0, 0.0)): ") and out.endswith("\nquant_code\n")


def test_the_old_homes_of_the_selection_types_still_work():
    from lightning_pin.core import plan, selection, state

    assert plan.Selection is selection.Selection and state.SavedSelection is selection.SavedSelection


def test_the_layer_reader_sees_circles_upward_and_hidden_imports(tmp_path, monkeypatch):
    core = tmp_path / "lightning_pin" / "core"
    (core / "kinds").mkdir(parents=True)
    (core / "__init__.py").write_text("")
    (core / "kinds" / "__init__.py").write_text("from lightning_pin.core.kinds.value import X\n")
    (core / "sharding.py").write_text("from lightning_pin.core.engine import PinEngine\n")
    (core / "engine.py").write_text("import torch\n")
    (core / "spec.py").write_text("def f():\n    from lightning_pin.core.kinds import value\n")
    (core / "kinds" / "value.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lightning_pin.core.engine import X\n"
        "from . import _common\nfrom lightning_pin.core import spec\n"
    )
    (core / "kinds" / "_common.py").write_text("import torch\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "lightning_pin")
    graph = _import_graph()
    assert graph == {
        "lightning_pin.core": set(),
        "lightning_pin.core.engine": set(),
        "lightning_pin.core.kinds": {"lightning_pin.core.kinds.value"},
        "lightning_pin.core.kinds._common": set(),
        "lightning_pin.core.kinds.value": {"lightning_pin.core.kinds._common", "lightning_pin.core.spec"},
        "lightning_pin.core.sharding": {"lightning_pin.core.engine"},
        "lightning_pin.core.spec": {"lightning_pin.core.kinds", "lightning_pin.core.kinds.value"},
    }
    assert _cycle(graph) == ["lightning_pin.core.kinds", "lightning_pin.core.kinds.value", "lightning_pin.core.spec",
                             "lightning_pin.core.kinds"]
    for test in (test_core_imports_form_no_circle, test_core_has_no_function_local_imports_but_optional_packages,
                 test_core_modules_import_only_their_layer_and_below):
        with pytest.raises(AssertionError):
            test()
    graph["lightning_pin.core.spec"] = set()
    assert _cycle(graph) is None


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


def test_the_package_exports_the_documented_api_and_nothing_else(fresh):
    out = fresh[EXPORTS]["stdout"]
    names, exported = out.split("\n")[:2]
    # PinCallback and PinMonitor load on first use (the Lightning layer): exported, not yet bound.
    assert set(names.split()) | {"PinCallback", "PinMonitor"} == set(exported.split()) == {
        "AccuracyGapError", "NeuronPin", "Pin", "PinCallback", "PinError", "PinHandle", "PinMonitor", "QuantCode", "pin",
    }


@pytest.mark.parametrize(
    "statement", ["import lightning_pin", "from lightning_pin import PinCallback, pin, Pin"]
)
def test_the_package_imports_neither_hydra_nor_omegaconf(statement, fresh):
    loaded = _modules_after(fresh, statement)
    assert "torch" in loaded  # the reader sees what was imported (it can fail)
    assert [m for m in loaded if m.split(".")[0] in ("hydra", "omegaconf")] == []
