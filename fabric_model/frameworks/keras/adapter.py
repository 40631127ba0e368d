"""The Keras adapter: a ``keras.Model`` (Keras 3 on TensorFlow) or a ``tf_keras`` model (Keras 2,
``tf.keras`` under ``TF_USE_LEGACY_KERAS=1``) with an optimizer of the same Keras. Where the two
differ, the adapter asks the model's :class:`~.flavor.Flavor` (:mod:`.keras2` for Keras 2).

How the pieces travel and meet the shared loop:

- Shipping: the model goes to the workers as its ``.keras`` file (config + weights) and the
  optimizer as its config plus state, so both rebuild identically. Custom classes come from
  ``keras_custom_objects`` (and from Keras' registry of ``register_keras_serializable``
  classes), pickled with the job, so classes defined in a script or notebook arrive too. The
  driver rebuilds the model once itself, as the workers will, so a model that cannot be
  rebuilt fails before any worker starts.
- A micro-batch runs in a compiled ``tf.function``: ``tf.GradientTape`` forward and backward,
  and the result is one flat float32 tensor laid out by the same
  :class:`~fabric_model.step.layout.StepLayout` as the PyTorch adapter's step buffer::

      [ gradients * n_j/N | forward-updated variable deltas * n_j/N | got-gradient flags |
        loss sum | metric sums ... | sample count | micro-batches | snapshot vote | switch vote ]

- Exchange: torch views that TensorFlow tensor through a DLPack capsule, without a copy (on
  the GPU as on the CPU); the shared collective layer sum-allreduces it in place, and the
  apply function reads the same memory back. No host copy is made of gradients. (Inputs are
  converted from NumPy to tensors once per micro-batch, as ``model.fit`` does for NumPy data.)
  The capsule, not ``torch.from_dlpack(tensor)``: for a CUDA tensor torch passes its stream to
  ``tf.Tensor.__dlpack__``, which TensorFlow refuses. So on the GPU the step synchronizes
  TensorFlow's device before the collective reads the buffer, and torch's stream after it
  wrote it, before TensorFlow reads it back.
- Apply: the Keras optimizer's ``apply`` (Keras 2: ``apply_gradients``) in a second ``tf.function``,
  identical on every replica. Its variables (iteration count, moments) are part of the state a newcomer pulls.
- The micro-batch's gradient comes from the user's ``fn_step_train``, else the model's own
  ``train_step``, else our tape over the model's loss (its ``compute_loss`` where it has its
  own or the loss is a dict or list); the user's code hands its gradients over through the
  optimizer's ``apply`` (:mod:`.capture`, :mod:`.user_step`; docs/keras.md, "Custom steps").
  Those three compute their own loss, so only they may come with ``loss_function=None``
  (:func:`.names.check_own_loss`); validation then shows the model's ``compute_loss`` where it
  has its own, else NaN for the loss.

Forward-updated variables (BatchNorm moving statistics) start every micro-batch from the
step's values and the weighted deltas are reduced, as in the PyTorch adapter. Dropout and
other random layers draw from state set from the micro-batch's seed before its forward pass
(Keras 3's ``SeedGenerator`` states; Keras 2's generators, :mod:`.keras2_random`): randomness
depends on the micro-batch, never on the worker that computed it.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from ...profiling import phases as ph
from ...step.layout import StepLayout, StepResult
from ...step.tree import leaves
from ..base import FrameworkAdapter
from .batches import collate_numpy, split_keras_batch
from .flavor import flavor_of
from .names import (
    ACCURACY_NAMES,
    accuracy_for,
    check_own_loss,
    metric_label,
    resolve_loss,
    resolve_metric,
    resolve_optimizer,
)
from .runtime import configure_tensorflow, torch_view
from .shipping import (
    assign_all,
    checked_form,
    metrics_from_configs,
    model_from_bytes,
    shipped_form,
    variable_name,
    variables_state,
)
from .user_step import (
    Eva,
    UserCode,
    metric_value,
    overridden,
    pack_user_code,
    run_custom_step,
    run_test_fn,
    run_train_step,
    unpack_user_code,
)

log = logging.getLogger(__name__)


def _leading_dim(tree: Any) -> Any:
    import tensorflow as tf

    return tf.shape(leaves(tree)[0])[0]


def _scalar(value: Any) -> Any:
    """A loss or metric as a float32 scalar tensor (the mean of a per-sample one)."""
    import tensorflow as tf

    return tf.reduce_mean(tf.cast(value, tf.float32))


def _compute_loss(model: Any, x: Any, y: Any, out: Any, training: bool) -> Any:
    # An override written before Keras 3.3 has no `training` argument (Keras' own _compute_loss does this).
    if "training" in inspect.signature(type(model).compute_loss).parameters:
        return model.compute_loss(x, y, out, None, training=training)
    return model.compute_loss(x, y, out, None)


def _value(variable: Any) -> Any:
    """A variable's value as a tensor: Keras 3's ``.value`` is its TensorFlow variable, Keras 2's (a
    ``tf.Variable``) a method."""
    value = variable.value
    return value() if callable(value) else value


def _several_outputs(model: Any) -> bool:
    """Whether a functional model has more than one output (a subclassed model's are unknown until called)."""
    try:
        return len(model.outputs) > 1
    except (AttributeError, ValueError):
        return False


class KerasAdapter(FrameworkAdapter):
    """Trains a Keras 3 or Keras 2 (tf_keras) model micro-batch by micro-batch into one flat step buffer."""

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        loss_function: Any,
        metrics: Sequence[Any] | None = (),
        custom_objects: dict[str, Any] | None = None,
        collate_fn: Callable[[Sequence[Any]], Any] | None = None,
        clip_norm: float | None = None,
        user_code: UserCode | None = None,
    ) -> None:
        self.model = model
        self.flavor = flavor_of(model)  # Keras 3 or Keras 2: resolves names and the few calls that differ
        self.optimizer = resolve_optimizer(optimizer, self.flavor)
        self.loss_spec = loss_function  # the name, instance or callable (or a dict or list of them), as given
        self.user_code = user_code or UserCode()
        self.custom_step = self.user_code.step_fn is not None
        # How a micro-batch's gradient is made (docs/keras.md, "Custom steps"): fn_step_train, else
        # the model's own train_step, else our tape, with the model's compute_loss where it has
        # its own or the loss has a structure (Keras' compiled loss maps it onto the outputs).
        self.model_train_step = not self.custom_step and overridden(model, "train_step")
        own_loss = overridden(model, "compute_loss")
        if loss_function is None:  # only a model that computes its own loss may go without one
            check_own_loss(model, self.custom_step or self.model_train_step or own_loss)
        # None: no loss given (the model's own; validation then shows the model's compute_loss, or NaN).
        self.loss_function = None if loss_function is None else resolve_loss(loss_function, flavor=self.flavor)
        self.model_loss = own_loss or isinstance(loss_function, dict | list | tuple)
        if metrics is None:  # the default accuracy, where one output and our step make it meaningful
            simple = not (self.custom_step or self.model_train_step or self.model_loss or _several_outputs(model))
            metrics = ["accuracy"] if simple else []
        self.metric_specs = [resolve_metric(m, i, self.flavor) for i, m in enumerate(metrics)]
        self._metric_names_given = [m if isinstance(m, str) else None for m in metrics]  # for compile (names kept)
        self.custom_objects = dict(custom_objects or {})
        self._collate_fn = collate_fn
        self.clip_norm = clip_norm  # gradient_clip_norm=: the rebuilt optimizer's global_clipnorm
        taken: set[str] = set()
        # Labelled as given ("mae" stays "mae", as in Keras' compile), instances by their name.
        self.metric_names = [metric_label(m, i, taken) for i, m in enumerate(metrics)]
        # A custom step returns (its metric, loss): eva's value, the first metric given, else the accuracy,
        # named so (old-signature loggers get an accuracy in percent, as on the default path).
        step_metric = self.metric_names[0] if self.metric_names else "accuracy"
        self.stat_names = ["loss", step_metric] if self.custom_step else ["loss"] + self.metric_names
        self.train_set: Any = None
        self._shipped: dict[str, Any] | None = None
        self._packed_user_code: bytes | None = None  # the user's code as it travels (see __getstate__)

    # -- shipping -------------------------------------------------------------------------
    def check_rebuild(self, first_batch: Any) -> None:
        """Rebuild the model as a worker will, check it computes what ``model`` computes on
        ``first_batch``, and keep the checked form to ship (see :func:`.keras_shipping.checked_form`)."""
        self._shipped = checked_form(
            self.model, self.optimizer, self.metric_specs, self.custom_objects, first_batch, self.flavor
        )

    def __getstate__(self) -> dict[str, Any]:
        # check_rebuild (Framework.prepare_for_shipping) makes and checks the shipped form; without
        # it, the form is made here, unchecked, so pickling never depends on a call made before it.
        shipped = self._shipped
        if shipped is None:
            shipped = shipped_form(
                self.model, self.optimizer, self.metric_specs, self.custom_objects, flavor=self.flavor
            )
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_tf")}
        state.update(model=None, optimizer=None, metric_specs=None, _shipped=shipped)
        # The user's step may name the script's model or optimizer: they travel as references to the worker's.
        state.update(user_code=UserCode(), _packed_user_code=pack_user_code(self.user_code, self._live_objects()))
        if not isinstance(self.loss_spec, str):  # instances and callables travel by value (cloudpickle)
            state["loss_function"] = self.loss_spec
        else:
            state["loss_function"] = None
        return state

    def identity_view(self) -> dict[str, Any]:
        """The adapter with its live model, optimizer, metrics and user code, not the archive they
        travel in (it holds the save's date and object ids): driver/identity.py digests Keras
        objects by class, config and variable shapes."""
        dropped = ("_shipped", "_packed_user_code", "train_set")
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_tf") and k not in dropped}

    def _live_objects(self) -> dict[str, Any]:
        """What the user's code may name that a worker rebuilds: its references resolve to the worker's."""
        return {"model": self.model, "optimizer": self.optimizer}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # -- set-up ---------------------------------------------------------------------------
    def setup(self, device: str, num_threads: int) -> None:
        configure_tensorflow(device, num_threads)
        import tensorflow as tf

        shipped = self._shipped
        assert shipped is not None
        custom = shipped["custom_objects"]
        flavor = self.flavor
        self._device = device
        self._tf_device = "/GPU:0" if device.startswith("cuda") else "/CPU:0"
        with tf.device(self._tf_device):
            self.model = model_from_bytes(shipped["model"], custom, flavor)
            self.optimizer = flavor.optimizer_from_config(shipped["optimizer"], custom)
            if self.clip_norm is not None:  # Keras clips in the update, which gets the reduced gradient
                flavor.set_global_clipnorm(self.optimizer, self.clip_norm)
            flavor.build_optimizer(self.optimizer, self.model.trainable_variables)
            if shipped["optimizer_state"] is not None:
                assign_all(flavor.optimizer_variables(self.optimizer), shipped["optimizer_state"], "optimizer")
        if self.loss_function is None and self.loss_spec is not None:  # a name travels as itself
            self.loss_function = resolve_loss(self.loss_spec, flavor=flavor)
        self.metric_specs = metrics_from_configs(shipped["metrics"], custom, flavor)
        # Compiled as after compile(): model.optimizer, model.compute_loss and a train_step override
        # work as with fit (metrics only for a train_step, which reports them in its logs).
        flavor.compile(
            self.model,
            self.optimizer,
            self.loss_function,
            (self._compiled_metrics() or None) if self.model_train_step else None,  # [] is not None to compile
        )
        if self._packed_user_code is not None:
            self.user_code = unpack_user_code(self._packed_user_code, self._live_objects())
            self._packed_user_code = None
        self._eva = Eva(self.metric_specs, flavor)
        self._build_functions()

    def _compiled_metrics(self) -> list[Any]:
        """The metrics as given (names as names, so a train_step's logs carry the labels shown)."""
        return [name or spec for name, spec in zip(self._metric_names_given, self.metric_specs)]

    def _build_functions(self) -> None:
        import tensorflow as tf

        model = self.model
        self._train_vars = list(model.trainable_variables)
        for v in self._train_vars:
            if v.dtype != "float32":
                raise TypeError(f"Only float32 trainable variables are supported; {variable_name(v)} is {v.dtype}.")
        self._random = self.flavor.random_state(model)  # random layers drawing from the micro-batch's seed
        random = {id(v) for v in self._random.variables}
        others = [v for v in model.variables if not v.trainable and id(v) not in random]
        self._fwd_vars = [v for v in others if v.dtype == "float32"]
        self._fwd_start = [tf.Variable(_value(v), trainable=False) for v in self._fwd_vars]
        self._layout = StepLayout(
            n_gradients=sum(int(np.prod(v.shape)) for v in self._train_vars),
            n_buffers=sum(int(np.prod(v.shape)) for v in self._fwd_vars),
            n_flags=len(self._train_vars),
            n_stats=len(self.stat_names),
        )
        self._metrics_resolved: list[Any] | None = None
        self._tf_micro = tf.function(self._micro_batch, reduce_retracing=True)
        self._tf_solo = tf.function(self._solo_step, reduce_retracing=True)
        self._solo: tuple[Any, ...] | None = None
        self._solo_possible = False
        self._micro_batches_run = 0
        self._tf_apply = tf.function(self._apply, reduce_retracing=True)
        self._tf_eval = tf.function(self._evaluate, reduce_retracing=True)
        self._tf_snapshot = tf.function(self._snapshot)
        self._acc: Any = None
        self._view: torch.Tensor | None = None
        self._in_step = False

    @property
    def own_collate(self) -> bool:
        return self._collate_fn is None

    def collate(self, samples: Sequence[Any]) -> Any:
        return self._collate_fn(samples) if self._collate_fn is not None else collate_numpy(samples)

    # -- traced functions -----------------------------------------------------------------
    def _metrics(self, y_true: Any, y_pred: Any) -> list[Any]:
        if self._metrics_resolved is None:  # "accuracy" depends on the shapes, as in compile()
            self._metrics_resolved = [
                accuracy_for(y_true.shape, y_pred.shape, self.flavor)
                if isinstance(m, str) and m in ACCURACY_NAMES
                else m
                for m in self.metric_specs
            ]
        return self._metrics_resolved

    def _stat_values(self, y: Any, out: Any, loss: Any, n: Any) -> list[Any]:
        if self.custom_step:  # (loss, metric): the step's eva stands for the metric
            import tensorflow as tf

            # No accuracy to pick for several outputs unless a metric was given (eva is the user's to call).
            single = bool(self._eva) or len(leaves(out)) == 1
            return [loss * n, (_scalar(self._eva(y, out)) if single else tf.constant(float("nan"))) * n]
        return [loss * n] + [metric_value(m, y, out, self.flavor) * n for m in self._metrics(y, out)]

    def _loss(self, x: Any, y: Any, out: Any, training: bool) -> tuple[Any, Any]:
        """(the loss shown, the loss differentiated): the loss given and the layers' own losses, or
        what the model's ``compute_loss`` returns (its own, or Keras' for a structure of losses)."""
        import tensorflow as tf

        if self.model_loss:
            total = _compute_loss(self.model, x, y, out, training)
            return _scalar(total), total
        if self.loss_function is None:  # validating a step of the user's (no loss, no compute_loss of its own)
            nan = tf.constant(float("nan"))
            return nan, nan
        loss = tf.reduce_mean(tf.cast(self.loss_function(y, out), tf.float32))
        return loss, (loss + tf.add_n(self.model.losses) if training and self.model.losses else loss)

    def _forward_backward(self, x: Any, y: Any, seed: Any) -> tuple[list[Any], list[Any], list[Any]]:
        """(gradients, None where a variable got none; stat sums; sample count) of one micro-batch, traced."""
        import tensorflow as tf

        self._random.reseed(seed)
        n = tf.cast(_leading_dim(y), tf.float32)
        code = self.user_code
        if code.step_fn is not None:
            grads, metric, loss = run_custom_step(
                code.step_fn,
                self.model,
                self.optimizer,
                self._train_vars,
                (x, y),
                self._eva,
                self.train_set,
                code.fn_args,
            )
            return grads, [_scalar(loss) * n, _scalar(metric) * n], [n]
        if self.model_train_step:
            grads, logs = run_train_step(self.model, self.optimizer, self._train_vars, (x, y), self.stat_names)
            return grads, [_scalar(value) * n for value in logs], [n]
        with tf.GradientTape() as tape:
            out = self.model(x, training=True)
            loss, total = self._loss(x, y, out, training=True)
        grads = tape.gradient(total, self._train_vars)
        return list(grads), self._stat_values(y, out, loss, n), [n]

    def _micro_batch(self, x: Any, y: Any, weight: Any, seed: Any, acc: Any = None) -> Any:
        import tensorflow as tf

        for v, start in zip(self._fwd_vars, self._fwd_start):
            v.assign(start)
        grads, stats, count = self._forward_backward(x, y, seed)
        flags = [tf.constant([0.0 if g is None else 1.0]) for g in grads]
        grads = [tf.zeros_like(v) if g is None else g for g, v in zip(grads, self._train_vars)]
        parts = [tf.reshape(tf.convert_to_tensor(g), [-1]) for g in grads]
        parts += [tf.reshape(_value(v) - s, [-1]) for v, s in zip(self._fwd_vars, self._fwd_start)]
        weighted = tf.concat(parts, 0) if parts else tf.zeros([0])
        if weight is not None:  # None: the step's only micro-batch, weight 1 (saves a pass over the buffer)
            weighted = weighted * weight
        # stat sums, count, then the loop's slots (micro-batches computed, votes: the loop writes them)
        tail = tf.stack(stats + count + [tf.constant(0.0)] * StepLayout.LOOP_SLOTS)
        flat = tf.concat([weighted] + flags + [tail], 0)
        return flat if acc is None else acc + flat

    def _solo_step(self, x: Any, y: Any, seed: Any) -> Any:
        """A whole step when this is the only worker and the step one micro-batch: forward,
        backward and the optimizer in one compiled function, with nothing to exchange (the
        same arithmetic as the general path, without its flat buffer)."""
        import tensorflow as tf

        grads, stats, count = self._forward_backward(x, y, seed)
        pairs = [(tf.convert_to_tensor(g), v) for g, v in zip(grads, self._train_vars) if g is not None]
        if pairs:
            self.flavor.apply(self.optimizer, [g for g, _ in pairs], [v for _, v in pairs])
        self._random.clear()
        return tf.stack(stats + count)

    def _apply(self, flat: Any, used: tuple[bool, ...]) -> None:
        import tensorflow as tf

        offset = 0
        grads = []
        for v in self._train_vars:
            size = int(np.prod(v.shape))
            grads.append(tf.reshape(flat[offset : offset + size], v.shape))
            offset += size
        for v, start in zip(self._fwd_vars, self._fwd_start):
            size = int(np.prod(v.shape))
            v.assign(start + tf.reshape(flat[offset : offset + size], v.shape))
            offset += size
        pairs = [(g, v) for g, v, u in zip(grads, self._train_vars, used) if u]
        if pairs:
            self.flavor.apply(self.optimizer, [g for g, _ in pairs], [v for _, v in pairs])
        # Seed states are reset every micro-batch; a fixed value between steps keeps the
        # replicas' variables identical whichever micro-batches each one ran.
        self._random.clear()

    def _snapshot(self) -> None:
        for v, start in zip(self._fwd_vars, self._fwd_start):
            start.assign(v)

    def _evaluate(self, x: Any, y: Any) -> Any:
        import tensorflow as tf

        out = self.model(x, training=False)
        n = tf.cast(_leading_dim(y), tf.float32)
        return tf.stack(self._stat_values(y, out, self._loss(x, y, out, training=False)[0], n) + [n])

    def gradient_bytes(self) -> int:
        # The step's accumulator (gradients, deltas, sums) lives from its first micro-batch to its end.
        acc = self._acc
        return 0 if acc is None else int(acc.shape[0]) * acc.dtype.size

    # -- a step ---------------------------------------------------------------------------
    @property
    def step_buffer(self) -> torch.Tensor:
        if self._view is None:
            import tensorflow as tf

            with tf.device(self._tf_device):
                self._acc = tf.zeros([self._layout.size], tf.float32)
            self._view = torch_view(self._acc)
        return self._view

    @property
    def step_layout(self) -> StepLayout:
        # A step run whole in finish_step exchanges only the tail (see train_micro_batch).
        return self._layout.tail_only() if self._solo is not None else self._layout

    def begin_step(self, collective: Any = None) -> None:
        self._acc, self._view, self._solo = None, None, None
        self._solo_possible = collective is not None and collective.world_size == 1
        self._micro_batches_run = 0
        if self._fwd_vars:
            self._tf_snapshot()
        self._in_step = True

    def train_micro_batch(self, batch: Any, num_samples: int, step_samples: int, seed: int, last: bool = False) -> None:
        import tensorflow as tf

        x, y = split_keras_batch(batch)
        first, self._micro_batches_run = self._micro_batches_run == 0, self._micro_batches_run + 1
        with tf.device(self._tf_device):
            seed_t = tf.constant(seed, tf.int64)
            if self._solo_possible and first and last and num_samples == step_samples:
                # Alone with one micro-batch: run the whole step in finish_step, in one function.
                # Until then nothing has changed, so an aborted step has nothing to undo.
                self._solo = (x, y, seed_t)
                self._view = torch.zeros(self._layout.tail_only().size)  # stat sums, count, micro-batches, vote
                return
            weight = None if num_samples == step_samples else tf.constant(num_samples / step_samples, tf.float32)
            with self.phases(ph.FORWARD):  # one TensorFlow function: forward, loss and backward
                self._acc = self._tf_micro(x, y, weight, seed_t, self._acc)
        # A view of TensorFlow's buffer, not a copy: the allreduce writes into it in place.
        self._view = torch_view(self._acc)

    def all_reduce(self, collective: Any) -> None:
        buffer = self.step_buffer
        if buffer.is_cuda:  # TensorFlow's kernels run on its own stream: finish them before NCCL reads
            import tensorflow as tf

            tf.test.experimental.sync_devices()
        collective.wait(collective.all_reduce_start(buffer))
        if buffer.is_cuda:  # TensorFlow reads the buffer on its own stream next
            torch.cuda.current_stream(buffer.device).synchronize()

    def finish_step(self) -> StepResult:
        layout, buffer = self.step_layout, self.step_buffer
        if self._solo is not None:
            import tensorflow as tf

            with tf.device(self._tf_device), self.phases(ph.FORWARD):  # the whole step in one function
                stats = self._tf_solo(*self._solo).numpy().tolist()
            loop_slots = buffer[layout.computed : layout.vote + 1].tolist()
            self._solo, self._view, self._in_step = None, None, False
            return layout.result(stats + loop_slots)
        used = tuple(bool(f > 0) for f in buffer[layout.flags].tolist())
        with self.phases(ph.OPTIMIZER):
            self._tf_apply(self._acc, used)
        tail = buffer[layout.tail].tolist()
        self._acc, self._view, self._in_step = None, None, False
        return layout.result(tail)

    def abort_step(self) -> None:
        if not self._in_step:
            return
        self._in_step = False
        # An abandoned collective may still write into the old buffer: never reuse it.
        self._acc, self._view, self._solo = None, None, None
        for v, start in zip(self._fwd_vars, self._fwd_start):
            v.assign(start)

    # -- evaluation and state -------------------------------------------------------------
    def evaluate_batches(self, batches: Iterator[tuple[Any, Any]]) -> torch.Tensor:
        test_fn = self.user_code.test_fn
        if test_fn is not None:  # the user's fn_test, eagerly, over the whole shard
            import tensorflow as tf

            pairs = ((indices, split_keras_batch(batch)) for indices, batch in batches)
            with tf.device(self._tf_device):
                values, count = run_test_fn(test_fn, self.model, pairs, self.user_code.fn_args, len(self.stat_names))
            return torch.tensor([v * count for v in values] + [count], dtype=torch.float64)
        total = torch.zeros(self._layout.eval_size, dtype=torch.float64)
        for _, batch in batches:
            total += self._evaluate_batch(batch)
        return total

    def _evaluate_batch(self, batch: Any) -> torch.Tensor:
        """Stat sums (loss, metrics...) and the sample count over one test batch, float64 on the CPU."""
        import tensorflow as tf

        x, y = split_keras_batch(batch)
        with tf.device(self._tf_device):
            values = self._tf_eval(x, y)
        return torch.tensor(values.numpy(), dtype=torch.float64)

    def model_state(self) -> dict[str, Any]:
        return variables_state(self.model.variables)

    def optimizer_state(self) -> dict[str, Any]:
        if not self.flavor.optimizer_built(self.optimizer):
            return {}
        return variables_state(self.flavor.optimizer_variables(self.optimizer))

    def load_state(self, model_state: dict[str, Any], optimizer_state: dict[str, Any]) -> None:
        assign_all(self.model.variables, [t.numpy() for t in model_state.values()], "model")
        if optimizer_state:
            flavor = self.flavor
            flavor.build_optimizer(self.optimizer, self.model.trainable_variables)  # the user's, if not yet built
            values = [t.numpy() for t in optimizer_state.values()]
            assign_all(flavor.optimizer_variables(self.optimizer), values, "optimizer")
