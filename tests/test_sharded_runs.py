"""Sharded datasets in real runs (docs/data.md): 13 JSON-lines shards of uneven lengths are used
exactly once per epoch, and ``deterministic=True`` gives the same bits for 1, 2 and 3 workers,
through a SIGKILL and a join, and through a whole-job kill and a resume; a Hugging Face iterable
dataset and a webdataset-style tar shard set train alike; a shard that fails is named."""

from __future__ import annotations

import io
import itertools
import json
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fabric_model import FabricModel, ShardedDataset, ShardReadError
from fabric_model.step import stream_order as order
from fabric_model.step.plan import Plan
from fabric_model.testing import FaultInjector, HoldForJoin, Kill

from .helpers import final_train_records, fresh_model_and_optimizer, need, records, run_killed_job

pytestmark = pytest.mark.processes

SEED, EPOCHS, BATCH, GLOBAL = 7, 3, 8, 24  # 3 streams
LENGTHS = [30, 7, 0, 45, 12, 22, 9, 31, 5, 18, 26, 3, 14]  # 222 samples: 74 a stream, 10 steps an epoch
WINDOW = 16
PLAN = Plan(sum(LENGTHS), BATCH, GLOBAL // BATCH, SEED, shard_lengths=LENGTHS, shuffle_window=WINDOW)
REPO = Path(__file__).resolve().parents[1]


def write_shards(directory: Path) -> list[str]:
    """Shard ``i`` holds samples ``{"shard": i, "offset": k, "x": [...], "y": ...}``, one per line."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(12, 3, generator=g)
    paths = []
    for i, n in enumerate(LENGTHS):
        path = directory / f"part-{i:02d}.jsonl"
        with open(path, "w") as f:
            for k in range(n):
                x = torch.randn(12, generator=g)
                y = int((x @ w).argmax())
                f.write(json.dumps({"shard": i, "offset": k, "x": x.tolist(), "y": y}) + "\n")
        paths.append(str(path))
    return paths


class ReadJsonl:
    """``read_shard`` of a JSON-lines shard; it starts at ``start`` without parsing the lines before
    it, and appends ``shard offset`` of every sample it parses to ``<reads>/reads-<pid>.txt``."""

    def __init__(self, reads: str) -> None:
        self.reads = reads

    def __call__(self, path: str, start: int = 0):
        with open(path) as f, open(os.path.join(self.reads, f"reads-{os.getpid()}.txt"), "a") as log:
            for line in itertools.islice(f, start, None):
                r = json.loads(line)
                log.write(f"{r['shard']} {r['offset']}\n")
                log.flush()
                yield torch.tensor(r["x"]), r["y"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[str]:
    return write_shards(tmp_path_factory.mktemp("shards"))


def train(run_dir, shards, reads, workers, faults=(), marker_dir=None, driver_logger=None, **kwargs):
    model, opt = fresh_model_and_optimizer()
    read = ReadJsonl(str(reads))
    injector = FaultInjector(list(faults), marker_dir) if faults else None
    FabricModel(
        model,
        lambda: (ShardedDataset(shards, read, shuffle_window=WINDOW), ShardedDataset(shards[:3], read)),
        F.cross_entropy,
        opt,
        worker_logger_callback=injector,
        driver_logger_callback=driver_logger,
    ).train(
        EPOCHS, BATCH, workers, effective_batch_size=GLOBAL, seed=SEED, run_dir=run_dir, deterministic=True, **kwargs
    )
    return model.state_dict()


def used_samples(run_dir: Path, plan: Plan = PLAN) -> dict[int, list[tuple[int, int]]]:
    """Per epoch, the (shard, offset) of every sample of the committed steps, from their records."""
    used: dict[int, list[tuple[int, int]]] = {}
    steps = final_train_records(run_dir)
    assert sorted((r["epoch"], r["step"]) for r in steps) == [
        (e, s) for e in range(EPOCHS) for s in range(plan.steps_per_epoch)
    ]
    for r in steps:
        ids, starts = order.epoch_layout(plan.seed, r["epoch"], plan.shard_lengths, plan.shuffle_shards)
        for mbs in r["micro_batches"].values():
            for j in mbs:
                for p in plan.micro_batch_indices(r["epoch"], r["step"], j):
                    k, offset = order.locate(starts, int(p))
                    used.setdefault(r["epoch"], []).append((int(ids[k]), offset))
    return used


def every_sample() -> list[tuple[int, int]]:
    return [(i, k) for i, n in enumerate(LENGTHS) for k in range(n)]


def worker_reads(reads: Path) -> list[tuple[int, int]]:
    """What worker processes parsed (the caller's counting pass and first-batch check excluded)."""
    out = []
    for f in reads.glob("reads-*.txt"):
        if int(f.stem.split("-")[1]) != os.getpid():
            out += [tuple(map(int, line.split())) for line in f.read_text().splitlines()]
    return out


def assert_exactly_once(run_dir: Path) -> None:
    used = used_samples(run_dir)
    for epoch in range(EPOCHS):
        assert sorted(used[epoch]) == every_sample(), f"epoch {epoch}: not every sample exactly once"


def assert_equal(state, reference) -> None:
    differ = [k for k in reference if not torch.equal(state[k], reference[k])]
    assert not differ, f"not bitwise equal: {differ}"


@pytest.fixture(scope="module")
def reference(shards, tmp_path_factory):
    base = tmp_path_factory.mktemp("one")
    (base / "reads").mkdir()
    state = train(base / "run", shards, base / "reads", 1)
    return {k: v.clone() for k, v in state.items()}


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_exactly_once_and_bitwise_equal_for_any_worker_count(workers, shards, reference, tmp_path):
    (tmp_path / "reads").mkdir()
    state = train(tmp_path / "run", shards, tmp_path / "reads", workers)
    assert_equal(state, reference)
    assert_exactly_once(tmp_path / "run")
    # Each worker reads its streams front to back: every sample parsed once an epoch (validation:
    # the first three shards once an epoch), nothing read twice.
    validation = [(i, k) for i in range(3) for k in range(LENGTHS[i])]
    assert sorted(worker_reads(tmp_path / "reads")) == sorted((every_sample() + validation) * EPOCHS)
    data = json.loads((tmp_path / "run" / "run.json").read_text())["data"]
    assert data["train"] == {
        "shards": 13,
        "samples": 222,
        "counted_seconds": data["train"]["counted_seconds"],
        "skipped": [],
    }


def test_exactly_once_and_bitwise_equal_through_a_kill_and_a_join(shards, reference, tmp_path):
    """Worker 1 is SIGKILLed inside step 4: its streams are taken over where they stand by the
    others, then handed to its replacement, which joins after step 7."""
    (tmp_path / "reads").mkdir()
    state = train(tmp_path / "run", shards, tmp_path / "reads", 3, [Kill(1, 4), HoldForJoin(7)], tmp_path)
    assert_equal(state, reference)
    assert_exactly_once(tmp_path / "run")
    sizes = [g["workers"] for g in records(tmp_path / "run", "generation")]
    assert sizes[:2] == [3, 2] and sizes[-1] == 3, sizes
    reads = worker_reads(tmp_path / "reads")
    assert set(reads) >= set(every_sample())  # redone steps read again; what counts is what committed


def test_bitwise_equal_after_a_whole_job_kill_and_resume(shards, reference, tmp_path):
    run_dir, reads = tmp_path / "run", tmp_path / "reads"
    reads.mkdir()
    run_killed_job(
        tmp_path, "tests.test_sharded_runs", f"{str(run_dir)!r}, {shards!r}, {str(reads)!r}, 2", 15, run_dir=run_dir
    )
    state = train(run_dir, shards, reads, 3, resume=True)
    resumed = records(run_dir, "resume")[-1]
    assert 0 < resumed["resume_unit"] < 15 // 10 * 11 + 15 % 10, resumed  # from a checkpoint, not the start
    assert_equal(state, reference)
    assert_exactly_once(run_dir)


def test_a_shard_that_fails_in_a_worker_fails_the_run_naming_it(tmp_path):
    """With the lengths given nothing is read before the workers start: the failure comes from them, once."""

    def read(shard):
        if shard == "broken.tar":
            raise OSError("truncated archive")
        return ((torch.randn(12), 0) for _ in range(20))

    model, opt = fresh_model_and_optimizer()
    shards = ["a.tar", "b.tar", "broken.tar", "c.tar"]
    fm = FabricModel(
        model, lambda: (ShardedDataset(shards, read, lengths=[20] * 4, shuffle=False), None), F.cross_entropy, opt
    )
    with pytest.raises(
        ShardReadError, match=r"Reading shard 2 \('broken.tar'\) failed: OSError: truncated archive"
    ) as info:
        fm.train(1, 8, 2, run_dir=tmp_path / "run")
    assert str(info.value).count("truncated archive") == 1


def test_a_hugging_face_iterable_dataset_trains_exactly_once_alike_on_1_and_2_workers(tmp_path):
    datasets = need("datasets")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(150, 12, generator=g)
    rows = {"x": x.tolist(), "label": (x[:, 0] > 0).long().tolist()}

    def data():
        hf = datasets.Dataset.from_dict(rows).to_iterable_dataset(num_shards=8).with_format("torch")
        return hf, None

    states = []
    for workers in (1, 2):
        model, opt = _model(2)
        FabricModel(model, data, F.cross_entropy, opt).train(
            2, 8, workers, effective_batch_size=16, seed=3, run_dir=tmp_path / f"run{workers}", deterministic=True
        )
        states.append(model.state_dict())
        plan = Plan(**json.loads((tmp_path / f"run{workers}" / "run.json").read_text())["plan"])
        assert plan.shard_lengths == (19, 19, 19, 19, 19, 19, 18, 18)
        used = used_positions(tmp_path / f"run{workers}", plan, 2)
        assert all(sorted(u) == list(range(150)) for u in used.values())
    assert_equal(states[1], states[0])


def _model(classes: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, classes))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def used_positions(run_dir: Path, plan: Plan, epochs: int) -> dict[int, list[int]]:
    """Per epoch, the sequence positions of the committed steps (each must appear once)."""
    used: dict[int, list[int]] = {}
    for r in final_train_records(run_dir):
        for mbs in r["micro_batches"].values():
            for j in mbs:
                used.setdefault(r["epoch"], []).extend(
                    int(p) for p in plan.micro_batch_indices(r["epoch"], r["step"], j)
                )
    assert sorted(used) == list(range(epochs))
    return used


def write_tar_shards(directory: Path, shards: int, per_shard: int) -> list[str]:
    """webdataset's layout: per sample, ``<key>.npy`` and ``<key>.cls`` members, in key order."""
    g = np.random.default_rng(0)
    paths = []
    for i in range(shards):
        path = directory / f"shard-{i:04d}.tar"
        with tarfile.open(path, "w") as tar:
            for k in range(per_shard):
                key = f"{i:04d}{k:04d}"
                x = g.standard_normal(12).astype(np.float32)
                for suffix, payload in (("npy", _npy(x)), ("cls", str(int(x[0] > 0)).encode())):
                    info = tarfile.TarInfo(f"{key}.{suffix}")
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
        paths.append(str(path))
    return paths


def _npy(x: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, x)
    return buffer.getvalue()


def read_tar(path: str):
    """A webdataset shard with the standard library: members grouped by key, in order."""
    with tarfile.open(path) as tar:
        sample: dict[str, bytes] = {}
        key = None
        for member in tar:
            stem, suffix = member.name.rsplit(".", 1)
            if key is not None and stem != key:
                yield _decode(sample)
                sample = {}
            key = stem
            sample[suffix] = tar.extractfile(member).read()
        if sample:
            yield _decode(sample)


def _decode(sample: dict[str, bytes]):
    return torch.from_numpy(np.load(io.BytesIO(sample["npy"]))), int(sample["cls"])


def test_webdataset_style_tar_shards_read_with_tarfile_train_exactly_once(tmp_path):
    paths = write_tar_shards(tmp_path, 5, 23)
    model, opt = _model(2)
    fm = FabricModel(
        model, lambda: (ShardedDataset(paths, read_tar), ShardedDataset(paths[:1], read_tar)), F.cross_entropy, opt
    )
    result = fm.train(3, 8, 2, seed=5, run_dir=tmp_path / "run")
    plan = Plan(**json.loads((tmp_path / "run" / "run.json").read_text())["plan"])
    assert plan.shard_lengths == (23,) * 5
    used = used_positions(tmp_path / "run", plan, 3)
    assert all(sorted(u) == list(range(115)) for u in used.values())
    assert result.history.history["val_accuracy"][-1] > 0.6  # the labels are learnable: the samples arrived whole
    # evaluate() and predict() read a sharded dataset in the shards' order, as its samples in a list.
    assert fm.evaluate() == fm.evaluate(list(read_tar(paths[0])))
    assert torch.equal(fm.predict(ShardedDataset(paths, read_tar)), fm.predict([s for p in paths for s in read_tar(p)]))
