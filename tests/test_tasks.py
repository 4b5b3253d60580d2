"""Task ownership (lightning_pin.tasks) through the torch-native door: backward transfer exactly
zero under every kind of optimizer, views that restore bit for bit, prune edge cases, errors that
change nothing, resume through handle.state_dict(). Lightning paths: tests/test_tasks_lightning.py."""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_pin import PinError, pin
from lightning_pin.tasks import AccuracyMatrix, TaskOwnership

TASKS = 3


class Net(nn.Module):
    """Linear -> BatchNorm -> ReLU -> shared head with two output columns per task."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(6, 12)
        self.bn = nn.BatchNorm1d(12)
        self.fc2 = nn.Linear(12, 2 * TASKS)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def cols(task: int) -> slice:
    return slice(2 * (task - 1), 2 * task)


def batch(task: int, step: int, micro: int = 0, n: int = 8):
    g = torch.Generator().manual_seed(1000 * task + 10 * step + micro)
    x = torch.randn(n, 6, generator=g) + task
    return x, (x[:, task % 6] > task).long()


PROBE = torch.randn(16, 6, generator=torch.Generator().manual_seed(7))


def probe(model: nn.Module, own: TaskOwnership, task: int) -> torch.Tensor:
    was = model.training
    model.eval()
    with torch.no_grad(), own.view(task):
        out = model(PROBE + task)[:, cols(task)].clone()
    model.train(was)
    return out


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def run_phase(model, optimizer, own, task, steps, *, accumulate=1, clip=None, scheduler=None, first_step=0):
    with pin(model, optimizer, own.pins(task)) as handle:
        for step in range(first_step, steps):
            for micro in range(accumulate):
                x, y = batch(task, step, micro)
                (nn.functional.cross_entropy(model(x)[:, cols(task)], y) / accumulate).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
            if scheduler is not None:
                scheduler.step()
        handle.verify()


def train_sequence(make_optimizer, *, steps=4, fraction=0.5, accumulate=1, clip=None):
    model = Net()
    optimizer = make_optimizer(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.9)
    own = TaskOwnership(model, "*")
    log = AccuracyMatrix(TASKS)
    after_own: dict[int, torch.Tensor] = {}
    for task in range(1, TASKS + 1):
        run_phase(model, optimizer, own, task, steps, accumulate=accumulate, clip=clip, scheduler=scheduler)
        own.prune(task, fraction)
        run_phase(model, optimizer, own, task, steps, accumulate=accumulate, clip=clip, scheduler=scheduler)
        own.commit(task)
        after_own[task] = probe(model, own, task)
        log.measure(task, lambda j: float((probe(model, own, j).argmax(1) == 0).float().mean()), own)
    return model, optimizer, own, log, after_own


OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adam": lambda p: torch.optim.Adam(p, lr=0.05),
    "adamw_wd": lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.01),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, weight_decay=0.01),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_backward_transfer_is_exactly_zero(name):
    model, optimizer, own, log, after_own = train_sequence(OPTIMIZERS[name])
    for task in range(1, TASKS + 1):
        assert torch.equal(probe(model, own, task), after_own[task]), f"task {task} moved"
    report = log.to_dict()
    assert report["bwt"] == 0.0
    assert report["fingerprints_unchanged"] is True
    last = report["matrix"][-1]
    assert last == [report["matrix"][j][j] for j in range(TASKS)]  # each task scores as right after it
    # Later tasks did train (and did change the shared tensors): the zero is not from standing still.
    assert own.capacity()["fc1.weight"] < 0.5


def test_accumulation_and_clipping_keep_backward_transfer_zero():
    model, _, own, log, after_own = train_sequence(OPTIMIZERS["adamw_wd"], accumulate=3, clip=0.05)
    for task in range(1, TASKS + 1):
        assert torch.equal(probe(model, own, task), after_own[task])
    assert log.bwt() == 0.0


def test_naive_training_changes_earlier_tasks():
    """The control: without the ownership pins, the same sequence moves task 1's logits."""
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    own = TaskOwnership(model, "*")  # only for view(); trained without its pins
    run_phase(model, optimizer, own, 1, 4)
    own.commit(1)
    before = probe(model, own, 1)
    for step in range(4):
        x, y = batch(2, step)
        nn.functional.cross_entropy(model(x)[:, cols(2)], y).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert not torch.equal(probe(model, own, 1), before)


def test_statistics_of_newly_held_elements_are_cleared_and_the_optimizer_goes_on():
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    own = TaskOwnership(model, "*")
    run_phase(model, optimizer, own, 1, 3)
    own.prune(1, 0.5)
    run_phase(model, optimizer, own, 1, 2)  # the retraining holds the pruned elements at zero
    own.commit(1)
    weight = model.fc1.weight
    held = own.owner["fc1.weight"] == 1
    assert optimizer.state[weight]["exp_avg"][held].abs().sum() > 0  # task 1 left momentum behind
    # The pruned elements, free for task 2, start it from zero statistics (nothing parked is left).
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(optimizer.state[weight][key][~held], torch.zeros(int((~held).sum())))
    run_phase(model, optimizer, own, 2, 1)  # same optimizer object, its state and groups
    assert torch.equal(optimizer.state[weight]["exp_avg"][held], torch.zeros(int(held.sum())))
    assert optimizer.state[weight]["exp_avg"][~held].abs().sum() > 0  # task 2's elements trained


def test_view_restores_every_parameter_and_buffer_bit_for_bit_also_on_exceptions():
    model, _, own, _, _ = train_sequence(OPTIMIZERS["adam"], steps=2)
    model.bn.running_mean.add_(0.25)  # live statistics differ from every snapshot
    before = state(model)
    with own.view(1):
        inside = state(model)
        assert not torch.equal(inside["fc1.weight"], before["fc1.weight"])
        assert not torch.equal(inside["bn.running_mean"], before["bn.running_mean"])
        assert torch.equal(inside["fc1.weight"][own.owner["fc1.weight"] != 1], torch.zeros(
            int((own.owner["fc1.weight"] != 1).sum())))
    assert_same(state(model), before)
    with pytest.raises(RuntimeError, match="boom"), own.view(2):
        assert model.fc1.weight.detach()[own.owner["fc1.weight"] == 3].abs().sum() == 0
        raise RuntimeError("boom")
    assert_same(state(model), before)


def test_norm_snapshots_are_per_task():
    model, _, own, _, _ = train_sequence(OPTIMIZERS["adam"], steps=2)
    means = []
    for task in range(1, TASKS + 1):
        with own.view(task):
            means.append(model.bn.running_mean.clone())
    assert not torch.equal(means[0], means[1]) and not torch.equal(means[1], means[2])


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_prune_fraction_edges(fraction):
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    own = TaskOwnership(model, "*")
    run_phase(model, optimizer, own, 1, 2)
    trained = state(model)
    pruned = own.prune(1, fraction)
    for name, owner in own.owner.items():
        n = owner.numel()
        assert pruned[name] == (n if fraction == 1.0 else 0)
        weight = dict(model.named_parameters())[name].detach()
        if fraction == 1.0:
            assert torch.equal(owner, torch.zeros_like(owner)) and torch.equal(weight, torch.zeros_like(weight))
        else:
            assert torch.equal(owner, torch.ones_like(owner)) and torch.equal(weight, trained[name])
    run_phase(model, optimizer, own, 1, 2)
    own.commit(1)
    assert all(c == fraction for c in own.capacity().values())
    if fraction == 1.0:  # nothing owned: pruned zeros were held during the fine-tune
        assert torch.equal(model.fc1.weight.detach(), torch.zeros_like(model.fc1.weight))
        assert own.pins(2) == []  # the second task has everything


@settings(max_examples=25, deadline=None)
@given(fraction=st.floats(0.0, 1.0), seed=st.integers(0, 5), ties=st.booleans())
def test_prune_takes_the_smallest_magnitudes(fraction, seed, ties):
    model = nn.Linear(5, 4)
    with torch.no_grad():
        if ties:
            model.weight.copy_(torch.tensor([0.5, -0.5, 1.0, 2.0, -1.0]).repeat(4, 1))
    own = TaskOwnership(model, "*", seed=seed)
    own.pins(1)
    before = model.weight.detach().clone()
    counts = own.prune(1, fraction)
    assert counts["weight"] == round(fraction * 20)
    free = own.owner["weight"] == 0
    assert int(free.sum()) == counts["weight"]
    assert torch.equal(model.weight.detach()[free], torch.zeros(counts["weight"]))
    assert torch.equal(model.weight.detach()[~free], before[~free])
    if counts["weight"] and not free.all():
        assert before[free].abs().max() <= before[~free].abs().min()
    twin = nn.Linear(5, 4)  # another process with the same weights picks the same elements, ties included
    with torch.no_grad():
        twin.weight.copy_(before)
    twin_own = TaskOwnership(twin, "*", seed=seed)
    twin_own.pins(1)
    twin_own.prune(1, fraction)
    assert torch.equal(twin_own.owner["weight"], own.owner["weight"])


def test_task_ids_past_the_map_range():
    model = Net()
    own = TaskOwnership(model, "*")
    before = state(model)
    for bad in (0, 256, -1, 2.0, True):
        with pytest.raises(PinError, match=r"task must be an integer in \[1, 255\]"):
            own.pins(bad)
    assert_same(state(model), before)
    wide = TaskOwnership(model, "*", max_tasks=1000)
    assert wide.owner["fc1.weight"].dtype == torch.int16
    wide.pins(300)
    wide.commit(300)
    assert int(wide.owner["fc1.weight"].unique()) == 300
    with pytest.raises(PinError, match="max_tasks"):
        TaskOwnership(model, "*", max_tasks=40000)


def test_misuse_raises_and_changes_no_weight():
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    own = TaskOwnership(model, "*")
    with pytest.raises(PinError, match="never trained"):
        own.view(1).__enter__()
    with pytest.raises(PinError, match="never trained"):
        own.prune(1, 0.5)
    run_phase(model, optimizer, own, 1, 2)
    own.prune(1, 0.5)
    before, owners = state(model), {k: v.clone() for k, v in own.owner.items()}
    with pytest.raises(PinError, match="already pruned"):
        own.prune(1, 0.25)
    with pytest.raises(PinError, match=r"fraction must be a number in \[0, 1\]"):
        own.prune(1, 1.5)
    with pytest.raises(PinError, match="task 1 is still in progress"):
        own.pins(2)
    own.commit(1)
    with pytest.raises(PinError, match="already committed"):
        own.commit(1)
    with pytest.raises(PinError, match="comes before the last committed task"):
        own.pins(1)
    with pytest.raises(PinError, match="never trained"):
        with own.view(2):
            pass
    with pytest.raises(PinError, match="never trained"):
        own.fingerprint(2)
    assert_same(state(model), before)
    assert all(torch.equal(own.owner[k], owners[k]) for k in owners)
    with pytest.raises(PinError, match="matches no parameter"):
        TaskOwnership(model, "encoder.*")
    with pytest.raises(PinError, match="only normalization-layer"):
        TaskOwnership(model, "bn.*")


def _save(obj) -> dict:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("where", ["before_prune", "after_prune"])
def test_resume_mid_task_through_handle_state_is_bit_identical(where):
    steps, cut = 6, 3

    def start():
        model = Net()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
        own = TaskOwnership(model, "*")
        run_phase(model, optimizer, own, 1, steps)
        own.prune(1, 0.5)
        run_phase(model, optimizer, own, 1, steps)
        own.commit(1)
        return model, optimizer, own

    def phase(model, optimizer, own, first, last, save=None):
        handle = pin(model, optimizer, own.pins(2))
        if save is not None:
            handle.load_state_dict(save["pins"])
        for step in range(first, last):
            x, y = batch(2, step)
            nn.functional.cross_entropy(model(x)[:, cols(2)], y).backward()
            optimizer.step()
            optimizer.zero_grad()
        saved = _save({"model": model.state_dict(), "opt": optimizer.state_dict(), "pins": handle.state_dict(),
                       "own": own.state_dict()})
        handle.remove()
        return saved

    def finish(model, optimizer, own, resume_at_prune, first=0, save=None):
        if not resume_at_prune:
            phase(model, optimizer, own, first, steps, save)
            own.prune(2, 0.5)
            phase(model, optimizer, own, 0, steps)
        else:
            phase(model, optimizer, own, first, steps, save)
        own.commit(2)
        return state(model), own.fingerprint(1), own.fingerprint(2)

    # The uninterrupted run.
    model, optimizer, own = start()
    if where == "after_prune":
        phase(model, optimizer, own, 0, steps)
        own.prune(2, 0.5)
    reference = finish(model, optimizer, own, where == "after_prune")

    # Interrupted at step `cut` of the current phase, resumed into fresh objects.
    model, optimizer, own = start()
    fingerprint1 = own.fingerprint(1)
    if where == "after_prune":
        phase(model, optimizer, own, 0, steps)
        own.prune(2, 0.5)
    saved = phase(model, optimizer, own, 0, cut)
    model, optimizer = Net(seed=1), None
    model.load_state_dict(saved["model"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    optimizer.load_state_dict(saved["opt"])
    own = TaskOwnership(model, "*")
    own.load_state_dict(saved["own"])
    resumed = finish(model, optimizer, own, where == "after_prune", first=cut, save=saved)
    assert_same(resumed[0], reference[0])
    assert resumed[1:] == reference[1:] and resumed[1] == fingerprint1


def test_state_dict_round_trip_and_mismatch():
    model, _, own, _, _ = train_sequence(OPTIMIZERS["adam"], steps=2)
    saved = _save(own.state_dict())
    other = TaskOwnership(model, "*")
    other.load_state_dict(saved)
    assert [other.fingerprint(t) for t in (1, 2, 3)] == [own.fingerprint(t) for t in (1, 2, 3)]
    assert [p.fingerprint() for p in other.pins(4)] == [p.fingerprint() for p in own.pins(4)]
    with pytest.warns(UserWarning, match="no task owns them"):
        fewer = TaskOwnership(model, "fc1.*")
    with pytest.raises(PinError, match="owns parameters"):
        fewer.load_state_dict(saved)
    with pytest.raises(PinError, match="not a TaskOwnership state"):
        other.load_state_dict({"owner": {}})


def test_heads_are_held_and_zero_in_earlier_views():
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.ModuleList([nn.Linear(6, 2), nn.Linear(6, 2)]))
    trunk = nn.Sequential(model[0], model[1])
    heads = model[2]
    own = TaskOwnership(model, "*", heads={1: "2.0.*", 2: "2.1.*"})
    assert sorted(own.parameters) == ["0.bias", "0.weight"]
    assert TaskOwnership(model, "*", heads={"1": "2.0.*", "2": "2.1.*"}).heads == own.heads  # keys from YAML
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    for task in (1, 2):
        with pin(model, optimizer, own.pins(task)):
            for step in range(3):
                x, y = batch(task, step)
                x = x[:, :4]
                nn.functional.cross_entropy(heads[task - 1](trunk(x)), y).backward()
                optimizer.step()
                optimizer.zero_grad()
        own.prune(task, 0.5)
        own.commit(task)
        if task == 1:
            head1, fingerprint1 = heads[0].weight.detach().clone(), own.fingerprint(1)
    assert torch.equal(heads[0].weight.detach(), head1) and own.fingerprint(1) == fingerprint1
    with own.view(1):
        assert torch.equal(heads[1].weight.detach(), torch.zeros(2, 6))
    assert heads[1].weight.detach().abs().sum() > 0


def test_norm_first_holds_the_layers_after_task_one():
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    own = TaskOwnership(model, "*", norm="first")
    run_phase(model, optimizer, own, 1, 3)
    own.commit(1)
    affine = [model.bn.weight.detach().clone(), model.bn.bias.detach().clone()]
    with own.view(1):
        stats1 = model.bn.running_mean.clone()
    run_phase(model, optimizer, own, 2, 3)  # train mode: the forward updates the running statistics...
    own.commit(2)
    assert torch.equal(model.bn.weight.detach(), affine[0]) and torch.equal(model.bn.bias.detach(), affine[1])
    # ... and the pin that freezes the layer writes them back after every step (Pin(buffers=True))
    assert torch.equal(model.bn.running_mean, stats1)
    with own.view(2):
        assert torch.equal(model.bn.running_mean, stats1)


@settings(max_examples=8, deadline=None)
@given(
    name=st.sampled_from(sorted(OPTIMIZERS)),
    fraction=st.sampled_from([0.0, 0.3, 0.75, 1.0]),
    steps=st.integers(1, 3),
)
def test_backward_transfer_zero_for_any_optimizer_and_prune_fraction(name, fraction, steps):
    model, _, own, log, after_own = train_sequence(OPTIMIZERS[name], steps=steps, fraction=fraction)
    for task in range(1, TASKS + 1):
        assert torch.equal(probe(model, own, task), after_own[task])
    assert log.bwt() == 0.0 and log.to_dict()["fingerprints_unchanged"] is True


def test_ownership_pins_add_no_sync_in_steady_state_steps():
    """The pins of a pruned task (held masks, zeros) through pin(): per batch after the first, the
    same sync-forcing ops as the same loop without pins (tests/test_syncs.py counts them)."""
    import copy

    from test_syncs import SyncCounter

    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05, foreach=True)
    own = TaskOwnership(model, "*")
    run_phase(model, optimizer, own, 1, 2)
    own.prune(1, 0.5)
    own.commit(1)
    run_phase(model, optimizer, own, 2, 2)
    own.prune(2, 0.5)
    start = (copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()))

    def count(pins):
        model.load_state_dict(start[0])
        optimizer.load_state_dict(start[1])
        counter = SyncCounter()
        with pin(model, optimizer, pins), counter:
            for step in range(8):
                counter.batch = step
                x, y = batch(2, step)
                nn.functional.cross_entropy(model(x)[:, cols(2)], y).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                optimizer.step()
                optimizer.zero_grad()
                counter.batch = None
        return counter

    pins = own.pins(2)
    assert len(pins) == 2  # task 1's elements held, task 2's pruned ones at zero
    plain, pinned = count([]), count(pins)
    for step in range(1, 8):
        assert not pinned.counts[step] - plain.counts[step], (step, dict(pinned.counts[step] - plain.counts[step]))


def test_parameters_no_task_owns_are_named_in_a_warning():
    model = Net()
    with pytest.warns(UserWarning, match=r"no task owns them .*\['fc1.bias', 'fc2.bias'\]"):
        TaskOwnership(model, "re:.*weight")


def test_tasks_module_imports_torch_and_core_only():
    import ast
    from pathlib import Path

    import lightning_pin.tasks

    tree = ast.parse(Path(lightning_pin.tasks.__file__).read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    forbidden = ("lightning", "pytorch_lightning", "hydra", "omegaconf", "torchmetrics", "lightning_pin.callbacks",
                 "lightning_pin.app", "lightning_pin.reporting")
    assert sorted(n for n in names if any(n == f or n.startswith(f + ".") for f in forbidden)) == []
    assert "lightning_pin.core.plan" in names  # the check looks at the real imports


# ------------------------------------------------------------------------------------------
# prune(release=...): what the pruned elements start the next task from


@pytest.mark.parametrize("release", ["zero", "keep"])
def test_prune_release_zero_or_keep_the_old_values_for_the_next_task(release):
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    own = TaskOwnership(model, ["fc1.weight", "fc2.weight"])
    run_phase(model, optimizer, own, 1, 3)
    before = model.fc1.weight.detach().clone()
    own.prune(1, 0.5, release=release)
    freed = own.owner["fc1.weight"] == 0
    assert int(freed.sum()) == 36
    assert torch.equal(model.fc1.weight.detach()[freed], torch.zeros(36))  # task 1 fine-tunes without them
    run_phase(model, optimizer, own, 1, 3)
    assert torch.equal(model.fc1.weight.detach()[freed], torch.zeros(36))
    kept = model.fc1.weight.detach()[~freed].clone()
    first = probe(model, own, 1)
    own.commit(1)
    after = model.fc1.weight.detach()
    expected = before[freed] if release == "keep" else torch.zeros(36)
    assert torch.equal(after[freed], expected)       # the next task's starting point
    assert torch.equal(after[~freed], kept)          # task 1's own elements untouched
    assert torch.equal(probe(model, own, 1), first)  # task 1's view still reads its freed elements as 0
    run_phase(model, optimizer, own, 2, 2)
    assert torch.equal(model.fc1.weight.detach()[~freed], kept)


@pytest.mark.filterwarnings("ignore:TaskOwnership")
def test_prune_release_keep_survives_a_state_dict_round_trip_between_prune_and_commit():
    model = Net()
    own = TaskOwnership(model, "fc1.weight")
    own.pins(1)
    before = model.fc1.weight.detach().clone()
    own.prune(1, 0.25, release="keep")
    buffer = io.BytesIO()
    torch.save(own.state_dict(), buffer)
    buffer.seek(0)
    again = TaskOwnership(model, "fc1.weight")
    again.load_state_dict(torch.load(buffer, weights_only=True))
    again.commit(1)
    assert torch.equal(model.fc1.weight.detach(), before)  # every freed element back at its old value


@pytest.mark.filterwarnings("ignore:TaskOwnership")
def test_prune_release_must_be_zero_or_keep_and_changes_nothing_otherwise():
    model = Net()
    own = TaskOwnership(model, "fc1.weight")
    own.pins(1)
    before = state(model)
    with pytest.raises(PinError, match=r"release must be one of \('zero', 'keep'\)"):
        own.prune(1, 0.5, release="restore")
    assert_same(state(model), before)
    assert int((own.owner["fc1.weight"] != 0).sum()) == 0
    own.prune(1, 0.5)  # still in training: the refused call changed nothing


@pytest.mark.filterwarnings("ignore:TaskOwnership")
def test_a_version_1_state_without_released_values_still_loads():
    model = Net()
    own = TaskOwnership(model, "fc1.weight")
    own.pins(1)
    own.commit(1)
    saved = own.state_dict()
    saved["version"] = 1
    del saved["released"]
    again = TaskOwnership(model, "fc1.weight")
    again.load_state_dict(saved)
    assert again.committed == [1]


@pytest.mark.filterwarnings("ignore:TaskOwnership")
def test_a_loaded_owner_map_naming_a_task_without_status_is_refused():
    model = Net()
    own = TaskOwnership(model, "fc1.weight")
    own.pins(1)
    own.commit(1)
    saved = own.state_dict()
    saved["owner"]["fc1.weight"][0, 0] = 4
    fresh = TaskOwnership(model, "fc1.weight")
    with pytest.raises(PinError, match=r"owner map of 'fc1.weight' names task\(s\) \[4\] that the state has no status"):
        fresh.load_state_dict(saved)
    assert fresh.committed == [] and int(fresh.owner["fc1.weight"].count_nonzero()) == 0


# ------------------------------------------------------------------------------------------
# AccuracyMatrix: rows never measured, NaN, task ids that skip


def test_accuracy_matrix_names_a_row_never_measured():
    log = AccuracyMatrix(3)
    log.matrix[2] = [0.9, 0.8, 0.7]  # the row after task 3, written without the rows before it
    with pytest.raises(PinError, match=r"the row after task 1 has no accuracy for task 1 \(never measured\)"):
        log.bwt()
    with pytest.raises(PinError, match="the row after task 1"):
        log.average_accuracy()
    with pytest.raises(PinError, match="nothing measured yet"):
        AccuracyMatrix(2).bwt()


def test_accuracy_matrix_refuses_task_ids_that_skip_unless_declared():
    log = AccuracyMatrix(5)
    log.measure(1, lambda j: 0.9)
    words = r"measure\(5\): no row was measured for task\(s\) \[2, 3, 4\].*AccuracyMatrix\(\[1, 5\]\)"
    with pytest.raises(PinError, match=words):
        log.measure(5, lambda j: 0.8)
    assert log.matrix[4] == [None] * 5  # nothing recorded
    declared = AccuracyMatrix([1, 5])
    declared.measure(1, lambda j: 0.9)
    assert declared.measure(5, lambda j: {1: 0.7, 5: 0.8}[j]) == [0.7, 0.8]
    assert declared.bwt() == pytest.approx(-0.2) and declared.to_dict()["task_ids"] == [1, 5]
    with pytest.raises(PinError, match=r"after must be one of the task ids \[1, 5\], got 3"):
        declared.measure(3, lambda j: 0.5)
    for bad in ([], [2, 1], [0, 1], [1, 1.5]):
        with pytest.raises(PinError, match="task ids must be increasing positive integers"):
            AccuracyMatrix(bad)


@pytest.mark.parametrize("result", [float("nan"), None, "high"])
def test_accuracy_matrix_refuses_an_accuracy_that_is_not_a_number(result):
    log = AccuracyMatrix(2)
    log.measure(1, lambda j: 0.9)
    with pytest.raises(PinError, match=r"measure\(2\): evaluate\(2\) returned"):
        log.measure(2, lambda j: 0.5 if j == 1 else result)
    assert log.matrix[1] == [None, None]  # nothing recorded
