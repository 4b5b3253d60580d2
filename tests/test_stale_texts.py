"""Texts that said something untrue of the run they describe: a summary verifying pins when none were pinned, a
study counting a diverged job as recovered, advice to switch to the optimizer the jobs already used, the README
refusing a fault kind the command has, and texts the deploy, remap, study-cost, engine, trust and stuck-neuron work
replaced in the old README coming back with the pages its sections moved into (their replacements are checked on
the pages)."""

from __future__ import annotations

from pathlib import Path

from lightning_pin.app.train import print_summary
from lightning_pin.reporting import faults as report

ROOT = Path(__file__).resolve().parents[1]
#: The README and every page of the docs site.
DOCS = {path: path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]}


def summary(**changes):
    base = {
        "choices": {"pin": "none"}, "pinned_elements": 0, "trainable_elements": 9930, "violations": 0, "files": [],
        "output_dir": "out", "seconds": 1.0, "settled_step": 0, "baseline": 0.97, "forced": 0.97, "final": 0.98,
        "gap": -0.01, "tolerance": 0.01, "recovered_step": 0,
    }  # fmt: skip
    return {**base, **changes}


def test_a_run_with_nothing_pinned_does_not_claim_to_have_verified_pinned_elements(capsys):
    print_summary(summary())
    out = capsys.readouterr().out
    assert "verified with torch.equal on every pinned element" not in out
    assert "nothing pinned" in out
    print_summary(summary(pinned_elements=7, choices={"pin": "fraction"}))
    assert "verified with torch.equal on every pinned element" in capsys.readouterr().out


def job(**changes):
    row = {"kind": "value", "rate": 0.2, "seed": 0, "baseline": 0.97, "forced": 0.5, "final": 0.09, "gap": 0.88,
           "recovered_step": 20, "pins_exact": True, "tolerance": 0.01, "diverged": True, "recipe": ""}
    return {**row, **changes}


def test_a_diverged_job_is_not_counted_as_recovered(capsys):
    # Within the tolerance at step 20, then diverged: it did not recover.
    report.print_curve([job()], "t")
    out = capsys.readouterr().out
    assert "0/1, 1 diverged" in out and "1/1" not in out
    report.print_curve([job(diverged=False, final=0.965, gap=0.005)], "t")
    assert "1/1" in capsys.readouterr().out


def test_the_divergence_advice_never_suggests_the_optimizer_the_jobs_used(capsys):
    # No optimizer override: the app's default, AdamW.
    for recipe in ("", "optimizer=adamw optimizer.lr=1e-2"):
        report.print_curve([job(recipe=recipe)], "t")
        out = capsys.readouterr().out
        assert "diverged" in out and "optimizer=adamw" not in out and "lower learning rate" in out
    report.print_curve([job(recipe="optimizer=sgd")], "t")
    assert "optimizer=adamw" in capsys.readouterr().out


def test_the_readme_offers_the_fault_kinds_the_command_has():
    from lightning_pin.app.fault_pins import KINDS, fault_generator

    for path, text in DOCS.items():
        assert "until your version has it" not in text, path
    for kind in KINDS:
        if kind != "value":
            fault_generator(kind)  # every kind the README lists has its generator


def test_outcome_says_at_chance_within_two_points_of_guessing_and_diverged_when_free_weights_blew_up():
    from lightning_pin.app.train import diverged, outcome

    healthy = {"train_loss": 0.3, "forced": 0.5, "final": 0.9, "tolerance": 0.01, "weight_drift": 3.0}
    assert outcome(healthy, chance=0.1) is None and not diverged(healthy, chance=0.1)
    # 0.115 is 1.5 points above guessing (chance 0.1): at chance, though more than the tolerance (0.01) above it.
    low = {**healthy, "forced": 0.1, "final": 0.115}
    assert outcome(low, chance=0.1) == "at chance" and diverged(low, chance=0.1)
    assert outcome({**low, "final": 0.121}, chance=0.1) is None  # 2.1 points above: a (poor) accuracy
    assert outcome(low) is None  # no chance known (a metric that is not accuracy)
    # The free weights blew up (their drift is not finite), or the final metric is NaN: diverged.
    for blown in ({**healthy, "weight_drift": float("inf")}, {**healthy, "final": float("nan")}):
        assert outcome(blown, chance=0.1) == "diverged" and diverged(blown, chance=0.1)


def test_the_train_summary_says_at_chance_or_diverged(capsys):
    print_summary(summary(outcome="at chance", chance=0.1, final=0.11, diverged=True))
    out = capsys.readouterr().out
    assert "  outcome   AT CHANCE: the final accuracy is no better than guessing (guessing scores 0.100)" in out
    print_summary(summary(outcome="diverged", diverged=True))
    assert "  outcome   DIVERGED: a loss, metric or free weight that is not finite" in capsys.readouterr().out
    print_summary(summary())
    assert "outcome" not in capsys.readouterr().out


def test_the_pages_carry_what_replaced_the_old_readme_texts():
    """What the deploy, remap and study-cost branches changed in the README before its sections moved into the docs
    site: the old texts stay out, their replacements are on the pages."""
    stale = ["was not checked (it is not", "Each job saves its faults as", "0.091: diverged 3/3", "mean ± 95% CI;",
             "2 seeds, mean ± 95%"]
    for path, text in DOCS.items():
        flat = " ".join(text.split())
        for old in stale:
            assert old not in flat, (path, old)
    page = {path.relative_to(ROOT).as_posix(): " ".join(text.split()) for path, text in DOCS.items()}
    assert "--keep-checkpoints" in page["docs/how-to/fault-study.md"] and "recovered_step, recovered," in page[
        "docs/how-to/fault-study.md"]
    assert "](../flip_curve.png)" in page["docs/how-to/fault-study.md"]
    assert "](../study_cost.png)" in page["docs/explanation/performance.md"]
    assert "pinned_checkpoint=weights" in page["docs/how-to/hydra-app.md"]
    assert "--int8" in page["docs/how-to/export-check.md"]
    assert "--deploy torchao-int8" in page["docs/how-to/deploy-int8.md"]
    assert "python benchmarks/remap.py" in page["docs/how-to/fault-aware-mapping.md"]
    assert "](docs/how-to/deploy-int8.md)" in page["README.md"] and "](docs/how-to/fault-aware-mapping.md)" in page[
        "README.md"]


def test_the_pages_carry_the_engine_branchs_readme_changes():
    """What the engine branch (the step plan, PinMonitor's memory) changed in the README before its sections moved
    into the docs site: weight drift is opt-in, the step-call counts, no projections.py in the layout."""
    page = {path.relative_to(ROOT).as_posix(): " ".join(text.split()) for path, text in DOCS.items()}
    for path, text in page.items():
        assert "projections.py" not in text, path
    monitor = page["docs/how-to/monitor.md"]
    assert "| with `PinMonitor(weight_drift=True)`: L2 distance of the free weights" in monitor
    assert "The default monitor keeps no copy of the weights" in monitor and "`benchmarks/monitor_memory.py`" in monitor
    performance = page["docs/explanation/performance.md"]
    assert "`benchmarks/step_calls.py` counts the Python calls" in performance
    assert "| quantized codes | 307 | 34 |" in performance and "at most 20 + 2 per tensor = 52" in performance
    assert "`verify=\"step\"` reads one count per step from the device" in performance
    assert "a step plan per optimizer" in page["docs/explanation/architecture.md"]


def test_the_pages_carry_the_trust_branchs_readme_changes():
    """What the trust branch changed in the README before its sections moved into the docs site: a code pin without a
    stuck bit is refused, and `diverged` / at chance as the study and `lightning-pin train` decide them."""
    page = {path.relative_to(ROOT).as_posix(): " ".join(text.split()) for path, text in DOCS.items()}
    for path, text in page.items():
        assert "when its loss is not finite or retraining ends at chance" not in text, path
    assert "`code=` without a stuck bit (it would only move the elements onto the grid: `quantize()` trains on it)" in (
        page["docs/tutorials/int8-stuck-bits.md"])
    study = page["docs/how-to/fault-study.md"]
    assert "when its loss, final accuracy or free weights are not finite" in study
    assert "within 2 points of chance or below the forced accuracy" in study
    assert "`outcome AT CHANCE` or `DIVERGED`" in study and "`pin_report.png` draws the chance line" in study


def test_the_pages_carry_the_neuron_branchs_readme_changes():
    """What the stuck-neuron branch changed in the README before its sections moved into the docs site: the feature
    axis by module type, the new refusals, averaged copies, pin=neuron_faults's defaults on any model."""
    page = {path.relative_to(ROOT).as_posix(): " ".join(text.split()) for path, text in DOCS.items()}
    for path, text in page.items():
        assert "counted with the batch dimension as axis 0: a convolution's channels" not in text, path
        assert "seed=0, axis=1, value=0.0" not in text, path  # NeuronPin's axis defaults to None
    neurons = page["docs/how-to/stuck-neurons.md"]
    assert "`axis=None` (the default) is the module's feature axis, decided at its first forward" in neurons
    assert "A 3-D output of another module is refused: give `axis=1` or `axis=-1`" in neurons
    assert "(version 1) keep axis 1" in neurons
    assert "`layer1.0.conv1 output channels [3, 7] (axis 1) stuck at 0.0`" in neurons
    assert "An averaged copy (`handle.hold(ema)`, Lightning's weight averaging)" in neurons
    assert "every exponent bit (inf / NaN whatever the layer computes)" in neurons
    assert "matches a module and one of its descendants" in neurons
    assert 'per="channel", batch=None, seed=0, axis=None)`' in neurons
    assert "in every conv and linear layer, unless `pin.modules` names them" in neurons
    assert "or of every conv and linear layer of another model" in page["docs/how-to/hydra-app.md"]


def test_the_stuck_neuron_summary_line_on_the_page_is_what_the_summary_prints():
    import torch

    from lightning_pin import NeuronPin, pin

    model = torch.nn.Sequential()
    model.add_module("layer1", torch.nn.Sequential(torch.nn.Sequential()))
    model.layer1[0].add_module("conv1", torch.nn.Conv2d(1, 8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pin(model, optimizer, [NeuronPin("layer1.0.conv1", channels=[3, 7])]) as handle:
        model(torch.randn(2, 1, 8, 8))
        (line,) = handle.outputs["neuron"].summary().splitlines()
    assert f"(`{line}`)" in DOCS[ROOT / "docs" / "how-to" / "stuck-neurons.md"]


def test_the_pages_carry_the_batches_branchs_readme_changes():
    """What the batches branch (model=hf, fake data, batches of any structure) changed in the README before its
    sections moved into the docs site: its own-model texts, the app's table, installs from the clone, and a tutorial
    of its own for the Hugging Face models on fake data."""
    page = {path.relative_to(ROOT).as_posix(): " ".join(text.split()) for path, text in DOCS.items()}
    for path, text in page.items():
        assert "select every parameter named `*.weight` with two or more dimensions" not in text, path
        assert "pip install 'lightning-pin[" not in text, path
    own = page["docs/tutorials/fault-study-own-model.md"]
    assert "(on a transformer: its attention and MLP projections, Hugging Face's `Conv1D` included; not embeddings," in own
    assert "**Batches of any structure.** Every tool feeds a batch as your `validation_step` does" in own
    assert "a Hugging Face output's `.logits` is the prediction" in own and "](hf-transformer.md)" in own
    hf = page["docs/tutorials/hf-transformer.md"]
    assert hf.startswith("# A fault study of a Hugging Face transformer")
    assert "`model=hf` builds a Hugging Face `transformers` classifier (`pip install -e '.[hf]'`)" in hf
    assert "ends before any training with one line naming it, the directory looked in, `data.download=false`" in hf
    assert "`hf` (a Hugging Face `transformers` classifier: `model.name=NAME_OR_DIRECTORY`" in page[
        "docs/how-to/hydra-app.md"]
    assert "A fault study of a Hugging Face transformer: tutorials/hf-transformer.md" in (ROOT / "mkdocs.yml").read_text()
    assert "](hf-transformer.md)" in page["docs/tutorials/index.md"]
    assert "](docs/tutorials/hf-transformer.md)" in page["README.md"]
