"""The public face: ``FabricModel`` validates what the user gives and hands it to the driver."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import shutil
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import cloudpickle

# Light modules only: `import fabric_model` must not import torch (and so torch.distributed).
# The framework, checkpoints and the driver are imported inside the functions that use them.
from . import compat
from . import validation as v
from .callbacks import Callback, ProgressBar
from .config import EngineSizing, TrainConfig, get_timeout, local_device_count, size_engines, threads_per_worker
from .data import is_batch_level
from .job import Job
from .plan import Plan

if TYPE_CHECKING:
    from .frameworks.base import Framework, FrameworkAdapter

log = logging.getLogger(__name__)

#: How many of the newest checkpoints ``train`` keeps: ``checkpoint.DEFAULT_KEEP``, written out
#: here because importing checkpoint imports torch.
_DEFAULT_KEEP_CHECKPOINTS = 3


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


class _Loop(NamedTuple):
    """``train``'s knobs of the loop, as given (checked by ``_check_train_arguments``)."""

    num_dataloader_threads: Any
    validation_freq: Any
    checkpoint_freq: Any
    keep_checkpoints: Any


@dataclasses.dataclass
class _Prepared:
    """What ``train`` hands the driver: the checked data, the job as shipped, the run's configuration."""

    train_set: Any
    test_set: Any
    adapter: FrameworkAdapter
    payload: bytes
    config: TrainConfig
    plan: Plan
    gpus: int
    devices: list[str | None]
    resumed: Any


class FabricModel:
    """Trains a single-device PyTorch or Keras model data-parallel on up to ``engines_number`` workers.

    Args:
        model: a ``torch.nn.Module`` or a Keras 3 ``keras.Model`` (see the README's "Keras
            models": names are accepted for a Keras loss, optimizer and metrics).
        get_datasets: a function returning ``(train_dataset, test_dataset)``: map-style
            datasets (``__len__`` and ``__getitem__``) whose samples are ``(input, target)``
            tuples or dicts with a ``target``/``label`` key; ``test_dataset`` may be None.
            It is called once in the caller (to check it) and once in each worker.
        loss_function: torch: ``loss(output, target)`` returning the batch-mean loss. Keras: a
            ``keras.losses`` instance, a loss name, or ``loss(y_true, y_pred)`` (Keras' order).
        optimizer: an optimizer over ``model``'s parameters (Keras: an instance or a name).
        metrics: torch: callables ``metric(output, target)`` returning a batch mean. Keras:
            names ("accuracy"), ``keras.metrics.Metric`` instances or ``metric(y_true, y_pred)``.
        worker_logger_callback: a logger run in every worker (see :mod:`fabric_model.callbacks`).
        driver_logger_callback: a logger run in the caller; replaces the default progress bar.
        save_to_onnx: after training, also write ``model/model.onnx`` (dynamic batch dimension),
            checked with onnxruntime against the framework on a real batch. A failed export is
            a warning (the trained model is kept); missing packages fail before training.
        keras_custom_objects: ``{"name": class}`` of the custom layers, models, losses and
            metrics a Keras model needs to be rebuilt in each worker.
        fn_batch_collate: ``collate(list_of_samples) -> (inputs, target)``; the default stacks
            tensors, numpy arrays and numbers, and recurses into tuples and dicts.
    """

    def __init__(
        self,
        model: Any,
        get_datasets: Callable[[], tuple[Any, Any]],
        loss_function: Callable[[Any, Any], Any],
        optimizer: Any,
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
    ) -> None:
        # IBM's keyword names (compat.CONSTRUCTOR_ALIASES).
        driver_logger_callback = compat.pick(
            "driver_logger_callback", driver_logger_callback, "driver_logger", driver_logger
        )
        worker_logger_callback = compat.pick(
            "worker_logger_callback", worker_logger_callback, "worker_logger", worker_logger
        )
        save_to_onnx = compat.pick("save_to_onnx", save_to_onnx or None, "enable_onnx", enable_onnx) or save_to_onnx
        from .frameworks import detect_framework

        self._framework: Framework = detect_framework(model)  # chosen once; only it knows the framework
        self.framework = self._framework.name  # as run records and checkpoints spell it
        self.model, self.get_datasets, self.loss_function, self.optimizer = (
            model,
            get_datasets,
            loss_function,
            optimizer,
        )
        self.worker_logger_callback = worker_logger_callback
        self.driver_logger_callback = driver_logger_callback
        self.save_to_onnx = save_to_onnx
        self.keras_custom_objects = keras_custom_objects
        self.fn_batch_collate = fn_batch_collate
        self.fn_step_train, self.fn_test, self.fn_args = fn_step_train, fn_test, fn_args
        self.metrics, self.user_callbacks = self._check_arguments(metrics, user_callback)
        self.run_dir: Path | None = None

    def train(
        self,
        epoch_number: int,
        batch_size: int,
        engines_number: int | None = None,
        num_dataloader_threads: int = 4,
        validation_freq: int = 1,
        checkpoint_freq: int = 1,
        effective_batch_size: int | None = None,
        *,
        seed: int | None = None,
        run_dir: str | os.PathLike[str] | None = None,
        resume: bool = False,
        keep_checkpoints: int = _DEFAULT_KEEP_CHECKPOINTS,
        worker_memory: Any = None,
        driver_memory: Any = None,
    ) -> TrainResult:
        """Train for ``epoch_number`` epochs; the user's ``model`` then holds the trained weights.

        Args:
            epoch_number: epochs to train.
            batch_size: samples per micro-batch (per device).
            engines_number: the most workers at once; with ``batch_size`` it sets the global
                batch ``batch_size * engines_number``. Default: one per local GPU (1 on CPU).
            num_dataloader_threads: threads per worker reading upcoming micro-batches (0: none).
            validation_freq: validate after every ``validation_freq``-th epoch.
            checkpoint_freq: write a checkpoint (``run_dir/checkpoints/``) after every
                ``checkpoint_freq``-th epoch (0: never).
            effective_batch_size: the global batch, a multiple of ``batch_size``; see
                :func:`fabric_model.config.size_engines` for how it combines with engines_number.
            seed: the run's seed; by default drawn from the framework's global generator
                (torch's; for Keras, NumPy's, which ``keras.utils.set_random_seed`` seeds), so
                ``torch.manual_seed(0)`` or ``keras.utils.set_random_seed(0)`` at the top of a
                script makes the run reproducible.
            run_dir: where logs go; default ``$RESULT_DIR`` or ``./fabric_runs/<run-id>``.
            resume: continue the run in ``run_dir`` (or ``$RESULT_DIR``) from its newest complete
                checkpoint, with its seed and plan; the dataset length, ``batch_size`` and the
                global batch must match it, ``engines_number`` may differ. Without a checkpoint,
                training starts from the beginning (a warning is logged).
            keep_checkpoints: how many of the newest checkpoints to keep (older ones are deleted).
            worker_memory, driver_memory: accepted for scripts written for IBM's FabricModel,
                and ignored: memory is not capped (a note is logged).
        """
        prep = self._prepare(
            epoch_number,
            batch_size,
            engines_number,
            effective_batch_size,
            _Loop(num_dataloader_threads, validation_freq, checkpoint_freq, keep_checkpoints),
            seed,
            run_dir,
            resume,
            {"worker_memory": worker_memory, "driver_memory": driver_memory},
        )
        payload, config, plan, adapter, test_set = prep.payload, prep.config, prep.plan, prep.adapter, prep.test_set
        gpus, devices, sizing, resumed = prep.gpus, prep.devices, prep.config.sizing, prep.resumed
        directory = _run_directory(run_dir)
        _write_run_record(directory, config, plan, self.framework)
        logger = compat.adapt_logger(self.driver_logger_callback, in_worker=False) or ProgressBar(
            epoch_number, plan.steps_per_epoch, plan.global_batch
        )

        from .driver.driver import Driver  # torch.distributed is imported only once training starts

        driver = Driver(
            payload,
            config,
            plan,
            test_set is not None,
            adapter.stat_names,
            directory,
            devices,
            threads_per_worker(1 if gpus else sizing.max_workers),
            logger,
            framework=self.framework,
            keep_checkpoints=keep_checkpoints,
            resume=resumed,
        )
        final = driver.run()
        onnx_diff = self._finish(final, adapter, prep.train_set, directory, logger)
        self.run_dir = directory
        return TrainResult(
            directory, driver.train_history, driver.test_history, config.seed, driver.replica_digests, onnx_diff
        )

    def _finish(
        self, final: Any, adapter: FrameworkAdapter, train_set: Any, directory: Path, logger: Any
    ) -> float | None:
        """The trained state into the user's model and optimizer, the model saved (and exported)."""
        framework = self._framework
        framework.load_final_state(adapter, final.model_state, final.optimizer_state)
        framework.save_model(directory / "model", self.model, final.model_state)
        if not self.save_to_onnx:
            return None
        onnx_diff = _export_onnx(framework, self.model, adapter, train_set, directory)
        if onnx_diff is not None and isinstance(logger, ProgressBar):  # the default logger shows it
            logger.note(f"model/model.onnx written; onnxruntime vs {self.framework}: max abs diff {onnx_diff:.3g}")
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
        loop: _Loop,
        seed: int | None,
        run_dir: str | os.PathLike[str] | None,
        resume: bool,
        ignored: dict[str, Any],
    ) -> _Prepared:
        """Check ``train``'s arguments and the data, size the run, draw its seed, serialize the job."""
        from . import checkpoint  # imports torch: only once training is asked for

        _check_train_arguments(
            epoch_number, batch_size, engines_number, effective_batch_size, loop, seed, resume, ignored
        )
        framework = self._framework
        if self.save_to_onnx:
            _check_onnx_available(framework, self.model)  # a missing package fails now, not after training
        train_set, test_set = v.check_datasets(self.get_datasets)
        items_per_micro_batch, sizing = _size_run(train_set, batch_size, engines_number, effective_batch_size)
        resumed = None
        if resume:  # the run's own seed and newest checkpoint; its plan is checked below
            resumed, seed = checkpoint.find_resume_point(run_dir, seed)
        seed = framework.draw_seed() if seed is None else seed
        adapter = self._make_adapter()
        first_batch = framework.first_batch(adapter, train_set)
        payload = self._job_payload(framework.prepare_for_shipping(adapter, first_batch))
        gpus = local_device_count()
        devices: list[str | None] = [f"cuda:{i % gpus}" if gpus else "cpu" for i in range(sizing.max_workers)]
        config = TrainConfig(
            epochs=epoch_number,
            batch_size=batch_size,
            sizing=sizing,
            seed=seed,
            num_dataloader_threads=loop.num_dataloader_threads,
            validation_freq=loop.validation_freq,
            checkpoint_freq=loop.checkpoint_freq,
            collective_timeout_s=get_timeout("EDT_COLLECTIVE_TIME_OUT").total_seconds(),
            backend="nccl" if gpus else "gloo",
        )
        plan = Plan(
            num_samples=len(train_set), batch_size=items_per_micro_batch, micro_batches=sizing.micro_batches, seed=seed
        )
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
        return _Prepared(train_set, test_set, adapter, payload, config, plan, gpus, devices, resumed)

    def _check_arguments(self, metrics: Any, user_callback: Any) -> tuple[list[Any], list[Any]]:
        """Check the constructor's arguments (messages name the argument); return the metrics and callbacks."""
        framework = self._framework
        framework.check_options(
            fn_step_train=self.fn_step_train, fn_test=self.fn_test, keras_custom_objects=self.keras_custom_objects
        )
        v.check_callable(
            "get_datasets",
            self.get_datasets,
            hint=" HINT: pass the function itself, get_datasets=my_fn, not its result my_fn().",
        )
        framework.check_loss(self.loss_function)
        checked_metrics = framework.check_metrics(metrics)
        v.check_logger("worker_logger_callback", self.worker_logger_callback)
        v.check_logger("driver_logger_callback", self.driver_logger_callback)
        v.check_bool("save_to_onnx", self.save_to_onnx)
        v.check_callable("fn_batch_collate", self.fn_batch_collate, allow_none=True)
        v.check_callable(
            "fn_step_train",
            self.fn_step_train,
            allow_none=True,
            hint=" HINT: step(model, data, eva, train_loader, fn_args) -> (metric, loss).",
        )
        v.check_callable(
            "fn_test",
            self.fn_test,
            allow_none=True,
            hint=" HINT: fn_test(model, test_iter, fn_args) -> (metric, loss).",
        )
        callbacks = v.check_user_callbacks(user_callback)
        framework.check_optimizer(self.model, self.optimizer)
        return checked_metrics, list(callbacks)

    def _make_adapter(self) -> FrameworkAdapter:
        return self._framework.make_adapter(
            self.model,
            self.optimizer,
            self.loss_function,
            self.metrics,
            collate=self.fn_batch_collate,
            custom_objects=self.keras_custom_objects,
            fn_step_train=self.fn_step_train,
            fn_test=self.fn_test,
            fn_args=self.fn_args,
        )

    def _job_payload(self, adapter: FrameworkAdapter) -> bytes:
        """The job every worker receives, cloudpickled once."""
        job = Job(
            adapter,
            self.get_datasets,
            compat.adapt_logger(self.worker_logger_callback, in_worker=True),
            list(self.user_callbacks),
        )
        try:
            payload = cloudpickle.dumps(job)
        except Exception as exc:
            raise TypeError(
                "Could not serialize the job (model, optimizer, get_datasets, loss_function, metrics, loggers) "
                f"for the workers: {exc!r}. HINT: objects holding open files, locks or sockets cannot be sent; "
                "create them inside get_datasets or the logger's methods instead."
            ) from exc
        if len(payload) > _LARGE_JOB_BYTES:
            warnings.warn(
                f"The job sent to each worker is {len(payload) / 2**20:,.0f} MiB. Data captured by get_datasets "
                "(or tensors that are views of a larger tensor) travel with it. HINT: load or build the data inside "
                "get_datasets, and .clone() tensor slices.",
                stacklevel=4,
            )
        return payload


_LARGE_JOB_BYTES = 256 * 2**20


def _check_train_arguments(
    epoch_number: Any,
    batch_size: Any,
    engines_number: Any,
    effective_batch_size: Any,
    loop: _Loop,
    seed: Any,
    resume: Any,
    ignored: dict[str, Any],
) -> None:
    """Check ``train``'s arguments (messages name the argument); note the ignored ones."""
    for name, value in ignored.items():
        if value is not None:
            log.info("%s=%r is ignored: %s", name, value, compat.IGNORED_TRAIN_KEYWORDS[name])
    v.check_positive_int("epoch_number", epoch_number)
    v.check_positive_int("batch_size", batch_size)
    v.check_positive_int("engines_number", engines_number, allow_none=True)
    v.check_positive_int("num_dataloader_threads", loop.num_dataloader_threads, minimum=0)
    v.check_positive_int("validation_freq", loop.validation_freq)
    v.check_positive_int("checkpoint_freq", loop.checkpoint_freq, minimum=0)
    v.check_bool("resume", resume)
    v.check_positive_int("keep_checkpoints", loop.keep_checkpoints)
    v.check_effective_batch(effective_batch_size, batch_size)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise TypeError(f"Expected `seed` to be a non-negative int or None. Received: seed={seed!r}")


def _size_run(
    train_set: Any, batch_size: int, engines_number: int | None, effective_batch_size: int | None
) -> tuple[int, EngineSizing]:
    """(dataset items per micro-batch, the engines' sizing)."""
    # A batch-level dataset (keras.utils.PyDataset) yields whole batches: the plan counts
    # its items, each item is one micro-batch, and batch_size must be the dataset's own.
    batch_level = is_batch_level(train_set)
    items_per_micro_batch = 1 if batch_level else batch_size
    if batch_level:
        _check_batch_level(train_set, batch_size)
    sizing = size_engines(
        items_per_micro_batch,
        engines_number,
        None if effective_batch_size is None else effective_batch_size // batch_size * items_per_micro_batch,
    )
    return items_per_micro_batch, sizing


def _run_directory(run_dir: str | os.PathLike[str] | None) -> Path:
    if run_dir is not None:
        path = Path(run_dir)
    elif os.environ.get("RESULT_DIR"):
        path = Path(os.environ["RESULT_DIR"])
    else:
        path = Path("fabric_runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
    (path / "logs").mkdir(parents=True, exist_ok=True)
    return path.resolve()


def _check_onnx_available(framework: Framework, model: Any) -> None:
    from .export import ExportError, _require

    try:
        for module in framework.onnx_requirements():
            _require(module, framework.name, model)
    except ExportError as exc:
        raise ImportError(f"save_to_onnx=True needs the ONNX packages: {exc}") from None


def _export_onnx(
    framework: Framework, model: Any, adapter: FrameworkAdapter, train_set: Any, directory: Path
) -> float | None:
    """``model/model.onnx`` from the trained model, traced on the first training batch; returns
    onnxruntime's max abs difference from the framework, also logged and written to
    ``logs/metrics.jsonl`` as a ``type: "onnx"`` line. A failure is a warning (and such a line
    with the error), not an exception: the trained model is already in ``model`` and ``model/``."""
    from .export import ExportError, export_onnx

    try:
        inputs = framework.export_inputs(adapter, train_set)
        diff = export_onnx(framework, model, inputs, directory / "model" / "model.onnx")
    except ExportError as exc:
        _append_log(directory, {"type": "onnx", "path": None, "error": str(exc)})
        warnings.warn(f"save_to_onnx=True, but the ONNX export failed; no model.onnx was written. {exc}", stacklevel=4)
        return None
    _append_log(directory, {"type": "onnx", "path": "model/model.onnx", "max_abs_diff": diff})
    log.info(
        "model/model.onnx written; onnxruntime vs %s on real batches: max abs difference %.3g", framework.name, diff
    )
    return diff


def _append_log(directory: Path, record: dict[str, Any]) -> None:
    with open(directory / "logs" / "metrics.jsonl", "a") as f:
        f.write(json.dumps({**record, "time": time.time()}) + "\n")


def _check_batch_level(train_set: Any, batch_size: int) -> None:
    own = getattr(train_set, "batch_size", None)
    if isinstance(own, int) and own != batch_size:
        raise ValueError(
            f"Expected `batch_size` to be the batch size of the train dataset, a {type(train_set).__name__} that "
            f"yields whole batches of {own}. Received: batch_size={batch_size}. HINT: pass batch_size={own}; each "
            "of its batches is one micro-batch."
        )


def _write_run_record(directory: Path, config: TrainConfig, plan: Plan, framework: str) -> None:
    record = {
        "framework": framework,
        "config": dataclasses.asdict(config),
        "plan": dataclasses.asdict(plan),
        "started": time.time(),
    }
    (directory / "run.json").write_text(json.dumps(record, indent=2))
