"""Steady-state training throughput of FabricModel against Keras' own ``model.fit`` (CPU).

One run of this script measures, on the same Keras model, synthetic data, batch size, loss
and SGD optimizer:

  FabricModel with 1 engine   vs   ``model.fit`` in a single process.

Start-up (process spawn, imports, tracing the ``tf.function``s) is excluded from both: the
first ``--warmup`` steps of every run are not timed. FabricModel's step times come from the
driver's commit timestamps in ``<run_dir>/logs/metrics.jsonl`` (records of type ``train``);
``model.fit`` stamps the end of each step with a ``keras.callbacks.Callback``
(``on_train_batch_end``, reading the step's loss as a logging callback does: FabricModel
reports it every step). Two figures are printed per run: the mean throughput over the timed
steps, and the throughput of the median step (batch / median step time), which the
occasional step slowed down by other load does not move.

Threads are matched: FabricModel gives its single CPU worker ``cores`` TensorFlow intra-op
threads and 1 inter-op thread, and ``model.fit`` runs in a fresh process configured the same
way (TensorFlow's threads must be set before its runtime starts). ``model.fit`` gets the data
as NumPy arrays (Keras feeds them through ``tf.data`` with shuffling); FabricModel gets a
map-style dataset of ``(x, y)`` samples over the same arrays and runs with its defaults
(loader threads chosen by the worker; ``--dataloader-threads`` changes it). On the CPU, ``fit``
does not use XLA (``jit_compile="auto"``), nor does FabricModel.

The two runs of a round are interleaved (fit, FabricModel); with ``--repeats`` > 1 each
figure is the best of the rounds, which damps noise from other load on the machine (the load
average is printed for that reason: on 2 cores, a 2-thread run is easily disturbed).

``FABRIC_BENCH_PROFILE=1`` profiles FabricModel's worker with cProfile (its training thread,
from the worker logger's ``on_train_begin`` to ``on_train_end``: start-up and data-loader
threads are not included) and prints the top functions by cumulative time; the profile is
written to ``<run_dir>/worker.prof``. Profiled runs are slower: their figures are not
comparable.

    PYTHONPATH=. python3 benchmarks/bench_keras.py             # default, about 1.5 minutes on 2 cores
    PYTHONPATH=. python3 benchmarks/bench_keras.py --quick     # a short smoke run
    PYTHONPATH=. python3 benchmarks/bench_keras.py --steps 400 --repeats 3
"""

from __future__ import annotations

import argparse
import logging
import math
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow loads, here and in spawned processes

import commits
import numpy as np  # noqa: E402

# TensorFlow and Keras are imported inside the functions: the fit baseline's process must set
# TensorFlow's thread counts before anything starts TensorFlow's runtime.

NUM_SAMPLES = 16384  # a multiple of the batch sizes used here: no short steps
FEATURES, HIDDEN, CLASSES = 512, 1024, 10
PROFILE_ENV = "FABRIC_BENCH_PROFILE"


# -- the workload -------------------------------------------------------------------------
def make_model(seed: int = 0):
    """An MLP of about 1.6 M parameters: a step at batch 128 is tens of ms of matmuls on CPU."""
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(HIDDEN, activation="relu"),
            keras.layers.Dense(HIDDEN, activation="relu"),
            keras.layers.Dense(CLASSES),
        ]
    )


def make_optimizer():
    import keras

    return keras.optimizers.SGD(learning_rate=0.01, momentum=0.9)


def make_loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def make_data() -> tuple[np.ndarray, np.ndarray]:
    """Synthetic, deterministic classification data (labels from a random linear teacher)."""
    rng = np.random.default_rng(1234)
    x = rng.standard_normal((NUM_SAMPLES, FEATURES), dtype=np.float32)
    y = (x @ rng.standard_normal((FEATURES, CLASSES), dtype=np.float32)).argmax(1).astype(np.int64)
    return x, y


class Samples:
    """A map-style dataset of ``(features, label)`` samples over two arrays."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.int64]:
        return self.x[i], self.y[i]


def get_datasets():
    return Samples(*make_data()), None


def epochs_for(total_steps: int, batch: int) -> int:
    return math.ceil(total_steps * batch / NUM_SAMPLES)


def steady_rates(times: list[float], warmup: int, batch: int) -> tuple[float, float]:
    """(mean, median-step) samples/s over the steps after the first ``warmup``.

    mean: timed steps * batch / time they took. median-step: batch / median step time,
    which a few steps slowed down by other load on the machine do not move.
    """
    timed = times[warmup - 1 :]
    intervals = [b - a for a, b in zip(timed, timed[1:])]
    return len(intervals) * batch / (timed[-1] - timed[0]), batch / statistics.median(intervals)


def usable_cores() -> int:
    """Cores this process may run on (taskset, cgroup cpusets): what FabricModel divides among its workers."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def configure_threads(intra: int) -> None:
    """TensorFlow's thread pools as FabricModel sets them for a CPU worker."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(intra)
    tf.config.threading.set_inter_op_parallelism_threads(1)


# -- the baseline: model.fit ----------------------------------------------------------------
def _fit_process(batch_size: int, epochs: int, threads: int, results) -> None:
    configure_threads(threads)
    import keras

    class StepTimes(keras.callbacks.Callback):
        """The time at the end of every training step."""

        def __init__(self) -> None:
            super().__init__()
            self.times: list[float] = []

        def on_train_batch_end(self, batch, logs=None) -> None:
            float(logs["loss"])  # what a callback that logs the loss does
            self.times.append(time.perf_counter())

    model = make_model()
    model.compile(optimizer=make_optimizer(), loss=make_loss())
    x, y = make_data()
    stamps = StepTimes()
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=True, verbose=0, callbacks=[stamps])
    results.put(stamps.times)


def bench_fit(batch_size: int, epochs: int, warmup: int) -> tuple[float, float]:
    ctx = mp.get_context("spawn")  # a fresh interpreter: TensorFlow's threads are set before it starts
    results = ctx.SimpleQueue()
    proc = ctx.Process(target=_fit_process, args=(batch_size, epochs, usable_cores(), results))
    proc.start()
    times = results.get()
    proc.join()
    if proc.exitcode:
        raise RuntimeError(f"the model.fit process exited with status {proc.exitcode}")
    return steady_rates(times, warmup, batch_size)


# -- FabricModel ----------------------------------------------------------------------------
class Quiet:
    """A driver logger that prints nothing (replaces the progress bar)."""

    def on_train_begin(self) -> None:
        pass


class ProfileWorker:
    """A worker logger that runs cProfile over the worker's life (with FABRIC_BENCH_PROFILE=1)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.profiler = None

    def on_train_begin(self) -> None:
        import cProfile

        self.profiler = cProfile.Profile()
        self.profiler.enable()

    def on_train_end(self) -> None:
        if self.profiler is not None:
            self.profiler.disable()
            self.profiler.dump_stats(self.path)


def bench_fabric(
    batch_size: int, warmup: int, epochs: int, run_dir: Path, dataloader_threads: int | None = None
) -> tuple[float, float]:
    from fabric_model import FabricModel

    profile = run_dir / "worker.prof" if os.environ.get(PROFILE_ENV) else None
    fm = FabricModel(
        make_model(),
        get_datasets,
        make_loss(),
        make_optimizer(),
        driver_logger_callback=Quiet(),
        worker_logger_callback=ProfileWorker(profile) if profile else None,
    )
    extra = {} if dataloader_threads is None else {"num_dataloader_threads": dataloader_threads}
    result = fm.train(epochs, batch_size, 1, run_dir=run_dir, seed=0, verbose=0, **extra)
    if profile is not None:
        print_profile(profile)
    # One line per committed step, stamped by the driver when the step's reports arrive (a lone
    # worker's in frames of ~0.1 s: benchmarks/commits.py).
    times = commits.train_stamps(result.run_dir)
    return batch_size / commits.mean_step(times, warmup - 1), batch_size / commits.median_step(times, warmup - 1)


def print_profile(path: Path) -> None:
    import pstats

    if not path.exists():
        print(f"no profile at {path} (the worker logger did not run)")
        return
    print(f"\nFabricModel worker profile ({path}), top 25 by cumulative time:")
    pstats.Stats(str(path)).sort_stats("cumulative").print_stats(25)


# -- the report -----------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=128, help="batch (default 128)")
    parser.add_argument("--steps", type=int, default=192, help="timed steps per run, at least (default 192)")
    parser.add_argument("--warmup", type=int, default=32, help="untimed steps at the start of each run (default 32)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the two runs; the best is reported")
    parser.add_argument("--quick", action="store_true", help="a short smoke run: --steps 64 --warmup 8 --repeats 1")
    parser.add_argument(
        "--dataloader-threads",
        type=int,
        default=None,
        help="FabricModel's num_dataloader_threads (default: FabricModel's own default)",
    )
    parser.add_argument("--keep-runs", action="store_true", help="keep FabricModel's run directories")
    args = parser.parse_args()
    # The driver logs each worker generation at WARNING level; keep the report readable.
    logging.getLogger("fabric_model").setLevel(logging.ERROR)
    if args.quick:
        args.steps, args.warmup, args.repeats = 64, 8, 1
    if NUM_SAMPLES % args.batch_size:
        parser.error(f"--batch-size must divide {NUM_SAMPLES}")
    if args.warmup < 1 or args.steps < 2 or args.repeats < 1:
        parser.error("--warmup must be >= 1, --steps >= 2 and --repeats >= 1")
    # FabricModel trains whole epochs, so runs are rounded up to whole epochs; fit trains the same.
    epochs = epochs_for(args.warmup + args.steps, args.batch_size)
    total = epochs * NUM_SAMPLES // args.batch_size

    import keras
    import tensorflow as tf

    cores = usable_cores()
    n_params = make_model().count_params()
    print(
        f"keras {keras.__version__}, tensorflow {tf.__version__}, {cores} usable CPU cores, "
        f"load average {os.getloadavg()[0]:.2f} (1 min)"
    )
    print(
        f"model: MLP {FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES} ({n_params / 1e6:.2f} M params), SGD, "
        f"{NUM_SAMPLES} synthetic samples, batch {args.batch_size}"
    )
    print(
        f"timed steps per run: {total - args.warmup} (after {args.warmup} warm-up steps, {epochs} epoch(s)); "
        f"{args.repeats} round(s); FabricModel num_dataloader_threads="
        f"{'default' if args.dataloader_threads is None else args.dataloader_threads}",
        flush=True,
    )
    if os.environ.get(PROFILE_ENV):
        print(f"{PROFILE_ENV} is set: FabricModel's worker runs under cProfile, its figures are not comparable")

    root = Path(tempfile.mkdtemp(prefix="bench_keras_"))
    runs: dict[str, list[tuple[float, float]]] = {"fit": [], "fm1": []}
    try:
        for r in range(args.repeats):
            runs["fit"].append(bench_fit(args.batch_size, epochs, args.warmup))
            runs["fm1"].append(
                bench_fabric(args.batch_size, args.warmup, epochs, root / f"fm1-{r}", args.dataloader_threads)
            )
            print(
                f"round {r + 1} (mean samples/s): " + ", ".join(f"{k} {v[-1][0]:,.0f}" for k, v in runs.items()),
                flush=True,
            )
    finally:
        if args.keep_runs or os.environ.get(PROFILE_ENV):
            print(f"FabricModel run directories kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)

    # The best round of each run: other load on the machine only ever slows a run down.
    mean = {k: max(m for m, _ in v) for k, v in runs.items()}
    median = {k: max(m for _, m in v) for k, v in runs.items()}
    rows = [("keras model.fit", "fit"), ("FabricModel, 1 engine", "fm1")]
    print(f"\n{'run':<24}{'workers':>8}{'threads':>9}{'batch':>7}{'samples/s (mean)':>18}{'(median step)':>15}")
    for name, key in rows:
        print(f"{name:<24}{1:>8}{cores:>9}{args.batch_size:>7}{mean[key]:>18,.0f}{median[key]:>15,.0f}")
    ratio, target = mean["fm1"] / mean["fit"], 0.9
    print(
        f"\nFabricModel 1 engine / model.fit (mean samples/s; median-step in brackets): {ratio:.3f}x  "
        f"[{median['fm1'] / median['fit']:.3f}x]  target >= {target:.2f}x: {'met' if ratio >= target else 'MISSED'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
