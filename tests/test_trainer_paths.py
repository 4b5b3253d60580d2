"""Integration tests with a real Trainer on CPU: pins are exact after every optimizer step on every
path a step can take (accumulation, clipping, mixed precision, schedulers, manual optimization,
per-batch ``when`` pins, step windows), and the callback never moves anything by itself.

Exactness is always ``torch.equal``; snapshots after each step come from a torch step post-hook
registered after the PinCallback's (``helpers.StepRecorder``).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers import StepRecorder, TinyNet, check_pins, flat_index, make_loader, snapshot, trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pin import Pin, PinCallback, PinError
from lightning_pin.core.plan import fraction_indices

ENC_COORDS = [(0, 0), (3, 5), (15, 7)]
ENC_VALUES = [1.5, -2.0, 0.0]


def standard_pins() -> list[Pin]:
    """Element indices with explicit values, a fraction keeping its values, a whole-tensor freeze."""
    return [
        Pin("encoder.weight", indices=ENC_COORDS, value=ENC_VALUES),
        Pin("head.weight", fraction=0.25, seed=2),
        Pin("head.bias"),
    ]


def standard_expected(init: dict) -> dict:
    head = fraction_indices("head.weight", init["head.weight"].numel(), 0.25, 2)
    return {
        "encoder.weight": (flat_index((16, 8), ENC_COORDS), torch.tensor(ENC_VALUES)),
        "head.weight": (head, init["head.weight"].reshape(-1)[head]),
        "head.bias": (None, init["head.bias"]),
    }


def fit_pinned(model, pins, loader=None, extra_callbacks=(), **trainer_kwargs):
    init = snapshot(model)
    cb = PinCallback(pins, verbose=False)
    rec = StepRecorder()
    tr = trainer(callbacks=[cb, rec, *extra_callbacks], **trainer_kwargs)
    tr.fit(model, loader if loader is not None else make_loader())
    return init, cb, rec, tr


def assert_exact_every_step(rec: StepRecorder, expected: dict, final: dict) -> None:
    assert rec.steps, "no optimizer step was recorded"
    for record in rec.steps:
        check_pins(record["params"], expected, f"after step {record['step']}")
    check_pins(final, expected, "at the end")


def assert_free_elements_trained(init: dict, final: dict, expected: dict) -> None:
    """Every parameter that is only partly pinned has unpinned elements that moved."""
    for name, (index, _) in expected.items():
        if index is None:
            continue
        free = torch.ones(init[name].numel(), dtype=torch.bool)
        free[index] = False
        assert (final[name].reshape(-1)[free] != init[name].reshape(-1)[free]).any(), f"{name} did not train"


# --------------------------------------------------------------------------------------------
# Module-level models and callbacks


class GradInjectNet(TinyNet):
    """Overwrites chosen gradient elements in on_after_backward (before any pinning hook).

    ``inject``: name -> (flat indices, value); ``on_batches``: batch counters (over the whole
    fit) where to inject, None for every batch.
    """

    def __init__(self, inject: dict, on_batches=None, optimizer_factory=None):
        super().__init__(optimizer_factory=optimizer_factory)
        self.inject = inject
        self.on_batches = on_batches
        self.batches = -1
        self.out_dtypes: set = set()

    def training_step(self, batch, batch_idx):
        self.batches += 1
        x, y = batch
        out = self(x)
        self.out_dtypes.add(out.dtype)
        return nn.functional.cross_entropy(out, y)

    def on_after_backward(self):
        if self.on_batches is not None and self.batches not in self.on_batches:
            return
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name, (index, value) in self.inject.items():
                params[name].grad.view(-1)[index] = value


class BatchRecorder(L.Callback):
    """Parameters before and after every batch, and the grad scaler's scale after it."""

    def __init__(self):
        self.before: list[dict] = []
        self.after: list[dict] = []
        self.scales: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before.append(snapshot(pl_module))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after.append(snapshot(pl_module))
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.scales.append(None if scaler is None else float(scaler.get_scale()))


def sgd_momentum(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


# --------------------------------------------------------------------------------------------
# Gradient accumulation


def test_accumulation_exact_after_every_step_including_partial_last_window():
    model = TinyNet()
    init, cb, rec, tr = fit_pinned(model, standard_pins(), max_epochs=2, accumulate_grad_batches=3)
    # 8 batches per epoch: windows of 3, 3 and a partial 2 at the epoch end -> 3 steps per epoch.
    assert [r["step"] for r in rec.steps] == list(range(6))
    assert tr.global_step == 6
    final = snapshot(model)
    expected = standard_expected(init)
    assert_exact_every_step(rec, expected, final)
    assert_free_elements_trained(init, final, expected)
    # The partial window's step really updated the free weights.
    assert not torch.equal(rec.steps[2]["params"]["encoder.weight"], rec.steps[1]["params"]["encoder.weight"])
    cb.verify(model)


# --------------------------------------------------------------------------------------------
# Gradient clipping


CLIP_PINS = [(2, 3), (7, 1)]


def clip_run(algorithm, clip, pinned_grad, with_pins=True):
    torch.manual_seed(0)
    index = flat_index((16, 8), CLIP_PINS)
    inject = {"encoder.weight": (index, pinned_grad), "head.bias": (torch.arange(3), pinned_grad)}
    model = GradInjectNet(inject, optimizer_factory=sgd_momentum)
    pins = [Pin("encoder.weight", indices=CLIP_PINS, value=[0.5, -0.5]), Pin("head.bias")] if with_pins else []
    init, cb, rec, _ = fit_pinned(
        model, pins, max_epochs=1, gradient_clip_val=clip, gradient_clip_algorithm=algorithm
    )
    expected = {
        "encoder.weight": (index, torch.tensor([0.5, -0.5])),
        "head.bias": (None, init["head.bias"]),
    }
    return model, rec, expected


@pytest.mark.parametrize("algorithm,clip", [("norm", 0.5), ("value", 0.01)])
def test_clipping_exact_and_ignores_pinned_grads(algorithm, clip):
    huge, huge_rec, expected = clip_run(algorithm, clip, 1e6)
    zero, zero_rec, _ = clip_run(algorithm, clip, 0.0)
    assert_exact_every_step(huge_rec, expected, snapshot(huge))
    assert_exact_every_step(zero_rec, expected, snapshot(zero))
    # A huge gradient on pinned elements changes nothing else: bit-identical runs, step by step.
    assert len(huge_rec.steps) == len(zero_rec.steps) == 8
    for a, b in zip(huge_rec.steps, zero_rec.steps):
        for name in a["params"]:
            assert torch.equal(a["params"][name], b["params"][name]), f"{name} differs after step {a['step']}"
    if algorithm == "norm":
        # Control: without masking, the same huge gradient would dominate the clip norm and
        # shrink every other update, so the comparison above is sensitive.
        unmasked, _, _ = clip_run(algorithm, clip, 1e6, with_pins=False)
        assert not torch.equal(unmasked.head.weight, zero.head.weight)


# --------------------------------------------------------------------------------------------
# Mixed precision


def test_bf16_mixed_exact_after_every_step():
    model = GradInjectNet({}, on_batches=set())
    init, cb, rec, _ = fit_pinned(model, standard_pins(), max_epochs=1, precision="bf16-mixed")
    assert model.out_dtypes == {torch.bfloat16}  # autocast really ran
    assert model.encoder.weight.dtype == torch.float32
    final = snapshot(model)
    expected = standard_expected(init)
    assert len(rec.steps) == 8
    assert_exact_every_step(rec, expected, final)
    assert_free_elements_trained(init, final, expected)
    cb.verify(model)


def adamw_fused(params):
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1, fused=True)


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "adamw-fused"])
def test_16_mixed_grad_scaler_with_skipped_step(fused):
    """Fused optimizers unscale (and skip on inf) inside their step: grads are still scaled when
    they are masked, and the step post-hook fires even for the skipped step."""
    skip_batch = 2
    unpinned = flat_index((16, 8), [(4, 4)])  # not in ENC_COORDS
    model = GradInjectNet(
        {"encoder.weight": (unpinned, float("inf"))},
        on_batches={skip_batch},
        optimizer_factory=adamw_fused if fused else None,
    )
    batches = BatchRecorder()
    init, cb, rec, tr = fit_pinned(
        model,
        standard_pins(),
        max_epochs=1,
        plugins=[MixedPrecision("16-mixed", "cpu")],
        extra_callbacks=[batches],
    )
    assert model.out_dtypes == {torch.float16}  # fp16 autocast really ran
    # Only the injected step was skipped: the scale halved there and nowhere else. A non-fused
    # optimizer's skipped step fired no post-hook at all.
    start = 65536.0
    assert batches.scales == [start] * skip_batch + [start / 2] * (8 - skip_batch)
    assert len(rec.steps) == (8 if fused else 7)
    # The skipped step changed no weight at all.
    for name in init:
        assert torch.equal(batches.before[skip_batch][name], batches.after[skip_batch][name]), name
    # The others did train.
    assert not torch.equal(batches.before[skip_batch + 1]["head.weight"], batches.after[skip_batch + 1]["head.weight"])
    final = snapshot(model)
    expected = standard_expected(init)
    assert_exact_every_step(rec, expected, final)
    for i, after in enumerate(batches.after):
        check_pins(after, expected, f"after batch {i}")
    assert_free_elements_trained(init, final, expected)
    cb.verify(model)


# --------------------------------------------------------------------------------------------
# LR schedulers


class SchedNet(TinyNet):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def configure_optimizers(self):
        if self.kind == "step":
            opt = torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        else:
            opt = torch.optim.Adam(self.parameters(), lr=0.01, weight_decay=0.01)
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=20)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


@pytest.mark.parametrize("kind", ["step", "onecycle"])
def test_lr_schedulers_exact_after_every_step(kind):
    model = SchedNet(kind)
    init, cb, rec, _ = fit_pinned(model, standard_pins(), max_epochs=2)
    assert len(rec.steps) == 16
    assert len({r["lr"] for r in rec.steps}) > 2  # the scheduler really moved the learning rate
    final = snapshot(model)
    expected = standard_expected(init)
    assert_exact_every_step(rec, expected, final)
    assert_free_elements_trained(init, final, expected)
    cb.verify(model)


# --------------------------------------------------------------------------------------------
# Manual optimization with two optimizers


class TwoOptNet(TinyNet):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        enc_opt, head_opt = self.optimizers()
        loss = nn.functional.cross_entropy(self(x), y)
        enc_opt.zero_grad()
        self.manual_backward(loss)
        enc_opt.step()
        loss = nn.functional.cross_entropy(self(x), y)
        head_opt.zero_grad()
        self.manual_backward(loss)
        head_opt.step()

    def configure_optimizers(self):
        return (
            torch.optim.AdamW(self.encoder.parameters(), lr=0.05, weight_decay=0.1),
            torch.optim.SGD(self.head.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01),
        )


def test_manual_optimization_two_optimizers_windows_in_global_step():
    # global_step counts every step of both optimizers: batch b does steps 2b (encoder) and 2b+1 (head).
    enc = [(1, 2), (9, 4)]
    model = TwoOptNet()
    pins = [
        Pin("encoder.weight", indices=enc, value=[0.75, -0.25], start_step=3),  # opens at the head's step of batch 1
        Pin("head.weight", fraction=0.2, seed=5, start_step=2),  # value=None, opens at batch 1
        Pin("head.bias", indices=[(1,)], value=0.5, stop_step=5),  # closes before the head's step of batch 2
        Pin("encoder.bias"),  # whole tensor, all the time
    ]
    init, cb, rec, tr = fit_pinned(model, pins, max_epochs=1)
    assert [(r["step"], r["opt"]) for r in rec.steps] == [(s, s % 2) for s in range(16)]
    assert tr.global_step == 16
    after = {r["step"]: r["params"] for r in rec.steps}
    head_index = fraction_indices("head.weight", 48, 0.2, 5)
    enc_index = flat_index((16, 8), enc)
    head_target = after[1]["head.weight"].reshape(-1)[head_index]  # value when the pin opened
    for step, params in after.items():
        check_pins(params, {"encoder.bias": (None, init["encoder.bias"])}, f"after step {step}")
        enc_now = params["encoder.weight"].reshape(-1)[enc_index]
        if step >= 3:
            check_pins(params, {"encoder.weight": (enc_index, torch.tensor([0.75, -0.25]))}, f"after step {step}")
        else:
            assert not torch.equal(enc_now, torch.tensor([0.75, -0.25]))
        if step >= 2:
            check_pins(params, {"head.weight": (head_index, head_target)}, f"after step {step}")
        bias = params["head.bias"][1]
        if step < 5:
            assert bias == 0.5, f"head.bias[1] off after step {step}"
        else:
            assert bias != 0.5, f"head.bias[1] did not train again after step {step}"
    # Before its window the encoder pin's elements trained (the encoder step of batch 1 moved them).
    assert not torch.equal(
        after[2]["encoder.weight"].reshape(-1)[enc_index], after[0]["encoder.weight"].reshape(-1)[enc_index]
    )
    # Before its window the head fraction trained (the head steps of batch 0 moved it).
    assert not torch.equal(head_target, init["head.weight"].reshape(-1)[head_index])
    cb.verify(model)


# --------------------------------------------------------------------------------------------
# Per-batch `when` freezing with Adam (the tutorial: each task's batches freeze the other task's layer)


def is_task1(batch, batch_idx) -> bool:
    return bool(batch[2][0] == 1)


def is_task2(batch, batch_idx) -> bool:
    return bool(batch[2][0] == 2)


TASKS = [1, 2, 1, 1, 2, 2, 1, 2]


def multitask_loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 3, generator=g)
    y = torch.randint(0, 4, (64,), generator=g)
    task = torch.tensor(TASKS).repeat_interleave(8)
    return DataLoader(TensorDataset(x, y, task), batch_size=8, shuffle=False)


class MultiTaskNet(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.hidden_task1 = nn.Linear(3, 3, bias=False)
        self.hidden_task2 = nn.Linear(3, 3, bias=False)
        self.output = nn.Linear(3, 4, bias=False)
        self.grads: list[dict] = []

    def forward(self, x, task):
        # The batch's own layer leads, the other contributes: both layers get gradients every batch.
        h1, h2 = self.hidden_task1(x), self.hidden_task2(x)
        h = h1 + 0.5 * h2 if task == 1 else 0.5 * h1 + h2
        return self.output(torch.sigmoid(h))

    def training_step(self, batch, batch_idx):
        x, y, task = batch
        return nn.functional.cross_entropy(self(x, int(task[0])), y)

    def on_after_backward(self):
        self.grads.append(
            {n: None if p.grad is None else p.grad.detach().clone() for n, p in self.named_parameters()}
        )

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)


def test_when_freezing_per_task_with_adam():
    model = MultiTaskNet()
    batches = BatchRecorder()
    pins = [Pin("hidden_task2.weight", when=is_task1), Pin("hidden_task1.weight", when=is_task2)]
    init, cb, rec, tr = fit_pinned(model, pins, loader=multitask_loader(), max_epochs=1, extra_callbacks=[batches])
    assert len(batches.before) == len(model.grads) == len(TASKS)
    layers = {1: "hidden_task1.weight", 2: "hidden_task2.weight"}
    for i, task in enumerate(TASKS):
        trained, frozen = layers[task], layers[3 - task]
        for name in layers.values():
            grad = model.grads[i][name]
            assert grad is not None and (grad != 0).any(), f"{name} got no gradient on batch {i}"
        assert torch.equal(batches.before[i][frozen], batches.after[i][frozen]), f"{frozen} moved on batch {i}"
        assert not torch.equal(batches.before[i][trained], batches.after[i][trained]), f"{trained} frozen on batch {i}"
        assert not torch.equal(batches.before[i]["output.weight"], batches.after[i]["output.weight"])
    # Adam skipped each frozen layer entirely (state included): its step count is the number of
    # batches on which it trained.
    opt = tr.optimizers[0]
    assert int(opt.state[model.hidden_task1.weight]["step"]) == TASKS.count(1)
    assert int(opt.state[model.hidden_task2.weight]["step"]) == TASKS.count(2)


# --------------------------------------------------------------------------------------------
# Step windows


class ProbeNet(TinyNet):
    """Records, inside training_step, the values the forward of each step sees."""

    def __init__(self):
        super().__init__()
        self.seen: dict[int, tuple] = {}

    def training_step(self, batch, batch_idx):
        self.seen[self.trainer.global_step] = (
            self.head.weight[0, 0].detach().clone(),
            self.encoder.bias[1].detach().clone(),
        )
        return super().training_step(batch, batch_idx)


def test_start_and_stop_step():
    model = ProbeNet()
    pins = [
        Pin("head.weight", indices=[(0, 0)], value=3.0, start_step=4, stop_step=9),
        Pin("encoder.bias", indices=[(1,)], start_step=4),  # value=None: captured when it opens
    ]
    init, cb, rec, _ = fit_pinned(model, pins, max_epochs=2)
    assert [r["step"] for r in rec.steps] == list(range(16))
    head = [r["params"]["head.weight"][0, 0] for r in rec.steps]
    bias = [r["params"]["encoder.bias"][1] for r in rec.steps]
    # The forward of the first active step already sees the pinned values.
    assert model.seen[4][0] == 3.0
    assert model.seen[4][1] == bias[3]
    # Before start_step the elements train.
    assert model.seen[0][0] == init["head.weight"][0, 0]
    for step in range(4):
        assert model.seen[step][0] != 3.0
        assert head[step] != (init["head.weight"][0, 0] if step == 0 else head[step - 1]), f"step {step}"
        assert bias[step] != (init["encoder.bias"][1] if step == 0 else bias[step - 1]), f"step {step}"
    # Inside the window they are exact after every step.
    for step in range(4, 9):
        assert head[step] == 3.0, f"head.weight[0, 0] off after step {step}"
    for step in range(4, 16):
        assert bias[step] == bias[3], f"encoder.bias[1] off after step {step}"
        assert model.seen[step][1] == bias[3]
    # From stop_step on, the element trains again.
    for step in range(9, 16):
        assert head[step] != (3.0 if step == 9 else head[step - 1]), f"head.weight[0, 0] did not train at {step}"


# --------------------------------------------------------------------------------------------
# The callback never moves anything by itself


def adamw_wd(params):
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def _train(callbacks) -> tuple[dict, dict]:
    torch.manual_seed(7)
    model = TinyNet(optimizer_factory=adamw_wd)
    init = snapshot(model)
    trainer(max_epochs=3, callbacks=callbacks).fit(model, make_loader())
    return init, snapshot(model)


@pytest.mark.parametrize(
    "pins",
    [[], [Pin("head.weight", indices=[(0, 0)], value=0.0, start_step=10_000), Pin("encoder.*", start_step=10_000)]],
    ids=["empty", "window-never-opens"],
)
def test_inactive_pins_leave_training_bit_identical(pins):
    init, plain = _train([])
    _, pinned = _train([PinCallback(pins, verbose=False)])
    for name in plain:
        assert not torch.equal(plain[name], init[name]), f"{name} did not train"
        assert torch.equal(plain[name], pinned[name]), f"{name} differs from training without the callback"


# --------------------------------------------------------------------------------------------
# verify()


def test_verify_after_fit_names_tampered_elements():
    model = TinyNet()
    init, cb, rec, _ = fit_pinned(model, standard_pins(), max_epochs=1)
    cb.verify(model)
    cb.verify()
    with torch.no_grad():
        model.encoder.weight[1, 1] += 1.0  # not pinned
    cb.verify(model)
    with torch.no_grad():
        model.encoder.weight[3, 5] += 0.5  # pinned to -2.0
        model.head.bias[2] = model.head.bias[2] + 1e-6  # wholly pinned
    with pytest.raises(PinError) as info:
        cb.verify(model)
    message = str(info.value)
    assert "encoder.weight" in message and "(3, 5)" in message
    assert "head.bias" in message and "(2,)" in message
    assert "head.weight" not in message
    with torch.no_grad():
        model.encoder.weight[3, 5] = -2.0
        model.head.bias.copy_(init["head.bias"])
    cb.verify(model)
