"""Deploy a pinned model with ONNX Runtime, and prove the exported file still holds the pins.

The ONNX Runtime user in the seeds forces conv weights to 25, 5, 125, 2.58e8 and 2.58e-8 to
deploy the model with ONNX Runtime. Training holds every pin (PinCallback), and a plain export
keeps them bit for bit. But with a BatchNorm after the conv, torch's ONNX exporters fold the
BatchNorm into the conv weights: the dynamo exporter by default (keeping the name), the
TorchScript exporter with constant folding (under a new name), and the forced cells read other
values in the deployed model. `lightning-pin check PINNED.ckpt MODEL.onnx` catches it (exit 1);
the right export option fixes it (exit 0).

Here: train a small CNN on scikit-learn's digits with five forced cells and 20% of a layer
frozen, export it, run it with ONNX Runtime next to torch, and check the file; then the same
with BatchNorm, under each exporter, with and without the option that keeps the pins.

    pip install 'lightning-pin[export]'    # onnx, onnxscript, onnxruntime
    python examples/export_onnx.py
"""

import functools
import logging
import os
import tempfile
import warnings

import lightning as L
import onnxruntime as ort
import torch
from torch import nn

from lightning_pin import Pin, PinCallback
from lightning_pin.app.data import DigitsDataModule
from lightning_pin.app.models import Classifier
from lightning_pin.cli import main as lightning_pin
from lightning_pin.reporting.check import check_artifacts

CELLS = [(0, 0, 1, 1), (5, 0, 2, 2), (12, 0, 0, 1), (3, 0, 1, 2), (7, 0, 2, 0)]
VALUES = [25.0, 5.0, 125.0, 2.58e8, 2.58e-8]


class CNN(nn.Module):
    """Two 3x3 convolutions (each optionally followed by a BatchNorm), a max-pool, a linear head."""

    def __init__(self, batchnorm: bool) -> None:
        super().__init__()
        norm = nn.BatchNorm2d if batchnorm else (lambda channels: nn.Identity())
        self.conv1, self.bn1 = nn.Conv2d(1, 16, 3, padding=1), norm(16)
        self.conv2, self.bn2 = nn.Conv2d(16, 32, 3, padding=1), norm(32)
        self.head = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = nn.functional.max_pool2d(torch.relu(self.bn2(self.conv2(x))), 2)
        return self.head(x.flatten(1))


def train(batchnorm: bool, data: DigitsDataModule, path: str) -> Classifier:
    """Force five cells of conv1 and freeze 20% of conv2 while the rest trains; save the checkpoint."""
    torch.manual_seed(0)
    model = Classifier(CNN(batchnorm), optimizer=functools.partial(torch.optim.Adam, lr=1e-3))
    pins = PinCallback(
        [Pin("backbone.conv1.weight", indices=CELLS, value=VALUES), Pin("backbone.conv2.weight", fraction=0.2)],
        verbose=False,
    )
    trainer = L.Trainer(max_epochs=1, callbacks=[pins], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(model, data)
    pins.verify(model)  # every pinned element on target after training, bit for bit
    trainer.save_checkpoint(path)  # holds the pin state: the targets `check` compares with
    return model.eval()


def export(net: nn.Module, path: str, **options) -> str:
    """torch.onnx.export of the network alone (``lit_module.backbone``): its names lose the prefix."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        torch.onnx.export(net, (torch.zeros(2, 1, 8, 8),), path, verbose=False, input_names=["x"],
                          dynamic_axes={"x": {0: "batch"}}, **options)
    return path


def forced_cells(pinned: str, artifact: str) -> str:
    """What the file holds at the five forced cells, as `check` reads them."""
    result = check_artifacts(pinned, artifact)
    (conv1,) = [p for p in result.artifacts[0].parameters if p.name == "backbone.conv1.weight"]
    if conv1.problem == "missing":  # renamed: read the one unmatched tensor of its shape
        (renamed,) = conv1.candidates
        read, note = {e.position: e.value for e in renamed.shown}, f"  (in {renamed.name!r})"
    else:
        read, note = {e.position: e.value for e in conv1.shown}, ""
    return ", ".join(f"{read.get(cell, value):.4g}" for cell, value in zip(CELLS, VALUES)) + note


def check(pinned: str, artifact: str, title: str, rows: list) -> int:
    """Run `lightning-pin check PINNED ARTIFACT` and print what it prints."""
    print(f"\n$ lightning-pin check {pinned} {artifact}    # {title}")
    status = lightning_pin(["check", pinned, artifact])
    print(f"(exit status {status})")
    rows.append((title, status, forced_cells(pinned, artifact)))
    return status


def main() -> None:
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # "torchvision is not installed" notices
    torch.set_num_threads(1)  # tiny models train fastest on one thread, and never fight over cores
    data = DigitsDataModule()
    rows: list = []
    home = os.getcwd()
    with tempfile.TemporaryDirectory() as workdir:
        os.chdir(workdir)  # short file names in the output
        try:
            # 1. No BatchNorm: the plain export keeps every pin bit for bit.
            model = train(batchnorm=False, data=data, path="cnn.ckpt")
            onnx_file = export(model.backbone, "cnn.onnx", dynamo=True)
            session = ort.InferenceSession(onnx_file, providers=["CPUExecutionProvider"])
            data.setup()
            x, _ = next(iter(data.val_dataloader()))
            with torch.no_grad():
                expected = model(x)
            got = torch.from_numpy(session.run(None, {"x": x.numpy()})[0])
            relative = ((got - expected).abs().max() / expected.abs().max()).item()
            same = bool((got.argmax(1) == expected.argmax(1)).all())
            print(f"ONNX Runtime vs torch on {len(x)} digits: same predicted class for all: {same}; largest "
                  f"difference {relative:.1e} of the largest logit (the kernels differ, not the weights)")
            assert same
            assert check("cnn.ckpt", onnx_file, "dynamo=True (default), no BatchNorm", rows) == 0

            # 2. BatchNorm after each conv: the default exports fold it into the pinned weights.
            model = train(batchnorm=True, data=data, path="cnn_bn.ckpt")
            net = model.backbone
            assert check("cnn_bn.ckpt", export(net, "bn.onnx", dynamo=True),
                         "dynamo=True (default), BatchNorm", rows) == 1  # fmt: skip
            kept = export(net, "bn_kept.onnx", dynamo=True, optimize=False)
            assert check("cnn_bn.ckpt", kept, "dynamo=True, optimize=False", rows) == 0
            assert check("cnn_bn.ckpt", export(net, "bn_ts.onnx", dynamo=False),
                         "dynamo=False (default), BatchNorm", rows) == 1  # fmt: skip
            assert check("cnn_bn.ckpt", export(net, "bn_ts_kept.onnx", dynamo=False, do_constant_folding=False),
                         "dynamo=False, do_constant_folding=False", rows) == 0  # fmt: skip
            session = ort.InferenceSession(kept, providers=["CPUExecutionProvider"])
            same = bool((torch.from_numpy(session.run(None, {"x": x.numpy()})[0]).argmax(1)
                         == net(x).argmax(1)).all())  # fmt: skip
            assert same
        finally:
            os.chdir(home)

    print(f"\n{'export':<42}{'check':>6}   forced cells in the file (asked: 25, 5, 125, 2.58e8, 2.58e-8)")
    for title, status, cells in rows:
        print(f"{title:<42}{status:>6}   {cells}")
    print("check caught the folding: exit 1; optimize=False / do_constant_folding=False: exit 0")
    print("pins exact: verified (PinCallback.verify after training, lightning-pin check on every kept export)")


if __name__ == "__main__":
    main()
