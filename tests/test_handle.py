"""The torch-native front door: ``pin(module, optimizers, pins) -> PinHandle`` in plain loops.

Every optimizer of the matrix in ``test_optimizers`` through ``pin()``; gradient accumulation
with clipping; ``GradScaler`` on CPU (skipped steps included); step windows and what each
forward sees; ``when`` pins with ``batch_start`` (per-task freezing under Adam); ``verify``,
``remove`` and the context manager; a rejected spec leaves nothing behind; save/resume with
``torch.save`` / ``torch.load(weights_only=True)``; ``torch.compile``; Lightning Fabric.
The two-process DDP run is in ``test_handle_ddp.py``.

Expected targets are computed by the tests themselves (explicit values cast by hand, captured
ones from snapshots the test takes), and compared with ``torch.equal``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import TinyNet, make_loader, snapshot
from test_optimizers import BATCH, CASES, STEPS, _free_mask, _pins_and_expected
from torch import nn

from lightning_pin import Pin, PinError, PinHandle, pin
from lightning_pin.core.engine import PARKED_VALUE
from lightning_pin.core.plan import fraction_indices

# --------------------------------------------------------------------------------------------
# Shared pieces


def ce_loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def batches(steps: int, seed: int = 0) -> list:
    return list(make_loader(n=steps * BATCH, batch_size=BATCH, seed=seed))


def values_at(params: dict, name: str, index):
    tensor = params[name].detach()
    return tensor if index is None else tensor.reshape(-1)[index]


def off_targets(model, entries) -> list[str]:
    """Names whose pinned elements differ from the expected targets (bit for bit)."""
    params = dict(model.named_parameters())
    return [name for name, index, values in entries if not torch.equal(values_at(params, name, index), values)]


def nonzero_pinned_grads(model, entries) -> list[str]:
    """Names whose pinned gradient entries are not exactly zero (a missing grad counts as zero)."""
    params = dict(model.named_parameters())
    bad = []
    for name, index, _ in entries:
        grad = params[name].grad
        if grad is None:
            continue
        at = grad if index is None else grad.reshape(-1)[index]
        if not torch.equal(at, torch.zeros_like(at)):
            bad.append(name)
    return bad


def hook_counts(model, optimizers) -> tuple:
    """How many grad hooks each parameter holds, and step pre/post hooks each optimizer holds."""
    grads = tuple(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    steps = tuple((len(o._optimizer_step_pre_hooks), len(o._optimizer_step_post_hooks)) for o in optimizers)
    return grads, steps


# --------------------------------------------------------------------------------------------
# Every optimizer of the matrix


@pytest.mark.parametrize("opt_cls,opt_kwargs", CASES)
def test_pins_exact_after_every_step(opt_cls, opt_kwargs):
    model = TinyNet()
    pins, exp, init, pinned = _pins_and_expected(model)
    optimizer = opt_cls(model.parameters(), **opt_kwargs)
    handle = pin(model, optimizer, pins)
    # Pins of step 0 are forced by pin() itself, before the first forward.
    assert off_targets(model, exp.entries) == []
    for step, batch in enumerate(batches(STEPS)):
        ce_loss(model, batch).backward()
        assert nonzero_pinned_grads(model, exp.entries) == [], f"pinned grads not zero after backward {step}"
        optimizer.step()
        assert off_targets(model, exp.entries) == [], f"off target after step {step}"
        assert handle.step == step + 1
        optimizer.zero_grad()
    handle.verify()
    handle.remove()
    params = dict(model.named_parameters())
    for name in ("head.weight", "encoder.weight", "head.bias"):
        now, before = params[name].detach().reshape(-1), init[name].reshape(-1)
        free = _free_mask(name, now.numel(), pinned)
        moved = now[free] != before[free]
        assert bool(moved.all()), f"{name}: {int((~moved).sum())} of {int(free.sum())} free elements never moved"


def test_lbfgs_closure_steps_are_exact():
    """LBFGS runs the closure (forward and backward) several times inside one step."""
    model = TinyNet()
    pins, exp, init, pinned = _pins_and_expected(model)
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    handle = pin(model, optimizer, pins)
    for batch in batches(3):

        def closure():
            optimizer.zero_grad()
            loss = ce_loss(model, batch)
            loss.backward()
            assert nonzero_pinned_grads(model, exp.entries) == []
            return loss

        optimizer.step(closure)
        assert off_targets(model, exp.entries) == []
    assert handle.step == 3
    free = _free_mask("head.weight", 48, pinned)
    assert bool((model.head.weight.detach().reshape(-1)[free] != init["head.weight"].reshape(-1)[free]).all())


# --------------------------------------------------------------------------------------------
# Gradient accumulation with clipping


def test_accumulation_with_clipping_ignores_pinned_grads():
    """Pinned grads are zero after every backward of an accumulation window, and clipping gives
    exactly what it gives on gradients whose pinned entries were zeroed by hand."""
    micro, steps, max_norm = 3, 3, 0.05
    model = TinyNet()
    pins, exp, _, _ = _pins_and_expected(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    handle = pin(model, optimizer, pins)
    twin = copy.deepcopy(model)  # same weights (pins already forced), no hooks
    assert hook_counts(twin, [])[0] == tuple(0 for _ in twin.parameters())
    data = batches(steps * micro)
    for step in range(steps):
        twin.load_state_dict(model.state_dict())
        twin.zero_grad()
        for i in range(micro):
            batch = data[step * micro + i]
            (ce_loss(model, batch) / micro).backward()
            assert nonzero_pinned_grads(model, exp.entries) == [], f"step {step}, micro-batch {i}"
            (ce_loss(twin, batch) / micro).backward()
        # The twin's pinned entries zeroed by hand, after accumulating.
        twin_params = dict(twin.named_parameters())
        with torch.no_grad():
            for name, index, _ in exp.entries:
                grad = twin_params[name].grad
                if index is None:
                    grad.zero_()
                else:
                    grad.view(-1)[index] = 0.0
        unmasked = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in twin.parameters()]))
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        twin_norm = torch.nn.utils.clip_grad_norm_(twin.parameters(), max_norm)
        assert torch.equal(norm, twin_norm) and norm > max_norm  # the clip really scaled
        assert torch.equal(unmasked, twin_norm)
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert torch.equal(p.grad, q.grad), f"{name}: clipped grads differ at step {step}"
        optimizer.step()
        assert off_targets(model, exp.entries) == []
        optimizer.zero_grad()
    assert handle.step == steps


def test_clip_norm_would_differ_with_pinned_grads():
    """Sanity for the test above: on this model the pinned grads do change the clip norm."""
    model = TinyNet()
    pins, exp, _, _ = _pins_and_expected(model)
    twin = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pin(model, optimizer, pins):
        twin.load_state_dict(model.state_dict())
        batch = batches(1)[0]
        ce_loss(model, batch).backward()
        ce_loss(twin, batch).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        assert norm < torch.nn.utils.clip_grad_norm_(twin.parameters(), 1e9)


# --------------------------------------------------------------------------------------------
# GradScaler on CPU


@pytest.mark.parametrize("fused", [False, True], ids=["adam-forloop", "adam-fused"])
def test_grad_scaler_with_a_skipped_step(fused):
    """A step the scaler skips changes no weight. A non-fused optimizer's step() is then never
    called, so it is not counted; a fused one's step() is called and skips its update itself
    (found_inf on the device), so it is counted without a host sync."""
    model = TinyNet()
    pins, exp, _, _ = _pins_and_expected(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.1, **({"fused": True} if fused else {}))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    handle = pin(model, optimizer, pins)
    skip_at, counted = 2, 0
    for step, batch in enumerate(batches(5)):
        scaler.scale(ce_loss(model, batch)).backward()
        assert nonzero_pinned_grads(model, exp.entries) == []
        if step == skip_at:
            with torch.no_grad():
                model.head.bias.grad[0] = float("inf")  # a free element
        before, scale = snapshot(model), scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        after = snapshot(model)
        if step == skip_at:
            assert scaler.get_scale() < scale, "the scaler did not skip"
            assert all(torch.equal(after[n], before[n]) for n in before), "a skipped step changed a weight"
            counted += fused
        else:
            assert not torch.equal(after["head.bias"], before["head.bias"])
            counted += 1
        assert handle.step == counted
        assert off_targets(model, exp.entries) == []
        optimizer.zero_grad()
    assert handle.step == (5 if fused else 4)
    handle.verify()


# --------------------------------------------------------------------------------------------
# Step windows: what each forward sees


def test_windows_forced_before_the_forward_that_should_see_them():
    steps, start, stop = 6, 2, 4
    model = TinyNet()
    a_idx, a_vals = torch.tensor([0, 18]), torch.tensor([0.5, -0.5])  # head.weight (0, 0), (1, 2)
    b_idx = torch.tensor([5, 26])  # encoder.weight (0, 5), (3, 2)
    pins = [
        Pin("head.weight", indices=[(0, 0), (1, 2)], value=[0.5, -0.5], start_step=start, stop_step=stop),
        Pin("encoder.weight", indices=[(0, 5), (3, 2)], start_step=3),  # value=None: captured at activation
        Pin("head.bias", value=0.25),  # from step 0: forced by pin() itself
    ]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, foreach=False)
    seen: list[tuple] = []
    handle = pin(model, optimizer, pins)
    model.register_forward_pre_hook(
        lambda module, args: seen.append(
            (handle.step, module.head.weight.detach().reshape(-1)[a_idx].clone(), module.head.bias.detach().clone())
        )
    )
    assert torch.equal(model.head.bias.detach(), torch.full((3,), 0.25))
    state = optimizer.state
    after: list[dict] = []
    stats: list[torch.Tensor] = []
    for batch in batches(steps):
        ce_loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        after.append(snapshot(model))
        stats.append(torch.stack([state[model.head.weight][k].reshape(-1)[a_idx] for k in ("exp_avg", "exp_avg_sq")]))
    assert [s for s, _, _ in seen] == list(range(steps))
    for step, head_a, bias in seen:
        assert torch.equal(bias, torch.full((3,), 0.25))
        # The forward of step `start` already sees the window's values, the one before does not.
        assert torch.equal(head_a, a_vals) == (start <= step <= stop), (step, head_a)
    for step in range(steps):
        a_now = after[step]["head.weight"].reshape(-1)[a_idx]
        assert torch.equal(a_now, a_vals) == (start - 1 <= step < stop), (step, a_now)  # forced after step start-1
    # Released from step `stop`: both elements train again.
    assert bool((after[stop]["head.weight"].reshape(-1)[a_idx] != a_vals).all())
    # Optimizer statistics: there before the window; while pinned, the first moment is zero and the
    # second is parked at a normal value (torch's roots are slow on zeros; see the engine's
    # PARKED_VALUE); when the window closes both are zero: released elements start fresh.
    assert bool((stats[start - 2] != 0).all())
    assert torch.equal(stats[start - 1], torch.zeros_like(stats[start - 1]))  # zeroed as the window opened
    for step in range(start, stop - 1):
        exp_avg, exp_avg_sq = stats[step]
        assert torch.equal(exp_avg, torch.zeros_like(exp_avg)), step
        assert bool((exp_avg_sq > 0).all()) and bool((exp_avg_sq <= PARKED_VALUE).all()), step
    assert torch.equal(stats[stop - 1], torch.zeros_like(stats[stop - 1]))
    # The value=None window captured the values after step 2 (right when it opened), and holds them.
    captured = after[2]["encoder.weight"].reshape(-1)[b_idx]
    assert not torch.equal(captured, after[1]["encoder.weight"].reshape(-1)[b_idx])  # trained before
    for step in range(2, steps):
        assert torch.equal(after[step]["encoder.weight"].reshape(-1)[b_idx], captured), step
    assert handle.step == steps
    handle.verify()


# --------------------------------------------------------------------------------------------
# `when` pins: per-task freezing under Adam


class TwoTasks(nn.Module):
    """A shared trunk, one hidden layer per task (both in every forward), one head per task."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(6, 8)
        self.hidden_task1 = nn.Linear(8, 8)
        self.hidden_task2 = nn.Linear(8, 8)
        self.heads = nn.ModuleDict({"1": nn.Linear(16, 1), "2": nn.Linear(16, 1)})

    def forward(self, x, task: int):
        h = torch.relu(self.shared(x))
        features = torch.cat([torch.relu(self.hidden_task1(h)), torch.relu(self.hidden_task2(h))], dim=1)
        return self.heads[str(task)](features).squeeze(-1)


def task_1(batch, batch_idx) -> bool:
    return batch[2] == 1


def task_2(batch, batch_idx) -> bool:
    return batch[2] == 2


def task_batches(count: int) -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(count):
        x = torch.randn(8, 6, generator=g)
        task = 1 + i % 2
        out.append((x, x[:, :3].sum(1) if task == 1 else x[:, 3:].prod(1), task))
    return out


def task_step(model, optimizer, batch) -> None:
    x, y, task = batch
    nn.functional.mse_loss(model(x, task), y).backward()
    optimizer.step()
    optimizer.zero_grad()


def test_per_task_freezing_with_adam():
    model = TwoTasks()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    handle = pin(model, optimizer, [Pin("hidden_task2.*", when=task_1), Pin("hidden_task1.*", when=task_2)])
    data = task_batches(8)
    moments_checked = 0
    for batch_idx, batch in enumerate(data):
        frozen, trained = (
            (model.hidden_task2, model.hidden_task1) if batch[2] == 1 else (model.hidden_task1, model.hidden_task2)
        )
        handle.batch_start(batch, batch_idx)
        if batch_idx >= 2:
            # Adam has moments for the frozen layer from earlier batches: a zeroed gradient alone
            # would still move it.
            assert bool((optimizer.state[frozen.weight]["exp_avg"] != 0).any())
            moments_checked += 1
        frozen_before = [p.detach().clone() for p in frozen.parameters()]
        trained_before = [p.detach().clone() for p in trained.parameters()]
        task_step(model, optimizer, batch)
        for p, b in zip(frozen.parameters(), frozen_before):
            assert torch.equal(p.detach(), b), f"frozen layer moved on batch {batch_idx}"
        assert all(not torch.equal(p.detach(), b) for p, b in zip(trained.parameters(), trained_before))
        handle.verify()
    assert moments_checked == len(data) - 2 and handle.step == len(data)


def test_zeroed_grads_alone_move_the_frozen_layer_under_adam():
    """The baseline that makes the test above meaningful: without pin(), Adam moves it."""
    model = TwoTasks()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = task_batches(4)
    for batch in data[:2]:
        task_step(model, optimizer, batch)
    x, y, task = data[2]  # task 1: hidden_task2 should stay
    before = model.hidden_task2.weight.detach().clone()
    nn.functional.mse_loss(model(x, task), y).backward()
    for p in model.hidden_task2.parameters():
        p.grad.zero_()
    optimizer.step()
    assert not torch.equal(model.hidden_task2.weight.detach(), before)


def test_step_without_batch_start_raises_and_changes_nothing():
    model = TwoTasks()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    handle = pin(model, optimizer, [Pin("hidden_task2.*", when=task_1)])
    data = task_batches(3)
    x, y, task = data[0]
    nn.functional.mse_loss(model(x, task), y).backward()
    before = snapshot(model)
    with pytest.raises(PinError, match=r"batch_start\(batch, batch_idx\)"):
        optimizer.step()  # never decided
    assert all(torch.equal(v, before[n]) for n, v in snapshot(model).items())
    handle.batch_start(data[0], 0)
    optimizer.step()
    optimizer.zero_grad()
    assert handle.step == 1
    x, y, task = data[1]
    nn.functional.mse_loss(model(x, task), y).backward()
    before = snapshot(model)
    with pytest.raises(PinError, match="was not called since this optimizer's last step"):
        optimizer.step()  # decided for the previous step only
    assert all(torch.equal(v, before[n]) for n, v in snapshot(model).items())
    assert handle.step == 1


def test_when_pins_with_two_optimizers_decide_once_per_batch():
    """One batch_start covers the step of every optimizer; each optimizer's next step needs the next one."""
    model = TwoTasks()
    trunk = torch.optim.Adam([p for n, p in model.named_parameters() if not n.startswith("heads")], lr=1e-2)
    heads = torch.optim.SGD(model.heads.parameters(), lr=1e-2)
    handle = pin(model, [trunk, heads], [Pin("hidden_task2.*", when=task_1), Pin("hidden_task1.*", when=task_2)])
    for batch_idx, batch in enumerate(task_batches(4)):
        frozen = model.hidden_task2 if batch[2] == 1 else model.hidden_task1
        before = [p.detach().clone() for p in frozen.parameters()]
        handle.batch_start(batch, batch_idx)
        x, y, task = batch
        nn.functional.mse_loss(model(x, task), y).backward()
        trunk.step()
        heads.step()
        assert all(torch.equal(p.detach(), b) for p, b in zip(frozen.parameters(), before))
        trunk.zero_grad()
        heads.zero_grad()
    assert handle.step == 4  # the first optimizer's steps
    x, y, task = task_batches(1)[0]
    nn.functional.mse_loss(model(x, task), y).backward()
    with pytest.raises(PinError, match="batch_start"):
        heads.step()


@pytest.mark.parametrize(
    "answer",
    [None, 1, "yes", torch.tensor([True]), torch.tensor(1)],
    ids=["None", "int", "str", "1-d tensor", "int tensor"],
)
def test_when_must_answer_a_bool(answer):
    model = TwoTasks()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    handle = pin(model, optimizer, [Pin("hidden_task2.*", when=lambda batch, batch_idx: answer)])
    with pytest.raises(PinError, match="must return a bool"):
        handle.batch_start(task_batches(1)[0], 0)


@pytest.mark.parametrize("answer", [True, False, torch.tensor(True), torch.tensor(False)])
def test_when_bool_answers_are_taken(answer):
    model = TwoTasks()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    handle = pin(model, optimizer, [Pin("hidden_task2.*", when=lambda batch, batch_idx: answer)])
    handle.batch_start(task_batches(1)[0], 0)
    assert handle.engine.active == (frozenset({0}) if bool(answer) else frozenset())


# --------------------------------------------------------------------------------------------
# verify, remove, the context manager, rejected specs


def test_verify_names_elements_written_after_the_last_step():
    model = TinyNet()
    pins, exp, _, _ = _pins_and_expected(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    with pin(model, optimizer, pins) as handle:
        for batch in batches(2):
            ce_loss(model, batch).backward()
            optimizer.step()
            optimizer.zero_grad()
        handle.verify()
        with torch.no_grad():
            model.head.weight[2, 5] = 7.0  # pinned to -1.25
        with pytest.raises(PinError, match=r"head\.weight: 1 element\(s\) off target \(\(2, 5\): 7\.0 != -1\.25"):
            handle.verify()


def test_remove_removes_every_hook():
    model = TinyNet()
    pins, exp, _, _ = _pins_and_expected(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    empty = hook_counts(model, [optimizer])
    handle = pin(model, optimizer, pins)
    assert hook_counts(model, [optimizer]) != empty
    handle.remove()
    assert hook_counts(model, [optimizer]) == empty
    forced = snapshot(model)
    for batch in batches(2):
        ce_loss(model, batch).backward()
        assert nonzero_pinned_grads(model, exp.entries) == [name for name, _, _ in exp.entries]  # no grad hook
        optimizer.step()
        optimizer.zero_grad()
    assert handle.step == 0  # no step hook
    after = dict(model.named_parameters())
    for name, index, values in exp.entries:  # no restore: the formerly pinned elements trained
        assert bool((values_at(after, name, index) != values_at(forced, name, index)).all()), name
    handle.remove()  # twice is harmless


def test_context_manager_removes_on_exit_also_on_error():
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    empty = hook_counts(model, [optimizer])
    with pin(model, optimizer, Pin("head.bias")) as handle:
        assert isinstance(handle, PinHandle) and hook_counts(model, [optimizer]) != empty
    assert hook_counts(model, [optimizer]) == empty
    with pytest.raises(RuntimeError, match="boom"):
        with pin(model, optimizer, Pin("head.bias")):
            raise RuntimeError("boom")
    assert hook_counts(model, [optimizer]) == empty


@pytest.mark.parametrize(
    "pins,optimizers,message",
    [
        ([Pin("head.weight", value=0.0), Pin("encoder.wieght")], None, r"encoder\.wieght.*encoder\.weight"),
        ([Pin("head.weight", value=0.0), Pin("head.bias", indices=[(7,)], value=1.0)], None, "out of range"),
        ([Pin("head.bias", value=0.0), Pin("head.bias", value=1.0)], None, "different values"),
        (["head.bias"], None, "got str"),
        (Pin("head.bias", value=0.0), "not an optimizer", "expected a torch.optim.Optimizer"),
    ],
    ids=["typo", "out-of-range", "conflict", "bad-type", "bad-optimizer"],
)
def test_rejected_spec_changes_nothing_and_leaves_no_hook(pins, optimizers, message):
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    before, empty = snapshot(model), hook_counts(model, [optimizer])
    with pytest.raises(PinError, match=message):
        pin(model, [optimizer, optimizers] if optimizers else optimizer, pins)
    assert hook_counts(model, [optimizer]) == empty
    assert all(torch.equal(v, before[n]) for n, v in snapshot(model).items())


def test_sparse_gradients_refuse_element_pins_at_pin_time():
    model = nn.Embedding(10, 4, sparse=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before, empty = snapshot(model), hook_counts(model, [optimizer])
    with pytest.raises(PinError, match=r"'weight' gets sparse gradients .*use sparse=False, or pin the whole tensor"):
        pin(model, optimizer, Pin("weight", indices=[(1, 1)], value=0.5))
    assert hook_counts(model, [optimizer]) == empty and torch.equal(model.weight.detach(), before["weight"])
    # A whole-tensor pin needs no dense gradient.
    with pin(model, optimizer, Pin("weight")) as handle:
        model(torch.tensor([1, 2])).sum().backward()
        optimizer.step()
        assert torch.equal(model.weight.detach(), before["weight"]) and handle.step == 1


def test_empty_pin_set_trains_bit_identically():
    """The pinning never moves anything by itself."""
    torch.manual_seed(0)
    model = TinyNet()
    twin = copy.deepcopy(model)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1) for m in (model, twin)]
    with pin(model, optimizers[0], []):
        for batch in batches(3):
            for m, o in zip((model, twin), optimizers):
                ce_loss(m, batch).backward()
                o.step()
                o.zero_grad()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name


# --------------------------------------------------------------------------------------------
# Resume: torch.save / torch.load(weights_only=True), re-initialised model


def resume_pins() -> list[Pin]:
    return [
        Pin("encoder.weight", fraction=0.25, seed=3),  # value=None from step 0
        Pin("head.weight", indices=[(0, 1), (2, 5)], value=[2.5, -1.0]),  # explicit
        Pin("head.bias", start_step=3),  # whole tensor, value=None, opens before the save
        Pin("encoder.bias", indices=[(0,), (1,)], start_step=13),  # value=None, opens after the resume
        Pin("head.weight", indices=[(1, 0), (1, 7)], start_step=4, stop_step=15),  # across the boundary
        # From step 0 to after the boundary: Adam's coupled L2 decay fills its elements' moments while
        # pinned, and they shape the training after stop_step (so the optimizer state must survive).
        Pin("head.weight", indices=[(2, 0)], stop_step=16),
    ]


def adam_l2(model):
    return torch.optim.Adam(model.parameters(), lr=0.05, weight_decay=0.1)


def run(model, optimizer, handle, data, records=None):
    for batch in data:
        ce_loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        if records is not None:
            records.append(snapshot(model))


@pytest.fixture(scope="module")
def uninterrupted():
    torch.manual_seed(0)
    model = TinyNet()
    init = snapshot(model)
    optimizer = adam_l2(model)
    handle = pin(model, optimizer, resume_pins())
    records: list[dict] = []
    run(model, optimizer, handle, batches(20), records)
    assert handle.step == 20
    return {"init": init, "records": records, "final": snapshot(model)}


def save_after_ten(path) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = adam_l2(model)
    handle = pin(model, optimizer, resume_pins())
    run(model, optimizer, handle, batches(20)[:10])
    torch.save({"model": model.state_dict(), "opt": optimizer.state_dict(), "pins": handle.state_dict()}, path)


@pytest.mark.parametrize("order", ["pin-first", "weights-first"])
def test_resume_is_bit_identical_to_uninterrupted(uninterrupted, tmp_path, order):
    path = tmp_path / "ckpt.pt"
    save_after_ten(path)
    saved = torch.load(path, weights_only=True)
    torch.manual_seed(123)  # a different initialisation
    model = TinyNet()
    fresh = snapshot(model)
    assert not torch.equal(fresh["encoder.weight"], uninterrupted["init"]["encoder.weight"])
    optimizer = adam_l2(model)
    # Either order, as long as the pins' state is loaded last. The pins of step 0 zero their
    # optimizer statistics when they activate, which must not touch the loaded ones.
    if order == "pin-first":  # the README's order
        handle = pin(model, optimizer, resume_pins())
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["opt"])
    else:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["opt"])
        handle = pin(model, optimizer, resume_pins())
    handle.load_state_dict(saved["pins"])
    assert handle.step == 10
    records: list[dict] = []
    run(model, optimizer, handle, batches(20)[10:], records)
    assert handle.step == 20
    for step, (resumed, original) in enumerate(zip(records, uninterrupted["records"][10:]), start=10):
        for name, value in original.items():
            assert torch.equal(resumed[name], value), f"{name} differs after step {step}"
    handle.verify()
    # The window that opened after the resume captured the values it had then, and trained before.
    steps = uninterrupted["records"]
    assert torch.equal(steps[19]["encoder.bias"][:2], steps[12]["encoder.bias"][:2])
    assert not torch.equal(steps[12]["encoder.bias"][:2], steps[11]["encoder.bias"][:2])


def test_resume_without_the_pin_state_is_not_identical(uninterrupted, tmp_path):
    """Sanity for the test above: the captured targets must come from the saved pin state."""
    path = tmp_path / "ckpt.pt"
    save_after_ten(path)
    saved = torch.load(path, weights_only=True)
    torch.manual_seed(123)
    model = TinyNet()
    optimizer = adam_l2(model)
    handle = pin(model, optimizer, resume_pins())  # captures value=None targets from the new init
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["opt"])
    run(model, optimizer, handle, batches(20)[10:])
    assert not torch.equal(model.encoder.weight.detach(), uninterrupted["final"]["encoder.weight"])


def test_pins_on_a_trained_optimizer_zero_its_statistics():
    """pin() on an optimizer that already has statistics (training goes on with pins from now):
    they are reset for the pinned elements before the first step with pins."""
    model = TinyNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    data = batches(3)
    for batch in data[:2]:
        ce_loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    index = torch.tensor([0, 18])

    def moments():
        state = optimizer.state[model.head.weight]
        return torch.stack([state[k].reshape(-1)[index] for k in ("exp_avg", "exp_avg_sq")])

    assert bool((moments() != 0).all())
    handle = pin(model, optimizer, Pin("head.weight", indices=[(0, 0), (1, 2)], value=0.5))
    ce_loss(model, data[2]).backward()
    optimizer.step()
    # The first moment is zero; the second is parked at a normal value while pinned (see PARKED_VALUE).
    assert torch.equal(moments(), torch.tensor([[0.0, 0.0], [PARKED_VALUE, PARKED_VALUE]])) and handle.step == 1
    handle.verify()


def test_state_dict_refuses_other_pins_unless_not_strict():
    model = TinyNet()
    state = pin(model, adam_l2(model), resume_pins()).state_dict()
    other_model = TinyNet()
    other_pins = resume_pins()
    other_pins[1] = Pin("head.weight", indices=[(0, 1), (2, 5)], value=[3.0, -1.0])  # one value changed
    other = pin(other_model, adam_l2(other_model), other_pins)
    with pytest.raises(PinError, match="does not match these pins"):
        other.load_state_dict(state)
    other.remove()
    lenient = pin(other_model, adam_l2(other_model), other_pins, strict=False)
    with pytest.warns(UserWarning, match="strict=False: ignoring saved pin state that does not match"):
        lenient.load_state_dict(state)  # the default given to pin()
    with pytest.raises(PinError, match="does not match these pins"):
        lenient.load_state_dict(state, strict=True)
    # The matching pins took the saved targets (captured ones too); the changed one kept its own.
    lenient.verify()
    assert torch.equal(other_model.head.weight.detach()[[0, 2], [1, 5]], torch.tensor([3.0, -1.0]))
    saved_fraction = dict(model.named_parameters())["encoder.weight"].detach().reshape(-1)
    index = fraction_indices("encoder.weight", 128, 0.25, 3)
    assert torch.equal(other_model.encoder.weight.detach().reshape(-1)[index], saved_fraction[index])


# --------------------------------------------------------------------------------------------
# torch.compile and Fabric


def test_compiled_module():
    """Names as on the module inside; the aot_eager backend runs AOT autograd's backward (where
    the grad hooks must still fire) without inductor's C++ compile time."""
    model = TinyNet()
    pins, exp, init, pinned = _pins_and_expected(model)
    compiled = torch.compile(model, backend="aot_eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    handle = pin(compiled, optimizer, pins)
    assert handle.module is model
    for batch in batches(3):
        ce_loss(compiled, batch).backward()
        assert nonzero_pinned_grads(model, exp.entries) == []
        optimizer.step()
        assert off_targets(model, exp.entries) == []
        optimizer.zero_grad()
    handle.verify(compiled)
    free = _free_mask("encoder.weight", 128, pinned)
    assert bool((model.encoder.weight.detach().reshape(-1)[free] != init["encoder.weight"].reshape(-1)[free]).all())


def even_batches(batch, batch_idx) -> bool:
    return batch_idx % 2 == 0


def test_fabric():
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    model = TinyNet()
    pins, exp, init, pinned = _pins_and_expected(model)
    pins.append(Pin("head.bias", when=even_batches))
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1))
    handle = pin(model, optimizer, pins)  # both Fabric-wrapped
    inner = handle.module
    assert inner is model.module and handle.optimizers == [optimizer.optimizer]
    assert off_targets(inner, exp.entries) == []
    for step, batch in enumerate(batches(4)):
        handle.batch_start(batch, step)
        bias = inner.head.bias.detach().clone()
        fabric.backward(ce_loss(model, batch))
        assert nonzero_pinned_grads(inner, exp.entries) == []
        optimizer.step()
        assert off_targets(inner, exp.entries) == [], step
        assert torch.equal(inner.head.bias.detach(), bias) == even_batches(batch, step), step
        optimizer.zero_grad()
    assert handle.step == 4
    handle.verify(model)
    free = _free_mask("head.weight", 48, pinned)
    assert bool((inner.head.weight.detach().reshape(-1)[free] != init["head.weight"].reshape(-1)[free]).all())


def test_released_elements_start_fresh_even_with_coupled_weight_decay():
    # Adam's coupled L2 decay adds wd * value to the masked gradient inside the step, so the moments
    # of pinned elements grow while the pin holds; the release zeroes them.
    model = TinyNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.1)
    index = torch.tensor([0, 18])
    handle = pin(model, optimizer, Pin("head.weight", indices=[(0, 0), (1, 2)], value=0.5, stop_step=3))
    for step, batch in enumerate(batches(3)):
        ce_loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        state = optimizer.state[model.head.weight]
        moments = torch.stack([state[k].reshape(-1)[index] for k in ("exp_avg", "exp_avg_sq")])
        if step < 2:
            assert bool((moments[0] != 0).all())  # the decay fed them while pinned
    assert handle.step == 3 and torch.equal(moments, torch.zeros(2, 2))  # released after step 2
