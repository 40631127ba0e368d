"""Each change of workers in a run, from its ``logs/metrics.jsonl``: when, who, why, and how long
training paused for it (from the run's last step before the change to its first step after),
beside how long a step took just before it.

    python examples/clusters/report.py RUN_DIR
    python examples/clusters/report.py --hosts RUN_DIR   # the hosts training now, for a script to wait on
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def read(run_dir: str) -> list[dict]:
    path = Path(run_dir) / "logs" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def hosts_training(run_dir: str) -> str:
    """The hosts of the newest generation once it has committed a step, sorted; else nothing."""
    records = read(run_dir)
    generations = [r for r in records if r["type"] == "generation"]
    trained = {r["generation"] for r in records if r["type"] == "train"}
    if not generations or generations[-1]["generation"] not in trained:
        return ""
    return " ".join(sorted(generations[-1]["hosts"]))


def main(run_dir: str) -> None:
    records = read(run_dir)
    start = records[0]["time"]
    steps = [r["time"] for r in records if r["type"] == "train"]
    for r in records:
        if r["type"] != "generation":
            continue
        before = [t for t in steps if t < r["time"]]
        after = min((t for t in steps if t > r["time"]), default=None)
        paused = ""
        if before and after is not None:
            last = before[-5:]
            recent = sorted(b - a for a, b in zip(last, last[1:]))  # the gaps between the last steps
            usual = f" (a step: {recent[len(recent) // 2]:.2f} s)" if recent else ""
            paused = f", paused {after - before[-1]:.2f} s{usual}"
        hosts = ", ".join(r.get("hosts", []))
        print(f"+{r['time'] - start:5.2f} s gen {r['generation']}: {r['workers']} on {hosts}{paused}")
        reason = r["reason"]
        if r.get("restored") == "checkpoint":  # a resumed run's first generation
            reason += f", resumed from {r['checkpoint']}"
        print(f"           {reason[:68]}")


if __name__ == "__main__":
    if sys.argv[1] == "--hosts":
        print(hosts_training(sys.argv[2]))
    else:
        main(sys.argv[1])
