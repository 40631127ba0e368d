"""FabricModel beside its peers: throughput, start-up and faults, from one run (CPU).

    PYTHONPATH=. python benchmarks/bench_peers.py            # 3 rounds, about 5 minutes on 2 cores
    PYTHONPATH=. python benchmarks/bench_peers.py --quick    # 2 rounds, fewer steps: 2-3 minutes
    PYTHONPATH=. python benchmarks/bench_peers.py --rows mlp,start --rounds 5

Every run is a fresh process (``benchmarks/peer_runs.py``), so "process start -> first
committed step" counts the interpreter, imports, data and process group. Runs are
interleaved (plain, Lightning, FabricModel-1, DDP, FabricModel-2, plain, ...) and each
figure is a ratio against the baseline of its own round (the plain loop for one process,
hand-written DDP on gloo for two), shown as median [min-max] over the rounds: other load on
the machine moves both sides of a ratio alike.

Workloads, 64 samples per process and step, SGD with momentum, synthetic data: an MLP
256-512-512-10 (a ~2 ms step on 2 cores) and a small CNN on 3x32x32 (two conv layers, ~40 ms).
Threads: one process gets all usable cores; two processes one share each (gloo, 1 thread on
2 cores), as FabricModel gives its workers. Throughput counts the steps after a warm-up.
Every loop does the same work: it reads the loss each step, and FabricModel runs with
``metrics=[]``. One more MLP row adds an accuracy each step on both sides: FabricModel's
default (``metrics=None``, IBM's) against a plain loop that computes it as a tutorial does.

The fault rows run 3 FabricModel workers (paced, 20 ms a step), SIGKILL one inside a step
and compare with an undisturbed run: kill -> next committed step, kill -> the replacement
worker's first committed step, samples lost / doubled, the global batch kept, and the
largest weight difference to the undisturbed run.

Lightning Fabric and torchft are peers here only: ``pip install -e '.[bench]'`` installs them;
without one, its column says so. torchft appears in the fault rows, the same workload on three
replica groups with a lighthouse on loopback (``benchmarks/torchft_faults.py``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WARMUP = {"mlp": 40, "cnn": 4}
KINDS_1 = ("plain", "lightning", "fabric1")
KINDS_2 = ("ddp", "fabric2")
KINDS_ACC = ("plain_acc", "fabric1_acc")  # the MLP with an accuracy each step


def run(kind: str, workload: str, steps: int, tmp: Path) -> dict | None:
    """One run in a fresh process; its step times and first commit, with the process start."""
    out = tmp / f"{kind}-{workload}.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    start = time.time()
    done = subprocess.run(
        [sys.executable, str(HERE / "peer_runs.py"), kind, workload, str(steps), str(out)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    if done.returncode != 0 or not out.exists():
        print(f"  {kind} {workload} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    result = json.loads(out.read_text())
    out.unlink()
    result["start"] = start
    return result


def rate(result: dict, workload: str) -> float:
    """Steps per second after the warm-up."""
    times = result["times"][WARMUP[workload] - 1 :]
    return (len(times) - 1) / (times[-1] - times[0])


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="mlp,cnn,start,faults", help="any of mlp,cnn,start,faults (default: all)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--mlp-steps", type=int, default=600, help="MLP steps per run (default 600)")
    parser.add_argument("--cnn-steps", type=int, default=40, help="CNN steps per run (default 40)")
    parser.add_argument("--quick", action="store_true", help="2 rounds, 300 MLP and 24 CNN steps")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.mlp_steps, args.cnn_steps = 2, 300, 24
    rows = set(args.rows.split(","))
    workloads = [w for w in ("mlp", "cnn") if w in rows]
    if "start" in rows and "mlp" not in workloads:
        workloads.insert(0, "mlp")  # start-up is read from the MLP runs
    kinds_1 = [k for k in KINDS_1 if k != "lightning" or importlib.util.find_spec("lightning")]
    notes = [] if "lightning" in kinds_1 else ["Lightning Fabric: not installed (pip install -e '.[bench]')"]
    steps = {"mlp": args.mlp_steps, "cnn": args.cnn_steps}
    results: dict[tuple[str, str], list[dict]] = {}
    faults: list[dict] = []
    torchft: list[dict] | None = [] if importlib.util.find_spec("torchft") else None
    notes += [] if torchft is not None else ["torchft: not installed (pip install -e '.[bench]')"]
    print(f"{len(os.sched_getaffinity(0))} usable cores, load average {os.getloadavg()[0]:.2f}; "
          f"{args.rounds} rounds, rows {','.join(sorted(rows))}", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for workload in workloads:
                for kind in [*kinds_1, *KINDS_2, *(KINDS_ACC if workload == "mlp" else ())]:
                    result = run(kind, workload, steps[workload], Path(tmp))
                    if result is not None:
                        results.setdefault((kind, workload), []).append({**result, "round": r})
            if "faults" in rows:
                result = run("faults", "mlp", 128, Path(tmp))
                faults.extend([result] if result else [])
                if torchft is not None:
                    result = run("torchft", "mlp", 128, Path(tmp))
                    torchft.extend([result] if result else [])
            print(f"round {r + 1}/{args.rounds} done, load average {os.getloadavg()[0]:.2f}", flush=True)
            if r + 1 < args.rounds:  # a long run shows where it stands
                print_table(results, faults, workloads, rows, kinds_1, torchft)
    print_table(results, faults, workloads, rows, kinds_1, torchft)
    for note in notes:
        print(f"note: {note}")
    return 0


def ratios(results: dict, kind: str, base: str, workload: str) -> list[float]:
    """This kind's throughput over the baseline's, round by round."""
    ours = {x["round"]: rate(x, workload) for x in results.get((kind, workload), [])}
    theirs = {x["round"]: rate(x, workload) for x in results.get((base, workload), [])}
    return [ours[r] / theirs[r] for r in ours if r in theirs]


def print_table(
    results: dict, faults: list[dict], workloads: list[str], rows: set[str], kinds_1: list[str], torchft: Any = None
) -> None:
    header = ["", "plain loop", "Lightning Fabric", "fabric_model", "hand DDP (gloo)"]
    lines = [header, ["---"] * len(header)]
    names = {"mlp": "MLP 256-512-512-10, batch 64", "cnn": "small CNN 3x32x32, batch 64"}
    for workload in [w for w in workloads if w in rows]:
        light = spread(ratios(results, "lightning", "plain", workload)) if "lightning" in kinds_1 else "not installed"
        fm1 = spread(ratios(results, "fabric1", "plain", workload))
        lines.append([f"1 process, {names[workload]}", "1.00", light, fm1, ""])
        if workload == "mlp":
            fm1_acc = spread(ratios(results, "fabric1_acc", "plain_acc", workload))
            lines.append(["  the same, with an accuracy each step (FabricModel's default)", "1.00", "", fm1_acc, ""])
        fm2 = spread(ratios(results, "fabric2", "ddp", workload))
        lines.append([f"2 processes x 1 thread, {names[workload]}", "", "", fm2, "1.00"])
    if "start" in rows:
        starts = {
            k: [x["first"] - x["start"] for x in results.get((k, "mlp"), [])] for k in [*kinds_1, *KINDS_2]
        }  # fmt: skip
        row = ["process start -> first committed step, MLP (s)"]
        row.append(spread(starts["plain"], "{:.1f}"))
        row.append(spread(starts["lightning"], "{:.1f}") if "lightning" in kinds_1 else "not installed")
        row.append(f"{spread(starts['fabric1'], '{:.1f}')} (1), {spread(starts['fabric2'], '{:.1f}')} (2)")
        row.append(spread(starts["ddp"], "{:.1f}"))
        lines.append(row)
        plain = {x["round"]: x["first"] - x["start"] for x in results.get(("plain", "mlp"), [])}
        ratio = [x["first"] - x["start"] for x in results.get(("fabric1", "mlp"), [])]
        ratio = [
            s / plain[x["round"]] for s, x in zip(ratio, results.get(("fabric1", "mlp"), [])) if x["round"] in plain
        ]
        lines.append(["  the same, ratio to the plain loop", "1.00", "", spread(ratio), ""])
    if faults:
        peer = bool(torchft)
        if peer:  # torchft appears in the fault rows only
            for line in lines:
                line.append("torchft 0.2.0" if line is header else "---" if line[0] == "---" else "")
        for name, values in fault_rows(faults):
            lines.append([name, "", "", values, ""] + ([dict(fault_rows(torchft))[name]] if peer else []))
    print()
    for line in lines:
        print("| " + " | ".join(line) + " |")


def fault_rows(faults: list[dict]) -> list[tuple[str, str]]:
    """The fault rows' cells for one framework's runs (a run no replica finished has no figures)."""
    crashed = sum(f.get("crashed", 0) > 0 for f in faults)
    note = f"; survivors crashed in {crashed} of {len(faults)} runs" if crashed else ""
    faults = [f for f in faults if f.get("finished", True)]
    if not faults:
        return [(name, f"no run finished{note}") for name in FAULT_ROWS]
    replaced = [f["kill_to_replacement"] for f in faults if f["kill_to_replacement"] is not None]
    lost = f"{max(f['lost'] for f in faults)} / {max(f['doubled'] for f in faults)}"
    kept = "yes" if all(f["batch_kept"] for f in faults) else "no"
    diff = max(f["weights_max_diff"] for f in faults)
    next_step = [f["kill_to_next"] for f in faults if f["kill_to_next"] is not None]
    cells = [spread(next_step, "{:.3f}"), spread(replaced, "{:.1f}"), f"{lost}, {kept}, {diff:.1e}{note}"]
    return list(zip(FAULT_ROWS, cells))


FAULT_ROWS = (
    "SIGKILL mid-step -> next committed step (3 workers, s)",
    "SIGKILL -> replacement training (s)",
    "samples lost / doubled, global batch kept, largest weight difference to undisturbed",
)


if __name__ == "__main__":
    sys.exit(main())
