"""Start-up and replacement: process start to first committed step, and SIGKILL to a replacement training.

    PYTHONPATH=. python benchmarks/bench_startup.py              # 5 interleaved rounds
    PYTHONPATH=. python benchmarks/bench_startup.py --rounds 3 --no-replace
    PYTHONPATH=. python benchmarks/bench_startup.py --only datasets  # the rows of a caller that imported datasets

Each round starts, in turn, fresh interpreters that run:

- ``python``: an empty interpreter; ``import torch``: the import alone (what each fresh worker pays);
- ``plain``: ``import torch``, build the MLP 256->512->512->10, take one SGD step (batch 64);
- ``fm-1``, ``fm-2``: the same model through ``FabricModel.train`` with 1 and 2 engines,
  timed to the driver's first committed step (by default the warm process is a fork of the
  script, which runs no torch operation before ``FabricModel``); then the same with a fresh
  warm process (``FABRIC_MODEL_WARM_START=fresh``), and with fresh worker interpreters
  (``FABRIC_MODEL_WARM_START=0``), as before the warm process;
- ``again``: a caller unfit to fork (a notebook, whose kernel has threads: here
  ``FABRIC_MODEL_WARM_START=fresh``) trains the 2-engine job twice; from its second
  ``FabricModel(...)`` to that job's first committed step, with the warm process the first job
  kept (``launchers/warm_spare.py``) and with none kept (``FABRIC_MODEL_WARM_KEEP=0``);
- ``datasets``: the plain loop and ``fm-2`` in a script whose first line is ``import datasets``
  (Hugging Face's; pyarrow under it starts jemalloc's background thread, which once made the
  caller unfit to fork);
- ``keras``: a Keras MLP (12->64->64->3, batch 16): ``model.fit``'s first step in a fresh
  interpreter; the same model through ``FabricModel.train`` with 2 engines, to the first
  committed step, with the workers forks of the warm process that imported TensorFlow
  (launchers/warm.py) and as fresh interpreters that each import it (``FABRIC_MODEL_WARM_START=0``);
  and a notebook's second ``train()`` of it (``FABRIC_MODEL_WARM_START=fresh``: a Keras caller is
  never forked anyway), from the second ``FabricModel(...)`` to that job's first committed step,
  with the warm process kept and with none kept (``FABRIC_MODEL_WARM_KEEP=0``);
- ``replace`` (unless ``--no-replace``): 2 engines, worker 1 SIGKILLed inside step 3; from the
  kill to the next committed step (the survivor alone) and to the first committed step the
  replacement worker takes part in.

Times are from just before the parent starts the child to the moment the child stamps; the
table gives the median [min-max] over the rounds, each row's ratio to ``plain`` of the same
rounds, and for FabricModel's rows the seconds it takes beyond ``plain`` (target: at most 0.5 s on
CPU). Then the phases ``run.json`` records of each default ``fm`` run (``startup``: from
``train()`` to the first committed step; run/startup.py), medians over the rounds. Machine load
from other processes moves every row alike within a round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PLAIN = """
import time, torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step()
print("STAMP", time.time(), flush=True)
"""

FABRIC = """
import os, sys, time, torch, torch.nn as nn, torch.nn.functional as F
from fabric_model import FabricModel
from fabric_model.testing import FaultInjector, Kill

class Stamp:
    def __init__(self):
        self.done = False
    def log_train_metrics(self, metrics, iteration, epoch, workers):
        if not self.done:
            self.done = True
            print("STAMP", time.time(), flush=True)

class Data:
    def __init__(self):
        g, n = torch.Generator().manual_seed(0), STEPS * 64 * ENGINES
        self.x, self.y = torch.randn(n, 256, generator=g), torch.randint(0, 10, (n,), generator=g)
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        return self.x[i], self.y[i]

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
inj = FaultInjector([Kill(1, 3)], MARKERS, step_delay=0.1) if KILL else None
fm = FabricModel(model, lambda: (Data(), None), F.cross_entropy, opt, driver_logger_callback=Stamp(),
                 worker_logger_callback=inj)
fm.train(1, 64, ENGINES, seed=0, run_dir=RUN_DIR)
"""


AGAIN = (
    FABRIC[: FABRIC.index("torch.manual_seed(0)")]
    + """
for n in (1, 2):  # a notebook's two cells
    if n == 2:
        print("AGAIN", time.time(), flush=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    fm = FabricModel(model, lambda: (Data(), None), F.cross_entropy, opt, driver_logger_callback=Stamp())
    fm.train(1, 64, ENGINES, seed=0, run_dir=RUN_DIR + str(n))
"""
)


KERAS_MODEL = """
import os, sys, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np, keras
rng = np.random.default_rng(0)
X = rng.normal(size=(16 * 4, 12)).astype(np.float32)
Y = (X @ rng.normal(size=(12, 3))).argmax(1)
def model_and_optimizer():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(64, activation="relu"), keras.layers.Dense(3)])
    return model, keras.optimizers.SGD(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
"""

KERAS_FIT = (
    KERAS_MODEL
    + """
class Stamp(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 0:
            print("STAMP", time.time(), flush=True)
model, opt, loss = model_and_optimizer()
model.compile(optimizer=opt, loss=loss)
model.fit(X, Y, batch_size=16, epochs=1, verbose=0, callbacks=[Stamp()])
"""
)

KERAS_FABRIC = (
    KERAS_MODEL
    + """
from fabric_model import FabricModel
DATA = [(X[i], int(Y[i])) for i in range(len(X))]
class Stamp:
    def __init__(self):
        self.done = False
    def log_train_metrics(self, metrics, iteration, epoch, workers):
        if not self.done:
            self.done = True
            print("STAMP", time.time(), flush=True)
for n in range(1, CELLS + 1):  # a notebook's cells
    if n == 2:
        print("AGAIN", time.time(), flush=True)
    model, opt, loss = model_and_optimizer()
    fm = FabricModel(model, lambda: (DATA, None), loss, opt, driver_logger_callback=Stamp())
    fm.train(1, 16, 2, seed=0, run_dir=RUN_DIR + str(n), verbose=0)
"""
)


def _keras(tmp: Path, name: str, env: dict[str, str], cells: int) -> float:
    """A Keras script training ``cells`` times: seconds from process start to the first job's
    first committed step (1 cell), or from the second ``FabricModel(...)`` to its job's (2)."""
    header = f"CELLS={cells}\nRUN_DIR={str(tmp / name / 'run')!r}\n"
    if cells == 1:
        return _run(header + KERAS_FABRIC, env)[0]
    return _again(tmp, name, env, header + KERAS_FABRIC)


def _keras_round(tmp: Path, r: int, env: dict[str, str], notebook: dict[str, str]) -> list[tuple[str, float]]:
    """One round of the ``keras`` rows: (label, seconds)."""
    return [
        ("keras model.fit: start -> first step", _run(KERAS_FIT, env)[0]),
        ("keras fm 2 engines: start -> commit", _keras(tmp, f"k{r}", env, 1)),
        ("keras fm 2 engines, fresh workers", _keras(tmp, f"kf{r}", {**env, "FABRIC_MODEL_WARM_START": "0"}, 1)),
        ("keras again: kept warm process", _keras(tmp, f"ka{r}", notebook, 2)),
        ("keras again: none kept", _keras(tmp, f"kn{r}", {**notebook, "FABRIC_MODEL_WARM_KEEP": "0"}, 2)),
    ]


def _again(tmp: Path, name: str, env: dict[str, str], script: str | None = None) -> float:
    """Seconds from a second ``FabricModel(...)`` in the same caller to its job's first committed step."""
    run_dir = tmp / name / "run"
    header = f"STEPS=2\nENGINES=2\nKILL=False\nRUN_DIR={str(run_dir)!r}\nMARKERS=None\n"
    script = script if script is not None else header + AGAIN
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"child failed ({out.returncode}):\n{out.stderr[-3000:]}")
    marks = [line.split() for line in out.stdout.splitlines() if line.startswith(("AGAIN", "STAMP"))]
    again = next(i for i, (what, _) in enumerate(marks) if what == "AGAIN")
    return float(marks[again + 1][1]) - float(marks[again][1])


def _run(code: str, env: dict[str, str]) -> tuple[float, float]:
    """Run ``code`` in a fresh interpreter; (seconds to its STAMP or exit, its end time)."""
    start = time.time()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    end = time.time()
    if out.returncode != 0:
        raise RuntimeError(f"child failed ({out.returncode}):\n{out.stderr[-3000:]}")
    stamps = [float(line.split()[1]) for line in out.stdout.splitlines() if line.startswith("STAMP")]
    return (stamps[0] if stamps else end) - start, end


def _phases(run_dir: Path) -> list[list]:
    """``run.json``'s start-up phases: ``[[name, seconds], ...]`` and the total."""
    startup = json.loads((run_dir / "run.json").read_text())["startup"]
    return [*startup["phases"], ["total: train() -> first commit", startup["total"]]]


def _fabric(
    engines: int, tmp: Path, name: str, env: dict[str, str], kill: bool = False, prefix: str = ""
) -> tuple[float, Path, Path]:
    run_dir, markers = tmp / name / "run", tmp / name / "markers"
    markers.mkdir(parents=True)
    steps = 50 if kill else 2  # paced at 0.1 s: room for the replacement to join
    header = f"STEPS={steps}\nENGINES={engines}\nKILL={kill}\nRUN_DIR={str(run_dir)!r}\nMARKERS={str(markers)!r}\n"
    seconds, _ = _run(prefix + header + FABRIC, env)
    return seconds, run_dir, markers


def _replacement(tmp: Path, name: str, env: dict[str, str]) -> tuple[float, float]:
    """(kill -> next committed step, kill -> first committed step with the replacement)."""
    _, run_dir, markers = _fabric(2, tmp, name, env, kill=True)
    killed = float((markers / "fault-0").read_text())
    lines = [json.loads(x) for x in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    gens = {r["generation"]: r for r in lines if r["type"] == "generation"}
    steps = [r for r in lines if r["type"] == "train" and r["time"] > killed]
    with_new = [r for r in steps if any(m >= 2 for m in gens[r["generation"]]["members"])]
    if not with_new:
        raise RuntimeError(f"no step with a replacement worker: {gens}")
    return steps[0]["time"] - killed, with_new[0]["time"] - killed


def _row(name: str, values: list[float], base: list[float] | None) -> str:
    med = statistics.median(values)
    text = f"{name:<34} {med:7.2f} s [{min(values):.2f}-{max(values):.2f}]"
    if base:
        ratios = [v / b for v, b in zip(values, base)]
        text += f"   x{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}] of plain"
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-replace", action="store_true")
    groups = ("basic", "fm", "again", "datasets", "keras", "replace")
    parser.add_argument("--only", nargs="+", choices=groups, default=groups, help="the groups of rows to run")
    args = parser.parse_args()
    only = set(args.only) - ({"replace"} if args.no_replace else set())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("EDT_REPLACE_WORKERS", None)
    rows: dict[str, list[float]] = {}
    phases: dict[int, dict[str, list[float]]] = {1: {}, 2: {}}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for r in range(args.rounds):
            if "basic" in only:
                rows.setdefault("python", []).append(_run("pass", env)[0])
                rows.setdefault("import torch", []).append(_run("import torch", env)[0])
            rows.setdefault("plain loop: start -> first step", []).append(_run(PLAIN, env)[0])
            if "datasets" in only:
                plain = _run("import datasets\n" + PLAIN, env)[0]
                rows.setdefault("import datasets + plain loop", []).append(plain)
                seconds = _fabric(2, tmp, f"datasets-{r}", env, prefix="import datasets\n")[0]
                rows.setdefault("import datasets + fm 2 engines", []).append(seconds)
                rows.setdefault("  beyond its plain loop", []).append(seconds - plain)
            for engines in (1, 2) if "fm" in only else ():
                seconds, run_dir, _ = _fabric(engines, tmp, f"fm{engines}-{r}", env)
                rows.setdefault(f"fm {engines} engine(s): start -> first commit", []).append(seconds)
                for phase, took in _phases(run_dir):
                    phases[engines].setdefault(phase, []).append(took)
                for mode, label in (("fresh", "fresh warm process"), ("0", "fresh workers")):
                    seconds = _fabric(engines, tmp, f"{mode}{engines}-{r}", {**env, "FABRIC_MODEL_WARM_START": mode})[0]
                    rows.setdefault(f"fm {engines} engine(s), {label}", []).append(seconds)
            notebook = {**env, "FABRIC_MODEL_WARM_START": "fresh"}
            for keep, label in (("600", "kept warm process"), ("0", "none kept")) if "again" in only else ():
                seconds = _again(tmp, f"again{keep}-{r}", {**notebook, "FABRIC_MODEL_WARM_KEEP": keep})
                rows.setdefault(f"again: 2nd train(), {label}", []).append(seconds)
            if "keras" in only:
                for label, seconds in _keras_round(tmp, r, env, notebook):
                    rows.setdefault(label, []).append(seconds)
            if "replace" in only:
                nxt, new = _replacement(tmp, f"kill-{r}", env)
                rows.setdefault("SIGKILL -> next committed step", []).append(nxt)
                rows.setdefault("SIGKILL -> replacement training", []).append(new)
            print(f"round {r + 1}/{args.rounds} done (load {os.getloadavg()[0]:.2f})", file=sys.stderr)
    base = rows["plain loop: start -> first step"]
    keras_base = rows.get("keras model.fit: start -> first step")
    print(f"{args.rounds} rounds, {os.cpu_count()} cores; median [min-max]")
    for name, values in rows.items():
        ratio = name.startswith(("fm", "import", "plain")) and name != "import datasets + plain loop"
        if name.startswith("keras fm"):
            print(_row(name, values, keras_base).replace("of plain", "of model.fit"))
            continue
        print(_row(name, values, base if ratio else None))
        if name.startswith("fm"):
            beyond = [v - b for v, b in zip(values, base)]
            print(f"{'':<34} +{statistics.median(beyond):.2f} s [{min(beyond):.2f}-{max(beyond):.2f}] beyond plain")
    for engines, table in phases.items():
        if not table:
            continue  # the fm group did not run
        print(f"\nrun.json's start-up phases, {engines} engine(s) (median s over the rounds)")
        for phase, values in table.items():
            print(f"  {phase:<44} {statistics.median(values):7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
