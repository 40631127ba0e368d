"""A worker process: connect to the driver, receive the job, train, report, exit.

Started by a launcher as ``python -m fabric_model worker ...``, as a fork of the job's warm
process that runs the same :func:`main` (launchers/warm.py), or by hand on another host with
the same command line. The job's secret comes in the
environment (``FABRIC_MODEL_SECRET``, hex), never on the command line. See
docs/architecture.md, "Processes".
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import AuthenticationError

from ..context import WorkerContext, _install
from ..errors import encode_exception, user_traceback
from ..frameworks.keras.quiet import quiet_tensorflow
from ..launchers.native import die_with_parent
from ..settings.registry import (
    GLOO_SOCKET_IFNAME,
    HEARTBEAT_TIMEOUT,
    JOIN_FILE,
    LAUNCHED,
    PREEMPT_GRACE,
    PREEMPT_SIGNALS,
    START_TIMEOUT,
)
from ..setup.config import Timeouts, heartbeat_interval
from ..setup.job import Job
from ..step.digest import state_digest
from ..streams.datasets import in_worker
from ..transport import control
from ..transport import protocol as p
from ..transport.collective import Collective, CollectiveError
from ..transport.control import Channel
from ..transport.descriptors import allow_many_descriptors
from ..transport.network import select_interfaces
from ..transport.store.client import RemoteStore
from . import cli
from .allocator import keep_freed_memory, release_free_memory
from .host_share import HostShare
from .inbox import Heartbeat, Inbox, TrainingHalted, at_exit
from .job_loading import HostUnfit, fit_device, load_job
from .loop import TrainingLoop, WorkerLeft
from .notice import LeaveNotice
from .reattach import DriverWait, LossyChannel

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Stage:
    """How far this worker's life got, for what it tells a driver that comes back (worker/reattach.py)."""

    loop: TrainingLoop | None = None
    finished: p.Finished | None = None  # sent at the schedule's end
    handed_over: bool = False  # the final state went to the driver: nothing left to keep
    device: str | None = None  # where it trains (a restarted driver gives it the slot of that device)
    identity: dict[str, str] = dataclasses.field(default_factory=dict)  # the job's (driver/identity.py)

    def held(self) -> p.Held | None:
        """What this worker holds; None before it entered a generation or once it handed over."""
        loop = self.loop
        if loop is None or self.handed_over or not loop.entered_once:
            return None
        generation = loop.collective.generation
        launched = LAUNCHED.get()
        return p.Held(
            generation,
            loop.next_unit,
            launched,
            self.device,
            self.finished,
            tuple(loop.sent_reports),
            self.identity,
            loop.uploads.unconfirmed_unit,
        )


def _join(
    loop: TrainingLoop, inbox: Inbox, channel: Channel, timeouts: Timeouts, set_up: dict[str, float] | None = None
) -> bool:
    """Announce readiness and enter a generation; False after ``pull_failed_limit`` failed tries.

    Each try waits ``timeouts.pull`` (EDT_PULL_WEIGHT_TIME_OUT) for the generation and the state
    it pulls. ``set_up``: how long the set-up's parts took (the first Ready says it: run/startup.py).
    """
    limit = timeouts.pull_failed_limit
    for attempt in range(1, limit + 1):
        channel.send(p.Ready(attempt, tuple((set_up or {}).items()) if attempt == 1 else ()))
        deadline = time.monotonic() + timeouts.pull
        try:
            while True:  # an answer to an earlier attempt may still arrive: skip it
                generation = inbox.expect(p.EnterGeneration, max(0.0, deadline - time.monotonic()))
                if generation.attempt == attempt:
                    break
            loop.enter(generation)
            channel.send(p.Entered(generation.generation, tuple(loop.entered_in.items())))
            return True
        except (TimeoutError, CollectiveError) as exc:
            log.warning("pull %d/%d failed: %s", attempt, limit, exc)
            loop.collective.shutdown()
            if isinstance(exc, CollectiveError):
                channel.send(p.LeftGeneration(loop.collective.generation, -1, failed=True, reason="pull failed"))
    log.error("giving up after %d failed pulls (EDT_PULL_FAILED_LIMITS); the job goes on without this worker", limit)
    return False


def _set_up(
    spec: p.JobSpec,
    payload: list[bytes],
    worker_id: int,
    device: str | None,
    inbox: Inbox,
    threads: int,
    phases: dict[str, float],
) -> tuple[Job, WorkerContext, str]:
    """Unpickle the job (taking it out of ``payload``, so its bytes are freed), install the
    worker context, place the model on ``device`` with ``threads`` intra-op threads."""
    if spec.config.keep_freed_memory:  # before the job allocates (docs/architecture.md, "Worker memory")
        keep_freed_memory()
    began = time.monotonic()
    with quiet_tensorflow():  # a Keras job loads TensorFlow here: its start-up notices stay out of the log
        job: Job
        job, mapped = load_job(payload.pop())  # a CUDA state onto the CPU where this host has no GPU
        phases["unpickling the job"] = time.monotonic() - began
        device = fit_device(device or spec.device, mapped, spec.config.on_gpus)
        # Installed before any user code runs here, so datasets_function can ask where it is.
        context = WorkerContext(worker_id)
        context.pending_join = lambda: inbox.pending_generation > context.generation
        _install(context)
        began = time.monotonic()
        job.adapter.setup(device, threads)
        phases.update(job.adapter.setup_phases or {"device init and state": time.monotonic() - began})
        job.adapter.track_frozen(spec.config.frozen)  # left out of what travels while unchanged
    return job, context, device


def _train(
    spec: p.JobSpec,
    payload: list[bytes],
    worker_id: int,
    device: str | None,
    inbox: Inbox,
    channel: Channel,
    store: RemoteStore,
    stage: Stage,
    notice: LeaveNotice,
    own_threads: Callable[[], int] | None = None,
) -> Collective | None:
    """Set up, join, train to the schedule's end, report and hand over the final state on request.
    ``stage`` gets the loop, whose ``next_unit`` a failure reports. ``own_threads``: a
    hand-started worker's own thread count (its host's share), unless the run fixes them."""
    threads = spec.threads if own_threads is None or spec.threads_fixed else own_threads()
    source = "the run's" if own_threads is None or spec.threads_fixed else "this host's share"
    log.info("%d intra-op threads (%s)", threads, source)
    phases: dict[str, float] = {}  # the set-up's parts, for the run's start-up record (run/startup.py)
    job, context, device = _set_up(spec, payload, worker_id, device, inbox, threads, phases)
    stage.device = device
    config, plan = spec.config, spec.plan
    timeouts: Timeouts = config.timeouts
    began = time.monotonic()
    datasets = in_worker(*job.get_datasets(), plan, config.test_shard_lengths)  # sharded ones as streams
    phases["datasets_function"] = time.monotonic() - began
    job.adapter.train_set = datasets[0]
    params = {
        "optimizer": job.adapter.optimizer,
        "epochs": config.epochs,
        "batch_size": config.batch_size,
        "steps_per_epoch": plan.steps_per_epoch,
        "seed": plan.seed,
    }
    job.hooks.set_context(job.adapter.model, params)
    # Through the hooks: a test's fault injector may wrap the collective (docs/architecture.md, "Testing seams").
    collective = job.hooks.wrap_collective(
        Collective(store, config.backend, timedelta(seconds=timeouts.collective), device, inbox.aborted)
    )
    resize = None if own_threads is None or spec.threads_fixed else own_threads
    loop = TrainingLoop(job, config, plan, channel, inbox, collective, datasets, context, notice, threads, resize)
    stage.loop = loop
    if not _join(loop, inbox, channel, timeouts, phases):
        return collective
    if config.keep_freed_memory:  # what set-up and the pull freed, not the steps' memory
        release_free_memory()
    try:
        loop.run_joined()
    except TrainingHalted as halted:  # replicas diverged, or a restarted driver runs a changed job: it takes this state
        log.warning("the driver asked for this worker's state at unit %d, in place of a generation", loop.next_unit)
        asked = halted.args[0] if halted.args else p.SendFinalState()
        if asked.unconfirmed and loop.uploads.send_unconfirmed(loop.collective.generation, -1):
            loop.uploads.flush(timeouts.recovery)  # before the state: the driver writes it first
        model_state, optimizer_state, omitted = job.adapter.final_state()
        optimizer_state = loop.loop_state.pack(optimizer_state)
    else:
        loop.uploads.flush(timeouts.recovery)  # the last checkpoint reaches the driver before Finished
        model_state, optimizer_state, omitted = job.adapter.final_state()
        optimizer_state = loop.loop_state.pack(optimizer_state)
        state = {"model": model_state, "optimizer": optimizer_state}
        if omitted:  # the job's frozen parameters: their fingerprints compare them, the digest names them
            state["frozen"] = omitted
        stage.finished = p.Finished(state_digest(state), loop.next_unit, loop.fingerprint(), loop.end_saved)
        channel.send(stage.finished)
        asked = inbox.expect(p.SendFinalState, timeouts.recovery)
        if asked.save_branch:  # the member that ran it was lost: its export must still happen
            log.warning("running the save branch of epoch %d's end: the worker that ran it was lost", loop.end_epoch)
            job.hooks.save_branch(loop.end_epoch)
        # Only now: the driver asks once every member finished (or the rest are gone), and a peer
        # may still be in the last collective until then (docs/architecture.md, "User errors").
        collective.shutdown()
    stage.handed_over = True
    channel.send(p.FinalState(model_state, optimizer_state, loop.next_unit, tuple(omitted)))
    inbox.expect(p.Stop, timeouts.stop)  # the inbox exits the process on Stop
    return collective


def _report_failure(channel: Channel, exc: BaseException, unit: int) -> None:
    if isinstance(exc, HostUnfit):  # this host's circumstance, not a bug: its one line says it all
        sys.stderr.write(f"fabric_model worker: exiting (1): {exc}\n")
    else:
        sys.stderr.write(traceback.format_exc())  # the worker log keeps every frame
    text = user_traceback(exc)
    # Not the user's error: the driver must not count it against their code.
    not_the_user_s = (CollectiveError, TimeoutError, KeyboardInterrupt, HostUnfit)
    collective = isinstance(exc, not_the_user_s) or type(exc).__module__.startswith("torch.distributed")
    try:
        channel.send(p.WorkerFailed(text, encode_exception(exc), collective, unit))
    except (OSError, EOFError):
        pass


def run(
    address: tuple[str, int],
    secret: bytes,
    worker_id: int | None,
    device: str | None,
    notice: LeaveNotice,
    own_threads: Callable[[], int] | None = None,
) -> int:
    """The whole life of a worker; returns the process exit code."""
    try:
        channel = control.connect(address, secret, kind=LossyChannel)
    except (OSError, EOFError, AuthenticationError) as exc:
        why = "it refused the secret" if isinstance(exc, AuthenticationError) else f"{type(exc).__name__}: {exc}"
        sys.stderr.write(f"fabric_model worker: cannot join the driver at {address[0]}:{address[1]}: {why}\n")
        return 2
    channel.send(p.Hello(worker_id, os.getpid(), socket.gethostname()))
    inbox = Inbox(channel)
    # Until the job brings the driver's bounds, this worker's own environment sets them.
    heartbeat = Heartbeat(channel, heartbeat_interval(HEARTBEAT_TIMEOUT.get()))
    collective: Collective | None = None
    stage = Stage()
    try:
        start = START_TIMEOUT.get()
        if worker_id is None:
            worker_id = inbox.expect(p.Assigned, start).worker_id
        spec = inbox.expect(p.JobSpec, start)
        # The pickled job (the model's weights among it) is read once: keep the spec without it.
        payload = [spec.payload]
        spec = dataclasses.replace(spec, payload=b"")
        stage.identity = spec.identity
        heartbeat.interval = heartbeat_interval(spec.config.timeouts.heartbeat)
        notice.install(spec.config.preemption.signals, spec.config.preemption.grace)  # the driver's, as the bounds
        # The store shares the control plane's address and secret (docs/architecture.md, "Processes").
        store = RemoteStore(address, secret, worker_id, timedelta(seconds=spec.config.timeouts.collective))
        # A driver that vanishes is waited for while this worker holds the state (worker/reattach.py).
        wait = spec.config.timeouts.driver_wait
        inbox.driver_wait = DriverWait(address, secret, worker_id, wait, stage.held, [store.reopen], JOIN_FILE.get())
        collective = _train(spec, payload, worker_id, device, inbox, channel, store, stage, notice, own_threads)
        return 0
    except WorkerLeft as exc:  # told to leave: it left after a step, as its generation voted
        unit = stage.loop.next_unit if stage.loop is not None else -1
        sys.stderr.write(f"fabric_model worker: exiting (0): {exc} after unit {unit}\n")
        return 0
    except BaseException as exc:  # report everything, KeyboardInterrupt included, then exit
        _report_failure(channel, exc, stage.loop.next_unit if stage.loop is not None else -1)
        return 1
    finally:
        if collective is not None:
            collective.shutdown()


def main(argv: list[str]) -> int:
    """``fabric-model worker`` (see :mod:`fabric_model.worker.cli` for its options)."""
    parser = cli.parser()
    args = cli.resolve(parser.parse_args(argv), parser)
    # TensorFlow's C++ INFO and WARNING chatter (oneDNN, CPU features) off unless the user asks for it.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if LAUNCHED.get():
        die_with_parent()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver owns Ctrl-C and stops us
    # A preemption signal from the start: one before the job arrives ends the process at once.
    notice = LeaveNotice()
    notice.install(PREEMPT_SIGNALS.get(), PREEMPT_GRACE.get())
    logging.basicConfig(level=logging.INFO, format="[worker] %(asctime)s %(levelname)s %(name)s: %(message)s")
    # Collectives go out on the interface that routes to the driver (docs/architecture.md, "Processes").
    interface = select_interfaces(args.address[0])
    allow_many_descriptors()  # a gloo rank holds a socket a peer (docs/architecture.md, "The collective group")
    log.info("driver %s:%d, collectives on interface %s", *args.address, GLOO_SOCKET_IFNAME.get() or interface)
    # Started by hand: sized from this host, not the driver's (worker/host_share.py).
    share = None if LAUNCHED.get() or args.threads is not None else HostShare(f"{args.address[0]}-{args.address[1]}")
    if share is not None:
        at_exit(share.close)  # the inbox ends the process with os._exit at the job's Stop
    own_threads: Callable[[], int] | None = share.threads if share is not None else None
    if args.threads is not None:
        chosen = args.threads
        own_threads = lambda: chosen  # noqa: E731
    try:
        code = run(args.address, args.secret, args.worker_id, args.device, notice, own_threads)
    finally:
        if share is not None:
            share.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: prefetch threads and the inbox thread need no join.
    os._exit(code)
