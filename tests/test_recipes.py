"""The recipes of docs/clusters.md, run as the docs show them (network namespaces, root): each
ends with what the driver checked, its weights those of an undisturbed run, and nothing left
behind."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch

from . import netns
from .helpers import max_rel_diff, need
from .load import scaled
from .test_multihost import assert_exactly_once, undisturbed  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parent.parent


def run_recipe(script: str, work: Path, tag: str, net: str, timeout: float) -> list[str]:
    """``bash examples/clusters/<script> WORK`` as the docs show it (its namespaces named by
    ``tag``, on ``net``): the lines it printed, once it ended well and left no namespace."""
    env = dict(os.environ, FM_RECIPE_TAG=tag, FM_RECIPE_NET=net)
    out = subprocess.run(
        ["bash", f"examples/clusters/{script}", str(work)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=scaled(timeout),
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert not {n for n in netns.namespaces() if n.startswith(tag)}
    return out.stdout.splitlines()


def assert_same_training(work: Path, reference: dict) -> None:
    """Every sample once an epoch (the committed steps' records), the weights of an undisturbed run."""
    assert_exactly_once(work / "run")
    assert max_rel_diff(torch.load(work / "final.pt")["state"], reference) <= 1e-5


@pytest.mark.multihost
@pytest.mark.processes
@pytest.mark.timeout(400)
def test_workers_started_by_hand_survive_a_crash_a_partition_and_rejoin(tmp_path, undisturbed):  # noqa: F811
    netns.skip_unless_available()
    lines = run_recipe("hand_started.sh", tmp_path / "work", f"fmr{os.getpid() % 10000}", "10.233.0", 300.0)
    assert re.fullmatch(r"\[fabric-model\] done: 80 steps, every sample once an epoch, 2 replicas agree", lines[-2])
    reasons = [line.strip() for line in lines if line.startswith("           ")]
    assert reasons[1] == "worker 3 joins" and "lost" in reasons[2] and "EDT_HEARTBEAT_TIME_OUT" in reasons[4], reasons
    assert any("gen 5: 2 on 10.233.0.1, 10.233.0.2" in line for line in lines)  # hosts by address
    assert "exiting (4): removed from the job" in (tmp_path / "work" / "b.log").read_text()  # fenced at the heal
    assert_same_training(tmp_path / "work", undisturbed)


@pytest.mark.multihost
@pytest.mark.processes
@pytest.mark.timeout(600)
def test_a_ray_cluster_with_token_authentication_survives_a_crash_a_new_node_and_a_partition(tmp_path, undisturbed):  # noqa: F811
    netns.skip_unless_available()
    if importlib.util.find_spec("ray") is None:  # found without importing it (which sets RAY_* variables)
        need("ray")
    started = time.time()
    lines = run_recipe("ray_cluster.sh", tmp_path / "work", f"fmy{os.getpid() % 10000}", "10.234.0", 480.0)
    assert re.fullmatch(r"\[fabric-model\] done: 80 steps, every sample once an epoch", lines[-2]), lines[-3:]
    reasons = [line.strip() for line in lines if line.startswith("           ")]
    assert "lost" in reasons[1] and "joins" in reasons[2] and "EDT_HEARTBEAT_TIME_OUT" in reasons[3], reasons
    assert any("gen 2: 2 on 10.234.0.3, 10.234.0.4" in line for line in lines)  # hosts by address: C, D that joined
    assert_same_training(tmp_path / "work", undisturbed)
    assert not list(Path("/tmp").glob("fmray.*")) or all(
        p.stat().st_mtime < started for p in Path("/tmp").glob("fmray.*")
    )


def test_a_raylets_report_goes_to_the_run_directory_and_one_line_to_the_console(tmp_path, caplog):
    """Ray prints a dead raylet's report (its log's tail, a native stack trace) on the driver's
    console; while a job runs it goes to logs/ray.log instead, said in one line. Other output of
    Ray's (a worker's print) passes through, and the function is put back after."""
    from types import SimpleNamespace

    from fabric_model.launchers.ray_console import RayConsole

    printed = []
    ray_worker = SimpleNamespace(print_to_stdstream=lambda data, ignore_prefix: printed.append(data))
    original = ray_worker.print_to_stdstream
    console = RayConsole(tmp_path / "ray.log")
    console.install(ray_worker)
    report = "Raylet is terminated. Termination is unexpected. Last 20 lines of the Raylet logs:\n    *** SIGSEGV"
    ray_worker.print_to_stdstream({"lines": [report], "pid": "raylet", "is_err": False}, False)
    dead = "The node with node id: 6f1c and address: 10.234.0.3 and node name: 10.234.0.3 has been marked dead because"
    ray_worker.print_to_stdstream({"lines": [dead], "pid": "raylet", "is_err": False}, False)
    ray_worker.print_to_stdstream({"lines": ["hello"], "pid": 123, "is_err": False}, False)
    console.close()
    assert printed == [{"lines": ["hello"], "pid": 123, "is_err": False}]
    assert (tmp_path / "ray.log").read_text() == report + "\n" + dead + "\n"
    assert [r.getMessage() for r in caplog.records] == [
        "Ray: a node's raylet ended; Ray's report in logs/ray.log",
        "Ray marked node 10.234.0.3 dead; Ray's report in logs/ray.log",
    ]
    assert ray_worker.print_to_stdstream is original
