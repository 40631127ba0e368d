"""torchft 0.2.0's fault behaviour on the workload of ``bench_peers.py``'s fault rows (a peer, CPU).

Three replica groups of one process each train the MLP with torchft's ``Manager``, its
``DistributedDataParallel`` and ``OptimizerWrapper`` on gloo, coordinated by a lighthouse on
loopback (torchft's defaults otherwise). Replica ``r`` takes shard ``r`` of each 3x64 global
batch by the step counter torchft keeps, as a DistributedSampler would. Replica 1 SIGKILLs
itself inside step ``kill_step`` (after its forward, before backward's allreduce); the harness
restarts it at once, as a supervisor would, and the newcomer heals from its peers. Steps are
paced (20 ms) as FabricModel's fault rows are.

Each replica writes one JSON line per step: the step, whether it committed, the participants
and the time. From those: kill -> next committed step, kill -> the first committed step with 3
participants, shards lost (committed steps that lacked a shard) and doubled (a shard in two
committed steps), whether every committed step had the full global batch, and the largest
weight difference to an undisturbed run.

    PYTHONPATH=. python benchmarks/torchft_faults.py    # one disturbed and one undisturbed run
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPLICAS, BATCH, PACE = 3, 64, 0.02


def replica(replica_id: int, lighthouse: str, steps: int, kill_step: int, out: str, attempt: int) -> None:
    """One replica group (one process) of torchft's DDP loop."""
    from datetime import timedelta

    import peer_runs as pr
    import torch
    import torch.nn.functional as F
    from torch.distributed import TCPStore
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    model = pr.make_model("mlp")
    inner = pr.make_optimizer(model)

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=2,
        replica_id=f"replica-{replica_id}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        hostname="127.0.0.1",
        timeout=timedelta(seconds=10),
    )
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)
    data = pr.dataset("mlp", steps * BATCH * REPLICAS)
    if attempt == 0:  # the first quorum has all three (torchft would start with the first two ready)
        Path(out, f"ready-{replica_id}").touch()
        while not Path(out, "go").exists():
            time.sleep(0.01)
    with open(os.path.join(out, f"replica-{replica_id}-{attempt}.jsonl"), "a") as log:
        while manager.current_step() < steps:
            optimizer.zero_grad()  # starts the quorum
            step = manager.current_step()
            start = (step * REPLICAS + replica_id) * BATCH
            x, y = data.tensors[0][start : start + BATCH], data.tensors[1][start : start + BATCH]
            loss = F.cross_entropy(ddp(x), y)
            if replica_id == 1 and attempt == 0 and step == kill_step:
                Path(out, "killed").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
            committed = manager.should_commit()
            if committed:
                inner.step()
            record = {"step": step, "committed": committed, "participants": manager.num_participants()}
            log.write(json.dumps({**record, "time": time.time()}) + "\n")
            log.flush()
            time.sleep(PACE)
    torch.save(model.state_dict(), os.path.join(out, f"final-{replica_id}-{attempt}.pt"))
    manager.shutdown(wait=False)


def run(steps: int, kill_step: int | None, out: Path) -> list[int]:
    """The lighthouse here, the replicas as processes; replica 1 restarted once if it dies.
    Returns the replicas that failed (exited non-zero, other than the one SIGKILLed)."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    kill = -1 if kill_step is None else kill_step

    def start(replica_id: int, attempt: int) -> subprocess.Popen:
        args = [sys.executable, __file__, "replica", str(replica_id), lighthouse.address(), str(steps), str(kill)]
        log = open(out / f"replica-{replica_id}-{attempt}.out", "wb")
        return subprocess.Popen([*args, str(out), str(attempt)], env=env, stdout=log, stderr=subprocess.STDOUT)

    procs = {r: start(r, 0) for r in range(REPLICAS)}
    deadline = time.monotonic() + 300
    try:
        restarted = False
        while len(list(out.glob("ready-*"))) < REPLICAS:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs.values()):
                raise RuntimeError(f"torchft replicas did not start (see {out})")
            time.sleep(0.01)
        (out / "go").touch()
        while any(p.poll() is None for p in procs.values()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"torchft run did not finish in 300 s (see {out})")
            if not restarted and procs[1].poll() == -signal.SIGKILL:
                procs[1], restarted = start(1, 1), True
            time.sleep(0.01)
        return [r for r, p in procs.items() if p.returncode != 0]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        lighthouse.shutdown()


def summarize(out: Path, undisturbed: Path, steps: int) -> dict:
    import torch

    records = [json.loads(line) | {"replica": int(f.name.split("-")[1])}
               for f in out.glob("replica-*-*.jsonl") for line in f.read_text().splitlines()]  # fmt: skip
    killed = float((out / "killed").read_text())
    committed = [r for r in records if r["committed"]]
    after = sorted(r["time"] for r in committed if r["time"] > killed)
    full_after = sorted(r["time"] for r in committed if r["time"] > killed and r["participants"] == REPLICAS)
    shards: dict[int, list[int]] = {}
    for r in committed:
        shards.setdefault(r["step"], []).append(r["replica"])
    lost = sum(REPLICAS - len(set(s)) for s in shards.values()) * BATCH
    doubled = sum(len(s) - len(set(s)) for s in shards.values()) * BATCH
    finals = sorted(out.glob("final-*.pt"))  # a survivor's, else the replacement's
    final, reference = torch.load(finals[0]), torch.load(undisturbed / "final-0-0.pt")
    return {
        "kill_to_next": after[0] - killed if after else None,
        "kill_to_replacement": full_after[0] - killed if full_after else None,
        "lost": lost,
        "doubled": doubled,
        "batch_kept": lost == 0 and doubled == 0 and len(shards) == steps,
        "weights_max_diff": max(float((final[k] - reference[k]).abs().max()) for k in reference),
    }


def faults(steps: int = 128, kill_step: int = 20) -> dict:
    """One undisturbed and one disturbed run; the fault row's figures. Survivors that crashed
    (torchft's DDP can fail a survivor when a peer dies inside the allreduce) are counted."""
    with tempfile.TemporaryDirectory() as tmp:
        clean, disturbed = Path(tmp, "clean"), Path(tmp, "disturbed")
        clean.mkdir()
        disturbed.mkdir()
        if run(steps, None, clean):
            raise RuntimeError("the undisturbed torchft run failed")
        crashed = run(steps, kill_step, disturbed)
        if not list(disturbed.glob("final-*.pt")):
            return {"crashed": len(crashed), "finished": False}
        return {**summarize(disturbed, clean, steps), "crashed": len(crashed), "finished": True}


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "replica":
        rid, lighthouse, steps, kill, out, attempt = sys.argv[2:8]
        replica(int(rid), lighthouse, int(steps), int(kill), out, int(attempt))
    else:
        print(json.dumps(faults(), indent=1))
