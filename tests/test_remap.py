"""Fault-aware mapping (lightning_pin.faults.remap): groups from torch.fx, the search, exactness, refusals."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_pin import Pin, PinError, pin
from lightning_pin.app.models import SmallCNN
from lightning_pin.core.kinds.quant_code import QuantCode
from lightning_pin.faults import FaultMapping, bit_faults, cell_faults, remap, remap_spec


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(model: nn.Module, saved: dict[str, torch.Tensor]) -> bool:
    """Bit for bit: every tensor's bytes equal (NaN and -0.0 included)."""
    now = model.state_dict()
    return all(now[k].view(torch.uint8).equal(v.view(torch.uint8)) if v.is_floating_point() and v.numel()
               else torch.equal(now[k], v) for k, v in saved.items())


class Block(nn.Module):
    """A BatchNorm residual block: two residual adds into one stream, a projection head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(2, 8, 3, padding=1)
        self.bn0 = nn.BatchNorm2d(8)
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn0(self.stem(x)))
        x = x + torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(x + self.bn2(self.conv2(x)))
        return self.head(torch.nn.functional.adaptive_avg_pool2d(x, 1).flatten(1))


def trained_block() -> Block:
    torch.manual_seed(0)
    block = Block()
    for bn in (block.bn0, block.bn1, block.bn2):  # statistics that are not the defaults: they must move too
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.data.uniform_(0.5, 1.5)
    return block


def mlp() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 10), nn.Tanh(), nn.Linear(10, 3))


def outputs(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(x)


# ------------------------------------------------------------------------------------------------
# (a) groups


def test_spec_of_the_digits_cnn() -> None:
    spec = remap_spec(SmallCNN(), torch.zeros(2, 1, 8, 8))
    assert spec == {
        "features.0": [("features.0.weight", 0, 1), ("features.0.bias", 0, 1), ("features.2.weight", 1, 1)],
        # flatten after the pool: each channel is a block of 4 x 4 columns of the head
        "features.2": [("features.2.weight", 0, 1), ("features.2.bias", 0, 1), ("head.weight", 1, 16)],
    }


def test_spec_of_a_residual_block_shares_one_stream_and_moves_statistics() -> None:
    spec = remap_spec(trained_block(), torch.zeros(2, 2, 4, 4))
    assert set(spec) == {"stem"}  # conv1 and conv2 add into the stream of stem (its first producer)
    stream = {(n, a) for n, a, _ in spec["stem"]}
    assert {("bn0.running_mean", 0), ("bn0.running_var", 0), ("bn2.running_var", 0), ("conv2.weight", 0),
            ("conv1.weight", 1), ("conv2.weight", 1), ("head.weight", 1), ("stem.bias", 0)} <= stream
    assert ("bn1.running_mean", 0) in stream


class Cat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.out = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(12, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.cat([self.a(x), self.b(x)], dim=1))


def test_an_op_across_channels_is_refused_naming_the_node_unless_excluded() -> None:
    with pytest.raises(PinError, match=r"fx node 'cat'.*exclude="):
        remap_spec(Cat(), torch.zeros(1, 4))
    assert remap_spec(Cat(), torch.zeros(1, 4), exclude=["a", "b"]) == {}


def test_shape_reads_are_harmless_and_outputs_keep_their_order() -> None:
    class Shaped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return self.b(h.view(h.size(0), h.shape[1])) * h.dim()

    spec = remap_spec(Shaped(), torch.zeros(2, 4))
    assert set(spec) == {"a"} and "b" not in spec  # b's outputs are the model's: fixed


# ------------------------------------------------------------------------------------------------
# (b, c) the search, exactness


@pytest.mark.parametrize("make, shape", [(SmallCNN, (4, 1, 8, 8)), (mlp, (5, 6)), (trained_block, (3, 2, 4, 4))])
def test_function_kept_and_cost_lowered(make, shape) -> None:
    torch.manual_seed(2)
    model, x = make(), torch.randn(*shape)
    expected = outputs(model, x)
    original = snapshot(model)
    faults = cell_faults(model, "*weight", rate=0.3, sa1_fraction=0.0, seed=1)
    mapping = remap(model, faults, x)
    assert mapping.perms and mapping.cost_after < mapping.cost_before
    torch.testing.assert_close(outputs(model, x), expected)
    assert not same(model, original)
    mapping.undo(model)
    assert same(model, original)


def test_integer_weights_and_inputs_give_equal_outputs() -> None:
    torch.manual_seed(3)
    model = SmallCNN()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-3, 4, p.shape).float())
    x = torch.randint(0, 3, (4, 1, 8, 8)).float()
    expected = outputs(model, x)
    mapping = remap(model, cell_faults(model, "*weight", rate=0.3, sa1_fraction=0.0, seed=0), x)
    assert mapping.perms
    assert torch.equal(outputs(model, x), expected)  # integer sums: no reassociation error


def test_planted_map_is_found_at_zero_cost() -> None:
    torch.manual_seed(4)
    model, x = mlp(), torch.randn(3, 6)
    weight = model[0].weight.detach()
    planted = torch.randperm(12)
    # the chip's cells in layer 0 read exactly the rows of the weights, permuted: one mapping damages nothing
    faults = [Pin("0.weight", value=weight[planted].clone())]
    mapping = remap(model, faults, x, cost="count")
    assert mapping.cost_before > 0 and mapping.cost_after == 0
    assert torch.equal(mapping.perms["0"], planted)
    assert mapping.damaged_after == {"0.weight": 0}


def test_saved_mapping_reapplied_on_a_fresh_copy_matches() -> None:
    torch.manual_seed(5)
    model, x = trained_block(), torch.randn(2, 2, 4, 4)
    fresh = copy.deepcopy(model)
    mapping = remap(model, cell_faults(model, "*weight", rate=0.4, sa1_fraction=0.0, seed=2), x)
    buffer = io.BytesIO()
    torch.save(mapping.state_dict(), buffer)
    buffer.seek(0)
    loaded = FaultMapping.from_state_dict(torch.load(buffer, weights_only=True))
    loaded.apply(fresh)
    assert same(fresh, snapshot(model))
    assert loaded.cost_after == mapping.cost_after and loaded.perms.keys() == mapping.perms.keys()


def test_feed_forward_of_a_transformer_block_through_spec() -> None:
    torch.manual_seed(6)
    layer = nn.Sequential(nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True))
    x = torch.randn(2, 5, 8)
    assert remap_spec(layer, x) == {}  # fx keeps the encoder layer whole: nothing is guessed
    spec = {"ff": [("0.linear1.weight", 0, 1), ("0.linear1.bias", 0, 1), ("0.linear2.weight", 1, 1)]}
    expected = outputs(layer, x)
    mapping = remap(layer, cell_faults(layer, "0.linear*.weight", rate=0.3, sa1_fraction=0.0), x, spec=spec)
    assert "ff" in mapping.perms and mapping.cost_after < mapping.cost_before
    torch.testing.assert_close(outputs(layer, x), expected)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), rate=st.floats(0.05, 0.9), sa1=st.floats(0, 1),
       cost=st.sampled_from(["l2", "l1", "count"]), bits=st.booleans())
def test_cost_never_exceeds_the_unmapped_one(seed, rate, sa1, cost, bits) -> None:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2))
    if bits:
        faults = bit_faults(model, "*weight", rate=rate / 10, bits="mantissa", seed=seed)
    else:
        faults = cell_faults(model, "*weight", rate=rate, sa1_fraction=sa1, seed=seed)
    mapping = remap(model, faults, torch.randn(2, 3), cost=cost, seed=seed % 7, max_rounds=5)
    assert mapping.cost_after <= mapping.cost_before


def test_same_inputs_same_mapping() -> None:
    results = []
    for _ in range(2):
        model = SmallCNN()
        torch.manual_seed(7)
        model = SmallCNN()
        mapping = remap(model, cell_faults(model, "*weight", rate=0.3, sa1_fraction=0.0), torch.zeros(1, 1, 8, 8),
                        seed=3)
        results.append(mapping.perms)
    assert results[0].keys() == results[1].keys()
    assert all(torch.equal(results[0][g], results[1][g]) for g in results[0])


def test_importance_weighs_a_parameter() -> None:
    torch.manual_seed(8)
    model, x = mlp(), torch.randn(2, 6)
    faults = cell_faults(model, "*weight", rate=0.3, sa1_fraction=0.0)
    base = remap(copy.deepcopy(model), faults, x).cost_before
    weighted = remap(copy.deepcopy(model), faults, x, importance={"0.weight": 0.0})
    unweighted = remap(copy.deepcopy(model), [p for p in faults if p.params != "0.weight"], x)
    assert weighted.cost_before == pytest.approx(unweighted.cost_before) and weighted.cost_before < base


# ------------------------------------------------------------------------------------------------
# (c) refusals change no weight


def refused(model: nn.Module, match: str, *args, **kwargs) -> None:
    saved = snapshot(model)
    with pytest.raises(PinError, match=match):
        remap(model, *args, **kwargs)
    assert same(model, saved)


def test_refusals_change_no_weight() -> None:
    torch.manual_seed(9)
    model, x = mlp(), torch.randn(2, 6)
    faults = cell_faults(model, "*weight", rate=0.3, sa1_fraction=0.0)
    refused(model, "no target", [Pin("0.weight", indices=[[0, 0]])], x)
    refused(model, "cost must be", faults, x, cost="l3")
    refused(model, "max_rounds", faults, x, max_rounds=-1)
    refused(model, "importance names", faults, x, importance={"nope": 1.0})
    refused(model, "lacks", faults, x, spec={"g": [("nope.weight", 0, 1)]})
    # a spec that forgets a consumer: the function check restores the model and refuses
    refused(model, "outputs differ", faults, x, spec={"0": [("0.weight", 0, 1), ("0.bias", 0, 1)]})
    refused(Cat(), "fx node 'cat'", cell_faults(Cat(), "a.weight", rate=0.5, sa1_fraction=0.0), torch.zeros(1, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pin(model, optimizer, faults):
        refused(model, "pins already hold", faults, x)


def test_layer_norm_moves_with_its_channels_and_exclude_takes_globs() -> None:
    torch.manual_seed(13)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(5, 4)
    spec = remap_spec(model, x)
    assert ("1.weight", 0, 1) in spec["0"] and ("1.bias", 0, 1) in spec["0"] and set(spec) == {"0", "3"}
    expected = outputs(model, x)
    faults = cell_faults(model, "*weight", rate=0.4, sa1_fraction=0.0, seed=5)
    mapping = remap(copy.deepcopy(model), faults, x)
    assert set(mapping.perms) == {"0", "3"}
    kept = copy.deepcopy(model)
    mapping = remap(kept, faults, x, exclude="[3]")
    assert set(mapping.perms) == {"0"}
    torch.testing.assert_close(outputs(kept, x), expected)


def test_mapping_refuses_another_model() -> None:
    torch.manual_seed(10)
    model, x = mlp(), torch.randn(2, 6)
    mapping = remap(model, cell_faults(model, "*weight", rate=0.3, sa1_fraction=0.0), x)
    other = nn.Sequential(nn.Linear(6, 11), nn.ReLU(), nn.Linear(11, 10), nn.Tanh(), nn.Linear(10, 3))
    saved = snapshot(other)
    with pytest.raises(PinError, match="units"):
        mapping.apply(other)
    assert same(other, saved)


# ------------------------------------------------------------------------------------------------
# (d) the faults to train with; training after the mapping


def test_per_channel_code_scales_move_with_their_channel() -> None:
    torch.manual_seed(11)
    model, x = mlp(), torch.randn(2, 6)
    scale = model[0].weight.detach().abs().amax(dim=1).double() / 127
    code = QuantCode(bits=8, scale=scale, axis=0)
    faults = bit_faults(model, "0.weight", rate=0.05, code=code, seed=3)
    expected = outputs(model, x)
    mapping = remap(model, faults, x)
    assert "0" in mapping.perms
    moved = mapping.faults[0].code.scale
    assert torch.equal(moved, scale[mapping.perms["0"]])
    assert torch.equal(faults[0].code.scale, scale)  # the given pins are left as they were
    torch.testing.assert_close(outputs(model, x), expected)


def test_pin_and_train_after_the_mapping_then_verify() -> None:
    torch.manual_seed(12)
    model, x = SmallCNN(), torch.randn(8, 1, 8, 8)
    faults = cell_faults(model, "*weight", rate=0.2, sa1_fraction=0.5, seed=4)
    mapping = remap(model, faults, x)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    target = torch.randint(0, 10, (8,))
    with pin(model, optimizer, mapping.faults) as handle:
        for _ in range(3):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), target).backward()
            optimizer.step()
        handle.verify()
    for p in mapping.faults:  # the same pins hit the same cells: the cells hold the chip's values
        name = p.params
        weight = dict(model.named_parameters())[name]
        assert torch.equal(weight[tuple(p.indices.T)], p.value)


def test_a_model_a_pin_callback_holds_is_refused() -> None:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pin import PinCallback

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            return nn.functional.cross_entropy(self(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    seen = []

    class TryRemap(pl.Callback):
        def on_train_start(self, trainer, module):
            saved = snapshot(module)
            with pytest.raises(PinError, match="PinCallback"):
                remap(module, faults, torch.randn(2, 6))
            seen.append(same(module, saved))

    lit = Lit()
    faults = cell_faults(lit, "net.0.weight", rate=0.3, sa1_fraction=0.0)
    data = DataLoader(TensorDataset(torch.randn(4, 6), torch.randint(0, 3, (4,))), batch_size=4)
    trainer = pl.Trainer(max_steps=1, callbacks=[PinCallback(faults, verbose=False, monitor=False), TryRemap()],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(lit, data)
    assert seen == [True]
