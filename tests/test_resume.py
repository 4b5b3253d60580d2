"""Checkpoint resume with a real Trainer: saved targets survive, resumed runs are bit-identical to
uninterrupted ones, checkpoints load with ``weights_only=True``, and pin state that the callback
cannot match is refused (or, with ``strict=False``, dropped with a warning)."""

from __future__ import annotations

import pytest
import torch
from helpers import StepRecorder, TinyNet, check_pins, flat_index, make_loader, snapshot, trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_pin import Pin, PinCallback, PinError
from lightning_pin.core.plan import fraction_indices

ENC_FRACTION = fraction_indices("encoder.weight", 128, 0.25, 3)
HEAD_COORDS = [(0, 1), (2, 5)]


def resume_pins() -> list[Pin]:
    return [
        Pin("encoder.weight", fraction=0.25, seed=3),  # value=None from step 0
        Pin("head.weight", indices=HEAD_COORDS, value=[2.5, -1.0]),  # explicit
        Pin("head.bias", start_step=3),  # whole tensor, value=None, opens before the checkpoint
        Pin("encoder.bias", indices=[(3,), (4,)], start_step=8),  # opens right at the resume boundary
        Pin("encoder.bias", indices=[(0,), (1,)], start_step=11),  # opens after the resume
        Pin("encoder.weight", indices=[(5, 0)], value=0.25, stop_step=5),  # closed before the checkpoint
        # Open across the resume boundary. Adam's coupled L2 decay fills these elements' moments
        # while they are pinned, which shapes how they train after stop_step: zeroing that state
        # again on resume would show up in the final weights.
        Pin("head.weight", indices=[(1, 0), (1, 7)], start_step=2, stop_step=12),
    ]


def adam_l2(params):
    return torch.optim.Adam(params, lr=0.05, weight_decay=0.1)


def fit(model, callbacks, max_epochs, ckpt_path=None, **kwargs):
    tr = trainer(max_epochs=max_epochs, callbacks=callbacks, **kwargs)
    tr.fit(model, make_loader(), ckpt_path=ckpt_path, weights_only=True if ckpt_path else None)
    return tr


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Two epochs (16 steps) in one go, with a checkpoint at the end of each epoch."""
    directory = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    model = TinyNet(optimizer_factory=adam_l2)
    init = snapshot(model)
    rec = StepRecorder()
    checkpoint = ModelCheckpoint(dirpath=directory, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    fit(model, [PinCallback(resume_pins(), verbose=False), rec, checkpoint], 2, enable_checkpointing=True)
    assert [r["step"] for r in rec.steps] == list(range(16))
    return {"init": init, "final": snapshot(model), "steps": rec.steps, "ckpt": directory / "epoch=0.ckpt"}


def resume(ckpt, seed=123):
    """Resume into a model re-initialised with different random weights."""
    torch.manual_seed(seed)
    model = TinyNet(optimizer_factory=adam_l2)
    fresh = snapshot(model)
    cb = PinCallback(resume_pins(), verbose=False)
    rec = StepRecorder()
    fit(model, [cb, rec], 2, ckpt_path=str(ckpt))
    return model, fresh, cb, rec


def expected_targets(run) -> dict:
    init, steps = run["init"], run["steps"]
    return {
        "encoder.weight": (ENC_FRACTION, init["encoder.weight"].reshape(-1)[ENC_FRACTION]),
        "head.weight": (flat_index((3, 16), HEAD_COORDS), torch.tensor([2.5, -1.0])),
        "head.bias": (None, steps[2]["params"]["head.bias"]),
    }


def assert_same_run(run, model, rec):
    assert [r["step"] for r in rec.steps] == list(range(8, 16))
    for resumed, original in zip(rec.steps, run["steps"][8:]):
        for name, value in original["params"].items():
            assert torch.equal(resumed["params"][name], value), f"{name} differs after step {original['step']}"
    final = snapshot(model)
    for name, value in run["final"].items():
        assert torch.equal(final[name], value), f"{name} differs from the uninterrupted run"


def test_checkpoint_holds_only_weights_only_types(uninterrupted):
    checkpoint = torch.load(uninterrupted["ckpt"], weights_only=True)
    states = {k: v for k, v in checkpoint["callbacks"].items() if k.startswith("PinCallback")}
    assert len(states) == 1
    (state,) = states.values()
    assert len(state["pins"]) == len(resume_pins())


def test_resume_is_bit_identical_to_uninterrupted(uninterrupted):
    model, fresh, cb, rec = resume(uninterrupted["ckpt"])
    # The re-initialised model really had other weights at the value=None pins.
    assert not torch.equal(
        fresh["encoder.weight"].reshape(-1)[ENC_FRACTION],
        uninterrupted["init"]["encoder.weight"].reshape(-1)[ENC_FRACTION],
    )
    assert_same_run(uninterrupted, model, rec)
    expected = expected_targets(uninterrupted)
    for record in rec.steps:
        check_pins(record["params"], expected, f"after resumed step {record['step']}")
    # Pins opening at and after the resume boundary captured the values they had then.
    steps = uninterrupted["steps"]
    final = snapshot(model)
    assert torch.equal(final["encoder.bias"][3:5], steps[7]["params"]["encoder.bias"][3:5])
    assert torch.equal(final["encoder.bias"][0:2], steps[10]["params"]["encoder.bias"][0:2])
    # ... and trained before opening.
    assert not torch.equal(steps[7]["params"]["encoder.bias"][3:5], steps[6]["params"]["encoder.bias"][3:5])
    assert not torch.equal(steps[10]["params"]["encoder.bias"][0:2], steps[9]["params"]["encoder.bias"][0:2])
    # The pin open across the boundary held through it and its elements train after stop_step.
    window = [r["params"]["head.weight"][1, [0, 7]] for r in steps]
    for step in range(2, 12):
        assert torch.equal(window[step], window[1]), f"head.weight[1, [0, 7]] off after step {step}"
    assert (window[15] != window[1]).all()
    cb.verify(model)


def test_resume_keeps_saved_targets_when_checkpoint_weights_were_changed(uninterrupted, tmp_path):
    """value=None targets come from the callback state, not from the weights being resumed."""
    checkpoint = torch.load(uninterrupted["ckpt"], weights_only=True)
    weights = checkpoint["state_dict"]
    with torch.no_grad():
        weights["encoder.weight"].view(-1)[ENC_FRACTION] += 1.0  # value=None pin
        weights["head.weight"].view(-1)[flat_index((3, 16), HEAD_COORDS)] = 9.0  # explicit pin
        weights["head.bias"] += 1.0  # whole-tensor value=None pin
    tampered = tmp_path / "tampered.ckpt"
    torch.save(checkpoint, tampered)
    model, _, cb, rec = resume(tampered, seed=321)
    expected = expected_targets(uninterrupted)
    for record in rec.steps:
        check_pins(record["params"], expected, f"after resumed step {record['step']}")
    check_pins(snapshot(model), expected, "at the end")
    # The targets were forced before the first resumed forward, so nothing else noticed.
    assert_same_run(uninterrupted, model, rec)
    cb.verify(model)


# --------------------------------------------------------------------------------------------
# Pin state the callback cannot match


def _pretrained_checkpoint(tmp_path, pins):
    torch.manual_seed(0)
    model = TinyNet()
    tr = fit(model, [] if pins is None else [PinCallback(pins, verbose=False)], 1)
    path = tmp_path / "pins.ckpt"
    tr.save_checkpoint(path)
    return path, snapshot(model)


def test_resume_with_different_pins_raises(tmp_path):
    path, _ = _pretrained_checkpoint(tmp_path, [Pin("head.weight", indices=[(0, 0)], value=1.0)])
    torch.manual_seed(1)
    with pytest.raises(PinError, match="pin state"):
        fit(TinyNet(), [PinCallback([Pin("head.weight", indices=[(1, 1)], value=1.0)], verbose=False)], 2, path)


def test_resume_with_different_pins_strict_false_warns_and_continues(tmp_path):
    path, _ = _pretrained_checkpoint(tmp_path, [Pin("head.weight", indices=[(0, 0)], value=1.0)])
    torch.manual_seed(1)
    model = TinyNet()
    cb = PinCallback([Pin("head.weight", indices=[(1, 1)], value=-1.0)], strict=False, verbose=False)
    rec = StepRecorder()
    with pytest.warns(UserWarning, match="dropping saved pin state"):
        fit(model, [cb, rec], 2, path)
    assert [r["step"] for r in rec.steps] == list(range(8, 16))
    for record in rec.steps:
        assert record["params"]["head.weight"][1, 1] == -1.0
    # The old pin is gone: its element trains.
    assert model.head.weight[0, 0] != 1.0
    cb.verify(model)


def _mask_pin(path):
    return [Pin("encoder.weight", mask=str(path))]


def test_resume_with_changed_selection_raises_and_strict_false_starts_afresh(tmp_path):
    """Same spec (same state_key) but a mask file whose content changed: the saved selection differs."""
    mask_path = tmp_path / "mask.pt"
    mask = torch.zeros(16, 8, dtype=torch.bool)
    mask[0, :4] = True
    torch.save(mask, mask_path)
    path, trained = _pretrained_checkpoint(tmp_path, _mask_pin(mask_path))
    new_mask = torch.zeros(16, 8, dtype=torch.bool)
    new_mask[1, :4] = True
    torch.save(new_mask, mask_path)

    torch.manual_seed(1)
    with pytest.raises(PinError, match="differ"):
        fit(TinyNet(), [PinCallback(_mask_pin(mask_path), verbose=False)], 2, path)

    torch.manual_seed(1)
    model = TinyNet()
    cb = PinCallback(_mask_pin(mask_path), strict=False, verbose=False)
    rec = StepRecorder()
    with pytest.warns(UserWarning, match="ignoring saved pin state"):
        fit(model, [cb, rec], 2, path)
    # Started afresh: the new elements keep the values they had at the resume (the checkpoint's).
    for record in rec.steps:
        assert torch.equal(record["params"]["encoder.weight"][1, :4], trained["encoder.weight"][1, :4])
    assert not torch.equal(model.encoder.weight[0, :4].detach(), trained["encoder.weight"][0, :4])
    cb.verify(model)


def test_resume_from_checkpoint_without_pin_state_starts_pins(tmp_path):
    """Pretrain without pins, then resume with them: pins start at the resume step."""
    path, trained = _pretrained_checkpoint(tmp_path, None)
    assert not any(k.startswith("PinCallback") for k in torch.load(path, weights_only=True)["callbacks"])
    torch.manual_seed(1)
    model = TinyNet()
    cb = PinCallback([Pin("encoder.weight", indices=[(2, 2)]), Pin("head.weight", indices=[(0, 0)], value=4.0)])
    rec = StepRecorder()
    fit(model, [cb, rec], 2, path)
    assert [r["step"] for r in rec.steps] == list(range(8, 16))
    for record in rec.steps:
        assert record["params"]["encoder.weight"][2, 2] == trained["encoder.weight"][2, 2]
        assert record["params"]["head.weight"][0, 0] == 4.0
    cb.verify(model)


def test_resume_with_pins_from_checkpoint_of_empty_pin_set(tmp_path):
    path, trained = _pretrained_checkpoint(tmp_path, [])
    torch.manual_seed(1)
    model = TinyNet()
    cb = PinCallback([Pin("head.weight", indices=[(0, 0)], value=4.0)], verbose=False)
    fit(model, [cb], 2, path)
    assert model.head.weight[0, 0] == 4.0
    cb.verify(model)
