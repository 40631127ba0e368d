"""Workers on other hosts (docs/architecture.md, "Processes"): the bind address, the hand-started
worker's command line, and a job across hosts made of network namespaces (tests/netns.py)."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from fabric_model.settings.registry import SECRET
from fabric_model.transport import control
from fabric_model.transport.network import (
    advertised_address,
    interface_addresses,
    resolve_bind_address,
    select_interfaces,
)

from . import multihost_job as job
from . import netns
from .helpers import (
    final_train_records,
    fresh_model_and_optimizer,
    max_rel_diff,
    records,
    reference_train,
    sample_indices_of_steps,
)
from .load import scaled

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


@pytest.fixture(scope="module")
def undisturbed():
    model, opt = fresh_model_and_optimizer()
    reference_train(model, opt, job.DATA, seed=job.SEED, epochs=job.EPOCHS, batch_size=job.BATCH, micro_batches=3)
    return model.state_dict()


def worker_command(*options: str) -> list[str]:
    return [PY, "-m", "fabric_model", "worker", *options]


def worker_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *sys.path]), PYTHONUNBUFFERED="1")
    env.pop(SECRET.name, None)
    return env


def assert_exactly_once(run_dir: Path) -> None:
    # The committed record of each step: when a fault left no holder of the state (possible
    # on a loaded host), the run rolled back and the replayed steps' records supersede.
    train = final_train_records(run_dir)
    assert [(r["epoch"], r["step"]) for r in train] == [
        (e, s) for e in range(job.EPOCHS) for s in range(job.PLAN.steps_per_epoch)
    ]
    for epoch, used in sample_indices_of_steps(job.PLAN, train).items():
        assert sorted(used) == list(range(len(job.DATA))), f"epoch {epoch}: not every sample exactly once"


# -- on loopback ---------------------------------------------------------------------------------
@pytest.mark.processes
def test_a_bad_bind_address_fails_in_the_caller(run_dir, tmp_path):
    with pytest.raises(ValueError, match=r"`bind_address`.*cannot listen on 192\.0\.2\.254.*Received: bind_address="):
        job.train(str(run_dir), "192.0.2.254", str(tmp_path / "flag"))
    with pytest.raises(ValueError, match=r"IPv6 is not supported yet. Received: bind_address='::'"):
        resolve_bind_address("::")
    assert not run_dir.exists()  # nothing started


def test_interfaces_follow_the_route_to_the_driver_unless_the_user_chose(caplog):
    env: dict[str, str] = {}
    assert select_interfaces("127.0.0.1", env) == "lo" and env == {"GLOO_SOCKET_IFNAME": "lo"}  # NCCL keeps its own
    env = {"GLOO_SOCKET_IFNAME": "mine"}
    select_interfaces("localhost", env)
    assert env == {"GLOO_SOCKET_IFNAME": "mine"}
    with caplog.at_level("WARNING"):
        assert resolve_bind_address("0.0.0.0") == "0.0.0.0"
    assert "every interface" in caplog.text  # a wildcard only when named, with a warning
    routable = [a for a in interface_addresses().values() if not a.startswith("127.")]
    assert advertised_address("0.0.0.0") in (routable or ["127.0.0.1"])  # workers are told a real address
    assert advertised_address("127.0.0.1") == "127.0.0.1"


@pytest.mark.processes
def test_the_command_line_lists_the_worker_and_its_options():
    out = subprocess.run([PY, "-m", "fabric_model", "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0
    for option in ("worker", "--driver HOST:PORT", "--secret-file PATH", "--join JOIN_JSON", "run SCRIPT"):
        assert option in out.stdout.replace(
            "fabric-model run [--keras3] [--param NAME=VALUE]... [--params FILE] SCRIPT", "run SCRIPT"
        )


@pytest.mark.processes
def test_a_wrong_secret_or_no_driver_exits_non_zero_saying_why(tmp_path):
    server = control.ControlServer(b"s" * 32)
    try:
        secret_file = tmp_path / "secret"
        secret_file.write_text("ab" * 32)
        driver = f"{server.address[0]}:{server.address[1]}"
        out = subprocess.run(
            worker_command("--driver", driver, "--secret-file", str(secret_file)),
            capture_output=True,
            text=True,
            timeout=60,
            env=worker_env(),
        )
    finally:
        server.close()
    assert out.returncode == 2 and f"cannot join the driver at {driver}: it refused the secret" in out.stderr
    out = subprocess.run(
        worker_command("--driver", driver), capture_output=True, text=True, timeout=60, env=worker_env()
    )
    assert out.returncode == 2 and "the job's secret is missing" in out.stderr


class HandStarter:
    """A driver logger: once training runs, a worker started by hand joins (``--secret-file
    join.json``); once it is a member, one more tries to (``--join``) and must be refused."""

    def __init__(self, run_dir: Path, logs: Path, flag: Path) -> None:
        self.run_dir, self.logs, self.flag = run_dir, logs, flag
        self.joined: subprocess.Popen[bytes] | None = None
        self.refused: subprocess.Popen[bytes] | None = None

    def start(self, name: str, *options: str) -> subprocess.Popen[bytes]:
        with open(self.logs / f"{name}.log", "wb") as console:
            return subprocess.Popen(
                worker_command(*options), env=worker_env(), stdout=console, stderr=subprocess.STDOUT
            )

    def log_train_metrics(self, metrics, iteration, epoch, workers):
        join = str(self.run_dir / "join.json")
        if self.joined is None and iteration >= 2:
            driver = json.loads(Path(join).read_text())["driver"]
            self.joined = self.start("joined", "--driver", driver, "--secret-file", join)
        if self.joined is not None and self.refused is None and workers == 2:
            self.refused = self.start("refused", "--join", join)
        if self.refused is not None and self.refused.poll() is not None:
            self.flag.unlink(missing_ok=True)  # both seen: let the run finish

    def close(self) -> None:
        for proc in (self.joined, self.refused):
            if proc is not None:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)


@pytest.mark.processes
@pytest.mark.timeout(150)
def test_a_hand_started_worker_joins_and_one_too_many_is_refused(run_dir, tmp_path, monkeypatch, undisturbed):
    monkeypatch.setenv("FABRIC_MODEL_CPU_WORKERS", "1")  # one local worker; engines_number=2 leaves a slot
    flag = tmp_path / "pace"
    flag.touch()
    starter = HandStarter(run_dir, tmp_path, flag)
    try:
        model, result = job.train(str(run_dir), None, str(flag), driver_logger=starter, engines=2)
    finally:
        starter.close()
    assert starter.joined is not None and starter.refused is not None
    assert starter.joined.returncode == 0, (tmp_path / "joined.log").read_text()
    refused = (tmp_path / "refused.log").read_text()
    assert starter.refused.returncode == 4, refused
    assert "join refused: all 2 slots are taken (engines_number=2)" in refused
    assert [g["workers"] for g in records(run_dir, "generation")][-1] == 2
    assert_exactly_once(run_dir)
    assert len(set(result.replica_digests.values())) == 1 and len(result.replica_digests) == 2
    assert max_rel_diff(model.state_dict(), undisturbed) <= 1e-5


# -- across hosts, in network namespaces -----------------------------------------------------------
SOCKET_TABLES = ("tcp", "tcp6", "udp", "udp6")


def socket_addresses(pid: int) -> list[tuple[str, str, str]]:
    """(local, remote, state) of every socket in ``pid``'s network namespace (/proc/PID/net)."""
    rows = []
    for table in SOCKET_TABLES:
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            rows.append((_address(fields[1]), _address(fields[2]), fields[3]))
    return rows


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address.split(":")[0])
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    v6 = ipaddress.IPv6Address(words)
    return str(v6.ipv4_mapped or v6)


class AddressWatch:
    """Samples the sockets of every host while the job runs. The ``network`` fixtures stop any
    left running (:meth:`stop_all`): a test that fails midway must not leave a thread starting
    ``ip`` processes under the later tests."""

    running: list[AddressWatch] = []

    def __init__(self, hosts: list[netns.Host]) -> None:
        self.hosts, self.seen = hosts, set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        AddressWatch.running.append(self)

    @classmethod
    def stop_all(cls) -> None:
        while cls.running:
            cls.running.pop().stop()

    def _run(self) -> None:
        while not self._stop.wait(0.3):
            for host in self.hosts:
                for pid in host.pids()[:1]:  # one process shows its whole namespace
                    self.seen.update((host.name, *row) for row in socket_addresses(pid))

    def stop(self) -> set[tuple[str, str, str, str]]:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.seen


def in_test_network(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip in netns.SUBNET or ip.is_loopback


@pytest.fixture
def network():
    netns.skip_unless_available()
    with netns.Network(5) as net:
        try:
            yield net
        finally:
            AddressWatch.stop_all()
    # Ours only: other runs on this machine make and delete their own namespaces meanwhile.
    left = {n for n in netns.namespaces() if n.startswith(net.tag)}
    assert not left, f"namespaces left behind: {left}"


def wait_for(what: str, predicate, timeout: float, driver: subprocess.Popen, driver_log: Path):
    timeout = scaled(timeout)  # a bound on other processes' progress: longer on a busy machine
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if driver.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout:.0f} s; driver:\n{driver_log.read_text()[-4000:]}")


@pytest.mark.processes
@pytest.mark.multihost
@pytest.mark.timeout(240)
def test_a_job_across_hosts_survives_a_host_crash_a_new_host_and_a_healed_partition(network, tmp_path, undisturbed):
    a, b, c, d, _ = network.hosts
    run_dir, flag, out, driver_log = tmp_path / "run", tmp_path / "pace", tmp_path / "final.pt", tmp_path / "driver.log"
    flag.touch()
    env = dict(worker_env(), FABRIC_MODEL_CPU_WORKERS="1", EDT_HEARTBEAT_TIME_OUT="4")
    with open(driver_log, "wb") as log:
        cmd = [PY, "-m", "tests.multihost_job", str(run_dir), a.address, str(flag), str(out)]
        driver = a.popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    watch = AddressWatch([a, b, c, d])

    def wait(what, predicate, timeout=60.0):
        return wait_for(what, predicate, timeout, driver, driver_log)

    def members():
        """The members of the newest generation once it has committed a step (its group formed)."""
        if not (run_dir / "logs" / "metrics.jsonl").exists():
            return []
        gens = records(run_dir, "generation")
        trained = {r["generation"] for r in records(run_dir, "train")}
        return gens[-1]["members"] if gens and gens[-1]["generation"] in trained else []

    join = run_dir / "join.json"
    info = json.loads(wait("join.json", lambda: join.exists() and join.read_text()))
    host, port = info["driver"].rsplit(":", 1)
    assert host == a.address  # workers are told the bound address
    secret_file = tmp_path / "secret.hex"
    secret_file.write_text(info["secret"])
    consoles = {name: tmp_path / f"{name}.log" for name in "bcd"}

    def hand_start(host, name, worker_id, *options):
        with open(consoles[name], "wb") as console:
            argv = worker_command(*options, "--worker-id", str(worker_id))
            return host.popen(argv, env=worker_env(), stdout=console, stderr=subprocess.STDOUT, cwd=ROOT)

    hand_start(b, "b", 101, "--driver", info["driver"], "--secret-file", str(join))
    zombie = hand_start(c, "c", 102, "--join", str(join))
    wait("B and C join", lambda: {101, 102} <= set(members()) and len(members()) == 3)

    b.kill_all()  # host B crashes: every process on it
    wait("B's worker removed", lambda: members() and 101 not in members())
    hand_start(d, "d", 103, "--driver", info["driver"], "--secret-file", str(secret_file))
    wait("D joins", lambda: 103 in members())

    network.partition(c)
    wait("C removed after the heartbeat bound", lambda: members() and 102 not in members())
    network.heal(c)
    zombie.wait(timeout=scaled(60))
    console = consoles["c"].read_text()
    assert zombie.returncode == 4, console  # fenced: told why, exited non-zero
    assert "removed from the job: no heartbeat" in console, console
    flag.unlink()
    driver.wait(timeout=scaled(120))
    seen = watch.stop()
    assert driver.returncode == 0, driver_log.read_text()[-4000:]

    final = torch.load(out, weights_only=False)
    assert len(set(final["digests"].values())) == 1, final["digests"]  # identical replicas
    assert set(final["digests"]) == {0, 103}
    assert_exactly_once(run_dir)
    assert max_rel_diff(final["state"], undisturbed) <= 1e-5
    reasons = [g["reason"] for g in records(run_dir, "generation")]
    assert any("worker 101 lost" in r for r in reasons), reasons
    assert any("worker 102 lost: no heartbeat" in r for r in reasons), reasons
    used = {(local, remote) for _, local, remote, state in seen if state != "0A"}  # connections, not listeners
    assert used and all(in_test_network(x) for pair in used for x in pair if x not in ("0.0.0.0", "::")), used
    listening = {(h, local) for h, local, _, state in seen if state == "0A"}
    print("listening:", sorted(listening))
    assert (a.name, a.address) in listening
