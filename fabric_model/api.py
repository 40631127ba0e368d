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
from typing import Any

import cloudpickle

from . import checkpoint, compat
from . import validation as v
from .callbacks import Callback, ProgressBar
from .config import TrainConfig, get_timeout, local_device_count, size_engines, threads_per_worker
from .data import is_batch_level
from .frameworks import detect_framework
from .job import Job
from .plan import Plan

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
        self.framework = detect_framework(model)
        keras_model = self.framework == "keras"
        if keras_model:
            for name, value in (("fn_step_train", fn_step_train), ("fn_test", fn_test)):
                if value is not None:
                    raise TypeError(
                        f"`{name}` is supported for torch models only. Received: {name}={value!r} with a Keras model. "
                        "HINT: a Keras model's custom training belongs in its train_step-free call(); "
                        "leave the step to fabric_model."
                    )
        v.check_callable(
            "get_datasets",
            get_datasets,
            hint=" HINT: pass the function itself, get_datasets=my_fn, not its result my_fn().",
        )
        if not keras_model:
            v.check_callable(
                "loss_function",
                loss_function,
                hint=" HINT: pass e.g. torch.nn.functional.cross_entropy or torch.nn.CrossEntropyLoss().",
            )
        self.metrics = _check_keras_metrics(metrics) if keras_model else v.check_metrics(metrics)
        v.check_logger("worker_logger_callback", worker_logger_callback)
        v.check_logger("driver_logger_callback", driver_logger_callback)
        v.check_bool("save_to_onnx", save_to_onnx)
        if keras_custom_objects is not None and not isinstance(keras_custom_objects, dict):
            raise TypeError(
                "Expected `keras_custom_objects` to be a dict of name -> class or None. "
                f"Received: keras_custom_objects={keras_custom_objects!r}"
            )
        v.check_callable("fn_batch_collate", fn_batch_collate, allow_none=True)
        v.check_callable(
            "fn_step_train",
            fn_step_train,
            allow_none=True,
            hint=" HINT: step(model, data, eva, train_loader, fn_args) -> (metric, loss).",
        )
        v.check_callable(
            "fn_test", fn_test, allow_none=True, hint=" HINT: fn_test(model, test_iter, fn_args) -> (metric, loss)."
        )
        self.user_callbacks = v.check_user_callbacks(user_callback)
        if keras_model:
            from .frameworks.keras_names import resolve_loss, resolve_optimizer

            resolve_loss(loss_function)  # names checked here, in the caller
            resolve_optimizer(optimizer)
        else:
            _check_torch_optimizer(model, optimizer)
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
        keep_checkpoints: int = checkpoint.DEFAULT_KEEP,
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
        for name, value in (("worker_memory", worker_memory), ("driver_memory", driver_memory)):
            if value is not None:
                log.info("%s=%r is ignored: %s", name, value, compat.IGNORED_TRAIN_KEYWORDS[name])
        v.check_positive_int("epoch_number", epoch_number)
        v.check_positive_int("batch_size", batch_size)
        v.check_positive_int("engines_number", engines_number, allow_none=True)
        v.check_positive_int("num_dataloader_threads", num_dataloader_threads, minimum=0)
        v.check_positive_int("validation_freq", validation_freq)
        v.check_positive_int("checkpoint_freq", checkpoint_freq, minimum=0)
        v.check_bool("resume", resume)
        v.check_positive_int("keep_checkpoints", keep_checkpoints)
        v.check_effective_batch(effective_batch_size, batch_size)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise TypeError(f"Expected `seed` to be a non-negative int or None. Received: seed={seed!r}")
        if self.save_to_onnx:
            _check_onnx_available(self.framework, self.model)  # a missing package fails now, not after training
        train_set, test_set = v.check_datasets(self.get_datasets)
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
        resumed = None
        if resume:  # the run's own seed and newest checkpoint; its plan is checked below
            resumed, seed = checkpoint.find_resume_point(run_dir, seed)
        seed = _draw_seed(self.framework) if seed is None else seed
        adapter = self._make_adapter()
        _check_first_sample(adapter, train_set)
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
                stacklevel=2,
            )
        gpus = local_device_count()
        devices: list[str | None] = [f"cuda:{i % gpus}" if gpus else "cpu" for i in range(sizing.max_workers)]
        config = TrainConfig(
            epochs=epoch_number,
            batch_size=batch_size,
            sizing=sizing,
            seed=seed,
            num_dataloader_threads=num_dataloader_threads,
            validation_freq=validation_freq,
            checkpoint_freq=checkpoint_freq,
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
        if self.framework == "keras":
            adapter.load_state(final.model_state, final.optimizer_state)  # into the user's model and optimizer
            _save_keras_model(directory, self.model)
        else:
            self.model.load_state_dict(final.model_state)
            self.optimizer.load_state_dict(final.optimizer_state)
            _save_model(directory, final.model_state)
        onnx_diff = None
        if self.save_to_onnx:
            onnx_diff = _export_onnx(self.framework, self.model, adapter, train_set, directory)
            if onnx_diff is not None and isinstance(logger, ProgressBar):  # the default logger shows it
                logger.note(f"model/model.onnx written; onnxruntime vs {self.framework}: max abs diff {onnx_diff:.3g}")
        self.run_dir = directory
        return TrainResult(
            directory, driver.train_history, driver.test_history, seed, driver.replica_digests, onnx_diff
        )

    def download(self, out_dir: str | os.PathLike[str] | None = None) -> str:
        """Zip the last run's ``model/`` directory into ``out_dir`` (default: the run directory);
        returns the zip's path."""
        if self.run_dir is None or not (self.run_dir / "model").is_dir():
            raise RuntimeError("Nothing to download yet: call train() first; download() zips the trained model.")
        target = Path(out_dir) if out_dir is not None else self.run_dir
        target.mkdir(parents=True, exist_ok=True)
        archive = shutil.make_archive(str(target / "model"), "zip", root_dir=self.run_dir, base_dir="model")
        return str(Path(archive).resolve())

    def _make_adapter(self) -> Any:
        if self.framework == "keras":
            from .frameworks.keras_adapter import KerasAdapter

            return KerasAdapter(
                self.model,
                self.optimizer,
                self.loss_function,
                self.metrics,
                self.keras_custom_objects,
                self.fn_batch_collate,
            )
        from .frameworks.torch_adapter import TorchAdapter

        return TorchAdapter(
            self.model,
            self.optimizer,
            self.loss_function,
            self.metrics,
            self.fn_batch_collate,
            self.fn_step_train,
            self.fn_test,
            self.fn_args,
        )


_LARGE_JOB_BYTES = 256 * 2**20


def _check_torch_optimizer(model: Any, optimizer: Any) -> None:
    import torch

    if not isinstance(optimizer, torch.optim.Optimizer):
        hint = (
            " HINT: pass an instance, e.g. torch.optim.SGD(model.parameters(), lr=0.1)."
            if isinstance(optimizer, type)
            else ""
        )
        raise TypeError(
            f"Expected `optimizer` to be a torch.optim.Optimizer over the model's parameters. "
            f"Received: optimizer={optimizer!r}.{hint}"
        )
    model_params = {id(p) for p in model.parameters()}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    foreign = [p for p in held if id(p) not in model_params]
    if not held or foreign:
        raise ValueError(
            f"Expected `optimizer` to hold the parameters of `model`. Received: an optimizer over {len(held)} "
            f"tensor(s), {len(foreign)} of which are not parameters of the model. "
            "HINT: build the optimizer from this model, optimizer=SGD(model.parameters(), ...), "
            "after any model.to(device) or re-creation."
        )


def _check_first_sample(adapter: Any, train_set: Any) -> None:
    """Read and collate the first training sample, so a wrong sample shape fails here; a Keras
    model is then rebuilt once, as the workers will rebuild it."""
    keras_model = type(adapter).__name__ == "KerasAdapter"
    try:
        if is_batch_level(train_set):
            batch = train_set[0]
        else:
            batch = adapter.collate([train_set[0]])
        if keras_model:
            from .frameworks.keras_adapter import split_keras_batch

            split_keras_batch(batch)
        else:
            from .frameworks.torch_adapter import split_batch

            split_batch(batch)
    except Exception as exc:
        raise TypeError(
            f"Could not make a batch from the first training sample: {exc}. Expected samples to be "
            "(input, target) tuples or dicts with a 'target' or 'label' key, of tensors, numpy arrays or numbers "
            "(or pass `fn_batch_collate` returning (inputs, target))."
        ) from exc
    if keras_model:
        adapter.check_rebuild(batch)


def _draw_seed(framework: str) -> int:
    """A seed from the global generator that the framework's own seeding call sets:
    ``torch.manual_seed`` for torch; for Keras NumPy's, which ``keras.utils.set_random_seed``
    (and ``np.random.seed``) seeds. Keras 3 on TensorFlow does not seed torch."""
    if framework == "keras":
        import numpy as np

        return int(np.random.randint(0, 2**31 - 1))
    import torch

    return int(torch.randint(0, 2**31 - 1, (1,)).item())


def _run_directory(run_dir: str | os.PathLike[str] | None) -> Path:
    if run_dir is not None:
        path = Path(run_dir)
    elif os.environ.get("RESULT_DIR"):
        path = Path(os.environ["RESULT_DIR"])
    else:
        path = Path("fabric_runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
    (path / "logs").mkdir(parents=True, exist_ok=True)
    return path.resolve()


def _save_model(directory: Path, model_state: dict[str, Any]) -> None:
    """The final weights in torch's own format: ``model/model.pt``, a state_dict
    (load with ``torch.load(path, weights_only=True)``), written aside then renamed."""
    import torch

    model_dir = directory / "model"
    model_dir.mkdir(exist_ok=True)
    tmp = model_dir / ".model.pt.tmp"
    torch.save(model_state, tmp)
    os.replace(tmp, model_dir / "model.pt")


def _save_keras_model(directory: Path, model: Any) -> None:
    """The final model in Keras' own format: ``model/model.keras`` (``keras.saving.load_model``),
    written aside then renamed."""
    model_dir = directory / "model"
    model_dir.mkdir(exist_ok=True)
    tmp = model_dir / ".model.tmp.keras"  # Keras insists on the .keras suffix
    model.save(tmp)
    os.replace(tmp, model_dir / "model.keras")


def _check_onnx_available(framework: str, model: Any) -> None:
    from .export import ExportError, _require

    try:
        for module in ("onnx", "onnxruntime", "onnxscript" if framework == "torch" else "tf2onnx"):
            _require(module, framework, model)
    except ExportError as exc:
        raise ImportError(f"save_to_onnx=True needs the ONNX packages: {exc}") from None


def _export_onnx(framework: str, model: Any, adapter: Any, train_set: Any, directory: Path) -> float | None:
    """``model/model.onnx`` from the trained model, traced on the first training batch; returns
    onnxruntime's max abs difference from the framework, also logged and written to
    ``logs/metrics.jsonl`` as a ``type: "onnx"`` line. A failure is a warning (and such a line
    with the error), not an exception: the trained model is already in ``model`` and ``model/``."""
    from .export import ExportError, export_onnx

    try:
        if is_batch_level(train_set):
            batch = train_set[0]
        else:
            batch = adapter.collate([train_set[i] for i in range(min(len(train_set), 4))])
        if framework == "keras":
            from .frameworks.keras_adapter import split_keras_batch

            inputs = split_keras_batch(batch)[0]
        else:
            from .frameworks.torch_adapter import split_batch

            inputs = split_batch(batch)[0]
        diff = export_onnx(framework, model, inputs, directory / "model" / "model.onnx")
    except ExportError as exc:
        _append_log(directory, {"type": "onnx", "path": None, "error": str(exc)})
        warnings.warn(f"save_to_onnx=True, but the ONNX export failed; no model.onnx was written. {exc}", stacklevel=3)
        return None
    _append_log(directory, {"type": "onnx", "path": "model/model.onnx", "max_abs_diff": diff})
    log.info("model/model.onnx written; onnxruntime vs %s on real batches: max abs difference %.3g", framework, diff)
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


def _check_keras_metrics(metrics: Any) -> list[Any]:
    from .frameworks.keras_names import resolve_metric

    if metrics is None:
        return []
    if not isinstance(metrics, (list, tuple)):
        raise TypeError(
            "Expected `metrics` to be a list of Keras metric names ('accuracy'), keras.metrics.Metric objects or "
            f"callables metric(y_true, y_pred). Received: metrics={metrics!r}. HINT: wrap it in a list."
        )
    for i, m in enumerate(metrics):
        resolve_metric(m, i)
    return list(metrics)


def _write_run_record(directory: Path, config: TrainConfig, plan: Plan, framework: str) -> None:
    record = {
        "framework": framework,
        "config": dataclasses.asdict(config),
        "plan": dataclasses.asdict(plan),
        "started": time.time(),
    }
    (directory / "run.json").write_text(json.dumps(record, indent=2))
