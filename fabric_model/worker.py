"""A worker process: connect to the driver, receive the job, train, report, exit.

Started by the driver as ``python -m fabric_model worker ...`` (a fresh interpreter, never a
fork), or by hand on another host with the same command line. The job's secret comes in
the environment (``FABRIC_MODEL_SECRET``, hex), never on the command line.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import signal
import socket
import sys
import threading
import traceback
from datetime import timedelta
from typing import Any, Optional

import cloudpickle

from . import control
from .collective import Collective
from .config import TrainConfig
from .control import Channel
from .digest import state_digest
from .errors import encode_exception
from .loop import Job, TrainingLoop
from .plan import Plan

log = logging.getLogger(__name__)

SECRET_ENV = "FABRIC_MODEL_SECRET"
#: Set by the driver's launcher: the worker dies with the driver and leaves Ctrl-C to it.
LAUNCHED_ENV = "FABRIC_MODEL_LAUNCHED"


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the driver that launched it dies."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() == 1:  # the driver died before prctl took effect
        os._exit(1)


class Inbox:
    """Reads the driver's messages on a thread; a closed link or STOP ends the process.

    The worker must not outlive its driver: if the control connection drops, there is
    nobody to report to and nothing to train for, so the process exits at once.
    """

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.messages: "queue.Queue[tuple[str, dict[str, Any]]]" = queue.Queue()
        threading.Thread(target=self._run, name="fabric-inbox", daemon=True).start()

    def _run(self) -> None:
        try:
            while True:
                kind, payload = self.channel.recv()
                if kind == control.STOP:
                    os._exit(0)
                self.messages.put((kind, payload))
        except (EOFError, OSError):
            os._exit(3)

    def expect(self, kind: str, timeout: timedelta) -> dict[str, Any]:
        try:
            got, payload = self.messages.get(timeout=timeout.total_seconds())
        except queue.Empty:
            raise TimeoutError(f"no {kind!r} message from the driver within {timeout}") from None
        if got != kind:
            raise RuntimeError(f"expected {kind!r} from the driver, received {got!r}")
        return payload


def run(address: tuple[str, int], secret: bytes, worker_id: int, device: Optional[str]) -> int:
    """The whole life of a worker; returns the process exit code."""
    channel = control.connect(address, secret)
    channel.send(control.HELLO, {"worker_id": worker_id, "pid": os.getpid(), "host": socket.gethostname()})
    inbox = Inbox(channel)
    collective: Optional[Collective] = None
    try:
        start = timedelta(seconds=float(os.environ.get("EDT_START_TIME_OUT", "120")))
        job_msg = inbox.expect(control.JOB, start)
        config: TrainConfig = job_msg["config"]
        plan: Plan = job_msg["plan"]
        job: Job = cloudpickle.loads(job_msg["payload"])
        device = device or job_msg.get("device") or "cpu"
        job.adapter.setup(device, int(job_msg.get("threads", 1)))
        train_set, test_set = job.get_datasets()
        gen = inbox.expect(control.GENERATION, start)
        collective = Collective(tuple(gen["store"]), config.backend, timedelta(seconds=config.collective_timeout_s))
        collective.configure(gen["generation"], gen["rank"], gen["world_size"])
        loop = TrainingLoop(job, config, plan, channel, collective, train_set, test_set)
        loop.run()
        model_state, optimizer_state = job.adapter.model_state(), job.adapter.optimizer_state()
        if collective.rank == 0:
            channel.send(control.FINAL, {"model_state": model_state, "optimizer_state": optimizer_state})
        channel.send(control.DONE, {"digest": state_digest({"model": model_state, "optimizer": optimizer_state})})
        return 0
    except BaseException as exc:  # report everything, KeyboardInterrupt included, then exit
        text = traceback.format_exc()
        sys.stderr.write(text)
        try:
            channel.send(control.ERROR, {"worker_id": worker_id, "traceback": text, "exception": encode_exception(exc)})
        except (OSError, EOFError):
            pass
        return 1
    finally:
        if collective is not None:
            collective.shutdown()


def main(argv: list[str]) -> int:
    """``fabric_model worker --driver HOST:PORT --worker-id N [--device DEV]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m fabric_model worker", description=main.__doc__)
    parser.add_argument("--driver", required=True, help="HOST:PORT of the driver's control plane")
    parser.add_argument("--worker-id", type=int, required=True)
    parser.add_argument("--device", default=None, help="cpu, cuda:0, ... (default: what the driver assigns)")
    args = parser.parse_args(argv)
    secret_hex = os.environ.get(SECRET_ENV)
    if not secret_hex:
        parser.error(f"the job's secret must be in the environment variable {SECRET_ENV}")
    host, _, port = args.driver.rpartition(":")
    if os.environ.get(LAUNCHED_ENV):
        _die_with_parent()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver owns Ctrl-C and stops us
    logging.basicConfig(level=logging.INFO, format=f"[worker {args.worker_id}] %(levelname)s %(name)s: %(message)s")
    code = run((host, int(port)), bytes.fromhex(secret_hex), args.worker_id, args.device)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: prefetch threads and the inbox thread need no join.
    os._exit(code)
