"""A small torch job for the multi-host tests, run as a script (the driver) or imported.

``python -m tests.multihost_job RUN_DIR BIND_ADDRESS PACE_FLAG OUT`` trains on up to 3
engines with one local worker (``FABRIC_MODEL_CPU_WORKERS=1`` in its environment); workers
started by hand fill the other slots. Steps are paced while ``PACE_FLAG`` exists, so the
test's faults land mid-run however slow the host is; the final state goes to ``OUT``.

``python -m tests.multihost_job RUN_DIR - PACE_FLAG OUT resume`` is the same job as a Slurm task
runs it (examples/clusters/slurm.sh): ``train(..., resume="auto")``, on the address of
``$FABRIC_MODEL_BIND_ADDRESS``, so a requeued job goes on from its checkpoint.

``MH_HOLD=FILE`` in the driver's environment holds its local worker in its set-up (before it is
ready to train) while ``FILE`` exists: a recipe uses it to have workers started by hand connect
before the first generation forms, so that generation takes them in (``FM_RECIPE_JOIN=first``).

``python -m tests.multihost_job RUN_DIR BIND_ADDRESS PACE_FLAG OUT auto`` is the first form with
``resume="auto"``: run again after its driver was killed, it takes back the workers that wait
for it (examples/clusters/hand_started.sh).

``python -m tests.multihost_job RUN_DIR - PACE_FLAG OUT ray`` trains on 2 engines with
``cluster="ray"`` on the cluster of ``RAY_ADDRESS`` (tests/test_multihost_ray.py): it waits
for two nodes with CPUs first, and the driver listens on the node IP Ray reports.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F

from fabric_model import FabricModel, worker_context
from fabric_model.step.plan import Plan

from .helpers import fresh_model_and_optimizer, make_data
from .load import scaled

SEED, EPOCHS, BATCH, GLOBAL, ENGINES = 7, 8, 8, 24, 3
DATA = make_data(240)  # 10 steps an epoch
PLAN = Plan(len(DATA), BATCH, GLOBAL // BATCH, SEED)


def datasets():
    hold = os.environ.get("MH_HOLD")
    if hold and worker_context() is not None:  # a local worker of a driver told to hold them
        deadline = time.monotonic() + scaled(120.0)
        while os.path.exists(hold) and time.monotonic() < deadline:
            time.sleep(0.05)
    return DATA, DATA[:24]


class Pace:
    """A worker logger that sleeps ``seconds`` after each step while ``flag`` exists (longer on a
    busy machine, where the test's steps between faults take longer: tests/load.py)."""

    def __init__(self, flag: str, seconds: float | None = None) -> None:
        # MH_PACE: the seconds a step sleeps, for a run by hand with more to do between steps.
        seconds = float(os.environ.get("MH_PACE", "0.25")) if seconds is None else seconds
        # Stretched for the load where it sleeps, not fixed here: the same command run again must
        # ship the same job (a restarted driver takes its workers back only then: driver/identity.py).
        self.flag, self.base = flag, seconds

    def on_train_begin(self) -> None:
        pass

    def on_train_end(self) -> None:
        pass

    def log_train_metrics(self, metrics, iteration, epoch, workers) -> None:
        if os.path.exists(self.flag):
            time.sleep(scaled(self.base))

    def log_test_metrics(self, metrics, iteration, epoch) -> None:
        pass


def train(
    run_dir: str,
    bind_address: str | None,
    pace_flag: str,
    driver_logger=None,
    engines: int = ENGINES,
    cluster: str | None = None,
    resume: bool | str = False,
):
    model, opt = fresh_model_and_optimizer()
    result = FabricModel(
        model,
        datasets,
        F.cross_entropy,
        opt,
        worker_logger_callback=Pace(pace_flag),
        driver_logger_callback=driver_logger,
    ).train(
        EPOCHS,
        BATCH,
        engines,
        effective_batch_size=GLOBAL,
        seed=SEED,
        run_dir=run_dir,
        bind_address=bind_address,
        cluster=cluster,
        resume=resume,
    )
    return model, result


def wait_for_ray_nodes(count: int, timeout: float = 90.0) -> None:
    """Connect to ``RAY_ADDRESS`` and wait until ``count`` alive nodes offer CPUs."""
    import ray

    ray.init(logging_level="WARNING", log_to_driver=False)
    timeout = scaled(timeout)
    deadline = time.monotonic() + timeout
    while sum(1 for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {count} Ray nodes with CPUs after {timeout:.0f} s: {ray.nodes()}")
        time.sleep(0.2)


if __name__ == "__main__":
    run_dir, bind, flag, out = sys.argv[1:5]
    if sys.argv[5:] == ["ray"]:
        wait_for_ray_nodes(2)
        try:
            model, result = train(run_dir, None, flag, engines=2, cluster="ray")
        finally:
            import ray

            ray.shutdown()
    elif sys.argv[5:] == ["resume"]:
        model, result = train(run_dir, None, flag, resume="auto")
    elif sys.argv[5:] == ["auto"]:  # on BIND_ADDRESS, as run again after its driver was killed
        model, result = train(run_dir, bind, flag, resume="auto")
    else:
        model, result = train(run_dir, bind, flag)
    torch.save({"state": model.state_dict(), "digests": result.replica_digests}, out)
