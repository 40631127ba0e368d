"""Addresses: where the driver listens, what it tells workers, which interface a worker uses.

The driver's control plane and rendezvous store listen on one chosen address: loopback by
default, another of this host's addresses for workers on other hosts, a wildcard only when
asked for. A worker on another host picks the interface whose address routes to the driver
for its collectives (gloo/NCCL would otherwise resolve the hostname, often to 127.0.0.1).
See docs/architecture.md, "Processes". Standard library and the settings registry only; no torch.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import MutableMapping

from ..settings.registry import BIND_ADDRESS

log = logging.getLogger(__name__)

#: Where the driver listens when neither ``train(bind_address=...)`` nor ``$FABRIC_MODEL_BIND_ADDRESS`` is given.
DEFAULT_BIND_ADDRESS = "127.0.0.1"
#: Addresses that mean "every interface": accepted only when named explicitly.
WILDCARDS = ("0.0.0.0",)
_ACCEPTED = (
    "an IPv4 address of this host (e.g. '10.0.0.5'), a host name resolving to one, or '0.0.0.0' (every interface)"
)
_SIOCGIFADDR = 0x8915  # linux/sockios.h


def resolve_bind_address(bind_address: object) -> str:
    """The IPv4 address the driver will listen on, checked in the caller before any worker starts.

    ``None`` means ``$FABRIC_MODEL_BIND_ADDRESS``, else ``127.0.0.1``. An address this host does
    not have, an IPv6 address or a name that does not resolve raises ``ValueError`` naming the
    argument (or the variable), the value and what is accepted."""
    name = "bind_address"
    if bind_address is None:
        bind_address = BIND_ADDRESS.get()
        if bind_address is None:
            return DEFAULT_BIND_ADDRESS
        name = f"${BIND_ADDRESS.name}"
    if not isinstance(bind_address, str) or not bind_address.strip():
        raise TypeError(f"Expected `{name}` to be a string: {_ACCEPTED}. Received: {name}={bind_address!r}")
    text = bind_address.strip()
    if text in ("::", "[::]") or ":" in text:
        raise ValueError(f"Expected `{name}` to be {_ACCEPTED}; IPv6 is not supported yet. Received: {name}={text!r}")
    try:
        host = str(ipaddress.IPv4Address(text))
    except ValueError:
        try:
            host = str(socket.getaddrinfo(text, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
        except (socket.gaierror, IndexError, UnicodeError) as exc:
            raise ValueError(f"Expected `{name}` to be {_ACCEPTED}. Received: {name}={text!r} ({exc})") from None
    _check_bindable(name, text, host)
    if host in WILDCARDS:
        log.warning(
            "%s=%r: the driver listens on every interface; any host that can reach this one may try to connect "
            "(connections are authenticated with the job's secret)",
            name,
            text,
        )
    return host


def chosen_bind_address(bind_address: object) -> str | None:
    """The address the user chose (``bind_address``, else ``$FABRIC_MODEL_BIND_ADDRESS``),
    checked as :func:`resolve_bind_address` does; None when they chose none (the launcher's
    default then applies: loopback, or the node's IP on Ray)."""
    if bind_address is None and not BIND_ADDRESS.is_set():
        return None
    return resolve_bind_address(bind_address)


def _check_bindable(name: str, text: str, host: str) -> None:
    """Raise unless this host can listen on ``host`` (it is one of its addresses)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, 0))
        except OSError as exc:
            raise ValueError(
                f"Expected `{name}` to be {_ACCEPTED}; this host cannot listen on {host} ({exc.strerror}). "
                f"Received: {name}={text!r}"
            ) from None


def advertised_address(bind_host: str) -> str:
    """The address workers connect to: the bound one, or for a wildcard a routable address of
    this host (the source address of its default route; loopback when it has none)."""
    if bind_host not in WILDCARDS:
        return bind_host
    for probe in ("192.0.2.1", "10.255.255.255"):  # TEST-NET and private: connect() sends nothing on UDP
        source = route_source(probe)
        if source is not None and not source.startswith("127."):
            return source
    # No default route (an isolated network): the first address off loopback.
    routable = [a for a in interface_addresses().values() if not a.startswith("127.")]
    return routable[0] if routable else DEFAULT_BIND_ADDRESS


def route_source(destination: str) -> str | None:
    """This host's source address for packets to ``destination`` (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.connect((destination, 9))
            return str(udp.getsockname()[0])
    except OSError:
        return None


def interface_addresses() -> dict[str, str]:
    """Each local interface with an IPv4 address, by name: its (first) address."""
    found: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on it
            found[name] = socket.inet_ntoa(raw[20:24])
    return found


def interface_of(address: str) -> str | None:
    """The name of the local interface holding IPv4 ``address`` (``lo`` for 127.x), or None."""
    if address.startswith("127."):
        return "lo"
    return next((name for name, held in interface_addresses().items() if held == address), None)


def interface_towards(driver_host: str) -> str | None:
    """The interface whose address routes to the driver at ``driver_host``, or None."""
    try:
        host = str(socket.getaddrinfo(driver_host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
    except (socket.gaierror, IndexError, UnicodeError):
        return None
    source = route_source(host)
    return interface_of(source) if source is not None else None


def select_interfaces(driver_host: str, environ: MutableMapping[str, str] | None = None) -> str | None:
    """Point gloo (and NCCL, off loopback) at the interface that routes to the driver, unless the
    user chose one (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``); returns the interface."""
    env = os.environ if environ is None else environ
    interface = interface_towards(driver_host)
    if interface is None:
        log.warning("no local interface routes to the driver at %s; gloo picks one by the hostname", driver_host)
        return None
    env.setdefault("GLOO_SOCKET_IFNAME", interface)
    if interface != "lo":  # NCCL's own default avoids lo; a single-host GPU job keeps it
        env.setdefault("NCCL_SOCKET_IFNAME", interface)
    return interface
