"""The Keras framework's driver half: a Keras 3 ``keras.Model`` (on TensorFlow) with a Keras optimizer,
or, as the framework "tf_keras", a Keras 2 ``tf_keras`` model with a ``tf_keras`` optimizer.

Losses, optimizers and metrics may be given by name; names are resolved (and misspellings
reported) here, in the caller, by the model's Keras. TensorFlow is imported only when a Keras model
is given, and ``tf_keras`` only when a ``tf_keras`` model is.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ..base import Framework, FrameworkAdapter, TrainedModel, UserObjects
from .flavor import KERAS3, Flavor, flavor_named
from .names import check_own_loss, resolve_loss, resolve_metric, resolve_optimizer
from .user_step import computes_own_loss


class KerasFramework(Framework):
    """Keras: the model travels as its ``.keras`` file and is rebuilt in each worker, so the driver
    rebuilds it once itself first (``prepare_for_shipping``)."""

    name: ClassVar[str] = "keras"

    @property
    def flavor(self) -> Flavor:
        """Which Keras this framework's models are (the Keras 2 one is imported only for its framework)."""
        return KERAS3

    def check_options(self, *, fn_step_train: Any, fn_test: Any, keras_custom_objects: Any) -> None:
        """``keras_custom_objects`` must be a dict; ``fn_step_train`` and ``fn_test`` are taken as for torch
        (docs/keras.md, "Custom steps"; ``setup/checks.py`` checks that they are callables)."""
        super().check_options(fn_step_train=fn_step_train, fn_test=fn_test, keras_custom_objects=keras_custom_objects)

    def check_loss(self, loss_function: Any, *, model: Any = None, fn_step_train: Any = None) -> None:
        """A ``keras.losses`` instance, a loss name, ``loss(y_true, y_pred)``, or a dict or list of them
        (by output, as ``compile(loss=)`` takes); names resolved now. None where the model computes its
        own loss (:func:`.names.check_own_loss`: a ``compute_loss`` or ``train_step`` override, or
        ``fn_step_train``); the adapter checks it again when it is made."""
        if loss_function is None:
            if model is not None:
                check_own_loss(model, fn_step_train is not None or computes_own_loss(model))
            return
        resolve_loss(loss_function, flavor=self.flavor)

    def check_metrics(self, metrics: Any) -> list[Any] | None:
        """A list of metric names, ``keras.metrics.Metric`` instances or ``metric(y_true, y_pred)``; None for
        the adapter's default (IBM's: the accuracy ``compile(metrics=["accuracy"])`` picks, where it applies)."""
        if metrics is None:
            return None
        if not isinstance(metrics, (list, tuple)):
            raise TypeError(
                "Expected `metrics` to be a list of Keras metric names ('accuracy'), keras.metrics.Metric objects "
                f"or callables metric(y_true, y_pred). Received: metrics={metrics!r}. HINT: wrap it in a list."
            )
        for i, m in enumerate(metrics):
            resolve_metric(m, i, self.flavor)
        return list(metrics)

    def check_optimizer(self, model: Any, optimizer: Any) -> None:
        """An optimizer instance or name of the model's Keras (it is built over the rebuilt model in each worker)."""
        resolve_optimizer(optimizer, self.flavor)

    def make_adapter(self, user: UserObjects) -> FrameworkAdapter:
        """A :class:`~.adapter.KerasAdapter`, with the user's ``fn_step_train``, ``fn_test`` and ``fn_args``."""
        from .adapter import KerasAdapter
        from .user_step import UserCode

        return KerasAdapter(
            user.model,
            user.optimizer,
            user.loss_function,
            user.metrics,  # None: the adapter's default
            user.custom_objects,
            user.collate,
            user.step_options.gradient_clip_norm,
            UserCode(user.fn_step_train, user.fn_test, user.fn_args),
        )

    def split_batch(self, batch: Any) -> tuple[Any, Any]:
        """An ``(x, y)`` pair or a dict with a target key."""
        from .adapter import split_keras_batch

        return split_keras_batch(batch)

    def prepare_for_shipping(self, adapter: FrameworkAdapter, first_batch: Any) -> FrameworkAdapter:
        """Rebuild the model as a worker will and check it computes the same on ``first_batch``."""
        from .adapter import KerasAdapter

        assert isinstance(adapter, KerasAdapter)
        adapter.check_rebuild(first_batch)
        own = adapter.custom_step or adapter.model_train_step or adapter.model_loss
        if not own and adapter.loss_function is not None:  # our loss, our step (None: the model's own, above)
            check_summed_loss(adapter.model, adapter.loss_function, first_batch)
        return adapter

    def draw_seed(self) -> int:
        """From NumPy's global generator, which ``keras.utils.set_random_seed`` (and ``np.random.seed``)
        seeds; Keras 3 on TensorFlow does not seed torch."""
        return int(np.random.randint(0, 2**31 - 1))

    def save_model(self, model_dir: Path, model: Any, model_state: dict[str, Any]) -> Path:
        """``model.keras``, Keras' own format (``keras.saving.load_model``), from the user's model."""
        model_dir.mkdir(exist_ok=True)
        tmp, path = model_dir / ".model.tmp.keras", model_dir / "model.keras"  # Keras insists on the suffix
        model.save(tmp)
        os.replace(tmp, path)
        return path

    def deterministic(self, adapter: FrameworkAdapter, max_micro_batches: int) -> FrameworkAdapter:
        """The fixed-point sum of the step's gradients and variable deltas."""
        from .exact import ExactKerasAdapter

        return ExactKerasAdapter.from_adapter(adapter, max_micro_batches)

    @functools.cached_property
    def trained(self) -> TrainedModel:
        from .trained import KerasTrainedModel

        return KerasTrainedModel(self)

    def hand_over(self, adapter: FrameworkAdapter) -> None:
        """The user's model compiled with the loss, optimizer (holding the trained state) and metrics
        given, so ``model.evaluate`` works as after ``model.fit``. After ``save_model``: ``model.keras``
        stays as before, loadable without custom objects for a loss function."""
        from .inference import compile_trained

        compile_trained(adapter)


#: What to do about a loss summed over the batch.
SUM_FIX = (
    "leave the loss's `reduction` at its default, the batch mean (reduction=\"sum_over_batch_size\"; Keras 2's "
    'AUTO), e.g. keras.losses.SparseCategoricalCrossentropy(), not reduction="sum".'
)


def check_summed_loss(model: Any, loss_function: Any, first_batch: Any) -> None:
    """Refuse a loss summed over the batch (:func:`fabric_model.setup.checks.check_loss_reduction`): the
    loss on the first batch against that on its halves, from one inference call (``training=False``:
    no BatchNorm statistics updated, no dropout). One output and one target only."""
    import tensorflow as tf

    from ...setup.checks import check_loss_reduction
    from .adapter import split_keras_batch

    x, y = split_keras_batch(first_batch)
    out, y = model(x, training=False), np.asarray(y)
    size = y.shape[0] if y.ndim > 0 else 0
    if size < 2 or not isinstance(out, tf.Tensor) or out.shape.rank == 0 or out.shape[0] != size:
        return
    cut = size // 2
    try:
        whole, first, rest = (
            float(tf.reduce_mean(tf.cast(loss_function(y_part, out_part), tf.float32)))
            for y_part, out_part in ((y, out), (y[:cut], out[:cut]), (y[cut:], out[cut:]))
        )
    except Exception:  # the loss fails on fewer samples: nothing to compare (the workers' own call reports)
        return
    check_loss_reduction(whole, [(first, cut), (rest, size - cut)], SUM_FIX)


class TfKerasFramework(KerasFramework):
    """Keras 2 (``tf_keras``; ``tf.keras`` under ``TF_USE_LEGACY_KERAS=1``): the Keras framework with
    Keras 2's answers (:mod:`.keras2`). A framework of its own name, so run records and checkpoints
    say which Keras wrote them and a Keras 3 model does not resume a Keras 2 run."""

    name: ClassVar[str] = "tf_keras"

    @property
    def flavor(self) -> Flavor:
        return flavor_named("tf_keras")
