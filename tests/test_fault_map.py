"""Fault-map files: stuck values, stuck bits and bounds per parameter name; the older NaN maps still load."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from torch import nn

from lightning_pin import Pin, PinError, pin
from lightning_pin.app.pins import fault_map_pins, random_fault_map
from lightning_pin.core.plan import resolve
from lightning_pin.faults import bit_faults, cell_faults, load_fault_map, save_fault_map


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(16, 3))


def targets(pins, module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(index, values) per parameter, merged over the pins, as the plan resolves them."""
    out = {}
    for rp in resolve(pins, module).pins:
        for name, s in rp.selections.items():
            out[name] = (s.index.to(torch.int64), s.values)
    return out


def unsigned(mask: torch.Tensor) -> torch.Tensor:
    width = 8 * mask.element_size()
    return mask.to(torch.int64) & ((1 << width) - 1) if width < 64 else mask


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_cell_faults_round_trip_through_a_file(tmp_path, suffix):
    module = net()
    pins = cell_faults(module, "*.weight", rate=0.2, seed=4)
    path = save_fault_map(pins, tmp_path / f"chip{suffix}")
    loaded = load_fault_map(path)
    assert loaded.faulty == pins.faulty
    before, after = targets(pins, module), targets(loaded, module)
    assert before.keys() == after.keys() == {"0.weight", "2.weight"}
    for name in before:
        assert torch.equal(before[name][0], after[name][0]) and torch.equal(before[name][1], after[name][1])
    assert "0.weight: 7 stuck values" in loaded.summary  # 0.2 of 36


def test_bit_faults_round_trip_through_a_file_as_unsigned_patterns(tmp_path):
    module = net().to(torch.bfloat16)
    pins = bit_faults(module, "2.weight", rate=0.05, bits=["sign", "exponent"], seed=1)
    path = save_fault_map(pins, tmp_path / "chip.safetensors")
    (loaded,) = load_fault_map(path)
    # The generator tells the layer's shape: the elements come back as a mask of it (refused on another shape).
    assert loaded.kind == "stuck_bits" and torch.equal(loaded.mask.nonzero(), pins[0].indices)
    for field in ("stuck_at_zero", "stuck_at_one"):
        # The file holds the bit patterns as int64 >= 0 (0x8000 for bfloat16's sign, not -32768).
        assert bool((getattr(loaded, field) >= 0).all())
        assert torch.equal(getattr(loaded, field), unsigned(getattr(pins[0], field)))


def test_the_older_nan_maps_load_as_they_did(tmp_path):
    module = net()
    faults = random_fault_map(module, "*.weight", fraction=0.25, seed=2)
    torch.save(faults, tmp_path / "old.pt")
    save_file(faults, str(tmp_path / "old.safetensors"))
    for path in (tmp_path / "old.pt", tmp_path / "old.safetensors"):
        pins = fault_map_pins(path)
        assert [p.params for p in pins] == ["0.weight", "2.weight"]
        for p in pins:
            stuck = faults[p.params]
            assert torch.equal(p.mask, ~stuck.isnan()) and torch.equal(p.value, stuck[~stuck.isnan()])


def test_a_dense_map_holds_values_stuck_bits_and_bounds(tmp_path):
    nan, inf = math.nan, math.inf
    fault_map = {
        "2.bias:value": torch.tensor([nan, 0.5, nan]),
        "2.bias:stuck_at_one": torch.tensor([0x40000000, 0, 0]),
        "2.bias:low": torch.tensor([-inf, -inf, 0.0]),
        "0.bias:high": torch.tensor([inf, 1.0, inf, 2.0]),
    }
    torch.save(fault_map, tmp_path / "chip.pt")
    pins = load_fault_map(tmp_path / "chip.pt")
    by_kind = {(p.params, p.kind): p for p in pins}
    assert set(by_kind) == {("2.bias", "value"), ("2.bias", "stuck_bits"), ("2.bias", "bounds"), ("0.bias", "bounds")}
    value = by_kind["2.bias", "value"]
    assert torch.equal(value.mask, torch.tensor([False, True, False])) and torch.equal(value.value, torch.tensor([0.5]))
    bits = by_kind["2.bias", "stuck_bits"]
    assert torch.equal(bits.mask, torch.tensor([True, False, False]))
    assert torch.equal(bits.stuck_at_one, torch.tensor([0x40000000])) and bits.stuck_at_zero is None
    low, high = by_kind["2.bias", "bounds"].bounds
    assert torch.equal(low, torch.tensor([0.0]).double()) and torch.equal(high, torch.tensor([inf]).double())
    low, high = by_kind["0.bias", "bounds"].bounds
    assert torch.equal(by_kind["0.bias", "bounds"].mask, torch.tensor([False, True, False, True]))
    assert torch.equal(low, torch.full((2,), -inf).double()) and torch.equal(high, torch.tensor([1.0, 2.0]).double())
    assert pins.faulty == {"2.bias": 3, "0.bias": 2}


def test_save_merges_pins_on_one_parameter(tmp_path):
    pins = [
        Pin("w", indices=[[0], [2]], stuck_at_one=0x40000000),
        Pin("w", indices=[[2], [3]], stuck_at_zero=[0x1, 0x2], stuck_at_one=[0x10, 0]),
        Pin("w", indices=[[1]], bounds=(-1.0, 1.0)),
        Pin("w", indices=[[1]], bounds=(0.0, 2.0)),
        Pin("v", mask=torch.tensor([[True, False], [False, True]]), value=torch.tensor([[1.0, 9.0], [9.0, 2.0]])),
    ]
    saved = torch.load(save_fault_map(pins, tmp_path / "m.pt"), weights_only=True)
    assert torch.equal(saved["w:indices"], torch.tensor([[0], [1], [2], [3]]))
    assert torch.equal(saved["w:stuck_at_one"], torch.tensor([0x40000000, 0, 0x40000010, 0]))
    assert torch.equal(saved["w:stuck_at_zero"], torch.tensor([0, 0, 0x1, 0x2]))
    assert torch.equal(saved["w:low"], torch.tensor([-math.inf, 0.0, -math.inf, -math.inf]).double())
    assert torch.equal(saved["w:high"], torch.tensor([math.inf, 1.0, math.inf, math.inf]).double())
    assert torch.equal(saved["v:indices"], torch.tensor([[0, 0], [1, 1]]))
    assert torch.equal(saved["v:value"], torch.tensor([1.0, 2.0]))
    assert torch.equal(saved["v:shape"], torch.tensor([2, 2]))  # the mask tells v's shape; w's indices do not
    assert saved.keys() == {
        "w:indices", "w:stuck_at_zero", "w:stuck_at_one", "w:low", "w:high", "v:indices", "v:value", "v:shape"
    }


@pytest.mark.parametrize(
    ("pins", "match"),
    [
        ([Pin("*.weight", indices=[[0]], value=1.0)], "must name one parameter exactly"),
        ([Pin(["a", "b"], indices=[[0]], value=1.0)], "must name one parameter exactly"),
        ([Pin("w", fraction=0.5, value=1.0)], "fraction needs a module to resolve"),
        ([Pin("w", indices=[[0]], value=1.0, start_step=3)], "when, start_step and stop_step cannot be saved"),
        ([Pin("w", indices=[[0]])], "has no value"),
        ([Pin("w", value=1.0)], "selects a whole tensor whose shape it does not tell"),
        ([Pin("w", indices=[[0]], value="values.pt")], "value must be given in memory"),
        ([Pin("w", indices=[[0]], value=1.0), Pin("w", indices=[[0]], value=2.0)], r"element \(0,\) of 'w' is given"),
        (
            [Pin("w", indices=[[0]], stuck_at_one=0x1), Pin("w", indices=[[0]], stuck_at_zero=0x3)],
            r"element \(0,\) of 'w' has bits 0x1 stuck at zero and at one",
        ),
        ([Pin("w", indices=[[0]], bounds=(0, 1)), Pin("w", indices=[[0]], bounds=(2, 3))], "do not overlap"),
        ([], "no pins to save"),
    ],
)
def test_save_refuses_what_a_fault_map_cannot_hold(tmp_path, pins, match):
    with pytest.raises(PinError, match=match):
        save_fault_map(pins, tmp_path / "m.pt")
    assert not (tmp_path / "m.pt").exists()


def test_save_resolves_any_pin_on_a_module(tmp_path):
    module = net()
    pins = [
        Pin("2.*", fraction=0.25, seed=1, value=0.5),            # a glob and a fraction: resolved on the module
        Pin("0.bias"),                                          # value=None: stuck at what it holds now
        Pin("0.weight", indices=[(0, 0, 1, 1)], stuck_at_one=0x80000000),
        Pin("0.weight", indices=[(1, 0, 0, 0), (2, 0, 2, 2)], bounds=(-0.1, 0.1)),
    ]
    loaded = load_fault_map(save_fault_map(pins, tmp_path / "m.pt", module=module))
    before, after = resolve(pins, module), resolve(loaded, module)
    held = {}
    for rp in after.pins:
        for name, s in rp.selections.items():
            held[name, s.kind] = s
    for rp in before.pins:
        for name, s in rp.selections.items():
            t = held[name, s.kind]
            assert torch.equal(s.index.long() if s.index is not None else torch.arange(s.parameter.numel()),
                               t.index.long())  # fmt: skip
            if s.kind == "value":
                expected = s.values if s.values is not None else module.get_parameter(name).detach()
                assert torch.equal(t.values.reshape(-1), expected.reshape(-1))
            for field in ("stuck_at_zero", "stuck_at_one", "low", "high"):
                assert getattr(s, field) is None or torch.equal(getattr(s, field), getattr(t, field))
    with pytest.raises(PinError, match="when, start_step and stop_step cannot be saved"):
        save_fault_map([Pin("0.bias", stop_step=4)], tmp_path / "m.pt", module=module, overwrite=True)


def test_save_refuses_other_suffixes(tmp_path):
    with pytest.raises(PinError, match=r"must end in .pt, .pth or .safetensors"):
        save_fault_map([Pin("w", indices=[[0]], value=1.0)], tmp_path / "m.npy")


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ({"w:colour": torch.zeros(3)}, "key 'w:colour' ends in 'colour'"),
        ({"w:value": torch.zeros(3), "w:low": torch.zeros(4)}, r"w:low has shape \(4,\); expected \(3,\)"),
        ({"w": torch.zeros(3), "w:value": torch.zeros(3)}, "has its stuck values twice"),
        ({"w:stuck_at_one": torch.zeros(3)}, "must hold integer bit patterns"),
        ({"w:indices": torch.zeros(2, 1), "w:value": torch.zeros(2)}, "integer coordinates"),
        ({"w": torch.full((3,), math.nan)}, "marks no faulty cell"),
        ({"w": [1.0]}, "must hold a dict of tensors"),
    ],
)
def test_load_refuses_malformed_maps(tmp_path, content, match):
    torch.save(content, tmp_path / "m.pt")
    with pytest.raises(PinError, match=match):
        load_fault_map(tmp_path / "m.pt")


def test_load_names_a_missing_file(tmp_path):
    with pytest.raises(PinError, match="does not exist.*save_fault_map"):
        load_fault_map(tmp_path / "nope.pt")


def test_a_measured_map_of_every_kind_is_pinned_and_held_in_training(tmp_path):
    """A chip's dense map: values, stuck bits (as unsigned int64 patterns) and bounds, held after every step."""
    module = net()
    inf = math.inf
    weight = module[2].weight  # 3 x 16
    value = torch.full((3, 16), math.nan)
    value[0, :4] = torch.tensor([0.0, 0.25, -0.5, 1.0])
    one = torch.zeros(3, 16, dtype=torch.int64)
    one[1, :3] = 0x80000000  # sign stuck at one: the weight stays negative
    zero = torch.zeros(3, 16, dtype=torch.int64)
    zero[1, 3:6] = 0x40000000  # exponent MSB stuck at zero: |w| < 2
    low, high = torch.full((3, 16), -inf), torch.full((3, 16), inf)
    low[2, :5], high[2, :5] = 0.0, 0.05  # bounded cells
    save_file({"2.weight:value": value, "2.weight:stuck_at_one": one, "2.weight:stuck_at_zero": zero,
               "2.weight:low": low, "2.weight:high": high}, str(tmp_path / "chip.safetensors"))
    pins = load_fault_map(tmp_path / "chip.safetensors")
    assert [p.kind for p in pins] == ["value", "stuck_bits", "bounds"] and pins.faulty == {"2.weight": 15}
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.05)
    with pin(module, optimizer, pins) as handle:
        for _ in range(3):
            module(torch.randn(4, 1, 4, 4)).pow(2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            w = weight.detach()
            assert torch.equal(w[0, :4], value[0, :4])
            words = w.view(torch.int32)
            assert bool((words[1, :3] < 0).all()) and bool((w[1, 3:6].abs() < 2).all())
            assert bool(((w[2, :5] >= 0) & (w[2, :5] <= 0.05)).all())
        handle.verify()
    # Round trip: what save_fault_map writes from these pins loads as the same faults.
    again = load_fault_map(save_fault_map(pins, tmp_path / "again.pt"))
    a, b = resolve(pins, module), resolve(again, module)
    for x, y in zip(a.pins, b.pins):
        s, t = x.selections["2.weight"], y.selections["2.weight"]
        assert s.kind == t.kind and torch.equal(s.index, t.index)
        for field in ("values", "stuck_at_zero", "stuck_at_one", "low", "high"):
            u, v = getattr(s, field), getattr(t, field)
            assert (u is None and v is None) or torch.equal(u, v)


@settings(max_examples=20, deadline=None)
@given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    kinds=st.lists(st.sampled_from(["healthy", "value", "bits", "bounds"]), min_size=1, max_size=216),
    seed=st.integers(0, 1000),
)
def test_dense_maps_round_trip_through_save_and_load(tmp_path_factory, shape, dtype, kinds, seed):
    """A dense measured map -> pins -> save_fault_map (by coordinates) -> the same resolved faults."""
    module = nn.Module()
    module.w = nn.Parameter(torch.zeros(shape, dtype=dtype))
    numel = module.w.numel()
    kind = torch.tensor([["healthy", "value", "bits", "bounds"].index(k) for k in (kinds * numel)[:numel]])
    g = torch.Generator().manual_seed(seed)
    width = 8 * module.w.element_size()
    value = torch.where(kind == 1, torch.randn(numel, generator=g).to(dtype).float(), torch.nan)
    one = torch.where(kind == 2, 1 << (width - 1), 0)  # the sign bit
    zero = torch.where(kind == 2, torch.randint(1, 1 << (width - 2), (numel,), generator=g), 0)  # never the sign
    low = torch.where(kind == 3, -torch.rand(numel, generator=g), -math.inf)
    high = torch.where(kind == 3, torch.rand(numel, generator=g), math.inf)
    folder = tmp_path_factory.mktemp("map")
    torch.save({"w:value": value.reshape(shape), "w:stuck_at_zero": zero.reshape(shape),
                "w:stuck_at_one": one.reshape(shape), "w:low": low.reshape(shape), "w:high": high.reshape(shape)},
               folder / "dense.pt")  # fmt: skip
    if not bool((kind > 0).any()):
        with pytest.raises(PinError, match="marks no faulty cell"):
            load_fault_map(folder / "dense.pt")
        return
    dense = load_fault_map(folder / "dense.pt")
    sparse = load_fault_map(save_fault_map(dense, folder / "sparse.safetensors"))
    assert dense.faulty == sparse.faulty == {"w": int((kind > 0).sum())}
    a, b = resolve(dense, module), resolve(sparse, module)
    assert [rp.pin.kind for rp in a.pins] == [rp.pin.kind for rp in b.pins]
    for x, y in zip(a.pins, b.pins):
        s, t = x.selections["w"], y.selections["w"]
        assert torch.equal(s.index, t.index)
        assert torch.equal(s.index.long(), (kind == {"value": 1, "stuck_bits": 2, "bounds": 3}[s.kind]).nonzero()[:, 0])
        for field in ("values", "stuck_at_zero", "stuck_at_one", "low", "high"):
            assert (getattr(s, field) is None) == (getattr(t, field) is None)
            assert getattr(s, field) is None or torch.equal(getattr(s, field), getattr(t, field))


# --------------------------------------------------------------------------------------------
# Overwriting, and the shape of each parameter recorded in the file


def test_save_fault_map_refuses_to_overwrite_an_existing_file_unless_asked(tmp_path):
    module = net()
    pins = cell_faults(module, "2.weight", rate=0.2, seed=1)
    path = tmp_path / "chip.safetensors"
    path.write_bytes(b"my measurements")
    with pytest.raises(PinError, match=r"chip.safetensors already exists.*overwrite=True"):
        save_fault_map(pins, path, module=module)
    assert path.read_bytes() == b"my measurements"
    with pytest.raises(PinError, match="already exists"):  # refused before the pins are even looked at
        save_fault_map([Pin("*", fraction=0.5)], path)
    assert path.read_bytes() == b"my measurements"
    save_fault_map(pins, path, module=module, overwrite=True)
    assert torch.equal(load_fault_map(path)[0].value, pins[0].value)
    (tmp_path / "folder.pt").mkdir()
    with pytest.raises(PinError, match="is a directory"):
        save_fault_map(pins, tmp_path / "folder.pt", overwrite=True)


def _wide() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(32, 3))  # 2.weight: 3 x 32, not 3 x 16


@pytest.mark.parametrize("kind", ["cell", "bit"])
def test_a_sparse_map_records_each_shape_and_refuses_a_layer_of_another_shape(tmp_path, kind):
    module = net()
    draw = cell_faults if kind == "cell" else bit_faults
    pins = draw(module, "2.weight", rate=0.1, seed=3)
    path = save_fault_map(pins, tmp_path / "chip.safetensors", module=module)
    raw = load_fault_map.__globals__["load_tensors"](path)
    assert torch.equal(raw["2.weight:shape"], torch.tensor([3, 16]))
    loaded = load_fault_map(path)
    assert loaded.shapes == {"2.weight": (3, 16)}
    with pytest.raises(PinError, match=r"mask for '2.weight' has shape \(3, 16\); the parameter's shape is \(3, 32\)"):
        resolve(list(loaded), _wide())
    # On the layer it was measured on, the same elements and targets as the pins it was saved from.
    fields = ("values",) if kind == "cell" else ("stuck_at_zero", "stuck_at_one")
    (before,), (after,) = (list(resolve(list(p), module).pins[0].selections.values()) for p in (pins, loaded))
    assert torch.equal(before.index, after.index)
    for field in fields:
        assert torch.equal(getattr(before, field), getattr(after, field)), field
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1, weight_decay=0.1)
    with pin(module, optimizer, loaded) as handle:
        for _ in range(2):
            module(torch.randn(2, 1, 4, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        handle.verify()


@pytest.mark.parametrize("kind", ["cell", "bit"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_generated_map_saved_without_a_module_records_shapes_and_dtypes(tmp_path, kind, dtype):
    """save_fault_map(cell_faults(model, ...), path): the generator tells the shapes and dtypes, so the map is refused
    on a layer of another shape whose size happens to hold every listed element (it used to pin them silently)."""
    module = net().to(dtype)
    draw = cell_faults if kind == "cell" else bit_faults
    pins = draw(module, "2.weight", rate=0.2, seed=5)
    assert pins.shapes == {"2.weight": (3, 16)} and pins.dtypes == {"2.weight": dtype}
    path = save_fault_map(pins, tmp_path / "chip.safetensors")
    raw = load_fault_map.__globals__["load_tensors"](path)
    assert torch.equal(raw["2.weight:shape"], torch.tensor([3, 16])) and raw["2.weight:dtype"].dtype == dtype
    loaded = load_fault_map(path)
    assert loaded.shapes == {"2.weight": (3, 16)} and loaded.dtypes == {"2.weight": dtype}
    wide = _wide().to(dtype)  # 3 x 32: every (row, column) of a 3 x 16 layer is inside it
    before = {name: p.detach().clone() for name, p in wide.named_parameters()}
    optimizer = torch.optim.SGD(wide.parameters(), lr=0.1)
    with pytest.raises(PinError, match=r"'2.weight' has shape \(3, 16\); the parameter's shape is \(3, 32\)"):
        pin(wide, optimizer, loaded)
    assert all(torch.equal(p, before[name]) for name, p in wide.named_parameters())
    assert torch.equal(targets(loaded, module)["2.weight"][0], targets(pins, module)["2.weight"][0])


def test_shapes_come_from_masks_and_whole_tensors_without_a_module(tmp_path):
    mask = torch.zeros(3, 16, dtype=torch.bool)
    mask[0, 5] = mask[2, 15] = True
    pins = [Pin("2.weight", mask=mask, value=[1.0, 2.0]), Pin("2.bias", value=torch.tensor([0.0, 1.0, 2.0]))]
    loaded = load_fault_map(save_fault_map(pins, tmp_path / "m.pt"))
    assert loaded.shapes == {"2.weight": (3, 16), "2.bias": (3,)}
    with pytest.raises(PinError, match=r"shape \(3, 16\); the parameter's shape is \(3, 32\)"):
        resolve(list(loaded), _wide())
    resolved = targets(loaded, net())
    assert torch.equal(resolved["2.weight"][0], torch.tensor([5, 47])) and torch.equal(
        resolved["2.weight"][1], torch.tensor([1.0, 2.0]))
    # Pins of one parameter that disagree on its shape, or coordinates outside it, are refused.
    other = Pin("2.weight", mask=torch.ones(3, 8, dtype=torch.bool), value=0.0)
    with pytest.raises(PinError, match=r"the pins on '2.weight' do not agree on its shape: .* \(3, 8\) and as \(3, 16"):
        save_fault_map([pins[0], other], tmp_path / "x.pt")
    with pytest.raises(PinError, match=r"element \(0, 20\) of '2.weight' is outside its shape \(3, 16\)"):
        save_fault_map([pins[0], Pin("2.weight", indices=[(0, 20)], value=0.0)], tmp_path / "y.pt")


def test_an_older_sparse_map_without_shapes_still_loads_as_coordinates(tmp_path):
    module = net()
    pins = cell_faults(module, "2.weight", rate=0.1, seed=3)
    path = save_fault_map(pins, tmp_path / "chip.pt", module=module)
    raw = torch.load(path, weights_only=True)
    del raw["2.weight:shape"], raw["2.weight:dtype"]
    torch.save(raw, tmp_path / "old.pt")
    (old,) = load_fault_map(tmp_path / "old.pt")
    assert old.indices is not None and old.mask is None
    assert load_fault_map(tmp_path / "old.pt").shapes == {}
    assert torch.equal(targets([old], module)["2.weight"][1], targets(pins, module)["2.weight"][1])


@pytest.mark.parametrize(
    ("shape", "words"),
    [
        (torch.tensor([3.0, 16.0]), "must be the parameter's shape as non-negative integers"),
        (torch.tensor([3, 4]), r"element \(0, 5\) of '2.weight' is outside the recorded shape \(3, 4\)"),
        (torch.tensor([3, 16, 1]), "coordinates of 2 dimensions, the recorded shape has 3"),
    ],
)
def test_a_recorded_shape_that_does_not_fit_its_coordinates_is_refused(tmp_path, shape, words):
    raw = {"2.weight:indices": torch.tensor([[0, 5], [2, 15]]), "2.weight:value": torch.tensor([1.0, 2.0]),
           "2.weight:shape": shape}
    torch.save(raw, tmp_path / "m.pt")
    with pytest.raises(PinError, match=words):
        load_fault_map(tmp_path / "m.pt")


def test_a_recorded_shape_lists_each_element_once(tmp_path):
    raw = {"2.weight:indices": torch.tensor([[0, 5], [0, 5]]), "2.weight:value": torch.tensor([1.0, 2.0]),
           "2.weight:shape": torch.tensor([3, 16])}
    torch.save(raw, tmp_path / "m.pt")
    with pytest.raises(PinError, match=r"lists element \(0, 5\) of '2.weight' twice"):
        load_fault_map(tmp_path / "m.pt")


def test_saved_coordinates_are_the_smallest_integers_that_hold_the_shape(tmp_path):
    """A conv weight's 4 coordinates in 8 bytes (int16), a wide layer's in int32; they load as before."""
    from lightning_pin.faults import cell_faults, load_fault_map, save_fault_map

    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Linear(40_000, 2))
    pins = cell_faults(net, "*.weight", rate=0.01, seed=0)
    path = save_fault_map(pins, tmp_path / "map.pt", module=net)
    saved = torch.load(path, weights_only=True)
    assert saved["0.weight:indices"].dtype == torch.int16 and saved["1.weight:indices"].dtype == torch.int32
    loaded = {p.params: p for p in load_fault_map(path)}
    for pin in pins:
        name = pin.params if isinstance(pin.params, str) else pin.params[0]
        assert torch.equal(loaded[name].mask.nonzero(), pin.indices) and torch.equal(loaded[name].value, pin.value)
