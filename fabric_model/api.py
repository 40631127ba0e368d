"""The public face: ``FabricModel`` checks what the user gives and hands it to the pipeline
(:mod:`fabric_model.orchestrator.pipeline`); its warm process waits in a
:class:`~fabric_model.launchers.warm_slot.WarmSlot` until ``train()`` takes it."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from .callbacks import Callback
from .inference import InferenceMixin
from .launchers.cluster import check_cluster, open_cluster
from .orchestrator.run_setup import open_run
from .run.result import TrainResult
from .setup import checks as v
from .setup import compat
from .setup.config import LoopOptions

# Light modules only: `import fabric_model` must not import torch (and so torch.distributed).
# The framework, checkpoints and the driver are imported inside the functions that use them.
from .state import checkpoint
from .step.loop_state import check_lr_scheduler
from .step.options import check_step_options
from .transport.network import DEFAULT_BIND_ADDRESS as LOOPBACK
from .transport.network import chosen_bind_address

if TYPE_CHECKING:
    from .frameworks.base import Framework, FrameworkAdapter

__all__ = ["FabricModel", "TrainResult"]

log = logging.getLogger(__name__)


class FabricModel(InferenceMixin):
    """Trains a single-device PyTorch or Keras model data-parallel on up to ``engines_number`` workers.

    Args:
        model: a ``torch.nn.Module``, a Keras 3 ``keras.Model`` or a Keras 2 ``tf_keras.Model``
            (see docs/keras.md, "Loss, optimizer and metrics": names are accepted for a Keras loss,
            optimizer and metrics).
        datasets_function: a function returning ``(train_dataset, test_dataset)``: map-style
            datasets (``__len__`` and ``__getitem__``) whose samples are ``(input, target)``
            tuples or dicts with a ``target``/``label``/``labels`` key; ``test_dataset`` may be None.
            torch calls the model as its forward takes a sample (a dict by keyword,
            ``model(**inputs)``: docs/training.md, "Inputs and outputs").
            It is called once in the caller (to check it) and once in each worker.
        loss_function: torch: ``loss(output, target)`` returning the batch-mean loss, the output as
            the model returned it; None: the model computes its loss (``output.loss``, as Hugging
            Face models do when the batch holds ``labels``). Keras: a ``keras.losses`` instance, a
            loss name, or ``loss(y_true, y_pred)`` (Keras' order); None for a model that overrides
            ``compute_loss`` or ``train_step``, or with ``fn_step_train`` (docs/keras.md).
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
            ``{"scheduler": s, "interval": "step" | "epoch", "monitor": "val_loss"}``
            (docs/training.md, "Training features").
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
        # Defaults exist only so `get_datasets=` can stand in for the second parameter; both are required.
        # loss_function=None is the framework's to judge (torch: the model computes its loss).
        v.require(datasets_function=datasets_function, optimizer=optimizer)
        driver_logger_callback = compat.pick(
            "driver_logger_callback", driver_logger_callback, "driver_logger", driver_logger
        )
        worker_logger_callback = compat.pick(
            "worker_logger_callback", worker_logger_callback, "worker_logger", worker_logger
        )
        save_to_onnx = compat.pick("save_to_onnx", save_to_onnx or None, "enable_onnx", enable_onnx) or save_to_onnx
        from .frameworks import framework_name, framework_named
        from .launchers.warm_slot import WarmSlot

        self.framework = framework_name(model)  # as run records and checkpoints spell it
        self._stop_request = threading.Event()  # stop_training(): the running train()'s driver acts on it
        # The job's warm process imports from now on, beside this constructor and train()'s
        # checks: it is what bounds start-up (docs/architecture.md, "Start-up").
        self._warm = WarmSlot.prestart(self.framework)
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
            self.metrics, self.user_callbacks = v.check_constructor_arguments(self, metrics, user_callback)
            self.lr_scheduling = check_lr_scheduler(lr_scheduler, optimizer, self.framework)
            custom_step = fn_step_train is not None
            self.step_options = check_step_options(
                precision, gradient_clip_norm, self.framework, custom_step, optimizer
            )
        except BaseException:
            self._warm.drop()
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
        resume: bool | Literal["auto"] = False,
        keep_checkpoints: int = checkpoint.DEFAULT_KEEP,
        worker_memory: Any = None,
        driver_memory: Any = None,
        bind_address: str | None = None,
        cluster: str | None = None,
        verbose: int = 1,
        tensorboard: bool = True,
        deterministic: bool = False,
        profile: bool | int | tuple[int, int] | range | None = None,
        shard_optimizer_state: bool = False,
        num_dataloader_processes: int | None = None,
        checkpoint_steps: int = 0,
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
                ``__getitems__``, a list or tuple of samples), else one per two of the worker's
                cores, up to 4. Every sample is read after its seeds are set; a dataset that draws
                from torch's global generator is read on the training thread (docs/deterministic.md, "Augmentation").
            validation_freq: validate after every ``validation_freq``-th epoch.
            checkpoint_freq: checkpoint after every ``checkpoint_freq``-th epoch (0: never).
            effective_batch_size: the global batch, a multiple of ``batch_size``; see
                :func:`fabric_model.setup.config.size_engines` for how it combines with engines_number.
            seed: the run's seed; by default drawn from the framework's global generator, so
                ``torch.manual_seed(0)`` or ``keras.utils.set_random_seed(0)`` makes a run reproducible.
            run_dir: where logs go; default ``$RESULT_DIR`` or ``./fabric_runs/<run-id>``.
            resume: True: continue the run in ``run_dir`` (or ``$RESULT_DIR``) from its newest
                complete checkpoint, with its seed and plan (docs/run-directory.md, "Resume" says
                what must match); without a checkpoint, training starts from the beginning.
                ``"auto"``: continue a run that did not finish (``run.json`` says it failed, was
                interrupted or preempted, or its process was killed) and left a checkpoint, else
                start afresh, so a requeued or restarted job runs the same call unchanged.
            keep_checkpoints: how many of the newest checkpoints to keep (older ones are deleted).
            worker_memory, driver_memory: IBM's; accepted and ignored (memory is not capped).
            bind_address: the address of this host the driver listens on, for workers started by
                hand on other hosts (``fabric-model worker``); default ``$FABRIC_MODEL_BIND_ADDRESS``,
                else ``127.0.0.1``. ``"0.0.0.0"`` (every interface) only when asked for, with a warning.
            cluster: where workers run: ``"local"`` processes (default), or ``"ray"``: actors on the
                Ray cluster of ``RAY_ADDRESS`` (docs/clusters.md, "On a Ray cluster").
                Default ``$FABRIC_MODEL_CLUSTER``.
            verbose: 0 quiet, 1 a progress bar (plain lines when stderr is not a terminal) and the
                library's messages, 2 one line per epoch. ``logs/driver.log`` has every message.
            tensorboard: write TensorBoard scalars to ``<run_dir>/tensorboard`` and one CSV row per
                epoch to ``logs/metrics.csv``.
            deterministic: bitwise-identical weights, optimizer state and buffers for any worker count,
                faults and resumes (exact fixed-point step sums, one intra-op thread per CPU worker:
                docs/deterministic.md, "How"). Default: equal to float32 rounding, faster.
            profile: profile rank 0's steps with the torch profiler: True (steps 10-19), a number of
                steps from step 10, a ``(first, stop)`` pair or a ``range`` of global steps. The
                trace (Perfetto, Chrome, TensorBoard) and a summary of where a step's time went, your
                code against fabric_model's, go to ``<run_dir>/profile/``; the summary is also shown at
                the end (docs/training.md, "Profiling"). Default ``$FABRIC_MODEL_PROFILE``, else off.
            shard_optimizer_state: each worker holds the optimizer state of its slices of the
                parameters and of one other worker's (its buddy copy), about 2/N of the whole, and
                updates only those; among several, no worker keeps gradients between steps (they
                exist from a step's backward to its update); the weights are those of an unsharded
                run, a killed worker loses nothing, checkpoints hold the whole state (torch, elementwise optimizers:
                docs/elasticity.md, "Sharded optimizer state"). Default: off.
            num_dataloader_processes: processes per worker reading its micro-batches, for a dataset
                whose reading is bound by Python (PIL decoding, transforms), as
                ``DataLoader(num_workers=N)`` reads; every sample seeded as on threads, so the
                result is the same bits (torch; docs/training.md, "Reading in processes").
                Default: none (threads, ``num_dataloader_threads``).
            checkpoint_steps: also write a checkpoint after every ``checkpoint_steps``-th optimizer
                step, counted from the run's first step (global steps, over epochs); 0: none. Where
                such a step ends an epoch whose end writes one anyway, it is one checkpoint. Each
                counts in ``keep_checkpoints``; a resume goes on from the newest, mid-epoch or not
                (docs/run-directory.md, "Checkpoints"). Driver loggers hear of every checkpoint
                through ``on_step_checkpoint(iteration, name)`` (fabric_model/callbacks.py).
        """
        from .driver.display import check_verbose
        from .orchestrator import pipeline
        from .run.startup import StartUp

        startup = StartUp()  # from here to the first committed step, in phases (run.json's "startup")
        self._stop_request.clear()  # a stop asked outside a run does not end the next one
        ray_cluster = None
        try:
            verbose = check_verbose(verbose)
            v.check_bool("tensorboard", tensorboard)
            host = chosen_bind_address(bind_address)  # checked before anything starts
            ray_cluster = open_cluster(check_cluster(cluster))  # a bad value fails here, before anything starts
            loop = LoopOptions(
                num_dataloader_threads,
                validation_freq,
                checkpoint_freq,
                keep_checkpoints,
                deterministic,
                profile,
                shard_optimizer_state,
                num_dataloader_processes,
                checkpoint_steps=checkpoint_steps,
            )
            ignored = {"worker_memory": worker_memory, "driver_memory": driver_memory}
            sizes = pipeline.RunSizes(epoch_number, batch_size, engines_number, effective_batch_size)
            setup, adapter, train_set, resumed = pipeline.prepare(
                self, sizes, loop, seed, run_dir, resume, ignored, ray_cluster, startup
            )
            # Unless told otherwise, a Ray job listens on the node's IP, a local one on loopback.
            setup = dataclasses.replace(setup, bind_address=host or (ray_cluster.host if ray_cluster else LOOPBACK))
            run = open_run(run_dir, setup)
            # Local workers fork from the job's warm process (docs/architecture.md, "Start-up");
            # a Ray job's has nothing to do.
            warm = None if ray_cluster else self._warm.take(self.framework, run.logs / "warm.log")
            self._warm.drop()
            result = pipeline.run_job(
                self, setup, adapter, train_set, run, ray_cluster, (verbose, tensorboard), warm, resumed
            )
        except BaseException:
            self._warm.drop()  # a train() that fails leaves no process behind (but a kept one: warm_spare.py)
            raise
        finally:
            if ray_cluster is not None:
                ray_cluster.close()
        self.run_dir = run.path
        return result

    def stop_training(self) -> None:
        """End the running ``train()`` now, from any thread (a driver logger, a signal handler,
        another cell of a notebook): the workers abandon the step they are in, and ``train()``
        returns normally with the state after the last step every worker completed, each of its
        samples read once. Outside ``train()`` it does nothing. docs/training.md, "Stopping from
        the caller"."""
        self._stop_request.set()

    def download(self, out_dir: str | os.PathLike[str] | None = None) -> str:
        """Zip the last run's ``model/`` directory into ``out_dir`` (default: the run directory);
        returns the zip's path."""
        if self.run_dir is None or not (self.run_dir / "model").is_dir():
            raise RuntimeError("Nothing to download yet: call train() first; download() zips the trained model.")
        target = Path(out_dir) if out_dir is not None else self.run_dir
        target.mkdir(parents=True, exist_ok=True)
        archive = shutil.make_archive(str(target / "model"), "zip", root_dir=self.run_dir, base_dir="model")
        return str(Path(archive).resolve())

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
