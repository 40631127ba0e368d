"""What a driver killed without notice costs when the same command runs again (docs/elasticity.md,
"A lost driver").

    python benchmarks/bench_driver_restart.py                 # 2 ms and 50 ms steps, 3 rounds each
    python benchmarks/bench_driver_restart.py --rounds 5

Each round trains 2 local workers (the tiny MLP of the tests, ``deterministic=True``, steps paced
to the step time by the loss), SIGKILLs the driver from its own logger once step 100 is
committed, and runs the same script again at once with ``resume="auto"``. It prints, per step
time, the medians of:

- kill to first commit: from the SIGKILL to the first step the restarted driver commits;
- restart start-up: from the SIGKILL to the restarted driver listening (the new process's
  imports, ``FabricModel``, the argument checks: what any restart pays);
- taking back: from listening to the first committed step (the workers' reconnect, the
  generation formed from what they hold, and one step): what the workers' wait saves;
- steps redone: committed steps whose record comes twice (0: none redone);

and the load (1-minute average) before and after, since this machine's two cores are shared.
Rounds of the two step times are interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KILL_AT = 100

SCRIPT = textwrap.dedent("""
    import os, signal, sys, time, torch
    sys.path.insert(0, {root!r})
    torch.set_num_threads(1)
    import torch.nn.functional as F
    from tests.helpers import fresh_model_and_optimizer, make_data
    from fabric_model import FabricModel

    class Paced:
        def __init__(self, seconds):
            self.seconds = seconds
        def __call__(self, output, target):
            time.sleep(self.seconds)
            return F.cross_entropy(output, target)

    class KilledAt:  # SIGKILL to the driver once step {kill_at} is committed, saying when
        def log_train_metrics(self, metrics, iteration, epoch, workers):
            if iteration == {kill_at} and {kill}:
                with open({killed!r}, "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

    model, opt = fresh_model_and_optimizer()
    data = make_data(3200)  # 200 steps an epoch
    fm = FabricModel(model, lambda: (data, None), Paced({step}), opt, driver_logger_callback=KilledAt())
    fm.train(1, 8, 2, seed=3, run_dir={run_dir!r}, resume="auto", deterministic=True, tensorboard=False)
""")


def one_round(step: float) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir, killed = Path(tmp, "run"), Path(tmp, "killed")
        env = dict(os.environ, FABRIC_MODEL_DRIVER_WAIT="60")

        def script(kill: bool) -> list[str]:
            text = SCRIPT.format(
                root=str(ROOT), kill_at=KILL_AT, kill=kill, killed=str(killed), step=step, run_dir=str(run_dir)
            )
            return [sys.executable, "-c", text]

        first = subprocess.run(script(True), env=env, capture_output=True, timeout=600)
        assert first.returncode == -9, first.stdout[-2000:] + first.stderr[-2000:]
        join = run_dir / "join.json"
        before = join.stat().st_mtime_ns
        again = subprocess.Popen(script(False), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        listening = None
        while again.poll() is None:
            if listening is None and join.exists() and join.stat().st_mtime_ns != before:
                listening = time.time()  # the restarted driver wrote it once it listened
            time.sleep(0.002)
        assert again.returncode == 0 and listening is not None
        kill_time = float(killed.read_text())
        records = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
        trains = [r for r in records if r["type"] == "train"]
        first_commit = min(r["time"] for r in trains if r["time"] > listening)
        assert any(g.get("reason") == "the driver restarted" for g in records if g["type"] == "generation")
        iterations = [r["iteration"] for r in trains]
        return {
            "kill to first commit": first_commit - kill_time,
            "restart start-up": listening - kill_time,
            "taking back": first_commit - listening,
            "steps redone": float(len(iterations) - len(set(iterations))),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    steps = (0.002, 0.05)
    load = os.getloadavg()[0]
    results: dict[float, list[dict[str, float]]] = {s: [] for s in steps}
    for _ in range(args.rounds):
        for step in steps:
            results[step].append(one_round(step))
    print(f"load {load:.2f} before, {os.getloadavg()[0]:.2f} after; {args.rounds} rounds, medians")
    print(f"{'step':>8} {'kill to first commit':>21} {'restart start-up':>17} {'taking back':>12} {'steps redone':>13}")
    for step, rounds in results.items():
        m = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        print(
            f"{step * 1000:6.0f} ms {m['kill to first commit']:19.2f} s {m['restart start-up']:15.2f} s "
            f"{m['taking back']:10.2f} s {m['steps redone']:13.0f}"
        )


if __name__ == "__main__":
    main()
