"""The worker's command line: where the driver is and the job's secret.

``fabric-model worker --driver HOST:PORT`` with the secret in ``$FABRIC_MODEL_SECRET`` (hex), or
``--secret-file PATH`` (a file holding the hex secret, or the run's ``join.json``), or
``--join PATH/join.json`` alone (the driver's address and the secret). The secret never rides
on the command line, where other users of the host can read it. See docs/architecture.md,
"Processes"; docs/clusters.md, "Workers on other hosts".
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from ..settings.registry import SECRET


@dataclasses.dataclass(frozen=True)
class WorkerArgs:
    """What a worker needs to connect: the driver's address, the secret, its id and device."""

    address: tuple[str, int]
    secret: bytes
    worker_id: int | None
    device: str | None
    threads: int | None = None


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The worker's options (also listed by ``fabric-model --help``)."""
    parser.add_argument("--driver", metavar="HOST:PORT", help="the driver's control plane (join.json's 'driver')")
    parser.add_argument(
        "--secret-file",
        metavar="PATH",
        help=f"a file holding the job's hex secret, or the run's join.json (default: ${SECRET.name})",
    )
    parser.add_argument(
        "--join", metavar="JOIN_JSON", help="the run's join.json: the driver's address and the secret in one file"
    )
    parser.add_argument("--worker-id", type=int, default=None, help="default: the driver assigns one")
    parser.add_argument("--device", default=None, help="cpu, cuda:0, ... (default: what the driver assigns)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="intra-op threads (default: this host's usable cores shared among the job's workers on it)",
    )
    return parser


def parser(prog: str = "fabric-model worker") -> argparse.ArgumentParser:
    return add_arguments(
        argparse.ArgumentParser(
            prog=prog,
            description="Join a running fabric-model job as one more worker (this host's device).",
        )
    )


def resolve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> WorkerArgs:
    """The address and secret from the options and the environment; ``parser.error`` names what is wrong."""
    driver, secret_hex = args.driver, None
    for option, path in (("--join", args.join), ("--secret-file", args.secret_file)):
        if path is None:
            continue
        info = _read_secret_file(option, path, parser)
        secret_hex = secret_hex or info.get("secret")
        driver = driver or info.get("driver")
    secret_hex = secret_hex or SECRET.get()
    if not driver:
        parser.error("the driver's address is missing: give --driver HOST:PORT or --join PATH/join.json")
    if not secret_hex:
        parser.error(f"the job's secret is missing: give --secret-file PATH, --join PATH or set ${SECRET.name}")
    host, _, port = str(driver).rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        parser.error(f"expected the driver's address as HOST:PORT. Received: {driver!r}")
    try:
        secret = bytes.fromhex(str(secret_hex).strip())
    except ValueError:
        parser.error("the job's secret is not hexadecimal (it is join.json's 'secret', or its value alone)")
    if args.threads is not None and args.threads < 1:
        parser.error(f"expected --threads to be a positive int. Received: {args.threads}")
    return WorkerArgs((host, int(port)), secret, args.worker_id, args.device, args.threads)


def _read_secret_file(option: str, path: str, parser: argparse.ArgumentParser) -> dict[str, str]:
    """``{"secret": ..., "driver": ...}`` from a join.json, or ``{"secret": ...}`` from a bare hex file."""
    try:
        text = open(path, encoding="utf-8").read().strip()
    except OSError as exc:
        parser.error(f"{option}: cannot read {path!r} ({exc.strerror})")
    if not text.startswith("{"):
        return {"secret": text}
    try:
        info = json.loads(text)
        return {"secret": str(info["secret"]), "driver": str(info["driver"])}
    except (ValueError, KeyError, TypeError):
        parser.error(f"{option}: {path!r} is not a join.json with 'driver' and 'secret'")
