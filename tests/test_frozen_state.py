"""State that does not change is free: frozen parameters travel with the job only, while they
keep its values; the driver fills them back in, so what it holds and writes is complete."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from fabric_model import Callback, FabricModel
from fabric_model.driver.book import StateBook
from fabric_model.frameworks.torch.adapter import TorchAdapter
from fabric_model.frameworks.torch.frozen import FrozenParameters, frozen_names
from fabric_model.setup.config import SnapshotCadence
from fabric_model.state.checkpoint import checkpoint_name, decode_state
from fabric_model.state.frozen import FrozenBase
from fabric_model.state.uploader import StateUploader
from fabric_model.state.writer import CheckpointBook
from fabric_model.step.plan import Plan, Schedule
from fabric_model.testing import FaultInjector, HoldForJoin, Kill

from .helpers import records

VOCAB, DIM = 4000, 32  # a frozen embedding of 512 KB under a 2 KB head
SEED, EPOCHS, BATCH, GLOBAL = 3, 4, 8, 24


class Tagger(torch.nn.Module):
    """A frozen base (the embedding) under a small trainable head: LoRA's shape."""

    def __init__(self) -> None:
        super().__init__()
        self.base = torch.nn.Embedding(VOCAB, DIM)
        self.base.weight.requires_grad_(False)
        self.head = torch.nn.Linear(DIM, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.base(tokens).mean(1))


def fresh() -> tuple[Tagger, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Tagger()
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)


def token_data(n: int = 72) -> list[tuple[torch.Tensor, int]]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (n, 6), generator=g)
    return [(tokens[i].clone(), int(tokens[i, 0] % 3)) for i in range(n)]


DATA = token_data()
FROZEN_BYTES = VOCAB * DIM * 4


# -- which parameters still hold the job's values (in-process) -----------------------------
def test_a_frozen_parameter_stays_unchanged_until_something_writes_it():
    model, _ = fresh()
    names = frozen_names(model)
    assert names == ("base.weight",)
    frozen = FrozenParameters(model, names)
    assert frozen.unchanged() == {"base.weight"}
    model.head.weight.data.mul_(2.0)  # trained parameters are not its business
    assert frozen.unchanged() == {"base.weight"}
    with torch.no_grad():
        model.base.weight.mul_(1.0)  # an in-place operation counts, whatever it computes
    assert frozen.unchanged() == set()
    frozen.baseline(names)  # the driver's values loaded again
    model.base.weight.data.mul_(0.9).add_(0.1)  # an EMA through .data: the version counter does not see it
    assert frozen.unchanged() == set()
    frozen.baseline(names)
    model.base.weight.requires_grad_(True)  # unfrozen
    assert frozen.unchanged() == set()
    model.base.weight.requires_grad_(False)
    frozen.baseline(names)
    model.base.weight = torch.nn.Parameter(torch.zeros(VOCAB, DIM), requires_grad=False)  # replaced
    assert frozen.unchanged() == set()


def _uploaded(adapter: TorchAdapter, kind: str, unit: int, schedule: Schedule) -> list:
    sent: list = []
    channel = type("Channel", (), {"send": lambda self, message: sent.append(message)})()
    config = type(
        "Config",
        (),
        {
            "checkpoint_freq": 1,
            "checkpoint_steps": 0,
            "batch_size": BATCH,
            "snapshots": SnapshotCadence(),
            "shard_optimizer_state": False,
        },
    )()
    uploader = StateUploader(channel, schedule, config)
    uploader.framework = "torch"
    model, optimizer, omitted = adapter.state_to_send()
    uploader.upload(kind, unit, 0, model, optimizer, omitted)
    uploader.flush(10)
    return sent


def test_an_upload_leaves_the_frozen_part_out_and_the_driver_puts_it_back(tmp_path):
    """What rank 0 sends is the head and AdamW's moments; the snapshot the driver holds, the
    checkpoint it writes and the state a rollback loads are the whole model, loadable alone."""
    model, optimizer = fresh()
    adapter = TorchAdapter(model, optimizer, F.cross_entropy, metrics=[])
    adapter.setup("cpu", 1)
    adapter.track_frozen(frozen_names(model))
    loss = F.cross_entropy(model(torch.stack([x for x, _ in DATA[:8]])), torch.tensor([y for _, y in DATA[:8]]))
    loss.backward()
    optimizer.step()  # moments exist
    plan = Plan(len(DATA), BATCH, 3, SEED)
    schedule = Schedule(plan, EPOCHS, 1, False)
    chunks = _uploaded(adapter, "snapshot", 2, schedule) + _uploaded(adapter, "checkpoint", 4, schedule)
    sent = sum(len(bytes(c.data.raw()) if hasattr(c.data, "raw") else c.data) for c in chunks)
    assert sent < FROZEN_BYTES / 10, sent  # two uploads, without the embedding

    driver_model, _ = fresh()  # the user's model in the caller: the job's frozen values
    tensors, order = TorchAdapter(driver_model, optimizer, F.cross_entropy).frozen_parameters()

    class Metrics:
        def checkpoint(self, **record) -> None:
            pass

    checkpoints = CheckpointBook(tmp_path, "torch", 3, schedule.units_per_epoch, Metrics())
    book = StateBook(checkpoints, frozen=FrozenBase(tensors, order))
    for chunk in chunks:
        book.chunk(0, chunk, 0, [0])
    checkpoints.close(10)
    on_disk = torch.load(tmp_path / checkpoint_name(4), weights_only=True)  # torch alone reads it
    restored = decode_state(book.restore_point(2).data, plan)  # the snapshot, as a rollback loads it
    for state in (on_disk, restored):
        assert list(state["model"]) == list(model.state_dict()) and state["base"] == ["base.weight"]
        fresh_model, _ = fresh()
        fresh_model.load_state_dict(state["model"])  # strict: complete
        for name, tensor in model.state_dict().items():
            assert torch.equal(fresh_model.state_dict()[name], tensor), name


def test_a_state_without_the_frozen_part_loads_only_where_the_worker_holds_it_unchanged():
    source, optimizer = fresh()
    sender = TorchAdapter(source, optimizer, F.cross_entropy, metrics=[])
    sender.setup("cpu", 1)
    sender.track_frozen(frozen_names(source))
    with torch.no_grad():
        source.head.weight.add_(1.0)  # trained
    model, optimizer = sender.state_to_send()[0], sender.optimizer.state_dict()
    omitted = sender.state_to_send()[2]
    assert "base.weight" not in model and omitted == ["base.weight"]

    newcomer_model, newcomer_optimizer = fresh()
    newcomer = TorchAdapter(newcomer_model, newcomer_optimizer, F.cross_entropy, metrics=[])
    newcomer.setup("cpu", 1)
    newcomer.track_frozen(frozen_names(newcomer_model))
    newcomer.load_sent_state(model, optimizer, omitted=omitted)
    assert all(torch.equal(newcomer_model.state_dict()[k], v) for k, v in source.state_dict().items())

    newcomer_model.base.weight.data.add_(1.0)  # its own copy changed: it cannot stand in for the job's
    with pytest.raises(RuntimeError, match=r"without the frozen parameters \['base.weight'\] .* changed"):
        newcomer.load_sent_state(model, optimizer, omitted=omitted)


# -- real runs ------------------------------------------------------------------------------
class TeacherEMA(Callback):
    """A frozen copy of the head, moved towards it after every step through ``.data`` (an EMA
    teacher): a parameter that needs no gradient yet changes."""

    def on_batch_end(self, step: int) -> None:
        teacher, head = self.model.teacher.weight, self.model.head.weight
        teacher.data.mul_(0.5).add_(head.data, alpha=0.5)


class WithTeacher(Tagger):
    def __init__(self) -> None:
        super().__init__()
        self.teacher = torch.nn.Linear(DIM, 3, bias=False)
        self.teacher.weight.requires_grad_(False)


def train(run_dir, workers, faults=(), marker_dir=None, model_class=Tagger, callbacks=()):
    torch.manual_seed(0)
    model = model_class()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    injector = FaultInjector(list(faults), marker_dir) if faults else None
    fm = FabricModel(
        model,
        lambda: (DATA, DATA[:24]),
        F.cross_entropy,
        optimizer,
        metrics=[],
        worker_logger_callback=injector,
        user_callback=list(callbacks),
    )
    fm.train(EPOCHS, BATCH, workers, effective_batch_size=GLOBAL, seed=SEED, run_dir=run_dir, deterministic=True)
    return model


def uploaded_sizes(run_dir) -> list[int]:
    logs = "".join(path.read_text() for path in (run_dir / "logs").glob("worker-*.log"))
    return [int(n) for n in re.findall(r"(?:snapshot|checkpoint) of unit \d+ sent: (\d+) bytes", logs)]


def assert_same_weights(model, reference) -> None:
    differ = [k for k, v in reference.state_dict().items() if not torch.equal(model.state_dict()[k], v)]
    assert not differ, f"not bitwise equal: {differ}"


@pytest.mark.processes
def test_a_frozen_base_stays_home_through_a_kill_and_a_join_and_the_weights_are_the_undisturbed_ones(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("FABRIC_MODEL_SNAPSHOT_STEPS", "2")
    monkeypatch.setenv("FABRIC_MODEL_SNAPSHOT_SHARE", "0")
    reference = train(tmp_path / "one", 1)
    run_dir = tmp_path / "three"
    model = train(run_dir, 3, [Kill(1, 4), HoldForJoin(7)], tmp_path)
    assert_same_weights(model, reference)
    sizes = [g["workers"] for g in records(run_dir, "generation")]
    assert sizes[:2] == [3, 2] and sizes[-1] == 3, sizes  # the kill happened, the replacement joined (a pull)
    uploads = uploaded_sizes(run_dir)
    assert len(uploads) >= 4 and max(uploads) < FROZEN_BYTES / 10, uploads  # the embedding never travelled
    newest = sorted((run_dir / "checkpoints").glob("ckpt-unit-*.pt"))[-1]
    on_disk = torch.load(newest, weights_only=True)["model"]  # complete: the driver filled it in
    assert torch.equal(on_disk["base.weight"], reference.base.weight)


@pytest.mark.processes
def test_a_frozen_parameter_that_changes_travels_from_then_on(tmp_path, monkeypatch):
    """An EMA teacher (needs no gradient, written through .data after each step): a replacement
    gets its current values, not the job's, and the run ends where an undisturbed one does."""
    monkeypatch.setenv("FABRIC_MODEL_SNAPSHOT_STEPS", "2")
    reference = train(tmp_path / "one", 1, model_class=WithTeacher, callbacks=[TeacherEMA()])
    run_dir = tmp_path / "three"
    model = train(run_dir, 3, [Kill(1, 4), HoldForJoin(7)], tmp_path, WithTeacher, [TeacherEMA()])
    assert_same_weights(model, reference)
    assert not torch.equal(reference.teacher.weight, WithTeacher().teacher.weight)  # it moved
    sizes = [g["workers"] for g in records(run_dir, "generation")]
    assert sizes[:2] == [3, 2] and sizes[-1] == 3, sizes
