"""DDP (``ddp_spawn``, 2 CPU processes) with gradient accumulation and a `when` given as an import
path: element, fraction and whole-tensor pins under AdamW with weight decay stay exact on both
ranks after every optimizer step, and the ranks stay identical."""

from __future__ import annotations

import pytest
import torch
from helpers import check_pins, flat_index, make_loader, trainer
from test_ddp import DDPNet, RankRecorder

from lightning_pin import Pin, PinCallback
from lightning_pin.core.plan import fraction_indices

# Under pytest-xdist (make test) every test that starts several processes runs on one worker, one at a time:
# two process groups starting side by side compete for ports and for the two cores.
pytestmark = pytest.mark.xdist_group("processes")

COORDS = [(1, 1), (7, 3)]
VALUES = [0.25, -3.0]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_accumulate")
    torch.manual_seed(0)
    pins = [
        Pin("encoder.weight", indices=COORDS, value=VALUES),
        Pin("head.weight", fraction=0.25, seed=4),
        Pin("head.bias"),
        Pin("encoder.bias", when="helpers.first_label_is_zero"),  # travels to the workers by name
    ]
    tr = trainer(
        strategy="ddp_spawn",
        devices=2,
        max_epochs=2,
        accumulate_grad_batches=2,
        callbacks=[PinCallback(pins, verbose=False, monitor=False), RankRecorder(str(out))],
    )
    tr.fit(DDPNet(optimizer_factory=None), make_loader())
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


def test_pins_exact_after_every_accumulated_step_on_both_ranks(ranks):
    head = fraction_indices("head.weight", 48, 0.25, 4)
    for data in ranks:
        # 4 batches per rank per epoch, windows of 2: 2 steps an epoch.
        assert [s for s, _ in data["steps"]] == [0, 1, 2, 3]
        want = {
            "encoder.weight": (flat_index((16, 8), COORDS), torch.tensor(VALUES)),
            "head.weight": (head, data["init"]["head.weight"].reshape(-1)[head]),
            "head.bias": (None, data["init"]["head.bias"]),
        }
        for step, params in data["steps"]:
            check_pins(params, want, f"after step {step}")
        assert not torch.equal(data["final"]["encoder.weight"], data["init"]["encoder.weight"])
    for (step, a), (_, b) in zip(ranks[0]["steps"], ranks[1]["steps"]):
        for name in a:
            assert torch.equal(a[name], b[name]), f"{name} differs between ranks after step {step}"
