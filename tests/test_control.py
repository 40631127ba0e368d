"""The control plane under a hostile peer: garbage, an idle socket, a pickle that would run code.

Registration of honest workers must go on, and nothing is unpickled from a peer that has not
authenticated (docs/architecture.md, "Processes").
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import socket
import struct
import threading
import time

import pytest

from fabric_model.transport import control, sealed
from fabric_model.transport import protocol as p
from fabric_model.transport.sealed import SealedConnection
from fabric_model.worker.inbox import Heartbeat

SECRET = b"s" * 32


class _RunsCode:
    """Unpickling this creates ``path``: the proof that something was unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture
def server():
    ids = iter(range(100, 200))
    srv = control.ControlServer(SECRET, allocate_id=lambda: next(ids))
    yield srv
    srv.close()


def _register(server: control.ControlServer, worker_id: int | None = 7) -> tuple[control.Channel, float]:
    """Connect as an honest worker; returns the channel and the seconds until the driver saw Hello."""
    started = time.monotonic()
    channel = control.connect(server.address, SECRET)
    channel.send(p.Hello(worker_id, os.getpid(), "host"))
    got_id, message = server.events.get(timeout=5)
    assert isinstance(message, p.Hello) and got_id == (worker_id if worker_id is not None else 100)
    return channel, time.monotonic() - started


def test_an_idle_socket_does_not_delay_registration(server):
    idle = socket.create_connection(server.address, timeout=5)  # connects, then says nothing
    try:
        time.sleep(0.1)
        channel, seconds = _register(server)
        assert seconds < 1.0
        assert server.peer(7) == "127.0.0.1" and server.peer(8) is None  # where its connection came from
        channel.close()
    finally:
        idle.close()


def test_garbage_and_a_code_running_pickle_are_refused_and_registration_goes_on(server, tmp_path):
    proof = tmp_path / "unpickled"
    payload = pickle.dumps(_RunsCode(str(proof)))
    for data in (b"\x00\xff" * 64, b"GET / HTTP/1.1\r\n\r\n", struct.pack("!i", len(payload)) + payload):
        with socket.create_connection(server.address, timeout=5) as sock:
            sock.sendall(data)
            sock.settimeout(2)
            try:
                while sock.recv(4096):  # the server sends its challenge, then hangs up
                    pass
            except OSError:
                pass
    channel, seconds = _register(server, worker_id=None)  # the id comes back assigned
    assert seconds < 1.0
    assert not proof.exists(), "something was unpickled from an unauthenticated peer"
    with pytest.raises(queue.Empty):
        server.events.get(timeout=0.2)  # no event from any of the hostile connections
    channel.close()


def test_a_wrong_secret_is_refused(server):
    with pytest.raises(Exception):  # noqa: B017 - AuthenticationError or a closed connection
        control.connect(server.address, b"x" * 32).send(p.Hello(3, os.getpid(), "host"))
    with pytest.raises(queue.Empty):
        server.events.get(timeout=0.3)
    _register(server)[0].close()


def test_a_silent_peer_is_cut_off_after_the_handshake_bound(monkeypatch, tmp_path):
    monkeypatch.setattr(control, "HANDSHAKE_TIMEOUT", 0.3)
    srv = control.ControlServer(SECRET)
    try:
        with socket.create_connection(srv.address, timeout=5) as idle:
            idle.settimeout(3)
            started = time.monotonic()
            received = b""
            while chunk := idle.recv(4096):  # the challenge, then EOF when the server gives up
                received += chunk
            assert time.monotonic() - started < 2.5 and received  # cut off, not left hanging
    finally:
        srv.close()


def _step(step: int) -> p.StepDone:
    return p.StepDone(0, 0, step, 0, 1, (0,), (1.0, 8.0), 1)


def test_held_step_reports_arrive_in_order_before_the_next_message_and_the_end(server):
    """A lone worker's reports share frames (``send_soon``); the driver still gets every one, in
    order, before anything sent after them, and a connection's end follows all it sent."""
    channel, _ = _register(server)
    assert server.connection(7) == "open"
    channel.send_soon(_step(0), within=60.0)  # Hello went out just now: held
    channel.send_soon(_step(1), within=60.0)
    assert channel.holding.is_set()
    with pytest.raises(queue.Empty):
        server.events.get(timeout=0.3)  # both held
    channel.send(p.EvalDone(0, (1.0, 8.0)))  # one frame with the two, then this one
    assert not channel.holding.is_set()
    channel.send_soon(_step(2), within=60.0)
    channel.flush()  # what the heartbeat thread does
    channel.send_soon(_step(3), within=60.0)  # held, then lost with the process
    channel.close()
    got = [server.events.get(timeout=5) for _ in range(5)]
    assert [type(m).__name__ for _, m in got] == ["StepDone", "StepDone", "EvalDone", "StepDone", "ConnectionLost"]
    assert [m.step for _, m in got if isinstance(m, p.StepDone)] == [0, 1, 2]
    assert {w for w, _ in got} == {7}
    deadline = time.monotonic() + 5
    while server.connection(7) != "ended" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.connection(7) == "ended" and server.connection(8) == "none"


def test_a_report_goes_out_at_once_after_a_quiet_spell(server):
    channel, _ = _register(server)
    time.sleep(0.05)
    channel.send_soon(_step(0), within=0.02)  # nothing went out for 50 ms: sent now
    _, message = server.events.get(timeout=5)
    assert isinstance(message, p.StepDone) and message.step == 0
    channel.close()


def test_the_heartbeat_thread_sends_held_reports_long_before_its_next_beat(server):
    """A lone worker whose fast steps stop (a long validation, the end of its work) still gets
    its last reports to the driver within ~REPORT_WITHIN, not at the next heartbeat."""
    channel, _ = _register(server)
    Heartbeat(channel, interval=30.0)  # its first beat is 30 s away
    channel.send_soon(_step(0), within=60.0)  # Hello went out just now: held
    _, message = server.events.get(timeout=5)  # well before the beat
    assert isinstance(message, p.StepDone)
    channel.close()


def test_heartbeats_end_at_the_server_which_notes_when_it_heard_each_worker(server):
    """A heartbeat is most of what thousands of workers send: the reader thread notes the time and
    queues nothing for it, alone or in a batch; every other message still arrives, in order."""
    channel, _ = _register(server)
    before = time.monotonic()
    channel.send(p.Heartbeat())
    channel.send(p.Batch((_step(0), p.Heartbeat(), _step(1))))
    channel.send(p.Heartbeat())
    channel.send(_step(2))
    got = [server.events.get(timeout=5)[1] for _ in range(3)]
    assert [m.step for m in got if isinstance(m, p.StepDone)] == [0, 1, 2]
    assert server.heard[7] >= before
    channel.close()
    assert isinstance(server.events.get(timeout=5)[1], p.ConnectionLost)  # nothing else came before it


def test_the_reader_cuts_bytes_into_frames_however_they_arrive():
    """The driver's one reader thread (transport/reader.py) reads whatever a connection has ready:
    frames split anywhere, several in one read, and the 8-byte length of a frame over 2 GiB's
    header form, come out whole and in order, as ``Connection.recv_bytes`` would return them."""
    from fabric_model.transport.reader import Frames

    payloads = [b"", b"a", b"hello" * 1000, bytes(range(256)) * 70]
    wire = b"".join(struct.pack("!i", len(x)) + x for x in payloads[:3])
    wire += struct.pack("!i", -1) + struct.pack("!Q", len(payloads[3])) + payloads[3]  # the long form
    for cut in (1, 3, 7, 4096, len(wire)):
        frames, out = Frames(), []
        for i in range(0, len(wire), cut):
            out += frames.feed(wire[i : i + cut])
        assert out == payloads


def test_a_peer_frozen_mid_frame_holds_up_no_other_connection(tmp_path):
    """A worker that stopped halfway through a frame: the others' messages still arrive at once."""
    from fabric_model.transport.reader import ConnectionReader

    reader = ConnectionReader()
    got: list[tuple[str, bytes]] = []
    ends: list[str] = []
    pairs = {name: socket.socketpair() for name in ("frozen", "live")}
    try:
        for name, (ours, _) in pairs.items():
            reader.add(ours.fileno(), lambda f, n=name: got.append((n, f)), lambda e, n=name: ends.append(n))
        pairs["frozen"][1].sendall(struct.pack("!i", 100) + b"only part")
        pairs["live"][1].sendall(struct.pack("!i", 3) + b"abc")
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got == [("live", b"abc")]
        pairs["live"][1].close()
        while not ends and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ends == ["live"]
    finally:
        reader.close()
        for ours, theirs in pairs.values():
            ours.close()
            theirs.close()
    assert sorted(ends) == ["frozen", "live"]  # closing the reader ends the rest


def _sealed_pair() -> tuple[SealedConnection, SealedConnection]:
    """Two ends of a socket pair, the handshake done (the accepting end's on a thread)."""
    a, b = socket.socketpair()
    accepting, connecting = SealedConnection(a.detach(), accepting=True), SealedConnection(b.detach(), accepting=False)
    thread = threading.Thread(target=accepting.handshake, args=(SECRET,))
    thread.start()
    connecting.handshake(SECRET)
    thread.join(timeout=5)
    return accepting, connecting


def test_sealed_frames_of_every_size_arrive_whole_and_a_reflected_one_is_refused_once(monkeypatch, caplog):
    """Payloads small (sent in one buffer), large (gathered from the caller's buffer) and longer
    than a read buffer grows at once (memory follows the bytes that arrive) come out as sent; a
    frame sent back to its sender (the same key, the other direction) is refused, logged once,
    and the connection is over for both ends."""
    monkeypatch.setattr(sealed, "PREALLOCATE", 1 << 16)
    driver, worker = _sealed_pair()
    payloads = [b"", b"x" * 100, os.urandom(sealed.SMALL + 1), os.urandom(300_000)]
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.extend(driver.recv_bytes() for _ in payloads))
    reader.start()
    for payload in payloads:
        worker.send_bytes(bytearray(payload) if len(payload) > sealed.SMALL else payload)
    worker.send_bytes(memoryview(b"..offset.."), 2, 6)
    reader.join(timeout=10)
    assert got == payloads and driver.recv_bytes() == b"offset"
    # What the driver sends next, as the wire carries it, sent back to it by a peer on the path.
    driver.send_bytes(b"to the worker")
    echo = socket.socket(fileno=os.dup(worker.fileno()))
    try:
        echo.sendall(echo.recv(1 << 16))
    finally:
        echo.close()
    caplog.set_level(logging.WARNING, logger="fabric_model.transport.sealed")
    for _ in range(2):
        with pytest.raises(sealed.TamperedFrame):
            driver.recv_bytes()
    assert len([r for r in caplog.records if "integrity check" in r.getMessage()]) == 1
    with pytest.raises(EOFError):
        worker.recv_bytes()  # the driver shut the connection down
    driver.close()
    worker.close()
