"""Unit tests for lightning_pin.core.plan.resolve(): matching, selections, values, dtypes, summary."""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from lightning_pin import Pin, PinError
from lightning_pin.core.engine import PinEngine
from lightning_pin.core.plan import compact_index, fraction_indices, resolve


class Net(nn.Module):
    """Names: weight (5,), big (40,50), twin_a (1000,), twin_b (1000,), fc.weight (3,4), fc.bias (3,),
    fc2.weight (2,3), fc2.bias (2,), conv.weight (2,2,3,3), conv.bias (2,)."""

    def __init__(self, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.weight = nn.Parameter(torch.arange(5, **kw) if device != "meta" else torch.empty(5, **kw))
        self.fc = nn.Linear(4, 3, **kw)
        self.fc2 = nn.Linear(3, 2, **kw)
        self.conv = nn.Conv2d(2, 2, 3, **kw)
        self.big = nn.Parameter(torch.zeros(40, 50, **kw))
        self.twin_a = nn.Parameter(torch.zeros(1000, **kw))
        self.twin_b = nn.Parameter(torch.zeros(1000, **kw))


# named_parameters(): the module's own parameters first, then the submodules'.
ALL_NAMES = [
    "weight",
    "big",
    "twin_a",
    "twin_b",
    "fc.weight",
    "fc.bias",
    "fc2.weight",
    "fc2.bias",
    "conv.weight",
    "conv.bias",
]


@pytest.fixture
def net() -> Net:
    return Net()


def sel(plan, name, pin_id=0):
    return plan.pins[pin_id].selections[name]


def resolve_quiet(pins, module):
    """resolve() turning every warning into an error: for values that must be exact."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return resolve(pins, module)


def flat_of(shape, *coords):
    """Row-major flat indices of ``coords`` in a tensor of ``shape`` (computed independently)."""
    grid = torch.arange(torch.Size(shape).numel()).reshape(shape)
    return torch.tensor([int(grid[c]) for c in coords])


# ----------------------------------------------------------------------------------------------
# Matching


def test_net_names(net):
    assert [n for n, _ in net.named_parameters()] == ALL_NAMES


@pytest.mark.parametrize(
    "pattern, expected",
    [
        ("fc.weight", ["fc.weight"]),
        ("fc.*", ["fc.weight", "fc.bias"]),
        ("*.weight", ["fc.weight", "fc2.weight", "conv.weight"]),
        ("weight", ["weight"]),  # a bare name matches only itself, not "fc.weight"
        ("*weight", ["weight", "fc.weight", "fc2.weight", "conv.weight"]),
        ("fc?.*", ["fc2.weight", "fc2.bias"]),
        ("twin_[ab]", ["twin_a", "twin_b"]),
        ("*", ALL_NAMES),
        ("re:fc\\..*", ["fc.weight", "fc.bias"]),
        ("re:fc2?\\.weight", ["fc.weight", "fc2.weight"]),
        ("re:weight", ["weight"]),  # fullmatch: not fc.weight
        ("re:.*bias", ["fc.bias", "fc2.bias", "conv.bias"]),
        ("re:twin_.", ["twin_a", "twin_b"]),
    ],
)
def test_patterns_match_whole_names(net, pattern, expected):
    plan = resolve([Pin(pattern)], net)
    assert list(plan.pins[0].selections) == expected
    assert list(plan.parameters) == expected
    for name in expected:
        assert plan.parameters[name] is dict(net.named_parameters())[name]


@pytest.mark.parametrize("pattern", ["re:fc", "re:fc\\.", "re:eight", "eight", "fc", "fc.weigh", "c.weight"])
def test_partial_names_do_not_match(net, pattern):
    with pytest.raises(PinError, match="matches no parameter"):
        resolve([Pin(pattern)], net)


def test_weight_pattern_without_top_level_weight_does_not_match_fc_weight():
    m = nn.Module()
    m.fc = nn.Linear(2, 2)
    with pytest.raises(PinError, match="matches no parameter"):
        resolve([Pin("weight")], m)
    with pytest.raises(PinError, match="matches no parameter"):
        resolve([Pin("re:fc")], m)


def test_list_of_patterns_union_without_duplicates(net):
    plan = resolve([Pin(["fc.bias", "re:conv\\..*", "fc.*"])], net)
    assert list(plan.pins[0].selections) == ["fc.bias", "conv.weight", "conv.bias", "fc.weight"]
    # plan.parameters follows the module's order
    assert list(plan.parameters) == ["fc.weight", "fc.bias", "conv.weight", "conv.bias"]


def test_list_of_patterns_every_pattern_must_match(net):
    with pytest.raises(PinError, match="'nope'"):
        resolve([Pin(["fc.bias", "nope"])], net)


def test_whole_selection(net):
    plan = resolve([Pin("fc.weight")], net)
    s = sel(plan, "fc.weight")
    assert s.index is None and s.values is None and s.how == "whole"
    assert s.count == 12
    assert s.parameter is net.fc.weight


# ----------------------------------------------------------------------------------------------
# Indices


def test_indices_list_of_tuples(net):
    s = sel(resolve([Pin("fc.weight", indices=[(2, 3), (0, 1)])], net), "fc.weight")
    assert torch.equal(s.index, flat_of((3, 4), (0, 1), (2, 3)))
    # int32 where every index fits: 4 bytes per pinned element.
    assert s.index.dtype == torch.int32
    assert s.how == "indices" and s.values is None and s.count == 2


def test_indices_list_of_lists(net):
    s = sel(resolve([Pin("fc.weight", indices=[[1, 2]])], net), "fc.weight")
    assert torch.equal(s.index, torch.tensor([6]))


def test_indices_list_of_ints_for_1d(net):
    s = sel(resolve([Pin("weight", indices=[4, 0, 2])], net), "weight")
    assert torch.equal(s.index, torch.tensor([0, 2, 4]))


def test_indices_list_of_one_tuples_for_1d(net):
    s = sel(resolve([Pin("fc.bias", indices=[(2,), (1,)])], net), "fc.bias")
    assert torch.equal(s.index, torch.tensor([1, 2]))


def test_indices_long_tensor_k_by_ndim(net):
    coords = torch.tensor([[1, 0, 2, 1], [0, 1, 0, 0], [1, 1, 2, 2]])
    s = sel(resolve([Pin("conv.weight", indices=coords)], net), "conv.weight")
    expected = flat_of((2, 2, 3, 3), (1, 0, 2, 1), (0, 1, 0, 0), (1, 1, 2, 2)).sort().values
    assert torch.equal(s.index, expected)
    assert torch.equal(expected, torch.tensor([9, 25, 35]))


def test_indices_long_tensor_1d(net):
    s = sel(resolve([Pin("twin_a", indices=torch.tensor([999, 3, 500]))], net), "twin_a")
    assert torch.equal(s.index, torch.tensor([3, 500, 999]))


def test_indices_int32_tensor(net):
    s = sel(resolve([Pin("fc.weight", indices=torch.tensor([[2, 1]], dtype=torch.int32))], net), "fc.weight")
    assert torch.equal(s.index, torch.tensor([9])) and s.index.dtype == torch.int32


def test_indices_of_a_tensor_beyond_int32_stay_int64():
    # A parameter with 2**31 elements (on the meta device: no memory) needs int64 indices.
    big = nn.Module()
    big.w = nn.Parameter(torch.empty(2**31, device="meta"))
    s = sel(resolve([Pin("w", indices=[2**31 - 1, 0])], big), "w")
    assert s.index.dtype == torch.int64 and s.count == 2
    assert compact_index(torch.tensor([0, 2**31 - 1]), 2**31).tolist() == [0, 2**31 - 1]
    assert compact_index(torch.tensor([0, 2**31 - 2]), 2**31 - 1).dtype == torch.int32


def test_indices_duplicates_without_value_are_deduped(net):
    s = sel(resolve([Pin("fc.weight", indices=[(1, 1), (0, 0), (1, 1)])], net), "fc.weight")
    assert torch.equal(s.index, torch.tensor([0, 5]))
    assert s.count == 2


def test_indices_same_on_every_matched_parameter(net):
    plan = resolve([Pin(["fc.weight", "fc2.weight"], indices=[(1, 2)])], net)
    assert torch.equal(sel(plan, "fc.weight").index, torch.tensor([6]))
    assert torch.equal(sel(plan, "fc2.weight").index, torch.tensor([5]))


# ----------------------------------------------------------------------------------------------
# Masks


def _mask(shape, flat):
    m = torch.zeros(shape, dtype=torch.bool)
    m.view(-1)[torch.tensor(flat)] = True
    return m


def test_mask_tensor(net):
    mask = _mask((2, 2, 3, 3), [0, 7, 35])
    s = sel(resolve([Pin("conv.weight", mask=mask)], net), "conv.weight")
    assert torch.equal(s.index, torch.tensor([0, 7, 35]))
    assert s.how == "mask" and s.values is None


def test_mask_not_contiguous(net):
    mask = _mask((4, 3), [1, 5]).t()  # a (3, 4) view, not contiguous
    assert not mask.is_contiguous()
    s = sel(resolve([Pin("fc.weight", mask=mask)], net), "fc.weight")
    expected = mask.reshape(-1).nonzero().squeeze(1)
    assert torch.equal(s.index, expected)


def test_mask_pt_file(net, tmp_path):
    path = tmp_path / "mask.pt"
    torch.save(_mask((3, 4), [2, 11]), path)
    s = sel(resolve([Pin("fc.weight", mask=str(path))], net), "fc.weight")
    assert torch.equal(s.index, torch.tensor([2, 11]))


def test_mask_pt_file_as_path_object(net, tmp_path):
    path = tmp_path / "mask.pt"
    torch.save(_mask((3,), [1]), path)
    s = sel(resolve([Pin("fc.bias", mask=path)], net), "fc.bias")
    assert torch.equal(s.index, torch.tensor([1]))


def test_mask_safetensors_file_single_entry(net, tmp_path):
    path = tmp_path / "mask.safetensors"
    save_file({"anything": _mask((3, 4), [0, 5])}, str(path))
    s = sel(resolve([Pin("fc.weight", mask=str(path))], net), "fc.weight")
    assert torch.equal(s.index, torch.tensor([0, 5]))


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_mask_file_dict_by_name(net, tmp_path, suffix):
    masks = {"fc.weight": _mask((3, 4), [3, 4]), "fc.bias": _mask((3,), [2]), "conv.bias": _mask((2,), [0])}
    path = tmp_path / f"masks{suffix}"
    if suffix == ".pt":
        torch.save(masks, path)
    else:
        save_file(masks, str(path))
    plan = resolve([Pin("fc.*", mask=str(path))], net)
    assert torch.equal(sel(plan, "fc.weight").index, torch.tensor([3, 4]))
    assert torch.equal(sel(plan, "fc.bias").index, torch.tensor([2]))


def test_mask_dict_by_name_in_memory(net):
    plan = resolve([Pin(["fc.bias", "conv.bias"], mask={"fc.bias": _mask((3,), [0]), "conv.bias": _mask((2,), [1])})], net)
    assert torch.equal(sel(plan, "fc.bias").index, torch.tensor([0]))
    assert torch.equal(sel(plan, "conv.bias").index, torch.tensor([1]))


# ----------------------------------------------------------------------------------------------
# Fraction


@pytest.mark.parametrize(
    "name, numel, fraction",
    [
        ("conv.weight", 36, 0.5),
        ("fc.weight", 12, 0.3),  # 3.6 -> 4
        ("fc.weight", 12, 0.125),  # 1.5 -> round() = 2
        ("fc.weight", 12, 0.2083),  # 2.4996 -> 2
        ("fc.bias", 3, 0.01),  # 0.03 -> at least 1
        ("fc.bias", 3, 0.5),  # 1.5 -> 2
        ("big", 2000, 0.0001),  # 0.2 -> at least 1
        ("big", 2000, 0.05),  # 100
        ("big", 2000, 1.0),
        ("twin_a", 1000, 0.999),
    ],
)
def test_fraction_count(net, name, numel, fraction):
    s = sel(resolve([Pin(name, fraction=fraction)], net), name)
    expected = max(1, round(fraction * numel))
    assert s.count == expected
    assert s.index.numel() == expected
    assert torch.equal(s.index, s.index.unique())  # sorted, distinct
    assert int(s.index.min()) >= 0 and int(s.index.max()) < numel
    assert s.how.startswith("fraction") and s.values is None


def test_fraction_one_is_every_element(net):
    s = sel(resolve([Pin("fc.weight", fraction=1.0)], net), "fc.weight")
    assert torch.equal(s.index, torch.arange(12))


def test_fraction_reproducible_for_same_seed_and_name(net):
    a = sel(resolve([Pin("twin_a", fraction=0.1, seed=5)], net), "twin_a").index
    torch.manual_seed(1234)  # the global RNG plays no part
    torch.rand(10)
    b = sel(resolve([Pin("twin_a", fraction=0.1, seed=5)], Net()), "twin_a").index
    assert torch.equal(a, b)
    assert torch.equal(a, fraction_indices("twin_a", 1000, 0.1, 5))


def test_fraction_differs_across_names(net):
    plan = resolve([Pin("twin_*", fraction=0.1, seed=5)], net)
    a, b = sel(plan, "twin_a").index, sel(plan, "twin_b").index
    assert a.numel() == b.numel() == 100
    assert not torch.equal(a, b)


def test_fraction_differs_across_seeds(net):
    a = sel(resolve([Pin("twin_a", fraction=0.1, seed=0)], net), "twin_a").index
    b = sel(resolve([Pin("twin_a", fraction=0.1, seed=1)], net), "twin_a").index
    assert not torch.equal(a, b)


def test_fraction_smaller_is_prefix_of_same_permutation(net):
    # Both come from the same permutation, so growing the fraction only adds elements.
    small = set(sel(resolve([Pin("big", fraction=0.01)], net), "big").index.tolist())
    large = set(sel(resolve([Pin("big", fraction=0.1)], net), "big").index.tolist())
    assert small < large


# ----------------------------------------------------------------------------------------------
# Values


def test_value_scalar_whole(net):
    s = sel(resolve_quiet([Pin("fc.weight", value=2.5)], net), "fc.weight")
    assert s.index is None
    assert torch.equal(s.values, torch.full((3, 4), 2.5))


def test_value_int_scalar_whole(net):
    s = sel(resolve_quiet([Pin("fc.bias", value=3)], net), "fc.bias")
    assert torch.equal(s.values, torch.full((3,), 3.0))
    assert s.values.dtype == torch.float32


def test_value_scalar_indices(net):
    s = sel(resolve_quiet([Pin("fc.weight", indices=[(0, 0), (2, 2)], value=-1.5)], net), "fc.weight")
    assert torch.equal(s.values, torch.tensor([-1.5, -1.5]))


def test_value_sequence_follows_indices_order(net):
    s = sel(resolve_quiet([Pin("fc.weight", indices=[(2, 3), (0, 1), (1, 0)], value=[5.0, 7.0, 9.0])], net), "fc.weight")
    assert torch.equal(s.index, torch.tensor([1, 4, 11]))
    assert torch.equal(s.values, torch.tensor([7.0, 9.0, 5.0]))


def test_value_sequence_follows_tensor_indices_order(net):
    s = sel(resolve_quiet([Pin("twin_a", indices=torch.tensor([30, 10, 20]), value=[3.0, 1.0, 2.0])], net), "twin_a")
    assert torch.equal(s.index, torch.tensor([10, 20, 30]))
    assert torch.equal(s.values, torch.tensor([1.0, 2.0, 3.0]))


def test_value_sequence_row_major_for_mask(net):
    mask = _mask((3, 4), [9, 2, 6])
    s = sel(resolve_quiet([Pin("fc.weight", mask=mask, value=[1.0, 2.0, 3.0])], net), "fc.weight")
    assert torch.equal(s.index, torch.tensor([2, 6, 9]))
    assert torch.equal(s.values, torch.tensor([1.0, 2.0, 3.0]))


def test_value_sequence_row_major_for_fraction(net):
    plain = sel(resolve([Pin("big", fraction=0.01)], net), "big").index
    values = [float(i) for i in range(20)]
    s = sel(resolve_quiet([Pin("big", fraction=0.01, value=values)], net), "big")
    assert torch.equal(s.index, plain)
    assert torch.equal(s.values, torch.arange(20, dtype=torch.float32))


def test_value_sequence_row_major_for_whole(net):
    s = sel(resolve_quiet([Pin("fc.weight", value=[float(i) for i in range(12)])], net), "fc.weight")
    assert torch.equal(s.values, torch.arange(12, dtype=torch.float32).reshape(3, 4))


def test_value_nested_list_of_the_shape(net):
    nested = [[float(4 * r + c) for c in range(4)] for r in range(3)]
    s = sel(resolve_quiet([Pin("fc.weight", value=nested)], net), "fc.weight")
    assert torch.equal(s.values, torch.arange(12, dtype=torch.float32).reshape(3, 4))


def test_value_tensor_of_parameter_shape_whole(net):
    value = torch.arange(36, dtype=torch.float32).reshape(2, 2, 3, 3) / 4
    s = sel(resolve_quiet([Pin("conv.weight", value=value)], net), "conv.weight")
    assert torch.equal(s.values, value)
    assert s.values.data_ptr() != value.data_ptr()  # a copy: later edits of the input change nothing


def test_value_tensor_of_parameter_shape_with_indices(net):
    value = torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100
    s = sel(resolve_quiet([Pin("fc.weight", indices=[(2, 1), (0, 3)], value=value)], net), "fc.weight")
    assert torch.equal(s.index, torch.tensor([3, 9]))
    assert torch.equal(s.values, torch.tensor([103.0, 109.0]))


def test_value_tensor_of_parameter_shape_with_mask(net):
    value = torch.arange(36, dtype=torch.float32).reshape(2, 2, 3, 3)
    mask = _mask((2, 2, 3, 3), [4, 30, 17])
    s = sel(resolve_quiet([Pin("conv.weight", mask=mask, value=value)], net), "conv.weight")
    assert torch.equal(s.index, torch.tensor([4, 17, 30]))
    assert torch.equal(s.values, torch.tensor([4.0, 17.0, 30.0]))


def test_value_tensor_of_parameter_shape_with_fraction(net):
    value = torch.arange(2000, dtype=torch.float32).reshape(40, 50)
    s = sel(resolve_quiet([Pin("big", fraction=0.05, value=value)], net), "big")
    assert torch.equal(s.values, s.index.to(torch.float32))


def test_value_1d_tensor_per_element_for_indices(net):
    s = sel(resolve_quiet([Pin("fc.weight", indices=[(1, 1), (0, 0)], value=torch.tensor([8.0, 6.0]))], net), "fc.weight")
    assert torch.equal(s.index, torch.tensor([0, 5]))
    assert torch.equal(s.values, torch.tensor([6.0, 8.0]))


def test_value_dict_by_parameter_name(net):
    plan = resolve_quiet([Pin("fc.*", value={"fc.weight": 1.0, "fc.bias": [4.0, 5.0, 6.0], "other": 9.0})], net)
    assert torch.equal(sel(plan, "fc.weight").values, torch.ones(3, 4))
    assert torch.equal(sel(plan, "fc.bias").values, torch.tensor([4.0, 5.0, 6.0]))


def test_value_dict_with_one_named_entry_does_not_leak_to_other_parameters(net):
    # The user keyed the value by name: fc.bias has no entry. It must not get fc.weight's value.
    try:
        plan = resolve_quiet([Pin("fc.*", value={"fc.weight": 1.0})], net)
    except PinError as err:
        assert "fc.bias" in str(err)
        return
    assert "fc.bias" not in plan.pins[0].selections or plan.pins[0].selections["fc.bias"].values is None


def test_value_pt_file_tensor_of_shape(net, tmp_path):
    path = tmp_path / "v.pt"
    value = torch.arange(12, dtype=torch.float32).reshape(3, 4) * 0.5
    torch.save(value, path)
    s = sel(resolve_quiet([Pin("fc.weight", value=str(path))], net), "fc.weight")
    assert torch.equal(s.values, value)


def test_value_pt_file_per_element_list(net, tmp_path):
    path = tmp_path / "v.pt"
    torch.save([1.0, 2.0], path)
    s = sel(resolve_quiet([Pin("fc.weight", indices=[(2, 0), (0, 2)], value=str(path))], net), "fc.weight")
    assert torch.equal(s.index, torch.tensor([2, 8]))
    assert torch.equal(s.values, torch.tensor([2.0, 1.0]))


def test_value_pt_file_dict_by_name(net, tmp_path):
    path = tmp_path / "v.pt"
    torch.save({"fc.weight": torch.full((3, 4), 0.25), "fc.bias": torch.tensor([1.0, 2.0, 3.0])}, path)
    plan = resolve_quiet([Pin("fc.*", value=str(path))], net)
    assert torch.equal(sel(plan, "fc.weight").values, torch.full((3, 4), 0.25))
    assert torch.equal(sel(plan, "fc.bias").values, torch.tensor([1.0, 2.0, 3.0]))


def test_value_safetensors_file_dict_by_name(net, tmp_path):
    path = tmp_path / "v.safetensors"
    save_file({"fc.weight": torch.full((3, 4), -0.5), "conv.bias": torch.tensor([7.0, 8.0])}, str(path))
    plan = resolve_quiet([Pin(["fc.weight", "conv.bias"], value=str(path))], net)
    assert torch.equal(sel(plan, "fc.weight").values, torch.full((3, 4), -0.5))
    assert torch.equal(sel(plan, "conv.bias").values, torch.tensor([7.0, 8.0]))


def test_value_safetensors_file_single_entry_with_mask(net, tmp_path):
    path = tmp_path / "v.safetensors"
    save_file({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}, str(path))
    s = sel(resolve_quiet([Pin("fc.weight", mask=_mask((3, 4), [1, 10]), value=str(path))], net), "fc.weight")
    assert torch.equal(s.values, torch.tensor([1.0, 10.0]))


def test_value_and_mask_from_same_file_read(net, tmp_path):
    path = tmp_path / "both.pt"
    torch.save({"fc.weight": _mask((3, 4), [0, 1])}, path)
    s = sel(resolve([Pin("fc.weight", mask=str(path))], net), "fc.weight")
    assert torch.equal(s.index, torch.tensor([0, 1]))


def test_duplicate_indices_with_equal_values_ok(net):
    s = sel(resolve_quiet([Pin("fc.weight", indices=[(1, 1), (0, 0), (1, 1)], value=[3.0, 4.0, 3.0])], net), "fc.weight")
    assert torch.equal(s.index, torch.tensor([0, 5]))
    assert torch.equal(s.values, torch.tensor([4.0, 3.0]))


def test_duplicate_indices_with_different_values_error(net):
    with pytest.raises(PinError, match="repeat an element of 'fc.weight' with different values"):
        resolve([Pin("fc.weight", indices=[(1, 1), (0, 0), (1, 1)], value=[3.0, 4.0, 3.5])], net)


def test_explicit_value_beats_value_none_on_same_element(net):
    pins = [Pin("fc.weight"), Pin("fc.weight", indices=[(1, 2)], value=42.0)]
    plan = resolve(pins, net)  # no conflict error
    assert sel(plan, "fc.weight", 0).values is None
    assert torch.equal(sel(plan, "fc.weight", 1).values, torch.tensor([42.0]))
    # ... and the engine's merged target uses the explicit value there, the captured ones elsewhere.
    before = net.fc.weight.detach().clone()
    engine = PinEngine(plan)
    engine.set_active([0, 1])
    (target,) = engine.targets()
    expected = before.clone()
    expected[1, 2] = 42.0
    assert target.index is None
    assert torch.equal(target.values, expected)


def test_explicit_values_equal_on_overlap_ok(net):
    plan = resolve([Pin("fc.bias", value=1.0), Pin("fc.bias", indices=[1], value=1.0)], net)
    assert len(plan.pins) == 2


def test_conflicting_values_in_separate_windows_ok(net):
    pins = [Pin("fc.bias", value=1.0, stop_step=5), Pin("fc.bias", indices=[1], value=2.0, start_step=5)]
    plan = resolve(pins, net)
    assert plan.pins[0].in_window(4) and not plan.pins[0].in_window(5)
    assert plan.pins[1].in_window(5) and not plan.pins[1].in_window(4)


def test_resolve_writes_no_weight(net):
    before = {k: v.clone() for k, v in net.state_dict().items()}
    resolve([Pin("fc.weight", value=9.0), Pin("big", fraction=0.5, value=1.0), Pin("conv.*")], net)
    after = net.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


# ----------------------------------------------------------------------------------------------
# dtype, device and rounding


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_targets_in_parameter_dtype(dtype):
    m = Net(dtype=dtype)
    plan = resolve_quiet(
        [
            Pin("fc.weight", value=0.5),
            Pin("fc.bias", indices=[0, 2], value=[-2.0, 0.25]),
            Pin("conv.weight", value=torch.ones(2, 2, 3, 3, dtype=torch.float64)),
            Pin("twin_a", fraction=0.01, value=3),
        ],
        m,
    )
    for rp in plan.pins:
        for s in rp.selections.values():
            assert s.values.dtype == dtype
            assert s.values.device == s.parameter.device
    assert torch.equal(sel(plan, "fc.bias", 1).values, torch.tensor([-2.0, 0.25], dtype=dtype))
    assert torch.equal(sel(plan, "twin_a", 3).values, torch.full((10,), 3.0, dtype=dtype))


def test_float64_keeps_0_1_exactly_without_warning():
    m = Net(dtype=torch.float64)
    s = sel(resolve_quiet([Pin("fc.bias", value=0.1)], m), "fc.bias")
    assert s.values.dtype == torch.float64
    assert torch.equal(s.values, torch.full((3,), 0.1, dtype=torch.float64))
    assert s.values[0].item() == 0.1


def test_targets_on_parameter_device_meta():
    m = Net(device="meta")
    plan = resolve(
        [Pin("fc.weight", indices=[(0, 1)], value=2.0), Pin("big", fraction=0.1), Pin("fc.bias", value=1.0)], m
    )
    assert sel(plan, "fc.weight", 0).values.device.type == "meta"
    assert sel(plan, "fc.weight", 0).index.device.type == "meta"
    assert sel(plan, "big", 1).index.device.type == "meta"
    assert sel(plan, "fc.bias", 2).values.device.type == "meta"


@pytest.mark.parametrize(
    "dtype, asked, expected_stored",
    [
        (torch.float32, 0.1, 0.10000000149011612),
        (torch.bfloat16, 257, 256.0),
        (torch.bfloat16, 0.1, 0.10009765625),
        (torch.float16, 0.1, 0.0999755859375),
        (torch.float16, 2049, 2048.0),
        (torch.float32, 16777217, 16777216.0),
    ],
)
def test_inexact_value_rounded_with_warning(dtype, asked, expected_stored):
    m = Net(dtype=dtype)
    messages: list[str] = []
    pin = Pin("fc.bias", indices=[1], value=asked)
    s = sel(resolve([pin], m, warn=messages.append), "fc.bias")
    nearest = torch.tensor(asked, dtype=torch.float64).to(dtype)
    assert nearest.item() == expected_stored
    assert torch.equal(s.values, nearest.reshape(1))
    assert len(messages) == 1
    message = messages[0]
    assert repr(pin) in message
    assert "'fc.bias'" in message
    assert str(dtype) in message
    assert f"{asked!r} is stored as {expected_stored!r}" in message
    assert "nearest" in message


def test_inexact_value_default_warn_is_userwarning():
    m = Net()
    with pytest.warns(UserWarning, match=r"0\.1 is stored as 0\.10000000149011612"):
        resolve([Pin("fc.bias", value=0.1)], m)


def test_inexact_warning_counts_values():
    m = Net(dtype=torch.bfloat16)
    messages: list[str] = []
    resolve([Pin("fc.weight", indices=[(0, 0), (0, 1), (0, 2)], value=[257.0, 256.0, 0.1])], m, warn=messages.append)
    assert len(messages) == 1
    assert "2 value(s)" in messages[0]
    assert "257.0 is stored as 256.0" in messages[0]


@pytest.mark.parametrize(
    "dtype, value",
    [
        (torch.float32, 0.5),
        (torch.float32, [0.25, -3.0, 1024.0, 2.0**-20]),
        (torch.float32, 16777216),
        (torch.bfloat16, 256),
        (torch.bfloat16, [0.5, -1.5, 3.0]),
        (torch.float16, [65504.0, 2048, -0.125]),
        (torch.float64, [0.1, 1e300, 2.0**53]),
        (torch.float32, torch.tensor([0.1, 0.2, 0.3], dtype=torch.float32)),  # already float32
    ],
)
def test_exact_values_no_warning(dtype, value):
    m = Net(dtype=dtype)
    count = 1 if not isinstance(value, (list, torch.Tensor)) else len(value)
    messages: list[str] = []
    s = sel(resolve([Pin("twin_a", indices=list(range(count)), value=value)], m, warn=messages.append), "twin_a")
    assert messages == []
    expected = torch.as_tensor(value, dtype=torch.float64).to(dtype).reshape(-1).expand(count)
    assert torch.equal(s.values, expected)
    assert torch.equal(s.values.to(torch.float64), torch.as_tensor(value, dtype=torch.float64).reshape(-1).expand(count))


def test_int_value_beyond_float64_precision_warns():
    m = Net(dtype=torch.float64)
    messages: list[str] = []
    s = sel(resolve([Pin("fc.bias", indices=[0], value=2**53 + 1)], m, warn=messages.append), "fc.bias")
    assert s.values.item() == 2.0**53
    assert len(messages) == 1 and "stored as" in messages[0]


# ----------------------------------------------------------------------------------------------
# pinned_counts and summary


def test_pinned_counts_union(net):
    pins = [
        Pin("fc.weight", indices=[(0, 0), (0, 1)]),
        Pin("fc.weight", indices=[(0, 1), (1, 1)], value=0.0, start_step=3),
        Pin("conv.weight", mask=_mask((2, 2, 3, 3), [0, 1, 2])),
        Pin("conv.weight", indices=[(0, 0, 0, 2), (1, 1, 2, 2)]),
        Pin("fc.bias", indices=[0]),
        Pin("fc.bias"),
        Pin("big", fraction=0.05),
        Pin("big", fraction=0.05, seed=1),
    ]
    plan = resolve(pins, net)
    counts = plan.pinned_counts()
    big_a = set(fraction_indices("big", 2000, 0.05, 0).tolist())
    big_b = set(fraction_indices("big", 2000, 0.05, 1).tolist())
    assert counts == {"fc.weight": 3, "fc.bias": 3, "conv.weight": 4, "big": len(big_a | big_b)}
    assert len(big_a | big_b) > 100


def _summary_rows(text):
    lines = text.splitlines()
    return {line.split()[0]: line for line in lines[1:-1]}, lines


def test_summary(net):
    net.fc2.weight.requires_grad_(False)
    pins = [
        Pin("fc.*"),
        Pin("conv.weight", indices=[(0, 0, 0, 0), (1, 1, 2, 2)], value=1.0, start_step=2),
        Pin("big", fraction=0.1, seed=3, value=0.0, when="operator.eq"),
        Pin("fc.weight", indices=[(0, 0)], value=5.0, stop_step=9),
    ]
    plan = resolve(pins, net)
    text = plan.summary()
    rows, lines = _summary_rows(text)
    assert lines[0].split() == ["parameter", "shape", "elements", "pinned", "how"]
    assert list(rows) == ["big", "fc.weight", "fc.bias", "conv.weight"]  # module order, only pinned ones
    assert rows["fc.weight"].split()[:4] == ["fc.weight", "3x4", "12", "12"]
    assert "whole, current values" in rows["fc.weight"]
    assert "indices, explicit values, steps 0..8" in rows["fc.weight"]  # stop_step=9: the last step held is 8
    assert rows["fc.bias"].split()[:4] == ["fc.bias", "3", "3", "3"]
    assert rows["conv.weight"].split()[:4] == ["conv.weight", "2x2x3x3", "36", "2"]
    assert "indices, explicit values, steps 2..end" in rows["conv.weight"]
    assert rows["big"].split()[:4] == ["big", "40x50", "2,000", "200"]
    assert "fraction 0.1 (seed 3), explicit values" in rows["big"]
    assert "when eq" in rows["big"]
    trainable = sum(p.numel() for p in net.parameters() if p.requires_grad)
    pinned = 12 + 3 + 2 + 200
    assert lines[-1].startswith(
        f"trainable elements: {trainable:,}  pinned: {pinned:,}  free: {trainable - pinned:,}"
    )
    assert "(4 pins on 4 parameters)" in lines[-1]
    assert plan.trainable_elements == trainable == sum(p.numel() for p in net.parameters()) - 6


def test_summary_single_pin_wording(net):
    text = resolve([Pin("fc.bias", indices=[1])], net).summary()
    rows, lines = _summary_rows(text)
    assert list(rows) == ["fc.bias"]
    assert rows["fc.bias"].split()[:4] == ["fc.bias", "3", "3", "1"]
    assert "indices, current values" in rows["fc.bias"]
    assert "(1 pin on 1 parameter)" in lines[-1]
    one_step = resolve([Pin("fc.bias", indices=[1], start_step=4, stop_step=5)], net).summary()
    assert "indices, current values, step 4" in one_step


def test_empty_plan(net):
    plan = resolve([], net)
    assert plan.pins == [] and plan.parameters == {} and plan.pinned_counts() == {}
    assert plan.trainable_elements == sum(p.numel() for p in net.parameters())
    assert "pinned: 0" in plan.summary()


def test_plan_fingerprint_equal_for_equal_plans_and_differs_otherwise(net):
    a = resolve([Pin("fc.weight", indices=[(0, 1)], value=1.0)], net).fingerprint()
    b = resolve([Pin("fc.weight", indices=[(0, 1)], value=1.0)], Net()).fingerprint()
    c = resolve([Pin("fc.weight", indices=[(0, 1)], value=2.0)], net).fingerprint()
    d = resolve([Pin("fc.weight", indices=[(0, 2)], value=1.0)], net).fingerprint()
    assert a == b
    assert len({a, c, d}) == 3


def test_plan_fingerprint_of_a_scalar_target_on_a_one_element_parameter():
    """The ranks compare fingerprints under DDP: a binary classifier's bias pinned to a scalar (a
    target broadcast over one element, stride 0) once crashed the comparison."""
    head = nn.Linear(2, 1)
    zero = resolve([Pin("bias", value=0.0)], head).fingerprint()
    assert zero == resolve([Pin("bias", value=0.0)], nn.Linear(2, 1)).fingerprint()
    assert zero != resolve([Pin("bias", value=1.0)], head).fingerprint()
