"""A real training job under a hostile network (docs/architecture.md, "Processes").

While a job trains (and a worker is killed, so a new generation forms over the store), or a
``cluster="ray"`` job trains on a local Ray cluster, a driver logger aims at the job's one
listening port: an idle socket held open, raw garbage,
an HTTP request, a pickle that would run code, and a torch ``TCPStore`` client without the
secret. The job finishes with the undisturbed result, nothing is unpickled, the TCPStore
client reads and writes nothing, and an honest worker registers within a second of the idle
socket opening.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import struct
import threading
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

from fabric_model.testing import Kill
from fabric_model.transport import control
from fabric_model.transport import protocol as p

from . import ray_job
from .helpers import fresh_model_and_optimizer, max_rel_diff, reference_train
from .ray_cluster import cluster_fixture, two_nodes_fixture  # noqa: F401 (fixtures)
from .test_elastic import assert_invariants, generations, train, undisturbed  # noqa: F401 (a fixture)

pytestmark = pytest.mark.processes


class _RunsCode:
    """Unpickling this creates ``path``: the proof that something was unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


class Attacker:
    """A driver logger that attacks the job's port from a thread once ``at_iteration`` is reached."""

    def __init__(self, run_dir: Path, proof: Path, at_iteration: int = 2) -> None:
        self.run_dir, self.proof, self.at_iteration = run_dir, proof, at_iteration
        self.thread: threading.Thread | None = None
        self.idle: socket.socket | None = None
        self.found: dict[str, object] = {}

    def log_train_metrics(self, metrics, iteration, epoch, workers) -> None:
        if self.thread is None and iteration >= self.at_iteration:
            self.thread = threading.Thread(target=self._attack)  # the driver's loop goes on meanwhile
            self.thread.start()

    def on_train_end(self) -> None:
        if self.thread is not None:
            self.thread.join(timeout=30)
        if self.idle is not None:
            self.idle.close()

    def _attack(self) -> None:
        info = json.loads((self.run_dir / "join.json").read_text())
        host, port = info["driver"].rsplit(":", 1)
        address, secret = (host, int(port)), bytes.fromhex(info["secret"])
        self.found["address"] = address
        self.found["listening"] = _listening_ports(psutil.Process())
        self.idle = socket.create_connection(address, timeout=5)  # connects, then says nothing
        started = time.monotonic()
        honest = control.connect(address, secret)
        honest.send(p.Hello(None, os.getpid(), "honest"))
        assert isinstance(honest.recv(timeout=5), p.Assigned)
        self.found["registered_in"] = time.monotonic() - started
        honest.close()
        payload = pickle.dumps(_RunsCode(str(self.proof)))
        for data in (b"\x00\xff" * 64, b"GET / HTTP/1.1\r\n\r\n", struct.pack("!i", len(payload)) + payload):
            with socket.create_connection(address, timeout=5) as sock:
                sock.sendall(data)
                sock.settimeout(3)
                try:
                    while sock.recv(4096):  # the challenge, then the server hangs up
                        pass
                except OSError:
                    pass
        started = time.monotonic()
        try:
            tcp = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=1), wait_for_workers=False)
            tcp.set("generation/0//0/0", b"evil")
            self.found["tcpstore"] = ("answered", tcp.get("generation/0//0/0"))
        except RuntimeError as exc:
            self.found["tcpstore"] = ("refused", type(exc).__name__)
        self.found["tcpstore_seconds"] = time.monotonic() - started


def _listening_ports(process: psutil.Process) -> list[tuple[str, int]]:
    return sorted((c.laddr.ip, c.laddr.port) for c in process.net_connections("tcp") if c.status == psutil.CONN_LISTEN)


@pytest.mark.timeout(180)
def test_a_job_finishes_correctly_under_a_hostile_network(undisturbed, run_dir, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("EDT_REPLACE_WORKERS", "0")
    proof = tmp_path / "unpickled"
    attacker = Attacker(run_dir, proof)
    model, result = train(run_dir, tmp_path, [Kill(1, 8)], step_delay=0.15, driver_logger=attacker)
    assert_invariants(run_dir, result, model, undisturbed)
    found = attacker.found
    assert len(found["listening"]) == 1, f"the driver listens on more than its control port: {found['listening']}"
    assert found["listening"][0][0] == "127.0.0.1"
    assert found["registered_in"] < 1.0, found
    assert not proof.exists(), "something was unpickled from an unauthenticated peer"
    assert found["tcpstore"][0] == "refused" and found["tcpstore_seconds"] < 10.0, found
    sizes = [g["workers"] for g in generations(run_dir)]
    assert sizes == [3, 2], f"no generation formed under attack: {sizes}"


def test_a_ray_job_finishes_correctly_under_a_hostile_network(two_nodes, run_dir, tmp_path):
    """The same attacks on the control port of a ``cluster="ray"`` job (workers as actors)."""
    import torch.nn.functional as F

    from fabric_model import FabricModel

    model, opt = fresh_model_and_optimizer()
    reference_train(model, opt, ray_job.DATA, seed=7, epochs=1, batch_size=8, micro_batches=3)
    undisturbed_state = model.state_dict()
    proof = tmp_path / "unpickled"
    attacker = Attacker(run_dir, proof)
    # The workers pace from step 3 until the attacks are over (ray_job.Pace waits for `resized`).
    attacks = ray_job.ResizeAt(2, attacker._attack, str(tmp_path))
    pace = ray_job.Pace(str(tmp_path), pace_while=2, pace_from=3)
    model, opt = fresh_model_and_optimizer()
    fm = FabricModel(model, ray_job.datasets, F.cross_entropy, opt, worker_logger=pace, driver_logger=attacks)
    try:
        result = fm.train(1, 8, 2, effective_batch_size=24, seed=7, run_dir=run_dir, cluster="ray")
    finally:
        attacks.join()
        if attacker.idle is not None:
            attacker.idle.close()
    found = attacker.found
    assert max_rel_diff(model.state_dict(), undisturbed_state) <= 1e-5
    assert len(result.replica_digests) == 2 and len(set(result.replica_digests.values())) == 1
    host, port = found["address"]
    assert host == "127.0.0.1" and [a for a in found["listening"] if a[1] == port] == [(host, port)], found
    assert found["registered_in"] < 1.0, found
    assert not proof.exists(), "something was unpickled from an unauthenticated peer"
    assert found["tcpstore"][0] == "refused" and found["tcpstore_seconds"] < 10.0, found
    assert [g["workers"] for g in generations(run_dir)] == [2]  # the attacks cost no worker
