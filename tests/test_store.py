"""The driver's rendezvous store (docs/architecture.md, "Processes"): served over the
authenticated control plane on its one port, to the current generation's members only.

Real gloo groups of real processes form over it; a worker outside the generation, or one
asking for an older generation's keys, gets nothing and holds up no one; a torch TCPStore
client without the secret reads and writes nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from fabric_model.transport import control
from fabric_model.transport import protocol as p
from fabric_model.transport.store.client import RemoteStore
from fabric_model.transport.store.server import StoreService
from fabric_model.transport.store.wire import Op, encode

SECRET = b"k" * 32


@pytest.fixture
def store():
    service = StoreService()
    server = control.ControlServer(SECRET, allocate_id=lambda: 900, store=service)
    clients: list[RemoteStore] = []

    def client(worker_id: int, timeout: float = 5.0) -> RemoteStore:
        clients.append(RemoteStore(server.address, SECRET, worker_id, timedelta(seconds=timeout)))
        return clients[-1]

    yield service, server, client
    for c in clients:
        c.close()
    server.close()


class _Workers:
    """Worker processes (``tests/store_rank.py``), each with one store connection for its life."""

    def __init__(self, address: tuple[str, int], worker_ids: list[int]) -> None:
        env = dict(os.environ, FABRIC_MODEL_SECRET=SECRET.hex(), PYTHONPATH=os.pathsep.join(sys.path))
        command = [sys.executable, "-m", "tests.store_rank", address[0], str(address[1])]
        self.procs = {
            w: subprocess.Popen(
                [*command, str(w)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
            )
            for w in worker_ids
        }

    def run(self, orders: list[tuple[int, int, int, int]]) -> list[dict]:
        """Each ``(worker_id, generation, rank, world_size)`` at once; their results in order."""
        for worker_id, *spec in orders:
            self.procs[worker_id].stdin.write(" ".join(map(str, spec)) + "\n")  # type: ignore[union-attr]
        results = []
        for worker_id, *_ in orders:
            stdout = self.procs[worker_id].stdout
            ready = threading.Thread(target=lambda s=stdout: results.append(json.loads(s.readline())))
            ready.start()
            ready.join(timeout=60)
            assert not ready.is_alive(), f"worker {worker_id} gave no result within 60 s"
        return results

    def close(self) -> None:
        for proc in self.procs.values():
            proc.stdin.close()  # type: ignore[union-attr]
        for proc in self.procs.values():
            try:
                assert proc.wait(timeout=20) == 0
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=10)
                proc.stdout.close()  # type: ignore[union-attr]


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_gloo_groups_form_over_the_store_a_zombie_is_fenced_and_an_aborted_formation_fails_at_once(store):
    service, server, _ = store
    workers = _Workers(server.address, [10, 11, 12])
    try:
        service.admit(0, [10, 11, 12])
        results = workers.run([(10 + r, 0, r, 3) for r in range(3)])
        assert [r.get("sum") for r in results] == [[6.0] * 4] * 3, results
        assert service.keys() and all(k.startswith(b"generation/0/") for k in service.keys())
        # Generation 1 leaves worker 12 out; it claims generation 1's rank 0 and rejoins generation 0.
        service.admit(1, [10, 11])
        assert service.keys() == []  # the old generation's keys are gone
        results = workers.run([(12, 1, 0, 2), (10, 1, 0, 2), (11, 1, 1, 2), (12, 0, 0, 3)])
        zombie_new, member0, member1, zombie_old = results
        assert member0.get("sum") == member1.get("sum") == [3.0] * 4, results
        for zombie in (zombie_new, zombie_old):
            assert "fenced" in zombie.get("error", ""), zombie
            assert zombie["seconds"] < 5.0  # refused at once, not after the 20 s timeout
        assert all(k.startswith(b"generation/1/") for k in service.keys())
        # Generation 2: worker 12 never comes (it died as the group formed). The driver aborts the
        # generation; the two ranks blocked in the group's rendezvous fail at once, not after 20 s.
        service.admit(2, [10, 11, 12])
        aborter = threading.Timer(1.0, service.abort, args=(2,))
        aborter.start()
        results = workers.run([(10, 2, 0, 3), (11, 2, 1, 3)])
        aborter.join()
        for result in results:
            assert "aborted" in result.get("error", ""), results
            assert result["seconds"] < 6.0, results
    finally:
        workers.close()


def test_the_store_operations_behave_as_torch_stores_do(store):
    service, _, client = store
    service.admit(3, [1])
    s = dist.PrefixStore("generation/3/", client(1))
    s.set("a", b"x")
    assert s.get("a") == b"x" and s.check(["a"]) and not s.check(["a", "b"])
    assert s.add("n", 2) == 2 and s.add("n", 3) == 5 and s.get("n") == b"5"
    assert s.compare_set("c", "", "v1") == b"v1" and s.compare_set("c", "no", "v2") == b"v1"
    assert s.compare_set("c", "v1", "v2") == b"v2"
    s.multi_set(["m1", "m2"], [b"1", b"2"])
    assert s.multi_get(["m1", "m2"]) == [b"1", b"2"]
    s.append("m1", b"+")
    assert s.get("m1") == b"1+"
    assert s.num_keys() == 5 and s.delete_key("a") and not s.delete_key("a") and s.num_keys() == 4
    s.wait(["m2"], timedelta(seconds=1))


def test_a_waiting_get_blocks_neither_its_connection_nor_registration_and_honours_its_timeout(store):
    service, server, client = store
    service.admit(0, [1, 2])
    waiting, other = client(1), client(2)
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(waiting.get("generation/0/late")))
    reader.start()
    time.sleep(0.2)
    started = time.monotonic()
    waiting.set("generation/0/other", b"1")  # the same connection, while its get waits
    assert waiting.check(["generation/0/other"])
    channel = control.connect(server.address, SECRET)  # and the control plane still registers
    channel.send(p.Hello(None, os.getpid(), "host"))
    assert server.events.get(timeout=2)[0] == 900
    channel.close()
    assert time.monotonic() - started < 1.0
    other.set("generation/0/late", b"v")  # another member sets the key: the get returns
    reader.join(timeout=5)
    assert got == [b"v"]
    short = client(2, timeout=0.5)
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="timed out"):
        short.get("generation/0/never")
    assert 0.4 < time.monotonic() - started < 3.0


def test_outsiders_and_stale_keys_are_refused_at_once_and_waiters_are_fenced_on_a_new_generation(store):
    service, _, client = store
    service.admit(5, [1, 2])
    member, outsider = client(1, timeout=10), client(7, timeout=10)
    for call in (
        lambda: outsider.set("generation/5//0/0", b"evil"),
        lambda: outsider.get("generation/5//0/0"),
        lambda: outsider.wait(["generation/5//0/0"]),
        lambda: outsider.num_keys(),
        lambda: member.set("generation/4//0/0", b"stale"),
        lambda: member.get("generation/4//0/0"),
        lambda: member.set("elsewhere", b"x"),
    ):
        started = time.monotonic()
        with pytest.raises(dist.DistStoreError, match="fenced"):
            call()
        assert time.monotonic() - started < 1.0  # refused, not left waiting for the 10 s timeout
    assert service.keys() == []
    errors: list[BaseException] = []

    def wait_for_a_key() -> None:
        try:
            member.get("generation/5//never")
        except dist.DistStoreError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait_for_a_key)
    waiter.start()
    time.sleep(0.2)
    started = time.monotonic()
    service.admit(6, [2])  # generation 5 ended: its waiter is woken with a refusal
    waiter.join(timeout=5)
    assert errors and "fenced" in str(errors[0]) and time.monotonic() - started < 1.0


def test_a_tcpstore_client_and_a_malformed_frame_read_and_write_nothing(store):
    service, server, client = store
    service.admit(0, [1])
    member = client(1)
    member.set("generation/0/k", b"v")
    host, port = server.address
    started = time.monotonic()
    with pytest.raises(RuntimeError):  # torch's DistNetworkError: its ping gets the HMAC challenge
        tcp = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=0.3), wait_for_workers=False)
        tcp.set("generation/0/k", b"evil")
        tcp.get("generation/0/k")
    assert time.monotonic() - started < 10.0
    # An authenticated peer that sends a malformed frame loses its connection, and only that.
    channel = control.connect(server.address, SECRET)
    channel.send(p.StoreOpen(1))
    channel.send_bytes(encode(Op.SET, 1, [b"generation/0/k"])[:-3])
    with pytest.raises(EOFError):
        channel.recv_bytes()
    channel.close()
    assert service.keys() == [b"generation/0/k"] and member.get("generation/0/k") == b"v"
