"""compile_step=True: torch's own optimizer step compiled with the restore of pinned values inside it.

Compiling costs seconds per graph, so the matrix is small: three optimizers (AdamW with weight
decay, SGD with momentum, Adam with amsgrad and maximize) on one tiny model, each through
accumulation and clipping in a plain loop, compared step by step with ``torch.compile(opt.step)``
on an unpinned copy fed the same masked gradients; then ``when`` toggles without recompiling,
the fallback warnings, a Trainer fit with resume.

Each new graph costs seconds of inductor's C++ compile (a fresh clone's cache is empty), so the tests that check
something other than the optimizer reuse the optimizers, shapes and held tensors of another test: the same graph,
compiled once (inductor's cache). Which tests share a graph is said at each.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import lightning as L

from helpers import TinyNet, make_loader, trainer
from lightning_pin import Pin, PinCallback, pin
from lightning_pin.core import compiled_step
from lightning_pin.core.compiled_step import CompiledStep

OPTIMIZERS = {
    "adamw_wd": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adam_amsgrad_maximize": lambda ps: torch.optim.Adam(ps, lr=0.05, amsgrad=True, maximize=True),
}
WEIGHT_AT = [(0, 0), (2, 3), (4, 5)]

# Under pytest-xdist (make test) these tests share one worker, so inductor's first compile of the session,
# tens of seconds of imports and C++ toolchain probing, is paid once and not by every worker.
pytestmark = pytest.mark.xdist_group("inductor")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _mask(model: nn.Module) -> None:
    """What the pins do to the gradients of the reference: zero pinned elements, drop a whole one."""
    for row, col in WEIGHT_AT:
        model[0].weight.grad[row, col] = 0.0
    model[2].bias.grad = None


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_pinned_exact_and_free_bit_identical_to_the_compiled_step_without_pins(name):
    model, reference = _model(), _model()
    optimizer, ref_optimizer = OPTIMIZERS[name](model.parameters()), OPTIMIZERS[name](reference.parameters())
    ref_step = torch.compile(ref_optimizer.step)
    pins = [Pin("0.weight", indices=WEIGHT_AT, value=[0.5, -0.25, 2.0]), Pin("2.bias")]
    bias = model[2].bias.detach().clone()
    with pin(model, optimizer, pins, compile_step=True) as handle:
        assert isinstance(optimizer.__dict__["step"], CompiledStep)
        def restore_reference() -> None:
            with torch.no_grad():
                for (row, col), value in zip(WEIGHT_AT, [0.5, -0.25, 2.0]):
                    reference[0].weight[row, col] = value

        restore_reference()
        for step in range(4):
            for _ in range(2):  # accumulation over two micro-batches
                x = torch.randn(8, 6)
                for m in (model, reference):
                    (m(x).square().mean() / 2).backward()
            _mask(reference)
            for m in (model, reference):  # pinned gradients are zero before the clip
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            optimizer.step()
            ref_step()
            restore_reference()
            optimizer.zero_grad()
            ref_optimizer.zero_grad()
            for (row, col), value in zip(WEIGHT_AT, [0.5, -0.25, 2.0]):
                assert model[0].weight[row, col].item() == value, (step, row, col)
            assert torch.equal(model[2].bias, bias), step
            free = torch.ones(5, 6, dtype=torch.bool)
            for row, col in WEIGHT_AT:
                free[row, col] = False
            # Free elements: exactly what torch's compiled step computes without pins.
            assert torch.equal(model[0].weight[free], reference[0].weight[free]), step
            assert torch.equal(model[0].bias, reference[0].bias), step
            assert torch.equal(model[2].weight, reference[2].weight), step
        assert handle.step == 4
        handle.verify()
    assert "step" not in optimizer.__dict__  # remove() gives the optimizer its own step back


def _every_other(batch, batch_idx) -> bool:
    return batch_idx % 2 == 0


def test_when_toggles_and_windows_do_not_recompile():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    pins = [
        Pin("0.weight", fraction=0.5, seed=1, when=_every_other),  # re-captured at every activation
        Pin("2.weight", indices=[(1, 1)], value=3.0, start_step=2, stop_step=5),
        Pin("0.bias"),
        Pin("2.bias", bounds=(-0.01, 0.01)),  # fault projections run after the compiled step
        Pin("2.weight", indices=[(0, 0), (2, 4)], stuck_at_one=0x00400000),
    ]
    stats = []
    with pin(model, optimizer, pins, compile_step=True) as handle:
        # Step statistics on every other step (as a monitor's logging steps): the compiled step
        # then also measures how far the update moved the pinned elements, in a second graph.
        handle.engine.register_restore_hook(stats.append, wants_stats=lambda: handle.step % 2 == 0)

        def step(batch_idx: int) -> None:
            handle.batch_start(None, batch_idx)
            model(torch.randn(4, 6)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            handle.verify()  # every active pin on target, bit for bit
            if batch_idx % 2 == 0:  # weight decay moved the `when` pin's elements, the restore undid it
                assert stats[-1].drift_max.item() > 0 and stats[-1].violations.item() == 0
                assert stats[-1].elements == 15 + 5 + (batch_idx in (2, 4)) + 3 + 2
            else:
                assert stats[-1] is None

        for batch_idx in range(2):  # both states of the `when` pin: the graph is compiled once
            step(batch_idx)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for batch_idx in range(2, 8):  # the window starts and stops, the `when` pin toggles
                step(batch_idx)
                if batch_idx in (2, 4):
                    assert model[2].weight[1, 1].item() == 3.0
        assert handle.step == 8


class _OwnSGD(torch.optim.SGD):
    """A custom optimizer: its step may differ from torch's, so it is never compiled."""


def test_a_custom_optimizer_falls_back_to_the_eager_step_with_one_warning():
    model = _model()
    optimizer = _OwnSGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.warns(UserWarning, match=r"_OwnSGD runs eager.*not one of torch's own optimizers") as caught:
        handle = pin(model, optimizer, [Pin("0.weight", indices=[(0, 0)], value=1.5)], compile_step=True)
    assert len([w for w in caught if "compile_step" in str(w.message)]) == 1
    assert "step" not in optimizer.__dict__
    with handle, warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning at the steps
        for _ in range(2):
            model(torch.randn(4, 6)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        assert model[0].weight[0, 0].item() == 1.5
        handle.verify()


def test_no_cxx_compiler_falls_back_and_says_so(monkeypatch):
    monkeypatch.setattr(compiled_step, "_has_cxx", lambda: False)
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler was found"):
        handle = pin(model, optimizer, [Pin("2.bias", value=0.25)], compile_step=True)
    with handle:
        model(torch.randn(4, 6)).square().mean().backward()
        optimizer.step()
        assert torch.equal(model[2].bias, torch.full((3,), 0.25))


def test_a_compile_error_falls_back_to_the_eager_step_with_one_warning(monkeypatch):
    def broken(*args, **kwargs):
        raise torch._dynamo.exc.Unsupported("some construct torch cannot trace")

    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pin(model, optimizer, [Pin("0.weight", indices=[(1, 2)], value=-1.0)], compile_step=True) as handle:
        compiled = optimizer.__dict__["step"]
        monkeypatch.setattr(compiled, "_compiled", broken)
        with pytest.warns(UserWarning, match="SGD runs eager.*torch.compile failed: Unsupported"):
            model(torch.randn(4, 6)).square().mean().backward()
            optimizer.step()
        assert compiled.failed is not None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model(torch.randn(4, 6)).square().mean().backward()
            optimizer.step()
        assert model[0].weight[1, 2].item() == -1.0 and handle.step == 2
        handle.verify()


def test_trainer_fit_with_accumulation_clipping_and_resume(tmp_path):
    # The step's graphs are those of test_without_clipping_...: the same optimizer, and encoder.weight the one tensor
    # the step holds (head.weight's one element, below DENSE_FROM, is the engine's to restore).
    pins = [Pin("encoder.weight", fraction=0.3, seed=1), Pin("head.weight", indices=[(1, 2)], value=0.0)]

    def fit(max_epochs: int, ckpt_path=None):
        torch.manual_seed(0)
        model = TinyNet(lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1))
        callback = PinCallback(pins, verbose=False, monitor=False, verify="step", compile_step=True)
        t = trainer(max_epochs=max_epochs, accumulate_grad_batches=2, gradient_clip_val=0.1, callbacks=[callback],
                    default_root_dir=tmp_path)
        t.fit(model, make_loader(n=16, batch_size=4), ckpt_path=ckpt_path)
        callback.verify(model)
        return model, t

    straight, _ = fit(2)
    _, t = fit(1)
    t.save_checkpoint(tmp_path / "half.ckpt")
    resumed, _ = fit(2, ckpt_path=tmp_path / "half.ckpt")
    assert straight.head.weight[1, 2].item() == 0.0
    for name, value in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name


def test_a_scheduler_changing_a_float_lr_falls_back_with_the_fix_named():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)  # wraps optimizer.step
    with pytest.warns(UserWarning, match=r"changes its float lr.*lr=torch.tensor"):
        handle = pin(model, optimizer, [Pin("0.weight", indices=[(0, 1)], value=0.75)], compile_step=True)
    with handle:
        for _ in range(2):
            model(torch.randn(4, 6)).square().mean().backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        assert model[0].weight[0, 1].item() == 0.75 and handle.step == 2


def test_a_tensor_lr_under_a_scheduler_created_after_pin_compiles_once():
    # The model, optimizer and held tensor of the compile_step example in docs/explanation/performance.md (run by
    # tests/test_readme.py): one pair of graphs for both in a fresh clone (inductor's cache).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.1), weight_decay=0.1)
    pins = [Pin("0.weight", fraction=0.5, seed=0), Pin("0.weight", indices=[(0, 1)], value=0.75)]
    with pin(model, optimizer, pins, compile_step=True) as handle:
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
        assert isinstance(optimizer.__dict__["step"], CompiledStep)  # the scheduler did not wrap it again
        with warnings.catch_warnings():
            # Neither "lr_scheduler.step() before optimizer.step()" nor a fallback.
            warnings.filterwarnings("error", message=".*lr_scheduler.step")
            warnings.filterwarnings("error", message="compile_step")
            for step in range(4):
                model(torch.randn(4, 8)).square().mean().backward()
                with torch._dynamo.config.patch(error_on_recompile=step > 1):  # the first step creates the moments
                    optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        assert torch.equal(optimizer.param_groups[0]["lr"], torch.tensor(0.1) / 16)
        assert model[0].weight[0, 1].item() == 0.75 and handle.step == 4


def test_grad_scaler_steps_run_compiled_and_skipped_steps_change_nothing():
    model = _model()
    # The graphs of test_pinned_exact_...[sgd_momentum]: its optimizer, 0.weight held, 2.bias's gradient dropped.
    optimizer = OPTIMIZERS["sgd_momentum"](model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    with pin(model, optimizer, [Pin("0.weight", fraction=0.5, seed=3), Pin("2.bias", value=0.0)],
             compile_step=True) as handle:
        for step in range(3):
            loss = model(torch.randn(4, 6)).square().mean()
            if step == 1:
                loss = loss * float("inf")  # the scaler skips this step: no restore, no weight change
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            if step == 1:
                assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
            handle.verify()
        assert handle.step == 2 and optimizer.__dict__["step"].failed is None
        assert torch.equal(model[2].bias, torch.zeros(3))


def test_a_fused_optimizer_keeps_its_fused_step_with_one_warning():
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
    with pytest.warns(UserWarning, match=r"fused=True"):
        handle = pin(model, optimizer, [Pin("2.bias", value=0.5)], compile_step=True)
    with handle:
        model(torch.randn(4, 6)).square().mean().backward()
        optimizer.step()
        assert "step" not in optimizer.__dict__ and torch.equal(model[2].bias, torch.full((3,), 0.5))


def test_without_clipping_the_callback_leaves_gradients_and_the_step_ignores_them(tmp_path):
    """No clipping: pinned gradients are not zeroed in memory (a pass saved); the compiled step holds
    the pinned elements and their statistics where they were, whatever their gradients say."""
    pins = [Pin("encoder.weight", fraction=0.5, seed=1)]
    seen = {}

    class Look(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == 2:  # after PinCallback's own hook (callbacks run in order)
                target = callback.engine.targets()[0]
                seen["grads"] = pl_module.encoder.weight.grad.reshape(-1)[target.index.long()].clone()

    torch.manual_seed(0)
    model = TinyNet(lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1))
    callback = PinCallback(pins, verbose=False, monitor=False, verify="step", compile_step=True)
    t = trainer(max_epochs=1, callbacks=[callback, Look()], default_root_dir=tmp_path)
    t.fit(model, make_loader(n=32, batch_size=4))
    assert callback.engine.grads_read_before_step is False
    assert seen["grads"].abs().sum() > 0  # left as backward made them
    callback.verify(model)
    state = t.optimizers[0].state[model.encoder.weight]
    index = callback.engine.targets()[0].index.long()
    for key in ("exp_avg",):  # zero at the pin's start, never fed the pinned gradients
        assert torch.equal(state[key].reshape(-1)[index], torch.zeros(index.numel())), key


#: The pins of the tests below: with OPTIMIZERS["adamw_wd"], the graphs of test_pinned_exact_...[adamw_wd]
#: (0.weight held by the step, 2.bias's gradient dropped), compiled once for all of them.
HALF_OF_0_WEIGHT = [Pin("0.weight", fraction=0.5, seed=2), Pin("2.bias")]


def test_a_write_between_steps_is_undone_by_the_next_step():
    model = _model()
    optimizer = OPTIMIZERS["adamw_wd"](model.parameters())
    with pin(model, optimizer, HALF_OF_0_WEIGHT, compile_step=True) as handle:
        for step in range(4):
            model(torch.randn(4, 6)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            if step == 1:
                with torch.no_grad():  # as load_state_dict does: through the parameter
                    model[0].weight.copy_(torch.full_like(model[0].weight, 7.0))
            if step == 2:
                model[0].weight.data = torch.full_like(model[0].weight, -7.0)  # a .data swap
        handle.verify()
        assert "0.weight" in optimizer.__dict__["step"].names


def test_pin_can_leave_pinned_gradients_to_the_compiled_step():
    """zero_pinned_grads=False: gradients as backward made them; pinned elements exact, free ones
    bit-identical to torch.compile(opt.step) on an unpinned copy fed the very same gradients."""
    model, reference = _model(), _model()
    optimizer = OPTIMIZERS["adamw_wd"](model.parameters())
    ref_optimizer = OPTIMIZERS["adamw_wd"](reference.parameters())
    ref_step = torch.compile(ref_optimizer.step)
    with pin(model, optimizer, HALF_OF_0_WEIGHT, compile_step=True, zero_pinned_grads=False) as handle:
        target = handle.engine.targets()[0]
        index = target.index.long()
        with torch.no_grad():
            reference[0].weight.view(-1)[index] = target.values
        free = torch.ones(30, dtype=torch.bool)
        free[index] = False
        for step in range(4):
            x = torch.randn(8, 6)
            for m in (model, reference):
                m(x).square().mean().backward()
            if step > 0:  # the first step creates the statistics from masked gradients
                assert model[0].weight.grad.view(-1)[index].abs().sum() > 0
                assert torch.equal(model[0].weight.grad, reference[0].weight.grad)
            else:
                reference[0].weight.grad.view(-1)[index] = 0.0
            reference[2].bias.grad = None  # wholly pinned: its gradient dropped, as the pin drops the model's
            optimizer.step()
            ref_step()
            for m, o in ((model, optimizer), (reference, ref_optimizer)):
                o.zero_grad()
            handle.verify()
            assert torch.equal(model[0].weight.view(-1)[free], reference[0].weight.view(-1)[free]), step
            assert torch.equal(model[2].weight, reference[2].weight), step
            with torch.no_grad():
                reference[0].weight.view(-1)[index] = target.values


def test_the_compiled_step_names_itself_to_a_profiler_as_torch_step_does():
    """The profiler range is entered only while a profiler listens (it costs ~10 us a step), and
    then under torch's own name for an optimizer step."""
    model = _model()
    optimizer = OPTIMIZERS["adamw_wd"](model.parameters())
    with pin(model, optimizer, HALF_OF_0_WEIGHT, compile_step=True) as handle:
        for _ in range(2):
            model(torch.randn(8, 6)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        model(torch.randn(8, 6)).square().mean().backward()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            optimizer.step()
        names = {event.name for event in profiler.events()}
        assert "Optimizer.step#AdamW.step" in names
        handle.verify()
