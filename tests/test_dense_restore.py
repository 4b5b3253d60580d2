"""The restore of a CPU tensor with a third or more of its elements pinned is one dense pass over its
words (``Target._dense_write``: ``targets + words * kept``); it writes exactly the words ``index_copy_``
writes, for every bit pattern, and leaves every free word as it was."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from helpers import TanhStack, dense_index, with_specials
from lightning_pin import Pin, pin
from lightning_pin.core import sharding
from lightning_pin.core.kinds.stuck_bits import BITS_DTYPES
from lightning_pin.core.sharding import Target


@settings(max_examples=40, deadline=None)
@given(
    numel=st.integers(3, 400),
    fraction=st.floats(0.0, 1.0),
    dtype=st.sampled_from(list(BITS_DTYPES)),
    seed=st.integers(0, 2**16),
)
def test_the_dense_restore_writes_the_words_index_copy_writes(numel, fraction, dtype, seed):
    index = dense_index(numel, fraction, seed)
    count = index.numel()
    targets = with_specials(count, dtype, seed + 1)
    parameter = nn.Parameter(with_specials(numel, dtype, seed))
    expected = parameter.detach().clone().index_copy_(0, index.long(), targets)
    target = Target("w", parameter, index, targets)

    for _ in range(2):  # the second pass reads the kept targets and mask
        assert target.restore_dense()
        assert target._dense_targets is not None
        assert torch.equal(parameter.detach().view(BITS_DTYPES[dtype]), expected.view(BITS_DTYPES[dtype]))
        parameter.data.view(BITS_DTYPES[dtype]).add_(1)  # an optimizer step moved every element
        expected.view(BITS_DTYPES[dtype])[_free(numel, index)] += 1


def _free(numel: int, index: torch.Tensor) -> torch.Tensor:
    free = torch.ones(numel, dtype=torch.bool)
    free[index.long()] = False
    return free


@pytest.mark.parametrize("keep_wide", [True, False])
def test_below_a_third_or_on_a_permuted_tensor_the_index_kernels_write(monkeypatch, keep_wide):
    monkeypatch.setattr(sharding, "WIDE_LIMIT", 4)  # the path a large pin takes
    monkeypatch.setattr(sharding, "KEEP_WIDE_ON_CPU", keep_wide)  # False: no int64 copy, as off the CPU
    numel = 90
    for count, dense in ((29, False), (30, True), (90, True)):
        index = torch.arange(0, numel, numel // count, dtype=torch.int32)[:count]
        parameter = nn.Parameter(torch.zeros(numel))
        target = Target("w", parameter, index, torch.full((count,), 2.5))
        # below a third: index_copy_ of the kept int64 positions, or (no copy) False: the engine writes it
        # with copy_at; from a third on the dense pass, and no int64 copy is kept for it
        assert target.restore_dense() is (dense or keep_wide)
        assert (target._dense_targets is not None) is dense
        assert (target._wide is not None) is (keep_wide and not dense)
        if target.restore_dense():
            expected = torch.zeros(numel).index_fill_(0, index.long(), 2.5)
            assert torch.equal(parameter.detach(), expected)

    parameter = nn.Parameter(torch.zeros(6, 4).t())  # (4, 6), not contiguous
    target = Target("w", parameter, torch.arange(0, 24, 2, dtype=torch.int32), torch.ones(12))
    assert target._dense_write(parameter.data) is None


def test_a_new_storage_gets_the_targets_written_into_it():
    index = torch.arange(0, 12, 2, dtype=torch.int32)
    parameter = nn.Parameter(torch.zeros(12))
    target = Target("w", parameter, index, torch.full((6,), 7.0))
    assert target.restore_dense()
    parameter.data = torch.full((12,), -1.0)  # a .data swap: the bound pass wrote into the old words
    assert target.restore_dense()
    expected = torch.full((12,), -1.0).index_fill_(0, index.long(), 7.0)
    assert torch.equal(parameter.detach(), expected)


def test_a_training_loop_with_weight_decay_holds_its_pins_through_the_dense_restore(monkeypatch):
    monkeypatch.setattr(sharding, "WIDE_LIMIT", 4)  # a large pin's path
    torch.manual_seed(3)
    model = TanhStack(3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)  # decay moves pinned values too
    weight = model.layers[1].weight
    before = weight.detach().clone()
    with pin(model, opt, [Pin("layers.1.weight", fraction=0.5, seed=2, value=0.125)]) as handle:
        index = handle.engine.plan.pins[0].selections["layers.1.weight"].index.long()
        for _ in range(3):
            model(torch.randn(5, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            assert torch.equal(weight.detach().view(-1)[index], torch.full((index.numel(),), 0.125))
        assert handle.engine.targets()[0]._dense_targets is not None
        free = _free(weight.numel(), index)
        assert not torch.equal(weight.detach().view(-1)[free], before.view(-1)[free])  # the free ones trained
        handle.verify()
