"""``train()``'s pipeline once its arguments are checked: size and place the run, ship the job,
run the driver with the display around it, and hand the trained state back to the user's objects
(docs/architecture.md, "Processes", "Start-up")."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..driver.identity import identify
from ..frameworks.base import first_batch_items
from ..run.hooks import Hooks
from ..run.result import History, TrainResult
from ..run.rundir import RunDirectory
from ..run.startup import StartUp
from ..settings.profile_window import fit_to_run, profile_window
from ..settings.registry import OMIT_FROZEN, PROFILE
from ..setup import checks as v
from ..setup.config import LoopOptions
from ..setup.devices import place_workers
from ..setup.job import Job
from ..state import checkpoint
from ..state.best import best_of, check_monitors
from ..state.durable import adopt_snapshot
from ..state.frozen import FrozenBase
from ..step.loop_state import LoopState
from ..step.plan import Plan
from ..streams import datasets as streams
from . import run_setup
from .run_setup import micro_batch_flops, serialize_job, size_run, slot_devices, train_config

if TYPE_CHECKING:
    from ..api import FabricModel
    from ..driver.driver import DriverSetup
    from ..frameworks.base import FrameworkAdapter
    from ..launchers.warm_client import WarmProcess

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RunSizes:
    """``train()``'s sizes, as the user gave them."""

    epoch_number: int
    batch_size: int
    engines_number: int | None
    effective_batch_size: int | None


def prepare(
    fm: FabricModel,
    sizes: RunSizes,
    loop: LoopOptions,
    seed: int | None,
    run_dir: str | os.PathLike[str] | None,
    resume: bool | str,
    ignored: dict[str, Any],
    ray_cluster: Any = None,
    startup: StartUp | None = None,
) -> tuple[DriverSetup, FrameworkAdapter, Any, checkpoint.ResumeChoice]:
    """Check ``train``'s arguments and the data, size the run, draw its seed, serialize the job;
    returns what the driver needs, the adapter, the training set and how ``resume`` was resolved."""
    from ..driver.driver import DriverSetup

    epochs, batch_size = sizes.epoch_number, sizes.batch_size
    v.check_train_arguments(
        epochs, batch_size, sizes.engines_number, sizes.effective_batch_size, loop, seed, resume, ignored
    )
    framework = fm._framework
    if loop.shard_optimizer_state:
        framework.check_shardable(fm.optimizer)
    if loop.num_dataloader_processes:
        framework.check_reader_processes(loop.num_dataloader_processes)
    if fm.save_to_onnx:
        from ..frameworks.export import check_onnx_available

        check_onnx_available(framework, fm.model)  # a missing package fails now, not after training
    train_set, test_set = v.check_datasets(fm.datasets_function)
    data = streams.in_caller(train_set, test_set)  # a sharded dataset's shards counted (streams/)
    train_set, test_set = data.train, data.test
    v.check_sharded(data)
    items_per_micro_batch, sizing = size_run(train_set, batch_size, sizes.engines_number, sizes.effective_batch_size)
    engines, (sizing, gpus) = sizing.max_workers, place_workers(sizing, ray_cluster)  # engines: all slots
    resumed = None
    choice = checkpoint.choose_resume(resume, run_dir)  # "auto": from run.json's end and the checkpoints
    if choice.resume:  # the run's own seed and newest checkpoint; its plan is checked below
        resumed, seed, nothing = checkpoint.find_resume_point(run_dir, seed)
        choice = dataclasses.replace(choice, warning=nothing)
    seed = framework.draw_seed() if seed is None else seed
    plan = Plan(len(train_set), items_per_micro_batch, sizing.micro_batches, seed)
    if data.train_source is not None and data.train_count is not None:
        source = data.train_source
        plan = dataclasses.replace(
            plan,
            shard_lengths=data.train_count.lengths,
            shuffle_shards=source.shuffle,
            shuffle_window=source.shuffle_window,
        )
    if resumed is not None:
        checkpoint.check_resumable(
            resumed,
            plan=plan,
            framework=fm.framework,
            epochs=epochs,
            batch_size=batch_size,
            engines_number=sizes.engines_number,
            effective_batch_size=sizes.effective_batch_size,
        )
    startup = startup or StartUp()
    startup.mark("argument checks")
    exact = sizing.micro_batches if loop.deterministic else None  # the micro-batches per step
    window = profile_window(loop.profile) if loop.profile is not None else PROFILE.get()
    if window is not None:
        window = fit_to_run(window, epochs * plan.steps_per_epoch)
    adapter, payload, job = ship(fm, train_set, test_set is not None, exact, startup)
    if resumed is not None and resumed.path.name == checkpoint.SNAPSHOT_NAME:
        # The snapshot on disk, made whole with the job's frozen values; else the newest checkpoint.
        resumed = adopt_snapshot(resumed, *adapter.frozen_parameters()) or checkpoint.newest_checkpoint(
            resumed.path.parent
        )
    frozen = frozen_base(adapter, resumed)
    config = dataclasses.replace(
        train_config(epochs, batch_size, sizing, loop, gpus),
        test_shard_lengths=data.test_count.lengths if data.test_count is not None else (),
        profile=window,
        frozen=frozen.names,
    )
    step_flops = micro_batch_flops(adapter.first_forward_flops, first_batch_items(train_set), items_per_micro_batch)
    threads, why = run_setup.worker_threads(loop.deterministic, ray_cluster, gpus, sizing.max_workers, step_flops)
    startup.note("intra-op threads", f"{threads} per CPU worker: {why}")
    setup = DriverSetup(
        payload=payload,
        identity=identify(job, config, plan),
        config=config,
        plan=plan,
        has_test=test_set is not None,
        stat_names=adapter.stat_names,
        devices=slot_devices(sizing.max_workers, gpus),
        threads=threads,
        framework=fm.framework,
        keep_checkpoints=loop.keep_checkpoints,
        keep_best=best_of(fm.user_callbacks),
        resume=resumed,
        max_workers=engines,
        data=data.record(),
        threads_fixed=loop.deterministic,
        ray_actor=ray_cluster.actor_shape if ray_cluster is not None else "",
        frozen=frozen,
        startup=startup,
        rejoin=_vanished_driver(run_dir) if choice.resume else None,
    )
    return setup, adapter, train_set, choice


def _vanished_driver(run_dir: str | os.PathLike[str] | None) -> tuple[tuple[str, int], bytes] | None:
    """Where the run's vanished driver listened, and its secret: ``join.json``, which a driver
    removes at its end, so that only a driver killed without notice leaves it (its workers may
    wait there: docs/elasticity.md, "A lost driver")."""
    run = RunDirectory.named(run_dir)
    return run.read_join_info() if run is not None else None


def frozen_base(adapter: FrameworkAdapter, resumed: checkpoint.CheckpointInfo | None) -> FrozenBase:
    """The model's frozen parameters that travel with the job only (docs/architecture.md, "State
    that does not change"): none with ``FABRIC_MODEL_OMIT_FROZEN=0``; on resume, those whose
    values in the checkpoint are the job's."""
    tensors, order = adapter.frozen_parameters() if OMIT_FROZEN.get() else ({}, [])
    base = FrozenBase(tensors, order)
    return base.without_changed(resumed.path) if resumed is not None and base else base


def ship(
    fm: FabricModel, train_set: Any, has_test: bool, exact: int | None, startup: StartUp | None = None
) -> tuple[FrameworkAdapter, bytes, Job]:
    """The adapter (deterministic for ``exact`` micro-batches per step) and the job every worker
    receives, cloudpickled once, after what it monitors and its first batch are checked (and the
    job itself, which driver/identity.py identifies)."""
    adapter, framework = fm._make_adapter(), fm._framework
    if exact is not None:
        adapter = run_setup.make_deterministic(fm.framework, adapter, exact)
    # EarlyStopping, BestCheckpoints, ReduceLROnPlateau: each monitor must name a metric of the run.
    check_monitors([*fm.user_callbacks, fm.lr_scheduling], adapter.stat_names, has_test)
    adapter = framework.prepare_for_shipping(adapter, framework.first_batch(adapter, train_set))
    if startup is not None:
        startup.mark("first-batch check")
    hooks = Hooks.for_worker(fm.worker_logger_callback, fm.user_callbacks)
    job = Job(adapter, fm.datasets_function, hooks, fm.lr_scheduling)
    payload = serialize_job(job)
    if startup is not None:
        startup.mark("shipping the job")
    return adapter, payload, job


def run_job(
    fm: FabricModel,
    setup: DriverSetup,
    adapter: FrameworkAdapter,
    train_set: Any,
    run: RunDirectory,
    ray_cluster: Any,
    display: tuple[int, bool],
    warm: WarmProcess | None,
    resume: checkpoint.ResumeChoice | None = None,
) -> TrainResult:
    """Train with the driver (workers local, forked from ``warm`` when there is one, or on
    ``ray_cluster``), then hand the result over; ``run.json`` records how the run ended
    (finished, or failed with the error's type; an interrupt or a preemption is the display's
    to record, and a failure recorded after it does not replace it).

    ``resume``: how ``train(resume=...)`` was resolved; what it says is logged once the run's log is open."""
    with run.recording_end():
        from ..driver.display import run_with_display
        from ..driver.driver import Driver
        from ..launchers import warm_spare
        from ..launchers.local import local_launcher_factory

        launcher = (
            ray_cluster.launcher_factory(run.worker_log)
            if ray_cluster
            else local_launcher_factory(
                run.worker_log, setup.threads, warm, setup.config.timeouts.driver_wait, run.join_json
            )
        )

        def start(hooks: Hooks) -> tuple[Driver, Any]:
            # Here, in driver.log and on screen, not before the log is open (a bare line on stderr).
            if resume is not None and resume.said is not None:
                log.info("%s", resume.said)
            if resume is not None and resume.warning is not None:
                log.warning("%s", resume.warning)
            threads = setup.startup.notes.get("intra-op threads")
            if threads is not None:
                log.info("intra-op threads: %s", threads)
            if warm is not None:
                # A fresh interpreter imports torch and the job's modules again: seconds of start-up.
                log.info("local workers fork from the warm process: %s", warm.how)
                setup.startup.note("warm process", warm.how)
            if setup.rejoin is None:  # waiting workers this run does not take back hold the machine
                from ..driver.waiting import release_waiting

                release_waiting(run)
            driver = Driver(setup, run, hooks, launcher, stop_request=fm._stop_request)
            return driver, driver.run()

        try:
            (driver, final), hooks = run_with_display(fm.driver_logger_callback, setup, run, display, start)
        except BaseException as exc:  # a worker's error: its traceback is the cause, the driver's frames noise
            if warm is not None:
                warm.close()
            from ..errors import RemoteTraceback

            if isinstance(exc.__cause__, RemoteTraceback):
                raise exc.with_traceback(None) from exc.__cause__
            raise
        if warm is not None and not warm_spare.keep(warm):  # for the caller's next job
            warm.close()
        path, onnx_diff = finish(fm, final, adapter, train_set, run, hooks)
        if final.divergence is not None:
            fm.run_dir = run.path  # download() zips the model written
            raise diverged(final, path)
        from ..run import console

        detach = console.attach(display[0], run.logs / "driver.log")  # the display's, for its last line
        try:
            onnx = (fm.framework, onnx_diff) if onnx_diff is not None else None
            for line in run_summary(driver.progress.iteration, driver.replica_digests, path, onnx):
                log.info("%s", line)
            for summary in driver.profiles.summaries:  # train(profile=...): where a step's time went
                for line in summary:
                    log.info("%s", line)
        finally:
            detach()
        history = History(driver.train_history, driver.test_history)
        return TrainResult(run.path, history, driver.test_history, setup.plan.seed, driver.replica_digests, onnx_diff)


def run_summary(steps: int, digests: dict[int, str], model: Path, onnx: tuple[str, float] | None = None) -> list[str]:
    """The lines a finished run ends with: what the driver checked, and where the model is. Every
    committed step's micro-batches were computed exactly once (the ledger refuses one that was
    not), and the finished replicas' digests agree (a difference fails the run before this).
    ``onnx``: the framework and onnxruntime's largest difference from it, when the model was exported."""
    from ..driver.display import _shown

    agree = f", {len(digests)} replicas agree" if len(digests) > 1 else ""
    digest = f" (sha256 {next(iter(digests.values()))[:12]})" if digests else ""
    lines = [f"done: {steps} steps, every sample once an epoch{agree}", f"model: {_shown(model)}{digest}"]
    if onnx is not None:
        lines.append(f"onnx: {_shown(model.parent / 'model.onnx')} (matches {onnx[0]} within {onnx[1]:.3g})")
    return lines


def diverged(final: Any, path: Path) -> Exception:
    """The error of a run whose replicas diverged, once the state handed back is written and loaded."""
    from ..driver.replicas import ReplicaDivergenceError

    divergence = final.divergence
    return ReplicaDivergenceError(
        f"replicas diverged {divergence.where}: {divergence.describe()}. {final.source[:1].upper()}{final.source[1:]} "
        f"was written to {path} and loaded into the model. Replicas differ when code changes weights, buffers or "
        "optimizer state differently on each worker: a forward that assigns a buffer a new tensor, a callback or "
        "hook that acts on some workers, randomness not drawn from the step's seed. "
        'See docs/architecture.md, "Replica checks"; FABRIC_MODEL_DIVERGENCE_CHECK_STEPS sets how often replicas '
        "are compared",
        divergence,
        str(path),
    )


def finish(
    fm: FabricModel,
    final: Any,
    adapter: FrameworkAdapter,
    train_set: Any,
    run: RunDirectory,
    hooks: Hooks,
) -> tuple[Path, float | None]:
    """The trained state into the user's model and optimizer, the model saved (and exported, unless
    the replicas diverged); returns the model's path and the ONNX comparison."""
    framework = fm._framework
    fm._trained_adapter = adapter  # evaluate() and predict() use the trained model through it
    # The scheduler's final state into the user's, as the optimizer's (callbacks stay: a next train() starts fresh).
    own = LoopState(adapter.stat_names, fm.lr_scheduling, []).unpack(final.optimizer_state)
    framework.load_final_state(adapter, final.model_state, own)
    path = framework.save_model(run.model, fm.model, final.model_state)
    framework.hand_over(adapter)  # Keras: the model comes back compiled
    if not fm.save_to_onnx or final.divergence is not None:
        return path, None
    from ..frameworks.export import export_final_model

    onnx_diff = export_final_model(framework, fm.model, adapter, train_set, run)
    if onnx_diff is not None:  # for a user's logger; the screen says it in the run's last lines
        hooks.note(f"model/model.onnx written; onnxruntime vs {fm.framework}: max abs diff {onnx_diff:.3g}")
    return path, onnx_diff
