"""``handle.hold(averaged)``: a plain loop's ``torch.optim.swa_utils.AveragedModel`` copy holds the
pins (exact values, stuck bits, bounds) after every ``update_parameters``, as Lightning's averaging
callbacks are held by PinCallback."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from lightning_pin import Pin, PinError, pin


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _pins():
    return [
        Pin("0.weight", indices=[(0, 0), (1, 2)], value=[0.1, -3.0]),  # 0.1: rounded to float32, with a warning
        Pin("0.weight", indices=[(2, 1), (3, 3)], stuck_at_one=0x80000001, stuck_at_zero=0x00400002),
        Pin("2.bias", bounds=(0.0, 0.05)),
    ]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


def _assert_held(module: nn.Module) -> None:
    w = module.get_parameter("0.weight").detach()
    assert torch.equal(w[0, 0], torch.tensor(0.1, dtype=torch.float32)) and torch.equal(w[1, 2], torch.tensor(-3.0))
    for i, j in ((2, 1), (3, 3)):
        word = int(_bits(w)[i, j]) & 0xFFFFFFFF
        assert word & 0x80000001 == 0x80000001 and not word & 0x00400002, (i, j, hex(word))
    b = module.get_parameter("2.bias").detach()
    assert bool(((b >= 0.0) & (b <= 0.05)).all()), b


@pytest.mark.filterwarnings("ignore:.*not representable")
@pytest.mark.parametrize("averaging", ["swa", "ema"])
def test_an_averaged_model_of_a_plain_loop_holds_values_stuck_bits_and_bounds(averaging):
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    kwargs = {"multi_avg_fn": get_ema_multi_avg_fn(0.9)} if averaging == "ema" else {}
    averaged = AveragedModel(model, **kwargs)  # a copy taken before the pins existed
    with pin(model, optimizer, _pins()) as handle:
        unheld = AveragedModel(model, **kwargs)  # the control: a copy taken with the pins in place, not held
        held = handle.hold(averaged)
        _assert_held(averaged.module)  # written in at once
        broken = 0
        for step in range(6):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g)
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            averaged.update_parameters(model)
            unheld.update_parameters(model)
            _assert_held(averaged.module)
            handle.verify(averaged.module)
            try:
                handle.verify(unheld.module)
            except PinError as err:  # averaging words breaks their stuck bits
                assert "0.weight" in str(err) and "with stuck bits off" in str(err)
                broken += 1
        handle.verify()  # checks the held copy too
        assert broken >= 2, broken  # the control: without hold() the copy does not hold the pins
        # The rest of the copy is the average: it differs from the live model.
        assert not torch.equal(averaged.module[0].weight.detach(), model[0].weight.detach())
        held.remove()
        assert "update_parameters" not in vars(averaged)


@pytest.mark.filterwarnings("ignore:.*not representable")
def test_a_copy_taken_before_pin_is_off_until_held_and_verify_names_a_held_copy_written_by_someone_else():
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    with pin(model, optimizer, _pins()) as handle:
        with pytest.raises(PinError, match="off target"):
            handle.verify(averaged.module)  # copied before pin() forced anything
        handle.hold(averaged)
        with torch.no_grad():
            averaged.module[0].weight[1, 2] = 7.0  # someone else writes the copy
        with pytest.raises(PinError, match=r"in the held copy AveragedModel.*0.weight"):
            handle.verify()


def test_hold_refuses_what_it_cannot_hold_and_the_handle_takes_its_holds_with_it():
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = pin(model, optimizer, [Pin("2.bias", value=0.0)])
    with pytest.raises(PinError, match="hold\\(\\) takes a torch.optim.swa_utils.AveragedModel"):
        handle.hold(nn.Linear(2, 2))
    with pytest.raises(PinError, match="lacks the pinned parameter"):
        handle.hold(AveragedModel(nn.Linear(4, 8)))
    averaged = AveragedModel(model)
    handle.hold(averaged)
    handle.remove()
    assert "update_parameters" not in vars(averaged)
    with pytest.raises(PinError, match="removed PinHandle"):
        handle.hold(averaged)
    assert math.isfinite(float(averaged.module[2].bias.sum()))
