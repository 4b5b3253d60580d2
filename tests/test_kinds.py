"""The kinds of pin live in one place (lightning_pin/core/kinds): the rest asks the registry and
never tests a kind's name, and every registered kind answers the whole interface."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

from lightning_pin import Pin, QuantCode
from lightning_pin.core import kinds
from lightning_pin.core.plan import resolve
from lightning_pin.core.state import PinState

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_pin"
#: Where ``--kind value|cell|bit|flip`` chooses a fault *generator* (its own names, not pin kinds).
GENERATOR_CHOICE = {"app/fault_pins.py", "app/study.py", "app/config.py", "cli.py", "reporting/faults.py",
                    "faults/neurons.py"}  # neuron_faults(kind="sa0"|"sa1"|"value"): what a stuck neuron reads


def _names_a_kind(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value in kinds.BY_NAME


def _mentions_kind(node: ast.AST) -> bool:
    text = ast.unparse(node)
    return text == "kind" or text.endswith(".kind")


def test_nothing_outside_the_kinds_tests_a_kind_name():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(PACKAGE))
        if where.startswith("core/kinds/") or where in GENERATOR_CHOICE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                literals = [c for s in sides for c in ([s] if not isinstance(s, (ast.Tuple, ast.List, ast.Set))
                                                        else s.elts)]
                if any(_mentions_kind(s) for s in sides) and any(_names_a_kind(c) for c in literals):
                    found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.Dict) and sum(_names_a_kind(k) for k in node.keys if k is not None) > 1:
                found.append(f"{where}:{node.lineno}: a dict keyed by kind names")
    assert found == []


def test_the_guard_above_would_see_a_branch_on_a_kind_name():
    tree = ast.parse('if selection.kind == "stuck_bits":\n    pass\nx = {"value": 1, "bounds": 2}')
    compare = next(n for n in ast.walk(tree) if isinstance(n, ast.Compare))
    assert _mentions_kind(compare.left) and _names_a_kind(compare.comparators[0])
    table = next(n for n in ast.walk(tree) if isinstance(n, ast.Dict))
    assert sum(_names_a_kind(k) for k in table.keys) == 2


EXAMPLES = {
    "value": Pin("w", indices=[(0, 1)], value=2.5),
    "quant_code": Pin("w", indices=[(0, 1)], stuck_at_one=0x40, code=QuantCode(bits=8, scale=0.25)),
    "stuck_bits": Pin("w", indices=[(0, 1)], stuck_at_one=0x40000000),
    "bounds": Pin("w", indices=[(0, 1)], bounds=(0.0, math.inf)),
}


def test_every_kind_is_registered_once_and_found_from_its_fields():
    assert list(kinds.BY_NAME) == [k.kind for k in kinds.KINDS] == list(EXAMPLES)
    fields = [f for k in kinds.KINDS for f in k.pin_fields]
    assert len(fields) == len(set(fields))  # no two kinds read the same field
    for name, pin in EXAMPLES.items():
        assert kinds.for_pin(pin) is kinds.of(name) and pin.kind == name
    assert kinds.for_pin(Pin("w")) is kinds.DEFAULT


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_each_kind_resolves_holds_describes_and_saves_its_payload(name):
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(torch.tensor([[1.0, -2.0], [3.0, 4.0]]))
    selection = resolve([EXAMPLES[name]], module).pins[0].selections["w"]
    kind = kinds.of(selection.kind)
    assert kind.kind == name and set(selection.payload) == set(kind.payload_fields)
    assert kind.describe(selection)
    saved = kind.saved(selection, None)
    state = PinState(("f",), ({"w": saved},), frozenset({0}), None, 0)
    again = PinState.from_dict(state.to_dict()).pins[0]["w"]
    assert again.kind == name and kind.saved_differs(selection, again, "w") == []
    for field in kind.payload_fields:
        assert torch.equal(again.payload[field], selection.payload[field].cpu())
    # The stored-tensor comparison (check / diff) agrees with the restore kernel.
    held = module.w.detach().clone()
    if not kind.frozen:
        kind.merge("w", module.w, [selection]).apply(held)
        off, _ = kind.stored_off(held.reshape(-1)[selection.index.long()], again)
        assert not bool(off.any())


def test_two_kinds_on_one_element_are_refused_with_both_kinds_words():
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(Exception, match="put stuck bits and bounds on 1 element"):
        resolve([EXAMPLES["stuck_bits"], EXAMPLES["bounds"]], module)
