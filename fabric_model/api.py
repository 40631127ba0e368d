"""The public face: ``FabricModel`` validates what the user gives and hands it to the driver."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .callbacks import Callback
from .inference import InferenceMixin
from .run.hooks import Hooks
from .run.rundir import RunDirectory
from .setup import checks as v
from .setup import compat, run_setup
from .setup.cluster import check_cluster, open_cluster
from .setup.constructor_checks import check_constructor_arguments
from .setup.devices import place_workers
from .setup.job import Job
from .setup.run_setup import (
    LoopOptions,
    check_train_arguments,
    open_run,
    serialize_job,
    size_run,
    slot_devices,
    train_config,
)

# Light modules only: `import fabric_model` must not import torch (and so torch.distributed).
# The framework, checkpoints and the driver are imported inside the functions that use them.
from .state import checkpoint
from .state.best import best_of, check_monitors
from .step.loop_state import LoopState, check_lr_scheduler
from .step.options import check_step_options
from .step.plan import Plan
from .transport.network import DEFAULT_BIND_ADDRESS as LOOPBACK
from .transport.network import chosen_bind_address

if TYPE_CHECKING:
    from .driver.driver import DriverSetup
    from .frameworks.base import Framework, FrameworkAdapter
    from .launchers.warm_client import WarmProcess

log = logging.getLogger(__name__)


@dataclasses.dataclass
class TrainResult:
    """What ``train()`` returns; the trained weights are in the user's model object itself.

    Attributes:
        run_dir: the run directory (logs, worker logs, metrics).
        history: per epoch, the sample-weighted training averages (``loss`` and metrics).
        test_history: per validation, the test metrics.
        seed: the seed the run used (pass it back as ``seed=`` to repeat the run).
        replica_digests: per worker, a SHA-256 of its final weights and optimizer state.
        onnx_max_diff: with ``save_to_onnx``, the largest absolute difference between
            onnxruntime on ``model/model.onnx`` and the framework's own output on real batches
            (None when no file was written).
    """

    run_dir: Path
    history: list[dict[str, float]]
    test_history: list[dict[str, float]]
    seed: int
    replica_digests: dict[int, str]
    onnx_max_diff: float | None = None


class FabricModel(InferenceMixin):
    """Trains a single-device PyTorch or Keras model data-parallel on up to ``engines_number`` workers.

    Args:
        model: a ``torch.nn.Module`` or a Keras 3 ``keras.Model`` (see the README's "Keras
            models": names are accepted for a Keras loss, optimizer and metrics).
        datasets_function: a function returning ``(train_dataset, test_dataset)``: map-style
            datasets (``__len__`` and ``__getitem__``) whose samples are ``(input, target)``
            tuples or dicts with a ``target``/``label`` key; ``test_dataset`` may be None.
            It is called once in the caller (to check it) and once in each worker.
        loss_function: torch: ``loss(output, target)`` returning the batch-mean loss. Keras: a
            ``keras.losses`` instance, a loss name, or ``loss(y_true, y_pred)`` (Keras' order).
        optimizer: an optimizer over ``model``'s parameters (Keras: an instance or a name).
        metrics: torch: callables ``metric(output, target)`` returning a batch mean. Keras:
            names ("accuracy"), ``keras.metrics.Metric`` instances or ``metric(y_true, y_pred)``.
            None (the default): an accuracy, as IBM's EDT showed; ``[]``: the loss alone.
        worker_logger_callback: a logger run in every worker (see :mod:`fabric_model.callbacks`).
        driver_logger_callback: a logger run in the caller, or a list of them; they are added to
            the default progress display and run recorder (``train(verbose=0, tensorboard=False)``
            turns those off).
        save_to_onnx: after training, also write ``model/model.onnx`` (dynamic batch dimension),
            checked with onnxruntime against the framework on a real batch. A failed export is
            a warning (the trained model is kept); missing packages fail before training.
        keras_custom_objects: ``{"name": class}`` of the custom layers, models, losses and
            metrics a Keras model needs to be rebuilt in each worker.
        fn_batch_collate: ``collate(list_of_samples) -> (inputs, target)``; the default stacks
            tensors, numpy arrays and numbers, and recurses into tuples and dicts.
        lr_scheduler: torch: a ``torch.optim.lr_scheduler`` built on ``optimizer``, stepped per epoch, or
            ``{"scheduler": s, "interval": "step" | "epoch", "monitor": "val_loss"}`` (README, "Training features").
        precision: torch: ``"32"``, ``"bf16-mixed"`` or ``"16-mixed"`` (autocast forward; float32 weights,
            gradients and reduction; float16 with a loss scale shared by every replica).
        gradient_clip_norm: clip the step's whole reduced gradient to this global L2 norm.
    """

    def __init__(
        self,
        model: Any,
        datasets_function: Callable[[], tuple[Any, Any]] | None = None,
        loss_function: Callable[[Any, Any], Any] | None = None,
        optimizer: Any = None,
        metrics: Sequence[Callable[[Any, Any], Any]] | None = None,
        worker_logger_callback: Any = None,
        driver_logger_callback: Any = None,
        save_to_onnx: bool = False,
        keras_custom_objects: dict[str, Any] | None = None,
        fn_batch_collate: Callable[[Sequence[Any]], Any] | None = None,
        *,
        fn_step_train: Callable[..., Any] | None = None,
        fn_test: Callable[..., Any] | None = None,
        fn_args: Any = None,
        user_callback: Sequence[Callback] | None = None,
        driver_logger: Any = None,
        worker_logger: Any = None,
        enable_onnx: bool | None = None,
        get_datasets: Callable[[], tuple[Any, Any]] | None = None,
        lr_scheduler: Any = None,
        precision: str = "32",
        gradient_clip_norm: float | None = None,
    ) -> None:
        # IBM's keyword names are aliases of ours (compat.pick); `get_datasets` is this package's old name.
        datasets_function = compat.pick("datasets_function", datasets_function, "get_datasets", get_datasets)
        # Defaults exist only so `get_datasets=` can stand in for the second parameter; all three are required.
        v.require(datasets_function=datasets_function, loss_function=loss_function, optimizer=optimizer)
        driver_logger_callback = compat.pick(
            "driver_logger_callback", driver_logger_callback, "driver_logger", driver_logger
        )
        worker_logger_callback = compat.pick(
            "worker_logger_callback", worker_logger_callback, "worker_logger", worker_logger
        )
        save_to_onnx = compat.pick("save_to_onnx", save_to_onnx or None, "enable_onnx", enable_onnx) or save_to_onnx
        from .frameworks import framework_name, framework_named
        from .launchers.local import prestart_warm_process

        self.framework = framework_name(model)  # as run records and checkpoints spell it
        # The job's warm process imports from now on, beside this constructor and train()'s
        # checks: it is what bounds start-up (docs/architecture.md, "Start-up").
        self._warm = prestart_warm_process(self.framework)
        self._warm_finalizer = weakref.finalize(self, self._warm.discard) if self._warm is not None else None
        try:
            self._framework: Framework = framework_named(self.framework)  # chosen once; only it knows the framework
            self.model, self.datasets_function = model, datasets_function
            self.loss_function, self.optimizer = loss_function, optimizer
            self.worker_logger_callback = worker_logger_callback
            self.driver_logger_callback = driver_logger_callback
            self.save_to_onnx = save_to_onnx
            self.keras_custom_objects = keras_custom_objects
            self.fn_batch_collate = fn_batch_collate
            self.fn_step_train, self.fn_test, self.fn_args = fn_step_train, fn_test, fn_args
            self.metrics, self.user_callbacks = check_constructor_arguments(self, metrics, user_callback)
            self.lr_scheduling = check_lr_scheduler(lr_scheduler, optimizer, self.framework)
            custom_step = fn_step_train is not None
            self.step_options = check_step_options(
                precision, gradient_clip_norm, self.framework, custom_step, optimizer
            )
        except BaseException:
            self._drop_warm()
            raise
        self.run_dir: Path | None = None

    def train(
        self,
        epoch_number: int,
        batch_size: int,
        engines_number: int | None = None,
        num_dataloader_threads: int | None = None,
        validation_freq: int = 1,
        checkpoint_freq: int = 1,
        effective_batch_size: int | None = None,
        *,
        seed: int | None = None,
        run_dir: str | os.PathLike[str] | None = None,
        resume: bool = False,
        keep_checkpoints: int = checkpoint.DEFAULT_KEEP,
        worker_memory: Any = None,
        driver_memory: Any = None,
        bind_address: str | None = None,
        cluster: str | None = None,
        verbose: int = 1,
        tensorboard: bool = True,
        deterministic: bool = False,
    ) -> TrainResult:
        """Train for ``epoch_number`` epochs; the user's ``model`` then holds the trained weights.

        Args:
            epoch_number: epochs to train.
            batch_size: samples per micro-batch (per device).
            engines_number: the most devices the job may use; the global batch is
                ``batch_size * engines_number``. ``min(engines_number, devices)`` workers start
                (see :mod:`fabric_model.setup.devices`), accumulating micro-batches to keep the global
                batch. Default: one per local GPU (1 on CPU).
            num_dataloader_threads: threads per worker reading upcoming micro-batches (0: none).
                Default: none for a dataset read in one gather (a ``TensorDataset``, one with
                ``__getitems__``), else one per two of the worker's cores, up to 4.
            validation_freq: validate after every ``validation_freq``-th epoch.
            checkpoint_freq: checkpoint after every ``checkpoint_freq``-th epoch (0: never).
            effective_batch_size: the global batch, a multiple of ``batch_size``; see
                :func:`fabric_model.setup.config.size_engines` for how it combines with engines_number.
            seed: the run's seed; by default drawn from the framework's global generator, so
                ``torch.manual_seed(0)`` or ``keras.utils.set_random_seed(0)`` makes a run reproducible.
            run_dir: where logs go; default ``$RESULT_DIR`` or ``./fabric_runs/<run-id>``.
            resume: continue the run in ``run_dir`` (or ``$RESULT_DIR``) from its newest complete
                checkpoint, with its seed and plan (the README's "checkpoints and resume" says what
                must match); without a checkpoint, training starts from the beginning.
            keep_checkpoints: how many of the newest checkpoints to keep (older ones are deleted).
            worker_memory, driver_memory: IBM's; accepted and ignored (memory is not capped).
            bind_address: the address of this host the driver listens on, for workers started by
                hand on other hosts (``fabric-model worker``); default ``$FABRIC_MODEL_BIND_ADDRESS``,
                else ``127.0.0.1``. ``"0.0.0.0"`` (every interface) only when asked for, with a warning.
            cluster: where workers run: ``"local"`` processes (default), or ``"ray"``: actors on the
                Ray cluster of ``RAY_ADDRESS`` (README, "On a Ray cluster"). Default ``$FABRIC_MODEL_CLUSTER``.
            verbose: 0 quiet, 1 a progress bar (plain lines when stderr is not a terminal) and the
                library's messages, 2 one line per epoch. ``logs/driver.log`` has every message.
            tensorboard: write TensorBoard scalars to ``<run_dir>/tensorboard`` and one CSV row per
                epoch to ``logs/metrics.csv``.
            deterministic: bitwise-identical weights, optimizer state and buffers for any worker count,
                faults and resumes (exact fixed-point step sums, one intra-op thread per CPU worker:
                README, "Deterministic training"). Default: equal to float32 rounding, faster.
        """
        from .run.display import check_verbose

        ray_cluster = None
        try:
            verbose = check_verbose(verbose)
            v.check_bool("tensorboard", tensorboard)
            host = chosen_bind_address(bind_address)  # checked before anything starts
            ray_cluster = open_cluster(check_cluster(cluster))  # a bad value fails here, before anything starts
            loop = LoopOptions(
                num_dataloader_threads, validation_freq, checkpoint_freq, keep_checkpoints, deterministic
            )
            ignored = {"worker_memory": worker_memory, "driver_memory": driver_memory}
            sizes = (epoch_number, batch_size, engines_number, effective_batch_size)
            setup, adapter, train_set = self._prepare(*sizes, loop, seed, run_dir, resume, ignored, ray_cluster)
            # Unless told otherwise, a Ray job listens on the node's IP, a local one on loopback.
            setup = dataclasses.replace(setup, bind_address=host or (ray_cluster.host if ray_cluster else LOOPBACK))
            return self._run(setup, adapter, train_set, open_run(run_dir, setup), ray_cluster, (verbose, tensorboard))
        except BaseException:
            self._drop_warm()  # a train() that fails leaves no process behind (the next starts its own)
            raise
        finally:
            if ray_cluster is not None:
                ray_cluster.close()

    def _run(
        self,
        setup: DriverSetup,
        adapter: FrameworkAdapter,
        train_set: Any,
        run: RunDirectory,
        ray_cluster: Any,
        display: tuple[int, bool],
    ) -> TrainResult:
        """Train with the driver (workers local or on ``ray_cluster``), then hand the result over."""
        from .driver.driver import Driver  # torch.distributed is imported only once training starts
        from .launchers.local import local_launcher_factory
        from .run.display import run_with_display

        # Local workers fork from the job's warm process (docs/architecture.md, "Start-up").
        warm = None if ray_cluster else self._take_warm(run)
        self._drop_warm()  # a Ray job's has nothing to do
        launcher = (
            ray_cluster.launcher_factory(run.worker_log)
            if ray_cluster
            else local_launcher_factory(run.worker_log, setup.threads, warm)
        )
        drivers: list[Driver] = []

        def start(hooks: Hooks) -> Any:
            drivers.append(Driver(setup, run, hooks, launcher))
            return drivers[0].run()

        try:
            final, hooks = run_with_display(self.driver_logger_callback, setup, run, display, start)
        except BaseException as exc:  # a worker's error: its traceback is the cause, the driver's frames noise
            from .errors import RemoteTraceback

            if isinstance(exc.__cause__, RemoteTraceback):
                raise exc.with_traceback(None) from exc.__cause__
            raise
        finally:
            if warm is not None:
                warm.close()
        driver, plan = drivers[0], setup.plan
        onnx_diff = self._finish(final, adapter, train_set, run, hooks)
        self.run_dir = run.path
        return TrainResult(
            run.path, driver.train_history, driver.test_history, plan.seed, driver.replica_digests, onnx_diff
        )

    def _take_warm(self, run: RunDirectory) -> WarmProcess | None:
        """The warm process started with this object, where it suits the job (it is alive and has
        the environment workers get now); else a new one. Either way it is this job's alone."""
        from .launchers.local import start_warm_process, warm_environment

        warm, self._warm = self._warm, None
        if self._warm_finalizer is not None:
            self._warm_finalizer.detach()
        if warm is not None and warm.alive and warm.env == warm_environment():
            warm.move_log(run.logs / "warm.log")
            return warm
        if warm is not None:
            warm.discard()
        return start_warm_process(self.framework, run.logs / "warm.log")

    def _drop_warm(self) -> None:
        """End the warm process started with this object, if no job has taken it."""
        warm, finalizer = getattr(self, "_warm", None), getattr(self, "_warm_finalizer", None)
        self._warm = self._warm_finalizer = None
        if finalizer is not None:
            finalizer.detach()
        if warm is not None:
            warm.discard()

    def __getstate__(self) -> dict[str, Any]:
        """A copy has no warm process (it is this object's, and a process is not data)."""
        state = self.__dict__.copy()
        state["_warm"] = state["_warm_finalizer"] = None
        return state

    def _finish(
        self, final: Any, adapter: FrameworkAdapter, train_set: Any, run: RunDirectory, hooks: Hooks
    ) -> float | None:
        """The trained state into the user's model and optimizer, the model saved (and exported)."""
        framework, self._trained_adapter = self._framework, adapter
        # The scheduler's final state into the user's, as the optimizer's (callbacks stay: a next train() starts fresh).
        own = LoopState(adapter.stat_names, self.lr_scheduling, []).unpack(final.optimizer_state)
        framework.load_final_state(adapter, final.model_state, own)
        framework.save_model(run.model, self.model, final.model_state)
        framework.hand_over(adapter)  # Keras: the model comes back compiled
        if not self.save_to_onnx:
            return None
        from .frameworks.export import export_final_model

        onnx_diff = export_final_model(framework, self.model, adapter, train_set, run)
        if onnx_diff is not None:  # the progress display shows it (a user's logger may take note() too)
            hooks.note(f"model/model.onnx written; onnxruntime vs {self.framework}: max abs diff {onnx_diff:.3g}")
        return onnx_diff

    def download(self, out_dir: str | os.PathLike[str] | None = None) -> str:
        """Zip the last run's ``model/`` directory into ``out_dir`` (default: the run directory);
        returns the zip's path."""
        if self.run_dir is None or not (self.run_dir / "model").is_dir():
            raise RuntimeError("Nothing to download yet: call train() first; download() zips the trained model.")
        target = Path(out_dir) if out_dir is not None else self.run_dir
        target.mkdir(parents=True, exist_ok=True)
        archive = shutil.make_archive(str(target / "model"), "zip", root_dir=self.run_dir, base_dir="model")
        return str(Path(archive).resolve())

    def _prepare(
        self,
        epoch_number: int,
        batch_size: int,
        engines_number: int | None,
        effective_batch_size: int | None,
        loop: LoopOptions,
        seed: int | None,
        run_dir: str | os.PathLike[str] | None,
        resume: bool,
        ignored: dict[str, Any],
        ray_cluster: Any = None,
    ) -> tuple[DriverSetup, FrameworkAdapter, Any]:
        """Check ``train``'s arguments and the data, size the run, draw its seed, serialize the job;
        returns what the driver needs, the adapter and the training set."""
        from .driver.driver import DriverSetup

        check_train_arguments(
            epoch_number, batch_size, engines_number, effective_batch_size, loop, seed, resume, ignored
        )
        framework = self._framework
        if self.save_to_onnx:
            from .frameworks.export import check_onnx_available

            check_onnx_available(framework, self.model)  # a missing package fails now, not after training
        train_set, test_set = v.check_datasets(self.datasets_function)
        items_per_micro_batch, sizing = size_run(train_set, batch_size, engines_number, effective_batch_size)
        engines, (sizing, gpus) = sizing.max_workers, place_workers(sizing, ray_cluster)  # engines: all slots
        resumed = None
        if resume:  # the run's own seed and newest checkpoint; its plan is checked below
            resumed, seed = checkpoint.find_resume_point(run_dir, seed)
        seed = framework.draw_seed() if seed is None else seed
        plan = Plan(len(train_set), items_per_micro_batch, sizing.micro_batches, seed)
        if resumed is not None:
            checkpoint.check_resumable(
                resumed,
                plan=plan,
                framework=self.framework,
                epochs=epoch_number,
                batch_size=batch_size,
                engines_number=engines_number,
                effective_batch_size=effective_batch_size,
            )
        exact = sizing.micro_batches if loop.deterministic else None  # the micro-batches per step
        adapter, payload = self._ship(train_set, test_set is not None, exact)
        config = train_config(epoch_number, batch_size, sizing, seed, loop, gpus)
        setup = DriverSetup(
            payload=payload,
            config=config,
            plan=plan,
            has_test=test_set is not None,
            stat_names=adapter.stat_names,
            devices=slot_devices(sizing.max_workers, gpus),
            threads=run_setup.worker_threads(loop.deterministic, ray_cluster, gpus, sizing.max_workers),
            framework=self.framework,
            keep_checkpoints=loop.keep_checkpoints,
            keep_best=best_of(self.user_callbacks),
            resume=resumed,
            max_workers=engines,
        )
        return setup, adapter, train_set

    def _make_adapter(self) -> FrameworkAdapter:
        from .frameworks.base import UserObjects

        user = UserObjects(
            self.model,
            self.optimizer,
            self.loss_function,
            self.metrics,
            collate=self.fn_batch_collate,
            custom_objects=self.keras_custom_objects,
            fn_step_train=self.fn_step_train,
            fn_test=self.fn_test,
            fn_args=self.fn_args,
            step_options=self.step_options,
        )
        return self._framework.make_adapter(user)

    def _ship(self, train_set: Any, has_test: bool, exact: int | None) -> tuple[FrameworkAdapter, bytes]:
        """The adapter (deterministic for ``exact`` micro-batches per step) and the job every
        worker receives, once what it monitors is checked."""
        adapter, framework = self._make_adapter(), self._framework
        if exact is not None:
            adapter = run_setup.make_deterministic(self.framework, adapter, exact)
        # EarlyStopping, BestCheckpoints, ReduceLROnPlateau: each monitor must name a metric of the run.
        check_monitors([*self.user_callbacks, self.lr_scheduling], adapter.stat_names, has_test)
        return adapter, self._job_payload(
            framework.prepare_for_shipping(adapter, framework.first_batch(adapter, train_set))
        )

    def _job_payload(self, adapter: FrameworkAdapter) -> bytes:
        """The job every worker receives, cloudpickled once."""
        hooks = Hooks.for_worker(self.worker_logger_callback, self.user_callbacks)
        return serialize_job(Job(adapter, self.datasets_function, hooks, self.lr_scheduling))
