"""A local multi-node Ray cluster for the tests that need one (tests/test_ray.py,
tests/test_hostile_network.py): one ``ray.cluster_utils.Cluster`` per test module, a head
without CPUs and 1-CPU nodes, all on 127.0.0.1. The leak check (tests/conftest.py) allows the
cluster's own processes and its idle pool workers, never an actor or a worker left by a test.
A module uses the fixtures ``cluster`` and ``two_nodes`` by importing ``cluster_fixture`` and
``two_nodes_fixture``.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import pytest

from . import conftest
from .load import scaled

NODE = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False}
#: Ray runs its workers at nice 15 (``RAY_worker_niceness``), so beside other busy processes an
#: actor's worker gets almost no CPU (one got 2% beside two busy loops, and a test's job took
#: minutes to start): the tests' clusters run them at the normal priority. docs/clusters.md says
#: the same to users.
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_worker_niceness": "0"}


def require_ray() -> ModuleType:
    """``ray``; a skip without it, except where the test environment promises every extra
    (tox): there its absence fails."""
    if os.environ.get("FABRIC_MODEL_TEST_ALL_EXTRAS"):
        return __import__("ray")
    return pytest.importorskip("ray")


def _cluster_pids(cluster: Any) -> set[int]:
    pids = set()
    for node in cluster.list_all_nodes():
        for infos in node.all_processes.values():
            pids.update(info.process.pid for info in infos)
    return pids


@pytest.fixture(scope="module", name="cluster")
def cluster_fixture():
    ray = require_ray()
    from ray.cluster_utils import Cluster

    patch = pytest.MonkeyPatch()
    for name, value in RAY_ENV.items():
        patch.setenv(name, value)
    # Actors start slowly on a busy machine (Ray's processes and the workers' imports share the
    # cores): the job's start and recovery bounds stretch with the load, as the tests' do.
    for name in ("EDT_START_TIME_OUT", "EDT_RECOVERY_TIME_OUT"):
        patch.setenv(name, f"{scaled(120.0):.0f}")
    patch.delenv("RAY_ADDRESS", raising=False)
    # Read when ray is imported, which this process did already: its own addresses stay on loopback too.
    patch.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)
    head = {**NODE, "num_cpus": 0}
    c = Cluster(initialize_head=True, head_node_args=head, shutdown_at_exit=False)
    seen: set[int] = set()

    def owned() -> set[int]:
        seen.update(_cluster_pids(c))
        return _cluster_pids(c)

    conftest.FIXTURE_PROCESSES.append(owned)
    try:
        ray.init(address=c.address, logging_level="WARNING", log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        owned()
        c.shutdown()
        conftest.FIXTURE_PROCESSES.remove(owned)
        patch.undo()
        left = conftest.wait_gone(seen, 15.0)
        assert not left, f"the Ray cluster left processes running: {left}"


@pytest.fixture(name="two_nodes")
def two_nodes_fixture(cluster):
    """Exactly two 1-CPU worker nodes at the start of the test (and no more after it)."""
    while len(cluster.worker_nodes) < 2:
        cluster.add_node(**NODE)
    cluster.wait_for_nodes()
    yield cluster
    for node in list(cluster.worker_nodes)[2:]:
        cluster.remove_node(node)
