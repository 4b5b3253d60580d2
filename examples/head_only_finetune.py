"""Head-only fine-tuning where the pooler sits outside the encoder.

A BERT fine-tuning user froze `model.encoder` for head-only training and still saw the pretrained
part change: BERT's pooler lives outside the encoder, and the object being trained was a
different wrapper from the one they froze. PinCallback resolves names on the module actually
trained (``trainer.lightning_module``), says which names exist when a pattern matches none, and
prints what it pins at fit start. Listing the parameters that changed after training (what the
maintainers advised that user to do) shows what really trained.

    python examples/head_only_finetune.py
"""

import warnings

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pin import Pin, PinCallback, PinError


class TinyBert(nn.Module):
    """Embeddings and an encoder, then a pooler and a classifier that sit outside the encoder."""

    def __init__(self, vocab: int = 50, dim: int = 32, classes: int = 3):
        super().__init__()
        self.embeddings = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, 4, dim_feedforward=64, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.pooler = nn.Linear(dim, dim)
        self.classifier = nn.Linear(dim, classes)

    def forward(self, tokens):
        hidden = self.encoder(self.embeddings(tokens))
        return self.classifier(torch.tanh(self.pooler(hidden[:, 0])))


class FineTuner(L.LightningModule):
    """The trained object wraps the model: its parameters are named model.encoder..., model.pooler..."""

    def __init__(self, model: TinyBert):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        return nn.functional.cross_entropy(self.model(tokens), labels)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fine_tune(pins: list, initial: dict) -> tuple[FineTuner, PinCallback, list[str]]:
    module = FineTuner(TinyBert())
    module.load_state_dict(initial)
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    callback = PinCallback(pins)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randint(0, 50, (128, 12), generator=g), torch.randint(0, 3, (128,), generator=g))
    L.Trainer(max_epochs=2, callbacks=[callback], logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False).fit(module, DataLoader(data, batch_size=16))
    callback.verify(module)
    changed = {name.rsplit(".", 1)[0] for name, p in module.named_parameters() if not torch.equal(p, before[name])}
    return module, callback, sorted(changed)


def main() -> None:
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    torch.manual_seed(0)
    torch.set_num_threads(1)  # tiny models train fastest on one thread, and never fight over cores
    initial = FineTuner(TinyBert()).state_dict()

    # 1. The names the user had in mind are not the names of the object trained: a clear error,
    #    raised at fit start before any weight changes, listing the closest names.
    try:
        fine_tune([Pin("encoder.*")], initial)
    except PinError as err:
        print(f"\nPinError: {str(err)[:240]}...\n")

    # 2. Freezing the encoder alone: the pooler, outside it, still trains.
    _, _, changed = fine_tune([Pin("model.encoder.*")], initial)
    print(f"froze model.encoder.*  -> changed: {changed}\n")
    assert "model.pooler" in changed

    # 3. Head-only: freeze everything but the classifier.
    module, _, changed = fine_tune([Pin(["model.embeddings.*", "model.encoder.*", "model.pooler.*"])], initial)
    print(f"froze everything but the classifier -> changed: {changed}")
    assert changed == ["model.classifier"]
    frozen = [n for n, p in module.named_parameters() if not n.startswith("model.classifier")]
    assert all(torch.equal(module.get_parameter(n), initial[n]) for n in frozen)
    print(f"pins exact: verified ({len(frozen)} frozen tensors equal their values before training)")


if __name__ == "__main__":
    main()
