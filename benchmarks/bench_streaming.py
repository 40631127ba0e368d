"""Sharded data against the same data map-style (docs/data.md, docs/architecture.md "Sharded data").

    python benchmarks/bench_streaming.py                # 3 rounds, about 2 minutes on 2 cores
    python benchmarks/bench_streaming.py --rounds 5 --engines 1 2

The data: 16 shards of 1,024 samples (64 float32 features, a class of 10), written once as
parquet files (pyarrow; the lengths passed from each file's metadata) and as JSON-lines files
(counted by the caller). The model: an MLP whose step at batch 64 takes about 2 ms here (the plain loop's step,
printed).

1. **Throughput**: one epoch with FabricModel (``deterministic=False``) from
   ``ShardedDataset`` over each format, and from the same samples map-style (a list of
   ``(tensor, label)`` pairs in memory, read item by item as any per-sample dataset is). Step
   time is the span of the driver's commit stamps after the first 20 steps over the steps in
   it (a lone worker's reports share frames, so single intervals mean little);
   the ratio is map-style step time / sharded step time (throughput, higher is better), one
   per round, interleaved, printed as median [min-max].
2. **Taking a stream over**: a worker that takes stream ``j`` over at step ``s`` (another
   worker died or joined) opens the shard where the stream stands and reaches the offset
   there. Timed: the first micro-batch read by a fresh reader at the middle of a shard, against
   the next micro-batch (the steady state), with a ``read_shard`` that seeks (``start``:
   parquet slices the table, JSON lines skips lines unparsed) and with one that does not (the
   samples before the offset are read and dropped).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import commits
import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fabric_model import FabricModel, ShardedDataset  # noqa: E402
from fabric_model.step.plan import Plan  # noqa: E402
from fabric_model.step.stream_order import segment_bounds  # noqa: E402
from fabric_model.streams.reader import StreamedDataset  # noqa: E402

SHARDS, PER_SHARD, FEATURES, CLASSES, BATCH, WIDTH = 16, 1024, 64, 10, 64, 768
EPOCHS, WARMUP = 2, 20


def make_arrays() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((SHARDS * PER_SHARD, FEATURES), dtype=np.float32)
    y = (x @ rng.standard_normal((FEATURES, CLASSES), dtype=np.float32)).argmax(1)
    return x, y


def write_parquet(directory: Path, x: np.ndarray, y: np.ndarray) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = []
    for i in range(SHARDS):
        rows = slice(i * PER_SHARD, (i + 1) * PER_SHARD)
        flat = pa.array(x[rows].reshape(-1))
        table = pa.table({"x": pa.FixedSizeListArray.from_arrays(flat, FEATURES), "y": pa.array(y[rows])})
        path = directory / f"part-{i:02d}.parquet"
        pq.write_table(table, path)
        paths.append(str(path))
    return paths


def write_jsonl(directory: Path, x: np.ndarray, y: np.ndarray) -> list[str]:
    paths = []
    for i in range(SHARDS):
        path = directory / f"part-{i:02d}.jsonl"
        with open(path, "w") as f:
            for k in range(i * PER_SHARD, (i + 1) * PER_SHARD):
                f.write(json.dumps({"x": x[k].tolist(), "y": int(y[k])}) + "\n")
        paths.append(str(path))
    return paths


def read_parquet(path: str, start: int = 0):
    """A parquet shard's rows from ``start`` on (the table sliced there: nothing before it is decoded)."""
    import pyarrow.parquet as pq

    table = pq.read_table(path).slice(start)
    # One copy of the shard's features (arrow's buffers are read-only; torch wants writable
    # arrays), cut into rows in one call.
    x = torch.from_numpy(table.column("x").combine_chunks().flatten().to_numpy().reshape(-1, FEATURES).copy())
    yield from zip(x.unbind(0), table.column("y").to_pylist())


def read_jsonl(path: str, start: int = 0):
    """A JSON-lines shard's samples from ``start`` on (the lines before it skipped unparsed)."""
    with open(path) as f:
        for k, line in enumerate(f):
            if k >= start:
                r = json.loads(line)
                yield torch.tensor(r["x"], dtype=torch.float32), r["y"]


def no_seek(read):
    """The same reader without ``start``: the reader reads and drops the samples before the offset."""

    def read_shard(path: str):
        return read(path)

    return read_shard


def parquet_lengths(paths: list[str]) -> list[int]:
    import pyarrow.parquet as pq

    return [pq.ParquetFile(p).metadata.num_rows for p in paths]


class Quiet:
    def log_train_metrics(self, metrics, iteration, epoch, workers) -> None:  # noqa: ANN001
        pass


def make_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, CLASSES),
    )
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def plain_step(x: np.ndarray, y: np.ndarray, steps: int = 200) -> float:
    """The model's step in a plain loop on in-memory tensors (the workload's size, not a baseline)."""
    model, opt = make_model()
    xt, yt = torch.from_numpy(x[:BATCH]), torch.from_numpy(y[:BATCH]).long()
    started = time.perf_counter()
    for i in range(steps + WARMUP):
        if i == WARMUP:
            started = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(xt), yt).backward()
        opt.step()
    return (time.perf_counter() - started) / steps


def step_time(datasets_function, engines: int, run_dir: Path) -> float:
    model, opt = make_model()
    try:
        FabricModel(model, datasets_function, F.cross_entropy, opt, metrics=[], driver_logger_callback=Quiet()).train(
            EPOCHS, BATCH, engines, seed=1, run_dir=run_dir, checkpoint_freq=0, verbose=0
        )
        times = commits.train_stamps(run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return commits.mean_step(times, WARMUP)  # a lone worker's reports come in frames


def fmt(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def takeover(paths: list[str], read, lengths: list[int], repeats: int = 5) -> tuple[float, float]:
    """(first micro-batch of a fresh reader mid-shard, the next one), in ms: medians of ``repeats``."""
    total = sum(lengths)
    plan = Plan(total, BATCH, 2, 0, shard_lengths=lengths, shuffle_window=1)
    bounds = segment_bounds(total, 2)
    step = (PER_SHARD // 2) // BATCH  # stream 0 at step s is s*64 samples into its first shard
    first, steady = [], []
    for _ in range(repeats):
        data = StreamedDataset(ShardedDataset(paths, read, lengths=lengths, shuffle_window=1), lengths, 0, True, bounds)
        started = time.perf_counter()
        data.__getitems__(plan.micro_batch_indices(0, step, 0))
        first.append(time.perf_counter() - started)
        started = time.perf_counter()
        data.__getitems__(plan.micro_batch_indices(0, step + 1, 0))
        steady.append(time.perf_counter() - started)
        data.close()
    return statistics.median(first) * 1e3, statistics.median(steady) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engines", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    os.environ.setdefault("FABRIC_MODEL_LOG_LEVEL", "WARNING")
    x, y = make_arrays()
    tmp = Path(tempfile.mkdtemp(prefix="bench-streaming-"))
    try:
        parquet = write_parquet(tmp, x, y)
        jsonl = write_jsonl(tmp, x, y)
        lengths = parquet_lengths(parquet)
        samples = [(torch.from_numpy(x[i]), int(y[i])) for i in range(len(y))]
        sources = {
            "map-style list": lambda: (samples, None),
            "sharded parquet": lambda: (ShardedDataset(parquet, read_parquet, lengths=lengths), None),
            "sharded JSON lines": lambda: (ShardedDataset(jsonl, read_jsonl), None),
        }
        print(
            f"{SHARDS} shards x {PER_SHARD} samples, {FEATURES} features, batch {BATCH} a worker; "
            f"{args.rounds} rounds; load average {os.getloadavg()[0]:.2f}; {os.cpu_count()} CPUs; "
            f"plain loop step {plain_step(x, y) * 1e3:.2f} ms"
        )
        for engines in args.engines:
            times: dict[str, list[float]] = {name: [] for name in sources}
            for r in range(args.rounds):
                for name, fn in sources.items():
                    times[name].append(step_time(fn, engines, tmp / f"run-{engines}-{r}-{len(times[name])}"))
            base = times["map-style list"]
            print(f"{engines} engine(s): map-style step {statistics.median(base) * 1e3:.2f} ms")
            for name in list(sources)[1:]:
                ratios = [b / s for b, s in zip(base, times[name])]
                step_ms = statistics.median(times[name]) * 1e3
                print(f"  {name}: step {step_ms:.2f} ms, throughput vs map-style {fmt(ratios)}x")
        for label, paths, read in (("parquet", parquet, read_parquet), ("JSON lines", jsonl, read_jsonl)):
            for seek in (True, False):
                first, steady = takeover(paths, read if seek else no_seek(read), lengths)
                how = "read_shard(shard, start)" if seek else "read_shard(shard), skipping"
                print(
                    f"take-over {label}, {how}: first micro-batch {first:.1f} ms at offset {PER_SHARD // 2} "
                    f"of a {PER_SHARD}-sample shard, next one {steady:.2f} ms"
                )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
