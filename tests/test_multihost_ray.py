"""A ``cluster="ray"`` job across hosts made of network namespaces (docs/architecture.md,
"Processes", "Ray"): the Ray head and the driver on host A, Ray nodes on B and C, then B
crashes (every process on it SIGKILLed), a new node D joins (the pending actor request is
placed), and C is partitioned and healed later (its worker removed by our heartbeat, and
fenced when it returns).

Every Ray process runs inside its host's namespace (``Host.popen``), started with
``--block`` so the test owns it; the namespaces and everything in them go at the end
(never ``ray stop``). Ray's health checks are fast (a node lost in ~4 s, not ~64 s).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import BinaryIO

import psutil
import pytest
import torch

from . import multihost_job as job
from . import netns
from .helpers import max_rel_diff, records
from .load import scaled
from .test_multihost import AddressWatch, assert_exactly_once, in_test_network, wait_for, worker_env
from .test_multihost import _address as socket_address

pytestmark = pytest.mark.processes

# Skipped without Ray, except where the test environment promises every extra (tox): there it fails.
if not os.environ.get("FABRIC_MODEL_TEST_ALL_EXTRAS"):
    pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
RAY = str(Path(PY).parent / "ray")  # the `ray` command of this interpreter's environment
GCS_PORT = 6379  # each host is a fresh namespace: every port is free there
#: Every Ray process: no usage report, and a silent node declared dead after ~4 s (default ~64 s).
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
    "RAY_worker_niceness": "0",  # as tests/ray_cluster.py says: actors at nice 15 starve beside other load
}
#: EDT_HEARTBEAT_TIME_OUT of the job: below Ray's ~4 s, so our heartbeat removes the partitioned worker.
HEARTBEAT = 3.0


@pytest.fixture(scope="module")
def undisturbed():
    from .helpers import fresh_model_and_optimizer, reference_train

    model, opt = fresh_model_and_optimizer()
    reference_train(model, opt, job.DATA, seed=job.SEED, epochs=job.EPOCHS, batch_size=job.BATCH, micro_batches=3)
    return model.state_dict()


@pytest.fixture
def network():
    netns.skip_unless_available()
    # Ray's session folders (its Unix sockets among them): short paths, one per node.
    scratch = tempfile.mkdtemp(prefix="fmray")
    try:
        with netns.Network(4) as net:
            net.scratch = Path(scratch)
            try:
                yield net
            finally:
                AddressWatch.stop_all()
            started = {pid for host in net.hosts for pid in host.pids()}  # Ray's, the workers'
        # Leaving the block SIGKILLed every process in the namespaces (never `ray stop`).
        assert all(wait_gone(pid, 10.0) for pid in started), "a process outlived its namespace"
    finally:
        subprocess.run(["rm", "-rf", scratch], check=False, timeout=60)
    # Ours only: other runs on this machine make and delete their own namespaces meanwhile.
    left = {n for n in netns.namespaces() if n.startswith(net.tag)}
    assert not left, f"namespaces left behind: {left}"


def ray_env(net: netns.Network) -> dict[str, str]:
    """The environment of every Ray process (and of the driver): the package importable on each
    host, as if installed there; no secret of ours (actors get it as a task argument); Ray's
    token authentication on, as docs/clusters.md says to run it: ``RAY_AUTH_MODE=token`` and
    the cluster's token in a file every host reads (``RAY_AUTH_TOKEN_PATH``), made for this
    cluster; a home of their own, so no Ray setting of this machine's user reaches it."""
    home = net.scratch / "home"
    home.mkdir(exist_ok=True)
    token = net.scratch / "ray-token"
    if not token.exists():
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
    return {**worker_env(), **RAY_ENV, "HOME": str(home), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}


def start_ray_node(net: netns.Network, host: netns.Host, head: netns.Host) -> subprocess.Popen:
    """``ray start --block`` inside ``host``: the head (no CPUs) when ``host`` is ``head``,
    else a 1-CPU node joining it; every address is the host's own."""
    argv = [RAY, "start", f"--node-ip-address={host.address}", "--block", "--disable-usage-stats"]
    argv += [f"--temp-dir={net.scratch / host.name}"]
    if host is head:
        argv += ["--head", f"--port={GCS_PORT}", "--num-cpus=0", "--include-dashboard=false"]
        argv += [f"--dashboard-host={host.address}", f"--ray-client-server-port={GCS_PORT + 1}"]
    else:
        argv += [f"--address={head.address}:{GCS_PORT}", "--num-cpus=1"]
    with open(net.scratch / f"{host.name}.log", "wb") as log:
        return host.popen(argv, env=ray_env(net), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def worker_process(host: netns.Host) -> tuple[int, BinaryIO]:
    """The fabric-model worker running in ``host`` (started by its Ray actor): pid and its output.

    The actor's copy of the output has no name (it dies with the actor), so the test opens it
    through the worker's stdout and can read it after both are gone."""
    for pid in host.pids():
        try:
            cmd = " ".join(psutil.Process(pid).cmdline())
        except psutil.Error:
            continue
        if "fabric_model worker" in cmd:
            return pid, open(f"/proc/{pid}/fd/1", "rb")
    raise AssertionError(f"no worker process in {host.name}")


def listening_addresses(pid: int) -> list[str]:
    """``HOST:PORT`` of every TCP socket ``pid`` listens on (read in its own namespace's /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            inodes.add(os.readlink(fd).removeprefix("socket:[").removesuffix("]"))
        except OSError:
            continue
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN, and one of pid's sockets
                host, port = fields[1].split(":")
                found.append(f"{socket_address(fields[1])}:{int(port, 16)}")
    return sorted(found)


def wait_gone(pid: int, timeout: float) -> bool:
    try:
        psutil.Process(pid).wait(timeout)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        return False
    return True


@pytest.mark.multihost
@pytest.mark.timeout(240)
def test_a_ray_job_across_hosts_survives_a_node_crash_a_new_node_and_a_healed_partition(network, tmp_path, undisturbed):
    a, b, c, d = network.hosts
    run_dir, flag, out, driver_log = tmp_path / "run", tmp_path / "pace", tmp_path / "final.pt", tmp_path / "driver.log"
    flag.touch()
    started = time.monotonic()
    start_ray_node(network, a, a)
    for host in (b, c):
        start_ray_node(network, host, a)
    env = dict(ray_env(network), RAY_ADDRESS=f"{a.address}:{GCS_PORT}", EDT_HEARTBEAT_TIME_OUT=str(HEARTBEAT))
    env["EDT_START_TIME_OUT"] = f"{scaled(120.0):.0f}"  # actors start slowly on a busy machine
    # Before the job starts (a refused client can take many seconds, which the run's paced steps
    # would not last): Ray's token authentication is on, and a client with another token is refused.
    probe = f"import ray; ray.init(address='{a.address}:{GCS_PORT}')"
    client = d.popen(
        [PY, "-c", probe], dict(env, RAY_AUTH_TOKEN="0" * 64), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    said = client.communicate(timeout=scaled(120.0))[0].decode(errors="replace")
    assert client.returncode != 0 and "InvalidAuthToken" in said, said[-2000:]
    with open(driver_log, "wb") as log:
        cmd = [PY, "-m", "tests.multihost_job", str(run_dir), "-", str(flag), str(out), "ray"]
        driver = a.popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    watch = AddressWatch([a, b, c, d])

    def wait(what, predicate, timeout=60.0):
        return wait_for(what, predicate, timeout, driver, driver_log)

    def generations():
        return records(run_dir, "generation") if (run_dir / "logs" / "metrics.jsonl").exists() else []

    def trained_generation():
        """The newest generation once it has committed a step (its group formed), else None."""
        gens = generations()
        trained = {r["generation"] for r in records(run_dir, "train")} if gens else set()
        return gens[-1] if gens and gens[-1]["generation"] in trained else None

    def hosts_now() -> set[str]:
        gen = trained_generation()
        return set(gen["hosts"]) if gen else set()

    join = run_dir / "join.json"
    info = json.loads(wait("join.json", lambda: join.exists() and join.read_text(), timeout=90))
    assert info["driver"].rsplit(":", 1)[0] == a.address  # the node IP Ray reports for A
    # Our one port is on A's address. (Ray's own gRPC server in the driver process listens on
    # every interface of A's namespace: lo and A's address only.)
    port = info["driver"].rsplit(":", 1)[1]
    assert [x for x in listening_addresses(driver.pid) if x.endswith(f":{port}")] == [info["driver"]]

    wait("workers on B and C train", lambda: hosts_now() == {b.address, c.address}, timeout=90)
    b.kill_all()  # node B crashes: its raylet, its actor, its worker, all at once
    wait("B's worker removed", lambda: hosts_now() == {c.address})
    start_ray_node(network, d, a)  # the pending actor request is placed on the new node
    wait("D's worker joins", lambda: hosts_now() == {c.address, d.address}, timeout=90)

    zombie, zombie_log = worker_process(c)
    removed_by_heartbeat = {g["generation"] for g in generations() if "no heartbeat" in g["reason"]}
    network.partition(c)
    cut = time.monotonic()
    wait("C's worker removed", lambda: hosts_now() == {d.address})
    removed_after = time.monotonic() - cut
    said_before_heal = os.fstat(zombie_log.fileno()).st_size
    network.heal(c)
    healed = time.monotonic()
    fenced = wait_gone(zombie, scaled(60.0))
    gone_after = time.monotonic() - healed
    zombie_said = zombie_log.read().decode(errors="replace")
    zombie_log.close()
    flag.unlink()  # let the run finish
    driver.wait(timeout=scaled(120))
    seen = watch.stop()
    elapsed = time.monotonic() - started
    told = "removed from the job: no heartbeat" in zombie_said
    print(
        f"elapsed {elapsed:.1f} s; C removed {removed_after:.1f} s after the partition; its worker gone"
        f" {gone_after:.1f} s after the heal, {'told why' if told else 'killed with its node by Ray'}"
    )
    assert driver.returncode == 0, driver_log.read_text()[-4000:]

    # The zombie: removed after our heartbeat bound (before Ray declares its node dead), gone
    # soon after the partition heals, and fenced meanwhile. Which fence ends it is a race: our
    # Stop (it prints why and exits 4) or Ray (C's raylet learns it was declared dead and
    # exits; the actor with it, the worker by PR_SET_PDEATHSIG). Either way it never trained,
    # joined a generation again (the driver admits no upload from it either: tests/test_store.py).
    assert fenced, f"C's worker (pid {zombie}) still runs after the partition healed:\n{zombie_said[-2000:]}"
    returned = zombie_said.encode()[said_before_heal:].decode(errors="replace")
    assert "generation" not in returned, zombie_said[-2000:]
    gens = generations()
    reasons = [g["reason"] for g in gens]
    lost_c = [g for g in gens if "no heartbeat" in g["reason"] and g["generation"] not in removed_by_heartbeat]
    assert len(lost_c) == 1 and HEARTBEAT <= removed_after, (reasons, removed_after)
    zombie_id = int(re.search(r"worker (\d+) lost", lost_c[0]["reason"]).group(1))
    assert all(zombie_id not in g["members"] for g in gens if g["generation"] >= lost_c[0]["generation"])

    # Sizes down and back up; hosts are the namespaces' addresses.
    sizes = [g["workers"] for g in gens]
    changes = [s for i, s in enumerate(sizes) if i == 0 or s != sizes[i - 1]]
    assert changes == [2, 1, 2, 1], sizes
    assert [set(g["hosts"]) for g in gens][0] == {b.address, c.address}
    assert {h for g in gens for h in g["hosts"]} == {b.address, c.address, d.address}

    final = torch.load(out, weights_only=False)
    assert len(final["digests"]) == 1 and zombie_id not in final["digests"], final["digests"]
    assert_exactly_once(run_dir)  # the driver checked it too (ExactlyOnceError)
    assert max_rel_diff(final["state"], undisturbed) <= 1e-5

    # No address outside the namespaces' subnet (and loopback) was ever used.
    addresses = [info["driver"].rsplit(":", 1)[0], *(h for g in gens for h in g["hosts"])]
    assert all(ipaddress.ip_address(x) in netns.SUBNET for x in addresses), addresses
    used = {(local, remote) for _, local, remote, state in seen if state != "0A"}  # connections, not listeners
    assert used and all(in_test_network(x) for pair in used for x in pair if x not in ("0.0.0.0", "::")), used
    assert elapsed < scaled(180), f"the scenario took {elapsed:.0f} s"  # a bound on hanging, stretched by load
