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
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import cloudpickle

from .. import control
from ..collective import Collective, CollectiveError
from ..config import TrainConfig, get_timeout, heartbeat_interval, pull_failed_limit
from ..context import WorkerContext, _install
from ..control import Channel
from ..digest import state_digest
from ..errors import encode_exception
from ..job import Job
from ..plan import Plan
from ..protocol import LAUNCHED_ENV, SECRET_ENV
from .loop import Membership, TrainingLoop

log = logging.getLogger(__name__)



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
    nobody to report to and nothing to train for, so the process exits at once. PENDING
    (a join vote request) is recorded for the loop instead of queued, since the loop only
    reads it at step boundaries.
    """

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.messages: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self.membership = Membership(self.expect)
        threading.Thread(target=self._run, name="fabric-inbox", daemon=True).start()

    def _run(self) -> None:
        try:
            while True:
                kind, payload = self.channel.recv()
                if kind == control.STOP:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(0)
                if kind == control.PENDING:
                    self.membership.pending_generation = max(self.membership.pending_generation, payload["generation"])
                    continue
                if kind == control.ABORT:
                    self.membership.abort_generation = max(self.membership.abort_generation, payload["generation"])
                    continue
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


def _heartbeat(channel: Channel, interval: float) -> None:
    """Tell the driver this process is alive (a SIGSTOPped or frozen process goes silent)."""
    while True:
        time.sleep(interval)
        try:
            channel.send(control.HEARTBEAT)
        except (OSError, EOFError):
            return


def _join(loop_factory: Callable[[], TrainingLoop], inbox: Inbox, channel: Channel) -> TrainingLoop | None:
    """Announce readiness and wait for a generation; None after EDT_PULL_FAILED_LIMITS tries.

    Each try waits EDT_PULL_WEIGHT_TIME_OUT for the generation and its state (the pull).
    """
    pull_timeout = get_timeout("EDT_PULL_WEIGHT_TIME_OUT")
    limit = pull_failed_limit()
    loop = loop_factory()
    for attempt in range(1, limit + 1):
        channel.send(control.READY, {"attempt": attempt})
        deadline = time.monotonic() + pull_timeout.total_seconds()
        try:
            while True:  # an answer to an earlier attempt may still arrive: skip it
                left = timedelta(seconds=max(0.0, deadline - time.monotonic()))
                generation = inbox.expect(control.GENERATION, left)
                if generation.get("attempt", attempt) == attempt:
                    break
            loop.enter(generation)
            return loop
        except (TimeoutError, CollectiveError) as exc:
            log.warning("pull %d/%d failed: %s", attempt, limit, exc)
            loop.collective.shutdown()
            if isinstance(exc, CollectiveError):
                channel.send(
                    control.FAILED, {"generation": loop.collective.generation, "next_unit": -1, "reason": "pull failed"}
                )
    log.error("giving up after %d failed pulls (EDT_PULL_FAILED_LIMITS); the job goes on without this worker", limit)
    return None


def run(address: tuple[str, int], secret: bytes, worker_id: int | None, device: str | None) -> int:
    """The whole life of a worker; returns the process exit code."""
    channel = control.connect(address, secret)
    channel.send(control.HELLO, {"worker_id": worker_id, "pid": os.getpid(), "host": socket.gethostname()})
    inbox = Inbox(channel)
    threading.Thread(target=_heartbeat, args=(channel, heartbeat_interval()), daemon=True).start()
    collective: Collective | None = None
    try:
        start = get_timeout("EDT_START_TIME_OUT")
        if worker_id is None:
            worker_id = int(inbox.expect(control.HELLO, start)["worker_id"])
        job_msg = inbox.expect(control.JOB, start)
        config: TrainConfig = job_msg["config"]
        plan: Plan = job_msg["plan"]
        job: Job = cloudpickle.loads(job_msg["payload"])
        device = device or job_msg.get("device") or "cpu"
        # Installed before any user code runs here, so get_datasets can ask where it is.
        context = WorkerContext(worker_id)
        context.pending_join = lambda: inbox.membership.pending_generation > context.generation
        _install(context)
        job.adapter.setup(device, int(job_msg.get("threads", 1)))
        datasets = job.get_datasets()
        job.adapter.train_set = datasets[0]
        params = {
            "optimizer": job.adapter.optimizer,
            "epochs": config.epochs,
            "batch_size": config.batch_size,
            "steps_per_epoch": plan.steps_per_epoch,
            "seed": plan.seed,
        }
        for callback in job.callbacks:
            callback.set_context(job.adapter.model, params)
        membership = inbox.membership
        collective = Collective(
            tuple(job_msg["store"]),
            config.backend,
            timedelta(seconds=config.collective_timeout_s),
            device,
            should_abort=lambda generation: membership.abort_generation >= generation,
        )
        recovery = get_timeout("EDT_RECOVERY_TIME_OUT")

        def make_loop() -> TrainingLoop:
            assert collective is not None
            return TrainingLoop(job, config, plan, channel, inbox.membership, collective, datasets, context, recovery)

        loop = _join(make_loop, inbox, channel)
        if loop is None:
            return 0
        loop.run_joined()
        model_state, optimizer_state = job.adapter.model_state(), job.adapter.optimizer_state()
        digest = state_digest({"model": model_state, "optimizer": optimizer_state})
        channel.send(control.DONE, {"digest": digest, "next_unit": loop.next_unit})
        collective.shutdown()
        inbox.expect(control.FINAL_REQUEST, get_timeout("EDT_RECOVERY_TIME_OUT"))
        channel.send(control.FINAL, {"model_state": model_state, "optimizer_state": optimizer_state})
        inbox.expect(control.STOP, get_timeout("EDT_STOP_TIME_OUT"))  # the inbox exits on STOP
        return 0
    except BaseException as exc:  # report everything, KeyboardInterrupt included, then exit
        text = traceback.format_exc()
        sys.stderr.write(text)
        try:
            channel.send(
                control.ERROR,
                {
                    "worker_id": worker_id,
                    "traceback": text,
                    "exception": encode_exception(exc),
                    # Not the user's error: the driver must not count it against their code.
                    "collective": isinstance(exc, (CollectiveError, TimeoutError, KeyboardInterrupt))
                    or type(exc).__module__.startswith("torch.distributed"),
                },
            )
        except (OSError, EOFError):
            pass
        return 1
    finally:
        if collective is not None:
            collective.shutdown()


def main(argv: list[str]) -> int:
    """``fabric_model worker --driver HOST:PORT [--worker-id N] [--device DEV]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m fabric_model worker", description=main.__doc__)
    parser.add_argument("--driver", required=True, help="HOST:PORT of the driver's control plane")
    parser.add_argument("--worker-id", type=int, default=None, help="default: the driver assigns one")
    parser.add_argument("--device", default=None, help="cpu, cuda:0, ... (default: what the driver assigns)")
    args = parser.parse_args(argv)
    secret_hex = os.environ.get(SECRET_ENV)
    if not secret_hex:
        parser.error(f"the job's secret must be in the environment variable {SECRET_ENV}")
    host, _, port = args.driver.rpartition(":")
    if os.environ.get(LAUNCHED_ENV):
        _die_with_parent()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver owns Ctrl-C and stops us
    logging.basicConfig(level=logging.INFO, format="[worker] %(asctime)s %(levelname)s %(name)s: %(message)s")
    code = run((host, int(port)), bytes.fromhex(secret_hex), args.worker_id, args.device)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: prefetch threads and the inbox thread need no join.
    os._exit(code)
