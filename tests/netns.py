"""Hosts on a private network, made of Linux network namespaces, for multi-host tests.

One bridge in its own namespace and ``n`` host namespaces, each with a veth to the bridge and
an address in ``SUBNET`` (loopback up in each). Nothing is attached to the caller's own
namespace, so traffic stays between these namespaces. Names carry the test process's pid, so
parallel runs do not collide. Any command runs inside a host with its own environment (a
worker, a Ray node, ...)::

    with Network(3) as net:
        a, b, c = net.hosts
        proc = a.popen([sys.executable, "-c", "..."], env={...})
        net.partition(b); ...; net.heal(b)
        b.kill_all()

Leaving the block (also on error) SIGKILLs every process in the namespaces and deletes them.
Needs root (``ip netns add``); :func:`available` says why not where it is refused.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from typing import Any

SUBNET = ipaddress.ip_network("10.231.0.0/24")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def available() -> str | None:
    """None when network namespaces can be made here, else the reason they cannot."""
    name = f"fmprobe{os.getpid()}"
    try:
        result = _ip("netns", "add", name, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns add` cannot run: {exc}"
    if result.returncode != 0:
        return f"`ip netns add` is refused here (needs root): {result.stderr.strip()}"
    _ip("netns", "delete", name, check=False)
    return None


def skip_unless_available() -> None:
    """Skip the calling test, with the reason printed, where namespaces cannot be made."""
    import pytest

    reason = available()
    if reason is not None:
        print(f"SKIPPED: {reason}")
        pytest.skip(reason)


def namespaces() -> set[str]:
    """The names of the network namespaces that exist now."""
    return {line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()}


class Host:
    """One host: a namespace with ``interface`` at ``address`` on the bridge's ``port``."""

    interface = "eth0"

    def __init__(self, network: Network, index: int) -> None:
        self.network, self.index = network, index
        self.name = f"{network.tag}h{index}"
        self.port = f"port{index}"
        self.address = str(SUBNET.network_address + index + 1)
        self.processes: list[subprocess.Popen[Any]] = []

    def popen(self, argv: Sequence[str], env: Mapping[str, str] | None = None, **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside this host (``ip netns exec``, which then runs it in place)."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.name, *argv], env=dict(env or os.environ), **kwargs)
        self.processes.append(proc)
        return proc

    def run(self, argv: Sequence[str], timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ip", "netns", "exec", self.name, *argv], capture_output=True, text=True, timeout=timeout, check=True
        )

    def pids(self) -> list[int]:
        """Every process running inside this host's namespace."""
        return [int(p) for p in _ip("netns", "pids", self.name, check=False).stdout.split()]

    def kill_all(self) -> list[int]:
        """SIGKILL every process in this host, as a machine losing power would; the pids killed."""
        killed = self.pids()
        for pid in killed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.processes:
            if proc.pid in killed:
                proc.wait(timeout=10)
        return killed


class Network:
    """``n`` hosts on one bridge; a context manager that removes everything it made."""

    def __init__(self, n: int) -> None:
        self.tag = f"fm{os.getpid()}"
        self.bridge = f"{self.tag}br"
        self.hosts = [Host(self, i) for i in range(n)]
        self._made: list[str] = []

    def __enter__(self) -> Network:
        try:
            self._make_bridge()
            for host in self.hosts:
                self._make_host(host)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _make_bridge(self) -> None:
        self._add_namespace(self.bridge)
        _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge, "link", "set", "br0", "up")

    def _make_host(self, host: Host) -> None:
        self._add_namespace(host.name)
        _ip(
            "-n",
            self.bridge,
            "link",
            "add",
            host.port,
            "type",
            "veth",
            "peer",
            "name",
            host.interface,
            "netns",
            host.name,
        )
        _ip("-n", self.bridge, "link", "set", host.port, "master", "br0", "up")
        _ip("-n", host.name, "addr", "add", f"{host.address}/{SUBNET.prefixlen}", "dev", host.interface)
        _ip("-n", host.name, "link", "set", host.interface, "up")

    def partition(self, host: Host) -> None:
        """Cut ``host`` off silently: its port leaves the bridge (no packet says so)."""
        _ip("-n", self.bridge, "link", "set", host.port, "nomaster")

    def heal(self, host: Host) -> None:
        """Put ``host`` back on the bridge."""
        _ip("-n", self.bridge, "link", "set", host.port, "master", "br0")

    def close(self) -> None:
        """SIGKILL every process in every host, reap ours, delete every namespace made."""
        for host in self.hosts:
            if host.name in self._made:
                host.kill_all()
            for proc in host.processes:
                if proc.poll() is None:
                    proc.kill()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        for name in reversed(self._made):
            for _ in range(50):  # a namespace's last process may take a moment to go
                if _ip("netns", "delete", name, check=False).returncode == 0 or name not in namespaces():
                    break
                time.sleep(0.1)
        self._made.clear()
