"""Gradient masks on their fast paths: one C-level map of ``put_`` over many small tensors
(``PinEngine.mask_all_grads``) and one dense pass with a kept mask for pins of many elements
(``Target._keep_dense``: int8, or the gradient's word width on CPU) write the same words as the general
mask, ``index_fill_`` of zeros."""

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
    fraction=st.floats(0.34, 1.0),
    dtype=st.sampled_from(list(BITS_DTYPES)),
    seed=st.integers(0, 2**16),
    narrow=st.booleans(),
)
def test_the_dense_mask_writes_the_words_index_fill_writes(numel, fraction, dtype, seed, narrow):
    """Either mask dtype: the word width (CPU's) or int8 (CUDA's, sign-extended by the AND)."""
    index = dense_index(numel, fraction, seed)
    count = index.numel()
    parameter = nn.Parameter(torch.zeros(numel, dtype=dtype))
    target = Target("w", parameter, index, torch.zeros(count, dtype=dtype))
    grad = with_specials(numel, dtype, seed)
    expected = grad.clone().index_fill_(0, index.long(), 0)
    keep_dtype = torch.int8 if narrow else BITS_DTYPES[dtype]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sharding, "keep_dtype", lambda grad: keep_dtype)
        assert target._keep_dense(grad)
    assert target._keep.dtype == keep_dtype
    assert torch.equal(grad.view(BITS_DTYPES[dtype]), expected.view(BITS_DTYPES[dtype]))


def test_on_cpu_the_mask_has_the_gradients_word_width():
    """CPU kernels would copy an int8 mask to the word width on every step (see keep_dtype)."""
    for dtype, word in BITS_DTYPES.items():
        parameter = nn.Parameter(torch.zeros(6, dtype=dtype))
        target = Target("w", parameter, torch.arange(3, dtype=torch.int32), torch.zeros(3, dtype=dtype))
        assert target._keep_dense(torch.ones(6, dtype=dtype))
        assert target._keep.dtype == word


def test_mask_grad_takes_the_dense_pass_from_a_third_of_the_elements_on(monkeypatch):
    monkeypatch.setattr(sharding, "WIDE_LIMIT", 4)  # the path a large pin takes: dense from a third on
    numel = 90
    for count, dense in ((29, False), (30, True), (90, True)):
        index = torch.arange(0, numel, numel // count, dtype=torch.int32)[:count]
        target = Target("w", nn.Parameter(torch.zeros(numel)), index, torch.zeros(count))
        grad = with_specials(numel, torch.float32, count)
        expected = grad.clone().index_fill_(0, index.long(), 0)
        target.mask_grad(grad)
        assert (target._keep is not None) is dense
        assert torch.equal(grad.view(torch.int32), expected.view(torch.int32))


def test_a_permuted_gradient_is_masked_by_the_general_path():
    parameter = nn.Parameter(torch.zeros(4, 6))
    index = torch.arange(0, 24, 2, dtype=torch.int32)  # half the elements, row-major
    target = Target("w", parameter, index, torch.zeros(12))
    grad = with_specials(24, torch.float32, 3).view(6, 4).t()  # (4, 6), not contiguous
    expected = grad.contiguous().view(-1).index_fill_(0, index.long(), 0).view(4, 6)
    assert not target._keep_dense(grad)
    target.mask_grad(grad)
    assert target._keep is None
    assert torch.equal(grad.contiguous().view(torch.int32), expected.view(torch.int32))


def test_many_small_masks_run_as_one_map_and_match_one_at_a_time():
    torch.manual_seed(0)
    model = TanhStack(6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    names = [f"layers.{i}.weight" for i in range(6)]
    with pin(model, opt, [Pin(names, fraction=0.25, seed=4, value=0.5)]) as handle:
        engine = handle.engine
        model(torch.randn(3, 8)).sum().backward()  # the end of backward masks them
        engine._build_grad_masks()
        assert len(engine._all_grad_masks.puts[0]) == 6 and not engine._all_grad_masks.pairs  # all mapped
        for name in names:
            grad = model.get_parameter(name).grad
            index = engine.plan.pins[0].selections[name].index.long()
            assert torch.equal(grad.view(-1)[index], torch.zeros(index.numel()))
            assert grad.view(-1).ne(0).sum() > 0  # the free elements keep theirs

        # A missing gradient (a layer out of this backward) or a cast one (refused before the step,
        # masked all the same): one at a time, the same words.
        model.zero_grad()
        model.double()
        model(torch.randn(3, 8, dtype=torch.float64)).sum().backward()
        model.layers[2].weight.grad = None
        engine.mask_all_grads()
        assert model.layers[2].weight.grad is None
        for name in names[:2] + names[3:]:
            grad = model.get_parameter(name).grad
            index = engine.plan.pins[0].selections[name].index.long()
            assert grad.dtype == torch.float64
            assert torch.equal(grad.view(-1)[index], torch.zeros(index.numel(), dtype=torch.float64))


@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_a_training_loop_holds_with_either_mask(fraction, monkeypatch):
    monkeypatch.setattr(sharding, "WIDE_LIMIT", 4)  # large pins: dense from a third on
    torch.manual_seed(1)
    model = TanhStack(6)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    with pin(model, opt, [Pin("layers.1.weight", fraction=fraction, seed=2, value=0.125)]) as handle:
        for _ in range(3):
            model(torch.randn(5, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        handle.verify()
        target = handle.engine.targets()[0]
        assert (target._keep is not None) is (fraction > 1 / 3)
        state = opt.state[model.layers[1].weight]
        index = handle.engine.plan.pins[0].selections["layers.1.weight"].index.long()
        assert torch.equal(state["exp_avg"].view(-1)[index], torch.zeros(index.numel()))
