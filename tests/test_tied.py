"""Tied weights: one tensor under several names (a language model's decoder is its word embedding).

A tied parameter can be pinned by any of its names; it is resolved onto the one tensor under the
first name ``named_parameters()`` yields; the summary lists its other names; a pattern that reaches
it through some of its names warns that the others share it; pins reaching it by different names
are merged (and checked for conflicts) as one parameter.
"""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from helpers import trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pin import Pin, PinCallback, PinError
from lightning_pin.core.plan import resolve

TIED = "'dec.weight' is the same tensor as 'emb.weight' (tied weights): pinning it pins both"
TIED_REVERSED = "'emb.weight' is the same tensor as 'dec.weight' (tied weights): pinning it pins both"


class TiedLM(L.LightningModule):
    """Embedding -> hidden layer -> decoder that shares the embedding's weight (vocab 10, width 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.mid = nn.Linear(4, 4)
        self.dec = nn.Linear(4, 10, bias=False)
        self.dec.weight = self.emb.weight

    def forward(self, tokens):
        return self.dec(torch.tanh(self.mid(self.emb(tokens))))

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        return nn.functional.cross_entropy(self(tokens).reshape(-1, 10), targets.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)


def _tokens(n: int = 32, length: int = 5, vocab: int = 10) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (n, length), generator=g)
    return DataLoader(TensorDataset(tokens, tokens.roll(1, dims=1)), batch_size=8)


def _resolve(pins, module):
    told = []
    plan = resolve(pins, module, warn=told.append)
    return plan, told


def test_the_hand_made_model_is_tied():
    model = TiedLM()
    assert model.dec.weight is model.emb.weight
    assert [n for n, _ in model.named_parameters(remove_duplicate=False)] == [
        "emb.weight", "mid.weight", "mid.bias", "dec.weight"
    ]


def test_a_tied_parameter_can_be_pinned_by_its_second_name():
    model = TiedLM()
    plan, told = _resolve([Pin("dec.weight", indices=[(7, 2)], value=3.0)], model)
    assert list(plan.parameters) == ["emb.weight"]
    assert plan.parameters["emb.weight"] is model.dec.weight
    selection = plan.pins[0].selections["emb.weight"]
    assert selection.index.tolist() == [7 * 4 + 2]
    assert torch.equal(selection.values, torch.tensor([3.0]))
    assert told == [f"{plan.pins[0].pin!r}: {TIED}"]


def test_pinning_the_first_name_warns_that_the_other_shares_it():
    plan, told = _resolve([Pin("emb.*")], TiedLM())
    assert list(plan.parameters) == ["emb.weight"]
    assert told == [f"{plan.pins[0].pin!r}: {TIED_REVERSED}"]


@pytest.mark.parametrize("params", [["emb.weight", "dec.weight"], "*.weight", "re:(emb|dec)\\.weight"])
def test_no_warning_when_every_name_of_the_tensor_is_pinned(params):
    plan, told = _resolve([Pin(params)], TiedLM())
    assert "emb.weight" in plan.parameters and "dec.weight" not in plan.parameters
    assert told == []


def test_the_summary_lists_the_aliases():
    plan, _ = _resolve([Pin("dec.weight", indices=[(0, 0)], value=1.0)], TiedLM())
    assert plan.aliases == {"emb.weight": ["dec.weight"]}
    row = plan.summary().splitlines()[1]
    assert row.split()[:6] == ["emb.weight", "(=", "dec.weight)", "10x4", "40", "1"]


def test_untied_models_have_no_aliases():
    plan, told = _resolve([Pin("*")], nn.Sequential(nn.Linear(2, 2)))
    assert plan.aliases == {} and told == []
    assert "(=" not in plan.summary()


def test_two_names_of_one_tensor_are_one_parameter_for_conflicts():
    pins = [Pin("emb.weight", indices=[(1, 2)], value=1.0), Pin("dec.weight", indices=[(1, 2)], value=2.0)]
    with pytest.raises(PinError, match=r"give 1 element\(s\) of 'emb.weight' different values.*1.0 vs 2.0"):
        _resolve(pins, TiedLM())


def test_two_names_of_one_tensor_with_equal_values_merge():
    pins = [Pin("emb.weight", indices=[(1, 2)], value=1.0), Pin("dec.weight", indices=[(1, 2), (3, 0)], value=1.0)]
    plan, _ = _resolve(pins, TiedLM())
    assert list(plan.parameters) == ["emb.weight"]
    assert plan.pinned_counts() == {"emb.weight": 2}


def test_fraction_selects_the_same_elements_by_either_name():
    by_first, _ = _resolve([Pin("emb.weight", fraction=0.25, seed=4)], TiedLM())
    by_second, _ = _resolve([Pin("dec.weight", fraction=0.25, seed=4)], TiedLM())
    a = by_first.pins[0].selections["emb.weight"].index
    b = by_second.pins[0].selections["emb.weight"].index
    assert a.numel() == 10 and torch.equal(a, b)


def test_a_value_dict_keyed_by_the_second_name_serves_the_tensor():
    values = {"dec.weight": torch.full((10, 4), 0.5)}
    plan, _ = _resolve([Pin("dec.weight", value=values)], TiedLM())
    assert torch.equal(plan.pins[0].selections["emb.weight"].values, torch.full((10, 4), 0.5))


def test_a_state_dict_of_a_tied_model_serves_as_values():
    # state_dict() holds the tied tensor under both names: equal entries are fine.
    source = TiedLM()
    plan, _ = _resolve([Pin(["emb.weight", "dec.weight"], value=source.state_dict())], TiedLM())
    assert torch.equal(plan.pins[0].selections["emb.weight"].values, source.emb.weight.detach())


def test_different_entries_for_two_names_of_one_tensor_are_an_error():
    values = {"emb.weight": torch.zeros(10, 4), "dec.weight": torch.ones(10, 4)}
    with pytest.raises(PinError, match="value has different entries for 'emb.weight' and 'dec.weight', which are the "
                       "same tensor"):
        _resolve([Pin("*.weight", value=values)], TiedLM())


def test_fit_pins_a_tied_parameter_by_its_second_name_exactly():
    model = TiedLM()
    initial_mid = model.mid.weight.detach().clone()
    pin = Pin("dec.weight", indices=[(7, 2), (0, 1)], value=[3.0, -0.5])
    cb = PinCallback([pin], verbose=False, monitor=False)
    with pytest.warns(UserWarning, match="'dec.weight' is the same tensor as 'emb.weight'"):
        trainer(max_steps=4, callbacks=[cb]).fit(model, _tokens())
    for weight in (model.emb.weight, model.dec.weight):
        assert torch.equal(weight.detach()[[7, 0], [2, 1]], torch.tensor([3.0, -0.5]))
    assert not torch.equal(model.mid.weight.detach(), initial_mid)  # the rest trained
    cb.verify(model)
    with torch.no_grad():
        model.emb.weight[0, 1] = 0.0
    with pytest.raises(PinError, match=r"emb.weight: 1 element\(s\) off target \(\(0, 1\): 0.0 != -0.5\)"):
        cb.verify(model)


# ----------------------------------------------------------------------------------------------
# A real Hugging Face model: BertForMaskedLM (decoder tied to the word embeddings), from a config


def _bert():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(config)


class BertLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = _bert()

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


DECODER = "cls.predictions.decoder.weight"
EMBEDDING = "bert.embeddings.word_embeddings.weight"


def test_bert_decoder_is_pinned_by_its_name_onto_the_embedding():
    model = _bert()
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    plan, told = _resolve([Pin(DECODER, indices=[(5, 3)], value=0.5)], model)
    assert list(plan.parameters) == [EMBEDDING]
    assert plan.aliases == {EMBEDDING: [DECODER]}
    assert told == [f"{plan.pins[0].pin!r}: '{DECODER}' is the same tensor as '{EMBEDDING}' (tied weights): "
                    "pinning it pins both"]
    assert plan.summary().splitlines()[1].startswith(f"{EMBEDDING} (= {DECODER})")


def test_bert_head_glob_warns_that_it_reaches_the_embedding():
    model = _bert()
    plan, told = _resolve([Pin("cls.*")], model)
    assert EMBEDDING in plan.parameters  # the decoder is the embedding: the glob freezes it
    assert any(f"'{DECODER}' is the same tensor as '{EMBEDDING}'" in message for message in told)


def test_bert_fit_pins_the_tied_decoder_exactly():
    module = BertLM()
    g = torch.Generator().manual_seed(1)
    loader = DataLoader(TensorDataset(torch.randint(0, 100, (16, 6), generator=g)), batch_size=4)
    before = module.model.bert.encoder.layer[0].output.dense.weight.detach().clone()
    cb = PinCallback([Pin(f"model.{DECODER}", indices=[(5, 3), (42, 0)], value=[0.5, -1.25])], verbose=False,
                     monitor=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(max_steps=3, callbacks=[cb]).fit(module, loader)
    embedding = module.model.bert.embeddings.word_embeddings.weight.detach()
    decoder = module.model.cls.predictions.decoder.weight.detach()
    assert torch.equal(embedding[[5, 42], [3, 0]], torch.tensor([0.5, -1.25]))
    assert torch.equal(decoder[[5, 42], [3, 0]], torch.tensor([0.5, -1.25]))
    assert not torch.equal(module.model.bert.encoder.layer[0].output.dense.weight.detach(), before)
    cb.verify(module)
