"""Workers as Ray actors (docs/architecture.md, "Ray"): real Ray, a local multi-node cluster.

One ``ray.cluster_utils.Cluster`` per module (tests/ray_cluster.py: a head without CPUs, and
1-CPU nodes, all on 127.0.0.1): each test starts with two worker nodes; nodes are removed
(every process of the node killed) and added mid-run.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.nn.functional as F

from fabric_model import FabricModel
from fabric_model.step.plan import Plan

from .helpers import fresh_model_and_optimizer, max_rel_diff, records, reference_train, sample_indices_of_steps
from .ray_cluster import NODE, RAY_ENV, cluster_fixture, require_ray, two_nodes_fixture  # noqa: F401 (fixtures)
from .ray_job import DATA, Pace, ResizeAt, datasets

if importlib.util.find_spec("ray") is None:
    require_ray()  # the module skipped (failed where tox promises every extra); ray itself imported where used

SEED, EPOCHS, BATCH, GLOBAL = 7, 2, 8, 24
PLAN = Plan(len(DATA), BATCH, GLOBAL // BATCH, SEED)


@pytest.fixture(scope="module")
def undisturbed():
    model, opt = fresh_model_and_optimizer()
    reference_train(model, opt, DATA, seed=SEED, epochs=EPOCHS, batch_size=BATCH, micro_batches=GLOBAL // BATCH)
    return copy.deepcopy(model.state_dict())


def train(run_dir, engines, worker_logger=None, driver_logger=None):
    model, opt = fresh_model_and_optimizer()
    fm = FabricModel(model, datasets, F.cross_entropy, opt, worker_logger=worker_logger, driver_logger=driver_logger)
    result = fm.train(EPOCHS, BATCH, engines, effective_batch_size=GLOBAL, seed=SEED, run_dir=run_dir, cluster="ray")
    return model, result


def check_exactly_once(run_dir) -> list[dict]:
    train_records = records(run_dir, "train")
    assert len(train_records) == EPOCHS * PLAN.steps_per_epoch
    used = sample_indices_of_steps(PLAN, train_records)
    for epoch in range(EPOCHS):
        assert sorted(used[epoch]) == list(range(len(DATA)))
    return train_records


def our_processes() -> list[str]:
    """Worker processes and worker actors under this process (the cluster's nodes are its children)."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if "fabric_model worker" in cmd or cmd.startswith("ray::WorkerHost"):
            found.append(f"pid {proc.pid}: {cmd[:80]}")
    return found


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_a_ray_job_trains_to_the_reference_weights(two_nodes, undisturbed, run_dir, tmp_path):
    model, result = train(run_dir, 2, worker_logger=Pace(str(tmp_path)))

    assert max_rel_diff(model.state_dict(), undisturbed) <= 1e-5
    assert len(result.replica_digests) == 2 and len(set(result.replica_digests.values())) == 1
    assert {r["workers"] for r in check_exactly_once(run_dir)} == {2}
    (generation,) = records(run_dir, "generation")
    assert generation["hosts"] == ["127.0.0.1", "127.0.0.1"]  # the actors' node IPs
    # The workers imported this test's own module from the folder Ray carried to them.
    imported = [p.read_text() for p in tmp_path.glob("module-*")]
    assert len(imported) == 2
    assert all(Path(f).name == "ray_job.py" and Path(__file__).parent not in Path(f).parents for f in imported)
    # The start-up line says what was asked of Ray, not local processes on this host.
    log = (run_dir / "logs" / "driver.log").read_text()
    assert f"asking Ray for 2 workers of 1 CPU each: 2 epochs of {PLAN.steps_per_epoch} steps" in log
    assert "on cpu" not in log
    # Their output reached the run directory through the actors.
    for worker in (0, 1):
        assert "[worker]" in (run_dir / "logs" / f"worker-{worker}.log").read_text()
    assert not our_processes()


@pytest.mark.timeout(150)
def worker_log_files() -> set[Path]:
    """The actors' copies of their workers' output that have a name (none should)."""
    return set(Path(tempfile.gettempdir()).glob("fabric-model-worker-*.log"))


@pytest.mark.processes
def test_a_lost_node_leaves_and_a_new_node_joins(two_nodes, undisturbed, run_dir, tmp_path):
    cluster = two_nodes
    logs_before = worker_log_files()
    doomed = sorted(cluster.worker_nodes, key=lambda n: n.unique_id)[0]

    def replace_node():
        cluster.remove_node(doomed, allow_graceful=False)  # the node and everything on it, at once
        cluster.add_node(**NODE)

    resize = ResizeAt(3, replace_node, str(tmp_path))
    worker = Pace(str(tmp_path), pace_while=2, pace_from=3, hold_at=1)
    model, result = train(run_dir, 2, worker_logger=worker, driver_logger=resize)
    resize.join()

    assert max_rel_diff(model.state_dict(), undisturbed) <= 1e-5
    train_records = check_exactly_once(run_dir)  # the driver checked it too (ExactlyOnceError)
    counts = [g["workers"] for g in records(run_dir, "generation")]
    assert counts[0] == 2 and 1 in counts and counts[-1] == 2
    assert counts.index(1) < len(counts) - 1
    assert {r["workers"] for r in train_records} == {1, 2}
    assert len(set(result.replica_digests.values())) == 1
    assert not our_processes()
    assert worker_log_files() <= logs_before  # the lost node's actor had no close(): nothing left behind


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_a_pending_actor_is_placed_when_a_node_joins(two_nodes, undisturbed, run_dir, tmp_path):
    cluster = two_nodes
    added: list[float] = []

    def add_node():
        added.append(time.time())
        cluster.add_node(**NODE)

    resize = ResizeAt(1, add_node, str(tmp_path))
    model, result = train(run_dir, 3, worker_logger=Pace(str(tmp_path), hold_at=2), driver_logger=resize)
    resize.join()

    generations = records(run_dir, "generation")
    # The third actor had no room: the job started without waiting for it...
    assert generations[0]["workers"] == 2 and generations[0]["time"] < added[0]
    # ...and it joined once a node with room came.
    assert generations[-1]["workers"] == 3 and generations[-1]["reason"].endswith("joins")
    assert max_rel_diff(model.state_dict(), undisturbed) <= 1e-5
    check_exactly_once(run_dir)
    assert len(result.replica_digests) == 3
    assert not our_processes()


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_a_parametrized_model_reaches_the_actors_and_trains_bitwise_as_locally(two_nodes, tmp_path):
    """weight_norm, spectral_norm, orthogonal and a LoRA delta (frameworks/torch/shipping.py) on Ray actors."""
    from .models.test_shipping import Parametrized, final_state
    from .models.test_shipping import train as train_shipped

    local = train_shipped(Parametrized, 1, tmp_path / "local", deterministic=True)
    on_ray = train_shipped(Parametrized, 2, tmp_path / "ray", deterministic=True, cluster="ray")
    assert all(torch.equal(a, b) for a, b in zip(final_state(*local), final_state(*on_ray), strict=True))
    assert not our_processes()


@pytest.mark.processes
def test_bad_cluster_values_fail_in_the_caller(monkeypatch, run_dir):
    model, opt = fresh_model_and_optimizer()
    fm = FabricModel(model, datasets, F.cross_entropy, opt)
    with pytest.raises(ValueError, match=r"`cluster`.*'local', 'ray'.*cluster='k8s'"):
        fm.train(1, BATCH, cluster="k8s", run_dir=run_dir)
    monkeypatch.setenv("FABRIC_MODEL_CLUSTER", "slurm")
    with pytest.raises(ValueError, match=r"FABRIC_MODEL_CLUSTER.*'slurm'"):
        fm.train(1, BATCH, run_dir=run_dir)
    monkeypatch.setenv("FABRIC_MODEL_CLUSTER", "ray")
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(ImportError, match=r"pip install fabric-model\[ray\]"):
        fm.train(1, BATCH, run_dir=run_dir)
    monkeypatch.setenv("FABRIC_MODEL_RAY_ACTOR_OPTIONS", "[1]")
    from fabric_model.launchers.ray_cluster import RayCluster

    with pytest.raises(ValueError, match="FABRIC_MODEL_RAY_ACTOR_OPTIONS"):
        RayCluster()
    assert not run_dir.exists()


def test_the_uploaded_folder_is_the_scripts_never_a_command_folder(monkeypatch, tmp_path):
    """Run through an installed command (``pytest``, ``fabric-model run``), ``__main__`` lives
    in the environment's bin/: uploading that would carry the environment's binaries instead
    of the user's code (a CI run under tox did exactly that). The current directory is used."""
    import sysconfig
    import types

    from fabric_model.launchers.ray_cluster import script_folder

    main = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.chdir(tmp_path)
    main.__file__ = str(Path(sysconfig.get_paths()["scripts"]) / "pytest")
    assert script_folder() == tmp_path.resolve()
    script = tmp_path / "project" / "train.py"
    script.parent.mkdir()
    main.__file__ = str(script)
    assert script_folder() == script.parent.resolve()


def test_the_start_up_line_names_what_each_actor_asks_of_ray():
    from fabric_model.launchers.ray_cluster import RayCluster

    cluster = object.__new__(RayCluster)  # its options only: no connection
    for options, said in [
        ({"num_cpus": 1}, "1 CPU"),
        ({"num_gpus": 1, "num_cpus": 8, "resources": {"a100": 1}}, "1 GPU, 8 CPUs, 1 a100"),
        ({"num_gpus": 0.5}, "0.5 GPUs"),
    ]:
        cluster.actor_options = options
        assert cluster.actor_shape == said


def test_rays_note_on_its_default_excludes_stays_off_the_console():
    """Ray warns when the uploaded folder holds ``__pycache__`` (any script's folder does); our
    excludes leave it out anyway, so the note is dropped and Ray's other warnings pass."""
    import logging

    from fabric_model.launchers.ray_cluster import quiet_default_excludes

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("ray._private.runtime_env.working_dir", logging.WARNING, "f", 1, msg, ("x",), None)

    note = "Directory %r is now ignored by default when packaging the working directory. To disable this behavior"
    assert not quiet_default_excludes(record(note))
    assert quiet_default_excludes(record("File %r is very large"))


@pytest.mark.processes
def test_import_and_local_runs_never_import_ray():
    code = (
        "import sys, fabric_model, fabric_model.launchers.cluster as c; assert c.check_cluster(None) == 'local';"
        "from fabric_model.launchers import local; import fabric_model.driver.driver;"
        "print(json.dumps('ray' in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", "import json;" + code], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(out.stdout) is False


SCRIPT = """
import json, sys, time
import psutil, ray, torch
import torch.nn.functional as F
from fabric_model import FabricModel
from mydata import datasets  # beside this script: the workers import it too

model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
result = FabricModel(model, datasets, F.cross_entropy, opt).train(1, 8, 1, seed=0, run_dir=sys.argv[1])
deadline = time.monotonic() + 15
while psutil.Process().children(recursive=True) and time.monotonic() < deadline:
    time.sleep(0.1)
left = [" ".join(c.cmdline()[:2]) for c in psutil.Process().children(recursive=True)]
print(json.dumps({"initialized": ray.is_initialized(), "left": left, "epochs": len(result.history)}))
"""

MODULE = """
import torch

def datasets():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    return [(x[i], int(x[i].sum() > 0)) for i in range(32)], None
"""


@pytest.mark.processes
@pytest.mark.timeout(150)
def test_a_script_starts_its_own_ray_and_stops_it_and_its_modules_reach_the_workers(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text(SCRIPT)
    (project / "mydata.py").write_text(MODULE)
    env = {**os.environ, **RAY_ENV, "FABRIC_MODEL_CLUSTER": "ray", "RAY_ADDRESS": "local"}  # a new local Ray
    out = subprocess.run(
        [sys.executable, str(project / "train.py"), str(tmp_path / "run")],
        cwd=tmp_path,  # not the script's folder: the workers get that one from the runtime_env
        env=env,
        capture_output=True,
        text=True,
        timeout=140,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report == {"initialized": False, "left": [], "epochs": 1}  # the Ray it started is gone
    assert "[worker]" in (tmp_path / "run" / "logs" / "worker-0.log").read_text()


@pytest.mark.processes
@pytest.mark.timeout(150)
def test_a_drained_node_s_worker_leaves_after_its_step(two_nodes, undisturbed, run_dir, tmp_path, monkeypatch):
    """Ray draining a node (``ray drain-node``, as its autoscaler does before taking a node back)
    is a preemption notice: the worker there leaves after its step, and the other goes on with
    nothing redone (docs/architecture.md, "Preemption")."""
    cluster = two_nodes
    monkeypatch.setenv("EDT_REPLACE_WORKERS", "0")  # the drained node takes no new actor anyway
    drained = sorted(cluster.worker_nodes, key=lambda n: n.unique_id)[0]
    accepted: list[bool] = []

    def drain():
        # What `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION` and Ray's autoscaler send the GCS.
        from ray._raylet import GcsClient
        from ray.core.generated import autoscaler_pb2

        reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
        deadline_ms = int(time.time() * 1000) + 60_000
        client = GcsClient(address=cluster.address)
        accepted.append(client.drain_node(drained.node_id, reason, "test", deadline_ms)[0])

    resize = ResizeAt(3, drain, str(tmp_path))
    try:
        # Slow steps (0.3 s): the driver reads Ray's draining nodes once a second.
        model, result = train(run_dir, 2, worker_logger=Pace(str(tmp_path), every=0.3), driver_logger=resize)
        resize.join()
    finally:
        cluster.remove_node(drained)  # a drained node takes no actor: the next test gets a fresh one
        cluster.add_node(**NODE)

    assert accepted == [True]
    assert max_rel_diff(model.state_dict(), undisturbed) <= 1e-5
    train_records = check_exactly_once(run_dir)
    steps = [(r["epoch"], r["step"]) for r in train_records]
    assert len(steps) == len(set(steps))  # nothing redone
    generations = records(run_dir, "generation")
    assert [g["workers"] for g in generations] == [2, 1]
    assert generations[1]["reason"].endswith("leaves (SIGTERM)") and generations[1].get("rolled_back_from") is None
    assert not our_processes()
