"""Stuck bits and bounds through the Lightning door (``PinCallback`` in a real ``Trainer``): after
every optimizer step (checked on integer views), under accumulation + clipping and bf16-mixed, in
averaged copies (EMA, SWA) and across a resume (bit identical); refused specs stop ``fit`` before
any weight changes. DDP (``ddp_spawn``, two processes) runs fault pins in test_ddp.py's shared run."""

from __future__ import annotations

import pytest
import torch
from helpers import StepRecorder, TinyNet, make_loader, snapshot, trainer
from lightning.pytorch.callbacks import Callback, EMAWeightAveraging, ModelCheckpoint, StochasticWeightAveraging

from lightning_pin import Pin, PinCallback, PinError
from lightning_pin.callbacks import _compat

ELEMENTS = [(i, j) for i in range(0, 16, 3) for j in range(0, 8, 3)]  # 18 elements of encoder.weight
ROWS, COLS = torch.tensor([i for i, _ in ELEMENTS]), torch.tensor([j for _, j in ELEMENTS])
SIGN, MANT = -(2**31), 0x00400000  # float32's sign bit (as int32) and a mantissa bit
LOW, HIGH = -0.05, 0.05


def fault_pins() -> list[Pin]:
    return [
        Pin("encoder.weight", indices=ELEMENTS, stuck_at_zero=0x80000000, stuck_at_one=MANT),
        Pin("head.weight", bounds=(LOW, HIGH)),
        Pin("head.bias", value=0.25),  # a value pin alongside
    ]


def bits(params: dict) -> torch.Tensor:
    return params["encoder.weight"][ROWS, COLS].contiguous().view(torch.int32)


def assert_faults_hold(params: dict, where: str) -> None:
    b = bits(params)
    assert torch.equal(b & SIGN, torch.zeros_like(b)), f"a sign bit stuck at 0 reads 1 {where}"
    assert torch.equal(b & MANT, torch.full_like(b, MANT)), f"a mantissa bit stuck at 1 reads 0 {where}"
    w = params["head.weight"]
    assert bool(((w >= LOW) & (w <= HIGH)).all()), f"head.weight out of bounds {where}"
    assert bool((params["head.bias"] == 0.25).all()), f"head.bias off target {where}"


class FirstForward(TinyNet):
    """Records the bit-pinned elements the first forward sees."""

    def training_step(self, batch, batch_idx):
        if self.global_step == 0 and batch_idx == 0:
            self.first_seen = {name: p.detach().clone() for name, p in self.named_parameters()}
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_faults_hold_after_every_step_with_accumulation_and_clipping(precision):
    torch.manual_seed(0)
    model = FirstForward()
    init = snapshot(model)
    recorder = StepRecorder()
    cb = PinCallback(fault_pins(), verbose=False)
    tr = trainer(max_epochs=2, accumulate_grad_batches=2, gradient_clip_val=0.5, precision=precision,
                 callbacks=[cb, recorder])
    tr.fit(model, make_loader())
    assert [r["step"] for r in recorder.steps] == list(range(8))
    assert_faults_hold(model.first_seen, "in the first forward")
    for record in recorder.steps:
        assert_faults_hold(record["params"], f"after step {record['step']}")
    final = snapshot(model)
    assert_faults_hold(final, "after fit")
    # The free bits of the bit-pinned elements trained, and bounded elements moved inside the bounds.
    changed = (bits(final) ^ bits(init)) & ~(SIGN | MANT)
    assert bool((changed != 0).all())
    steps = torch.stack([r["params"]["head.weight"] for r in recorder.steps])
    assert bool((steps[1:] != steps[:-1]).any())
    assert bool(((steps[-1] > LOW) & (steps[-1] < HIGH)).any())
    cb.verify(model)


def test_verify_names_a_flipped_stuck_bit():
    model = TinyNet()
    cb = PinCallback(fault_pins(), verbose=False)
    trainer(max_steps=2, callbacks=[cb]).fit(model, make_loader())
    cb.verify(model)
    with torch.no_grad():
        model.encoder.weight.view(torch.int32)[3, 3] ^= MANT  # one stuck bit flipped
    flipped = r"encoder\.weight: 1 element\(s\) with stuck bits off \(\(3, 3\).*wrong: 0x00400000"
    with pytest.raises(PinError, match=flipped):
        cb.verify(model)


@pytest.mark.parametrize("kind", ["ema", "swa"])
def test_averaged_copies_hold_the_faults(kind):
    torch.manual_seed(0)
    model = TinyNet()
    averager = EMAWeightAveraging(decay=0.9) if kind == "ema" else StochasticWeightAveraging(swa_lrs=0.01,
                                                                                                swa_epoch_start=1)
    seen = []

    class Watch(StepRecorder):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            averaged = dict(_compat.averaged_modules(trainer)).get(type(averager).__name__)
            if averaged is not None:
                seen.append(snapshot(averaged))

    cb = PinCallback(fault_pins(), verbose=False, monitor=False)
    trainer(max_epochs=3, callbacks=[cb, averager, Watch()]).fit(model, make_loader())
    assert len(seen) >= 8
    for k, params in enumerate(seen):
        assert_faults_hold({name.removeprefix("module."): p for name, p in params.items()}, f"in the average {k}")
    assert_faults_hold(snapshot(model), "in the module after fit (the average copied in)")
    cb.verify(model)


def test_resume_mid_run_is_bit_identical(tmp_path):
    def fit(model, ckpt_path=None, **kwargs):
        recorder = StepRecorder()
        callbacks = [PinCallback(fault_pins(), verbose=False), recorder, *kwargs.pop("extra", [])]
        tr = trainer(max_epochs=2, callbacks=callbacks, **kwargs)
        tr.fit(model, make_loader(), ckpt_path=ckpt_path, weights_only=True if ckpt_path else None)
        return recorder

    torch.manual_seed(0)
    straight_model = TinyNet()
    saver = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    straight = fit(straight_model, extra=[saver], enable_checkpointing=True)
    state = torch.load(tmp_path / "epoch=0.ckpt", weights_only=True)
    (saved,) = [v for k, v in state["callbacks"].items() if k.startswith("PinCallback")]
    assert saved["version"] == 3 and saved["pins"][0]["encoder.weight"]["kind"] == "stuck_bits"

    torch.manual_seed(123)  # other initial weights: everything must come from the checkpoint
    resumed_model = TinyNet()
    resumed = fit(resumed_model, ckpt_path=str(tmp_path / "epoch=0.ckpt"))
    assert [r["step"] for r in resumed.steps] == list(range(8, 16))
    for mine, theirs in zip(resumed.steps, straight.steps[8:]):
        for name, value in theirs["params"].items():
            assert torch.equal(mine["params"][name].view(torch.int32), value.view(torch.int32)), (name, mine["step"])
        assert_faults_hold(mine["params"], f"after resumed step {mine['step']}")
    for name, value in snapshot(straight_model).items():
        assert torch.equal(snapshot(resumed_model)[name].view(torch.int32), value.view(torch.int32)), name


@pytest.mark.parametrize(
    ("pins", "match"),
    [
        ([Pin("encoder.weight", stuck_at_one=0x7F800000)], "inf or NaN"),
        ([Pin("head.weight", bounds=(0, 1)), Pin("head.weight", indices=[(0, 0)], bounds=(2, 3))], "do not meet"),
        ([Pin("encoder.weight", indices=[(0, 0)], stuck_at_one=1 << 32)], "wider than torch.float32"),
    ],
    ids=["stuck exponent", "disjoint bounds", "mask too wide"],
)
def test_refused_faults_stop_fit_before_any_weight_changes(pins, match):
    model = TinyNet()
    before = snapshot(model)
    with pytest.raises(PinError, match=match):
        trainer(max_epochs=1, callbacks=[PinCallback(pins, verbose=False)]).fit(model, make_loader())
    for name, value in snapshot(model).items():
        assert torch.equal(value, before[name]), name


def test_true_bfloat16_training_holds_bfloat16_stuck_bits():
    torch.manual_seed(0)
    model = TinyNet()
    pins = [Pin("encoder.weight", indices=ELEMENTS, stuck_at_zero=0x8000, stuck_at_one=0x0040),
            Pin("head.weight", bounds=(LOW, HIGH))]
    recorder = StepRecorder()
    cb = PinCallback(pins, verbose=False)
    trainer(max_epochs=1, precision="bf16-true", callbacks=[cb, recorder]).fit(model, make_loader())
    assert model.encoder.weight.dtype == torch.bfloat16 and len(recorder.steps) == 8
    for record in recorder.steps:
        b = record["params"]["encoder.weight"][ROWS, COLS].contiguous().view(torch.int16)
        assert torch.equal(b & -(2**15), torch.zeros_like(b)) and torch.equal(b & 0x0040, torch.full_like(b, 0x0040))
        w = record["params"]["head.weight"]
        assert bool(((w >= LOW) & (w <= HIGH)).all())
    cb.verify(model)


@pytest.mark.parametrize(
    ("pins", "match"),
    [
        ([Pin("encoder.weight", indices=[(0, 0)], stuck_at_zero=0x80000000)], "wider than torch.bfloat16"),
        ([Pin("encoder.weight", indices=[(0, 0)], stuck_at_one=0x7F80)], "inf or NaN"),  # float32's are free
        ([Pin("head.bias", bounds=(-3.4e38, 0))], "overflow torch.bfloat16"),  # float32 holds it
    ],
    ids=["float32 mask", "bfloat16 exponent", "bound"],
)
def test_faults_that_do_not_fit_the_true_half_dtype_are_refused_before_the_cast(pins, match):
    model = TinyNet()
    before = snapshot(model)
    with pytest.raises(PinError, match=match):
        trainer(max_epochs=1, precision="bf16-true", callbacks=[PinCallback(pins, verbose=False)]).fit(
            model, make_loader()
        )
    assert model.encoder.weight.dtype == torch.float32  # refused in setup, before Lightning cast the module
    for name, value in snapshot(model).items():
        assert torch.equal(value, before[name]), name


class FlipStuckBit(Callback):
    """Flips one stuck bit after every batch, behind the pins' back."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with torch.no_grad():
            pl_module.encoder.weight.view(torch.int32)[3, 3] ^= MANT


def test_monitor_counts_flipped_stuck_bits_and_logs_drift():
    from test_monitor import MemoryLogger

    logger = MemoryLogger()
    cb = PinCallback(fault_pins(), verbose=False, verify="never")
    trainer(max_steps=4, logger=logger, log_every_n_steps=1, callbacks=[cb, FlipStuckBit()]).fit(
        TinyNet(), make_loader()
    )
    # Step 0 starts clean; before every later step one stuck bit is off.
    assert logger.series("pin/violations") == [(1, 0), (2, 1), (3, 1), (4, 1)]
    # Training pushes against the bounds and the stuck bits: the drift before each restore is > 0.
    assert all(value > 0 for _, value in logger.series("pin/drift_max"))
