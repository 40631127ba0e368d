"""Two torch profiler traces of the same steps, side by side: what one step of each launches.

    python benchmarks/trace_diff.py plain.pt.trace.json fabric.pt.trace.json --steps 10 [--rows 25]

Made for the GPU rows of ``bench_gpu.py`` (``--rows profile``: the plain loop's window of steps
beside FabricModel's), so that every microsecond a step costs beyond the plain loop has a name.
Per step, on each side: the operators (count and self CPU time), the CUDA runtime calls, among
them the synchronisations (``cuda*Synchronize``) and host-device copies by direction, the kernels
and their device time; then the rows where the two sides differ most, each with the named range
of FabricModel's trace it was launched in (``profiling/phases.py``; ``-`` outside any, ``thread``
off the stepping thread). Read counts as exact and times as the profiler's (it adds a few
microseconds an operator to both sides alike).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

#: The trace categories compared (the torch profiler's Chrome trace, kineto's names).
KINDS = ("cpu_op", "cuda_runtime", "cuda_driver", "kernel", "gpu_memcpy", "gpu_memset")


@dataclass
class Side:
    """One trace's events per step: ``rows[(kind, name)] = [count, self or device us, {range: count}]``."""

    steps: int
    rows: dict[tuple[str, str], list] = field(default_factory=dict)

    def add(self, kind: str, name: str, micros: float, where: str) -> None:
        row = self.rows.setdefault((kind, name), [0, 0.0, collections.Counter()])
        row[0] += 1
        row[1] += micros
        row[2][where] += 1

    def per_step(self, kind: str, name: str) -> tuple[float, float]:
        count, micros, _ = self.rows.get((kind, name), (0, 0.0, None))
        return count / self.steps, micros / self.steps

    def total(self, kind: str, match: str = "") -> tuple[float, float]:
        """Per step: the count and microseconds of ``kind``'s events whose name holds ``match``."""
        picked = [r for (k, n), r in self.rows.items() if k == kind and match in n]
        return sum(r[0] for r in picked) / self.steps, sum(r[1] for r in picked) / self.steps


def read(path: str | Path, steps: int) -> Side:
    """The trace's events, each operator charged its self time and the innermost named range
    (a ``user_annotation``) around it on its thread."""
    events = [e for e in json.loads(Path(path).read_text())["traceEvents"] if e.get("ph") == "X"]
    side = Side(steps)
    ranges = [e for e in events if e.get("cat") == "user_annotation" and not e["name"].startswith("profiling/")]
    stepping = {e["tid"] for e in ranges if e["name"] == "fabric_model/step"}
    by_thread: dict[object, list[dict]] = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in KINDS or e.get("cat") == "user_annotation":
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for (_, tid), thread in by_thread.items():
        host = thread[0].get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset")
        for event, own, where in _nested(thread):
            kind = event.get("cat")
            if kind == "user_annotation":
                continue
            if not host:  # device events: their own time, no host range
                side.add(kind, event["name"], float(event.get("dur", 0.0)), "device")
                continue
            place = where or ("thread" if stepping and tid not in stepping else "-")
            side.add(kind, event["name"], own, place)
    return side


def _nested(events: list[dict]) -> Iterable[tuple[dict, float, str]]:
    """Each event with its self time (its duration less its children's) and its innermost range."""
    order = sorted(events, key=lambda e: (e["ts"], -e.get("dur", 0.0)))
    stack: list[list] = []  # [event, children's time, innermost range name]
    done: list[tuple[dict, float, str]] = []

    def pop() -> None:
        event, inner, where = stack.pop()
        done.append((event, float(event.get("dur", 0.0)) - inner, where))
        if stack:
            stack[-1][1] += float(event.get("dur", 0.0))

    for e in order:
        while stack and e["ts"] >= stack[-1][0]["ts"] + stack[-1][0].get("dur", 0.0):
            pop()
        parent = stack[-1][2] if stack else ""
        where = e["name"] if e.get("cat") == "user_annotation" else parent
        stack.append([e, 0.0, where])
    while stack:
        pop()
    return done


def report(plain: Side, fabric: Side, rows: int = 20) -> list[str]:
    """The totals per step; then the (kind, name) pairs whose counts differ (exact, so first),
    then the ``rows`` whose times differ most at equal counts (the profiler's noise included)."""
    lines = [f"{'per step':<52}{'plain':>10}{'fabric':>10}{'difference':>12}"]
    for label, kind, match in (
        ("operators", "cpu_op", ""),
        ("CUDA runtime calls", "cuda_runtime", ""),
        ("  synchronisations (cuda*Synchronize)", "cuda_runtime", "Synchronize"),
        ("  copies launched (cudaMemcpy*)", "cuda_runtime", "Memcpy"),
        ("  allocations (cudaMalloc*, cudaHostAlloc)", "cuda_runtime", "lloc"),
        ("kernels", "kernel", ""),
        ("copies host to device", "gpu_memcpy", "HtoD"),
        ("copies device to host", "gpu_memcpy", "DtoH"),
    ):
        (ca, ta), (cb, tb) = plain.total(kind, match), fabric.total(kind, match)
        lines.append(f"{label + ' (count)':<52}{ca:>10.1f}{cb:>10.1f}{cb - ca:>+12.1f}")
        if kind in ("cpu_op", "kernel"):
            label = f"{label} ({'self CPU' if kind == 'cpu_op' else 'device'} us)"
            lines.append(f"{label:<52}{ta:>10.0f}{tb:>10.0f}{tb - ta:>+12.0f}")
    counted, timed = [], []
    for key in set(plain.rows) | set(fabric.rows):
        (ca, ta), (cb, tb) = plain.per_step(*key), fabric.per_step(*key)
        where = fabric.rows[key][2].most_common(1)[0][0] if key in fabric.rows else ""
        row = (key, ca, cb, ta, tb, where)
        if abs(cb - ca) >= 0.05:
            counted.append((-abs(cb - ca), row))
        elif abs(tb - ta) >= 5.0:
            timed.append((-abs(tb - ta), row))
    head = f"{'count':>13}{'us':>15}  fabric's range"
    for title, picked, limit in (("counts differ", counted, None), ("same counts, times differ", timed, rows)):
        lines += ["", f"{title + ', per step (plain, fabric)':<48}{head}"]
        for _, ((kind, name), ca, cb, ta, tb, where) in sorted(picked, key=lambda r: r[0])[:limit]:
            lines.append(f"{f'{kind} {name}'[:48]:<48}{ca:>6.1f}{cb:>7.1f}{ta:>8.0f}{tb:>7.0f}  {where}")
        if not picked:
            lines.append("  (none)")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plain")
    parser.add_argument("fabric")
    parser.add_argument("--steps", type=int, default=10, help="the steps each trace holds")
    parser.add_argument("--rows", type=int, default=20, help="the time differences listed")
    args = parser.parse_args()
    print("\n".join(report(read(args.plain, args.steps), read(args.fabric, args.steps), args.rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
