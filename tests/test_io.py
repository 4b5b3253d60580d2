"""The one tensor-file reader (core.io) and the one table printer (reporting.tables): every failure
names the file and says why, each caller keeps its own words, and tables print with or without rich."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lightning_pin import Pin, PinError
from lightning_pin.app.pins import fault_map_pins
from lightning_pin.app.train import load_weights
from lightning_pin.core.io import TensorFileError, load_checkpoint, load_tensors
from lightning_pin.core.plan import resolve
from helpers import TinyNet
from lightning_pin.reporting import tables


def _garbage(path: Path) -> Path:
    path.write_bytes(b"not a tensor file")
    return path


def _empty(path: Path) -> Path:
    path.write_bytes(b"")
    return path


def _cut(path: Path, legacy: bool = False) -> Path:
    """A checkpoint cut short, as an interrupted save or copy leaves it."""
    state = {"state_dict": {"w": torch.randn(64, 64)}, "epoch": 1}
    if path.suffix == ".safetensors":
        save_file(state["state_dict"], str(path))
    else:
        torch.save(state, path, _use_new_zipfile_serialization=not legacy)
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])
    return path


@pytest.mark.parametrize(
    ("make", "reason", "words"),
    [
        (lambda tmp: tmp / "missing.pt", "missing", "does not exist"),
        (lambda tmp: tmp / "values.npy", "suffix", "must end in one of .pt, .pth, .bin, .ckpt, .safetensors"),
        (lambda tmp: (tmp / "shards.ckpt").mkdir() or tmp / "shards.ckpt", "directory", "consolidate it"),
        (lambda tmp: _garbage(tmp / "garbage.pt"), "unreadable", "is not a PyTorch or safetensors file"),
        (lambda tmp: _garbage(tmp / "garbage.safetensors"), "unreadable", "is not a safetensors file"),
        (lambda tmp: _empty(tmp / "empty.ckpt"), "unreadable", r"is empty \(0 bytes\)"),
        (lambda tmp: _empty(tmp / "empty.safetensors"), "unreadable", r"is empty \(0 bytes\)"),
        (lambda tmp: _cut(tmp / "cut.ckpt"), "unreadable", r"is truncated \([0-9,]+ bytes, cut short"),
        (lambda tmp: _cut(tmp / "cut.pt", legacy=True), "unreadable", r"is truncated \([0-9,]+ bytes, cut short"),
        (lambda tmp: _cut(tmp / "cut.safetensors"), "unreadable", r"is truncated \([0-9,]+ bytes, cut short"),
    ],
    ids=["missing", "suffix", "directory", "unreadable-pt", "unreadable-safetensors", "empty", "empty-safetensors",
         "truncated", "truncated-legacy", "truncated-safetensors"],
)
def test_load_tensors_names_the_file_and_the_reason(tmp_path, make, reason, words):
    path = make(tmp_path)
    with pytest.raises(TensorFileError, match=words) as caught:
        load_tensors(path)
    assert caught.value.reason == reason and caught.value.path == path and str(path) in str(caught.value)
    # It survives the trip from a spawned worker to the parent process.
    copy = pickle.loads(pickle.dumps(caught.value))
    assert (str(copy), copy.path, copy.reason) == (str(caught.value), path, reason)


def test_load_tensors_reads_every_kind_bit_for_bit(tmp_path):
    weights = {"w": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int64)}
    for suffix in (".pt", ".pth", ".bin", ".ckpt"):
        torch.save(weights, tmp_path / f"w{suffix}")
    save_file(weights, str(tmp_path / "w.safetensors"))
    for path in sorted(tmp_path.iterdir()):
        loaded = load_tensors(path)
        assert set(loaded) == {"w", "b"} and all(torch.equal(loaded[k], weights[k]) for k in weights), path


def test_load_checkpoint_wraps_bare_state_dicts_and_refuses_the_rest(tmp_path):
    torch.save({"state_dict": {"w": torch.ones(2)}, "epoch": 3}, tmp_path / "a.ckpt")
    assert load_checkpoint(tmp_path / "a.ckpt")["epoch"] == 3
    save_file({"w": torch.ones(2)}, str(tmp_path / "b.safetensors"))
    assert torch.equal(load_checkpoint(tmp_path / "b.safetensors")["state_dict"]["w"], torch.ones(2))
    for name, content in (("list.pt", [1, 2]), ("empty.pt", {})):
        torch.save(content, tmp_path / name)
        with pytest.raises(TensorFileError, match="holds neither a Lightning checkpoint") as caught:
            load_checkpoint(tmp_path / name)
        assert caught.value.reason == "contents"


def test_callers_keep_their_own_words(tmp_path):
    # A pin's file: the pin and the field are named.
    (tmp_path / "dir.pt").mkdir()
    with pytest.raises(PinError, match=r"Pin\(params='head.bias'.*cannot read value file .*dir\.pt.*directory"):
        resolve([Pin("head.bias", value=str(tmp_path / "dir.pt"))], TinyNet())
    # A fault map: says how to write one when it is missing, and what is wrong otherwise.
    with pytest.raises(PinError, match="random_fault_map"):
        fault_map_pins(tmp_path / "missing.pt")
    with pytest.raises(PinError, match=r"fault map: .*garbage\.pt is not a PyTorch or safetensors file"):
        fault_map_pins(_garbage(tmp_path / "garbage.pt"))
    # The app's ckpt_path: a missing file is a FileNotFoundError naming the option.
    with pytest.raises(FileNotFoundError, match=r"ckpt_path='nowhere\.ckpt' does not exist"):
        load_weights(TinyNet(), "nowhere.ckpt")
    torch.save([1], tmp_path / "odd.ckpt")
    with pytest.raises(ValueError, match=r"ckpt_path=.*odd\.ckpt.*holds neither"):
        load_weights(TinyNet(), str(tmp_path / "odd.ckpt"))
    # An empty or truncated ckpt_path: the file and what is wrong with it, and the model left as it was.
    net = TinyNet()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    for bad, words in [(_empty(tmp_path / "empty.ckpt"), r"empty\.ckpt is empty \(0 bytes\)"),
                       (_cut(tmp_path / "cut.ckpt"), r"cut\.ckpt is truncated")]:
        with pytest.raises(ValueError, match=rf"ckpt_path=.*{words}"):
            load_weights(net, str(bad))
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())


def test_load_weights_takes_a_bare_state_dict(tmp_path):
    source, target = TinyNet(), TinyNet()
    assert not torch.equal(source.head.weight, target.head.weight)
    torch.save(source.state_dict(), tmp_path / "weights.pt")
    load_weights(target, str(tmp_path / "weights.pt"))
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), target.state_dict().values()))


# ------------------------------------------------------------------------------------------------
# The table printer

COLUMNS = ["tensor", tables.Column("changed", justify="right")]
ROWS = [["head.weight", "48"], ["head.bias", "3"]]


def test_plain_table_without_rich(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "rich.console", None)  # `import rich.console` now fails
    tables.print_table(COLUMNS, ROWS, "a -> b", row_styles=["dim", None], footer=[("2 tensors", "green")])
    assert capsys.readouterr().out.splitlines() == [
        "a -> b",
        "  tensor       changed",
        "  head.weight       48",
        "  head.bias          3",
        "2 tensors",
    ]


def test_rich_table_keeps_its_natural_width_in_a_pipe(capsys):
    long_name = "backbone.encoder.layers.0.self_attn.out_proj.weight." + "x" * 80
    tables.print_table(COLUMNS, [[long_name, "1,234,567"]], "wide", footer=[("[not markup]", None)])
    out = capsys.readouterr().out
    assert long_name in out and "1,234,567" in out  # neither folded nor cut
    assert "[not markup]" in out


def test_table_rows_must_fit_the_columns():
    with pytest.raises(ValueError, match="row 1 has 1 cells but the table has 2 columns"):
        tables.print_table(COLUMNS, [["a", "1"], ["b"]])
    with pytest.raises(ValueError, match="row_styles has 1 entries for 2 rows"):
        tables.print_table(COLUMNS, ROWS, row_styles=["dim"])


# --------------------------------------------------------------------------------------------
# Value and mask files keyed by name: one rule for what a key names


def _bn_net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))


@pytest.mark.parametrize("key", ["1.running_mean", "1.running_var", "1", "2"])
@pytest.mark.parametrize("field", ["value", "mask"])
def test_a_one_entry_file_under_a_buffer_or_submodule_name_is_not_applied_to_another_parameter(tmp_path, key, field):
    # The single-entry fallback (a one-tensor file under a name the module does not know) must not
    # take a key that names a buffer or a submodule: its entry fits 0.bias by shape only.
    model = _bn_net()
    entry = torch.tensor([1.0, 2.0, 3.0]) if field == "value" else torch.tensor([True, False, True])
    torch.save({key: entry}, tmp_path / "f.pt")
    before = model[0].bias.detach().clone()
    words = rf"{field} has no entry for parameter '0.bias'; its keys are \['{key}'\], and \['{key}'\] name other"
    with pytest.raises(PinError, match=words):
        resolve([Pin("0.bias", **{field: str(tmp_path / "f.pt")})], model)
    assert torch.equal(model[0].bias.detach(), before)
    # A key that names nothing in the module still serves the one parameter, by shape.
    torch.save({"stuck": entry}, tmp_path / "g.pt")
    resolve([Pin("0.bias", **{field: str(tmp_path / "g.pt")})], model)


@pytest.mark.parametrize("field", ["value", "mask"])
def test_a_file_keyed_like_a_compiled_modules_state_dict_serves_the_compiled_module(tmp_path, field):
    from lightning_pin import pin

    model = _bn_net()
    compiled = torch.compile(model)
    value = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    mask[1, 2] = True
    torch.save({"_orig_mod.0.weight": value if field == "value" else mask, "_orig_mod.2.bias": torch.zeros(2)},
               tmp_path / "f.pt")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    given = {field: str(tmp_path / "f.pt")} if field == "value" else {"mask": str(tmp_path / "f.pt"), "value": 7.0}
    with pin(compiled, optimizer, Pin("0.weight", **given)) as handle:
        expected = value if field == "value" else torch.where(mask, torch.tensor(7.0), model[0].weight.detach())
        assert torch.equal(model[0].weight.detach(), expected)
        handle.verify()
    # The same names with and without the prefix must agree.
    torch.save({"_orig_mod.0.weight": value, "0.weight": value + 1}, tmp_path / "both.pt")
    with pytest.raises(PinError, match=r"different entries for '0.weight' and '_orig_mod.0.weight'"):
        resolve([Pin("0.weight", value=str(tmp_path / "both.pt"))], model)
