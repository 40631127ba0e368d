"""A real training job under a hostile network (docs/architecture.md, "Processes"), and the
control plane's connections under a man in the middle (docs/clusters.md, "Security").

While a job trains (and a worker is killed, so a new generation forms over the store), or a
``cluster="ray"`` job trains on a local Ray cluster, a driver logger aims at the job's one
listening port: an idle socket held open, raw garbage,
an HTTP request, a pickle that would run code, and a torch ``TCPStore`` client without the
secret. The job finishes with the undisturbed result, nothing is unpickled, the TCPStore
client reads and writes nothing, and an honest worker registers within a second of the idle
socket opening.

On the path between an honest worker and the driver (a relay on loopback, in this process), a
frame altered, injected or replayed after the handshake ends the connection unread, either way
and on the store's connections as on the control plane's. And ``join.json`` gets the secret
through a file of its own, whatever was planted in the run directory.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import queue
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

from fabric_model.run.rundir import RunDirectory
from fabric_model.testing import Kill
from fabric_model.transport import control
from fabric_model.transport import protocol as p
from fabric_model.transport.reader import Frames
from fabric_model.transport.sealed import TAG, TamperedFrame
from fabric_model.transport.store.client import RemoteStore
from fabric_model.transport.store.server import StoreService
from fabric_model.transport.store.wire import Op, decode, encode

from . import ray_job
from .helpers import fresh_model_and_optimizer, max_rel_diff, reference_train
from .ray_cluster import cluster_fixture, two_nodes_fixture  # noqa: F401 (fixtures)
from .test_elastic import assert_invariants, generations, train, undisturbed  # noqa: F401 (a fixture)

SECRET = b"m" * 32


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


@pytest.mark.processes
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


@pytest.mark.processes
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


# -- a man in the middle --------------------------------------------------------------------------

#: Frames of the handshake each way (multiprocessing's challenge both ways, then the nonce): the
#: frames after them are sealed. Upstream (worker to driver): its digest, its challenge, WELCOME,
#: its nonce; downstream: the challenge, WELCOME, the digest, the nonce.
HANDSHAKE_FRAMES = 4
UP_HANDSHAKE = DOWN_HANDSHAKE = HANDSHAKE_FRAMES

#: What the relay does with a frame: (direction "up" or "down", its index that way, its body) ->
#: the bodies to pass on instead.
Edit = Callable[[str, int, bytes], list[bytes]]


class Relay:
    """A man in the middle on loopback: relays every frame between one client and ``target``,
    as ``edit`` says (each way on a thread; every read bounded)."""

    def __init__(self, target: tuple[str, int], edit: Edit) -> None:
        self.target, self.edit = target, edit
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(10)
        self.address = self._listener.getsockname()[:2]
        self._sockets: list[socket.socket] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            client, _ = self._listener.accept()
            server = socket.create_connection(self.target, timeout=10)
        except OSError:
            return
        self._sockets += [client, server]
        for source, sink, way in ((client, server, "up"), (server, client, "down")):
            source.settimeout(10)
            threading.Thread(target=self._relay, args=(source, sink, way), daemon=True).start()

    def _relay(self, source: socket.socket, sink: socket.socket, way: str) -> None:
        frames, index = Frames(), 0
        try:
            while data := source.recv(1 << 16):
                for frame in frames.feed(data):
                    for body in self.edit(way, index, frame):
                        sink.sendall(struct.pack("!i", len(body)) + body)
                    index += 1
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        for sock in (self._listener, *self._sockets):
            sock.close()


def _evil(proof: Path) -> bytes:
    return pickle.dumps(_RunsCode(str(proof)))


def _refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "integrity check" in r.getMessage()]


@pytest.fixture
def server():
    srv = control.ControlServer(SECRET, allocate_id=lambda: 100)
    yield srv
    srv.close()


@pytest.fixture
def relay():
    relays: list[Relay] = []

    def make(target: tuple[str, int], edit: Edit) -> Relay:
        relays.append(Relay(target, edit))
        return relays[-1]

    yield make
    for r in relays:
        r.close()


def _step(step: int) -> p.StepDone:
    return p.StepDone(0, 0, step, 0, 1, (0,), (1.0, 8.0), 1)


def _ends_after(server: control.ControlServer, worker_id: int, steps: list[int]) -> None:
    """``worker_id``'s events: its Hello, the StepDone of ``steps``, then its connection's end; no more."""
    events = []
    while not events or not isinstance(events[-1], p.ConnectionLost):
        got_id, message = server.events.get(timeout=5)
        assert got_id == worker_id
        events.append(message)
    assert isinstance(events[0], p.Hello)
    assert [m.step for m in events[1:-1]] == steps, events
    with pytest.raises(queue.Empty):
        server.events.get(timeout=0.2)


@pytest.mark.parametrize("attack", ["inject", "alter"])
def test_a_frame_injected_or_altered_on_the_way_to_the_driver_ends_the_connection_unpickled(
    server, relay, tmp_path, caplog, attack
):
    """After the worker's Hello, the relay puts a code-running pickle before its next frame: as a
    frame of its own (with a made-up tag) or as the payload of the honest frame (with its tag).
    The driver unpickles neither, says so once, and ends the connection: the worker sees it end."""
    proof = tmp_path / "unpickled"

    def edit(way: str, index: int, frame: bytes) -> list[bytes]:
        if way == "up" and index == UP_HANDSHAKE + 1:  # the frame after Hello
            forged = bytes(TAG) + _evil(proof) if attack == "inject" else frame[:TAG] + _evil(proof)
            return [forged, forged, frame]
        return [frame]

    channel = control.connect(relay(server.address, edit).address, SECRET, timeout=5)
    caplog.set_level(logging.WARNING, logger="fabric_model.transport.sealed")
    channel.send(p.Hello(7, os.getpid(), "host"))
    channel.send(_step(0))
    _ends_after(server, 7, [])
    assert not proof.exists(), "a frame injected after the handshake was unpickled"
    assert len(_refusals(caplog)) == 1, caplog.text
    with pytest.raises((EOFError, OSError)):
        channel.recv(timeout=5)  # the driver closed it
    channel.close()


@pytest.mark.parametrize("source", ["this connection", "another connection"])
def test_a_replayed_frame_is_refused(server, relay, source):
    """A frame sent again (a step report counted twice), or a frame of another connection put in
    this one's place (its Hello, with its valid tag), ends the connection: the sequence number and
    the connection's own key are in every tag."""
    recorded: list[bytes] = []

    def record(way: str, index: int, frame: bytes) -> list[bytes]:
        if way == "up" and index == UP_HANDSHAKE:
            recorded.append(frame)
        return [frame]

    first = control.connect(relay(server.address, record).address, SECRET, timeout=5)
    first.send(p.Hello(7, os.getpid(), "host"))
    assert isinstance(server.events.get(timeout=5)[1], p.Hello)
    if source == "another connection":

        def replay(way: str, index: int, frame: bytes) -> list[bytes]:
            return recorded if way == "up" and index == UP_HANDSHAKE else [frame]

        second = control.connect(relay(server.address, replay).address, SECRET, timeout=5)
        second.send(p.Hello(8, os.getpid(), "host"))  # replaced by the first connection's Hello
        with pytest.raises((EOFError, OSError)):
            second.recv(timeout=5)  # closed before it said anything
        second.close()
        with pytest.raises(queue.Empty):
            server.events.get(timeout=0.2)
        assert server.connection(8) == "none"
        first.close()
        assert server.events.get(timeout=5) == (7, p.ConnectionLost("EOFError()"))  # nothing before it
        return

    first.close()
    server.events.get(timeout=5)  # its ConnectionLost

    def twice(way: str, index: int, frame: bytes) -> list[bytes]:
        return [frame, frame] if way == "up" and index == UP_HANDSHAKE + 1 else [frame]

    channel = control.connect(relay(server.address, twice).address, SECRET, timeout=5)
    channel.send(p.Hello(9, os.getpid(), "host"))
    channel.send(_step(0))  # arrives twice: the second is refused
    channel.send(_step(1))
    _ends_after(server, 9, [0])
    channel.close()


def test_a_frame_injected_on_the_way_to_a_worker_is_never_unpickled(server, relay, tmp_path, caplog):
    """The driver's answer to a Hello (its id) comes after a forged frame: the worker refuses it
    unread, and its connection ends."""
    proof = tmp_path / "unpickled"

    def edit(way: str, index: int, frame: bytes) -> list[bytes]:
        return [bytes(TAG) + _evil(proof), frame] if way == "down" and index == DOWN_HANDSHAKE else [frame]

    channel = control.connect(relay(server.address, edit).address, SECRET, timeout=5)
    caplog.set_level(logging.WARNING, logger="fabric_model.transport.sealed")
    channel.send(p.Hello(None, os.getpid(), "host"))
    with pytest.raises(TamperedFrame):
        channel.recv(timeout=5)
    with pytest.raises(TamperedFrame):
        channel.recv(timeout=5)  # the honest Assigned behind it is not read either
    assert not proof.exists(), "a frame injected after the handshake was unpickled"
    assert len(_refusals(caplog)) == 1, caplog.text
    channel.close()


@pytest.mark.parametrize("attack", ["alter", "replay"])
def test_a_store_request_altered_or_replayed_on_the_way_is_refused(relay, attack):
    """The store's connections are sealed as the control plane's: a ``set`` whose value the relay
    rewrites (keeping the tag), or an ``add`` it sends twice, is not applied; the connection ends
    and the worker's call fails instead of waiting."""
    service = StoreService()
    server = control.ControlServer(SECRET, store=service)
    service.admit(0, [1])

    def edit(way: str, index: int, frame: bytes) -> list[bytes]:
        if way != "up" or index <= UP_HANDSHAKE:  # the handshake, then StoreOpen
            return [frame]
        code, request, fields = decode(frame[TAG:])
        if attack == "alter" and code == Op.SET and fields[1] == b"honest":
            return [frame[:TAG] + encode(code, request, [fields[0], b"evil"])]
        return [frame, frame] if attack == "replay" and code == Op.ADD else [frame]

    store = RemoteStore(relay(server.address, edit).address, SECRET, 1, timedelta(seconds=5))
    try:
        store.set("generation/0/before", b"kept")
        started = time.monotonic()
        with pytest.raises(dist.DistStoreError):
            if attack == "alter":
                store.set("generation/0/k", b"honest")
            else:
                store.add("generation/0/n", 1)
            store.get("generation/0/before")  # the first call's reply may have come before the end
        assert time.monotonic() - started < 5.0
        assert service.keys() == [b"generation/0/before"] + ([b"generation/0/n"] if attack == "replay" else [])
        assert attack == "alter" or service._data[b"generation/0/n"] == b"1"  # added once, not twice
    finally:
        store.close()
        server.close()


# -- join.json ------------------------------------------------------------------------------------


def test_join_json_gets_the_secret_through_a_file_of_its_own(tmp_path):
    """A file and a symlink planted where ``join.json``'s temporary file was (``.join.json.<pid>.tmp``),
    and a symlink planted as ``join.json`` itself: none receives the secret, the symlinks' targets are
    untouched, and ``join.json`` is a file of mode 0600."""
    run = RunDirectory(tmp_path / "run").create()
    target = tmp_path / "elsewhere"
    target.write_text("untouched")
    planted_file = run.path / f".join.json.{os.getpid()}.tmp"
    planted_file.write_text("planted")
    planted_file.chmod(0o666)
    planted_link = run.path / f".join.json.{os.getpid() + 1}.tmp"
    planted_link.symlink_to(target)
    (run.path / "join.json").symlink_to(target)
    secret = os.urandom(32)
    run.write_join_info(("127.0.0.1", 1234), secret)
    join = run.path / "join.json"
    assert not join.is_symlink() and stat.S_IMODE(join.stat().st_mode) == 0o600
    assert run.read_join_info() == (("127.0.0.1", 1234), secret)
    assert target.read_text() == "untouched"
    assert planted_file.read_text() == "planted" and planted_link.is_symlink()
    leftovers = sorted(p.name for p in run.path.iterdir() if p.name.startswith(".join.json"))
    assert leftovers == sorted([planted_file.name, planted_link.name])  # its own temporary file is gone
