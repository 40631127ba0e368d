"""The Keras adapter: a ``keras.Model`` (Keras 3 on TensorFlow) with a Keras optimizer.

How the pieces travel and meet the shared loop:

- Shipping: the model goes to the workers as its ``.keras`` file (config + weights) and the
  optimizer as its config plus state, so both rebuild identically. Custom classes come from
  ``keras_custom_objects`` (and from Keras' registry of ``register_keras_serializable``
  classes), pickled with the job, so classes defined in a script or notebook arrive too. The
  driver rebuilds the model once itself, as the workers will, so a model that cannot be
  rebuilt fails before any worker starts.
- A micro-batch runs in a compiled ``tf.function``: ``tf.GradientTape`` forward and backward,
  and the result is one flat float32 tensor laid out like the PyTorch adapter's step buffer::

      [ gradients * n_j/N | forward-updated variable deltas * n_j/N | got-gradient flags |
        loss sum | metric sums ... | sample count | switch vote ]

- Exchange: torch views that TensorFlow tensor through a DLPack capsule, without a copy (on
  the GPU as on the CPU); the shared collective layer sum-allreduces it in place, and the
  apply function reads the same memory back. No host copy is made of gradients. (Inputs are
  converted from NumPy to tensors once per micro-batch, as ``model.fit`` does for NumPy data.)
  The capsule, not ``torch.from_dlpack(tensor)``: for a CUDA tensor torch passes its stream to
  ``tf.Tensor.__dlpack__``, which TensorFlow refuses. So on the GPU the step synchronizes
  TensorFlow's device before the collective reads the buffer, and torch's stream after it
  wrote it, before TensorFlow reads it back.
- Apply: the Keras optimizer's ``apply`` in a second ``tf.function``, identical on every
  replica. Its variables (iteration count, moments) are part of the state a newcomer pulls.

Forward-updated variables (BatchNorm moving statistics) start every micro-batch from the
step's values and the weighted deltas are reduced, as in the PyTorch adapter. Dropout and
other random layers draw from Keras ``SeedGenerator`` states, which are set from the
micro-batch's seed before its forward pass: randomness depends on the micro-batch, never on
the worker that computed it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .base import FrameworkAdapter, metric_name
from .keras_names import ACCURACY_NAMES, accuracy_for, resolve_loss, resolve_metric, resolve_optimizer

log = logging.getLogger(__name__)

TARGET_KEYS = ("target", "label", "labels", "y")


# -- batches ------------------------------------------------------------------------------
def collate_numpy(samples: Sequence[Any], _top: bool = True) -> Any:
    """Stack per-sample ``(x, y)`` items (scalars, arrays, dicts and tuples of them) into
    NumPy arrays; float64 becomes float32, the dtype Keras computes in.

    Below the sample's own ``(x, y)`` level, a list or tuple of plain numbers
    (``[0.1, 0.2, 0.3]``) is one array-valued feature; other lists and tuples are structure
    (several model inputs)."""
    first = samples[0]
    if isinstance(first, Mapping):
        return {k: collate_numpy([s[k] for s in samples], False) for k in first}
    if isinstance(first, tuple | list) and (_top or not _is_number_list(first)):
        return tuple(collate_numpy([s[i] for s in samples], False) for i in range(len(first)))
    if hasattr(first, "numpy") and not isinstance(first, np.ndarray):  # tf or torch tensors
        samples = [s.numpy() for s in samples]
    array = np.stack([np.asarray(s) for s in samples])
    return array.astype(np.float32) if array.dtype == np.float64 else array


def _is_number_list(value: Sequence[Any]) -> bool:
    """A non-empty list of numbers (or of such lists)."""
    return len(value) > 0 and all(
        isinstance(v, int | float | np.number) or (isinstance(v, list | tuple) and _is_number_list(v)) for v in value
    )


def split_keras_batch(batch: Any) -> tuple[Any, Any]:
    """``(x, y)`` of a collated batch: a pair, or a dict with a target/label key."""
    if isinstance(batch, tuple | list):
        if len(batch) != 2:
            raise ValueError(
                f"A Keras sample or batch must be an (x, y) pair; received a sequence of {len(batch)} item(s). "
                "HINT: for several inputs make x a dict of arrays keyed by the model's input names."
            )
        return batch[0], batch[1]
    if isinstance(batch, Mapping):
        for key in TARGET_KEYS:
            if key in batch:
                rest = {k: v for k, v in batch.items() if k != key}
                return (next(iter(rest.values())) if len(rest) == 1 else rest), batch[key]
        raise ValueError(f"A dict sample needs a target under one of {TARGET_KEYS}; received keys {sorted(batch)}.")
    raise ValueError(f"A sample must be an (x, y) pair or a dict with a target key; received {type(batch).__name__}.")


def _leading_dim(tree: Any) -> Any:
    import tensorflow as tf

    while isinstance(tree, Mapping | tuple | list):
        tree = next(iter(tree.values())) if isinstance(tree, Mapping) else tree[0]
    return tf.shape(tree)[0]


# -- shipping the model -------------------------------------------------------------------
def model_to_bytes(model: Any) -> bytes:
    """The model's ``.keras`` file (architecture, weights), as bytes."""
    with tempfile.TemporaryDirectory(prefix="fabric-keras-") as tmp:
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        with open(path, "rb") as f:
            return f.read()


def model_from_bytes(data: bytes, custom_objects: dict[str, Any]) -> Any:
    import keras

    with tempfile.TemporaryDirectory(prefix="fabric-keras-") as tmp:
        path = os.path.join(tmp, "model.keras")
        with open(path, "wb") as f:
            f.write(data)
        return keras.saving.load_model(path, custom_objects=custom_objects, compile=False)


def shipped_custom_objects(user: dict[str, Any] | None) -> dict[str, Any]:
    """The user's ``keras_custom_objects`` plus Keras' registry of
    ``@register_keras_serializable`` classes: a worker has not run the code that registered them."""
    import keras

    objects = dict(keras.saving.get_custom_objects())
    objects.update(user or {})
    return objects


class KerasAdapter(FrameworkAdapter):
    """Trains a Keras 3 model micro-batch by micro-batch into one flat step buffer."""

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        loss_function: Any,
        metrics: Sequence[Any] = (),
        custom_objects: dict[str, Any] | None = None,
        collate_fn: Callable[[Sequence[Any]], Any] | None = None,
    ) -> None:
        self.model = model
        self.optimizer = resolve_optimizer(optimizer)
        self.loss_spec = loss_function  # the name, instance or callable, as given
        self.loss_function = resolve_loss(loss_function)
        self.metric_specs = [resolve_metric(m, i) for i, m in enumerate(metrics)]
        self.custom_objects = dict(custom_objects or {})
        self._collate_fn = collate_fn
        taken: set[str] = set()
        # Labelled as given ("mae" stays "mae", as in Keras' compile), instances by their name.
        self.stat_names = ["loss"] + [_metric_label(m, i, taken) for i, m in enumerate(metrics)]
        self.train_set: Any = None
        self._shipped: dict[str, Any] | None = None

    # -- shipping -------------------------------------------------------------------------
    def check_rebuild(self, first_batch: Any) -> None:
        """Run the model on the first batch, then rebuild it as a worker will and check that the
        rebuilt model computes the same outputs. Raises, before any worker starts, a ValueError
        when the model cannot take the batch and a TypeError pointing to ``keras_custom_objects``
        when it cannot be rebuilt, or is rebuilt into a model that computes something else."""
        import keras

        x, _ = split_keras_batch(first_batch)
        try:
            expected = _outputs(self.model, x)
        except Exception as exc:
            raise ValueError(
                f"The Keras model fails on the first training batch ({type(exc).__name__}: {str(exc)[:600]}). "
                f"Inputs received: {_describe(x)}. HINT: `get_datasets` must return samples (x, y) whose x the model "
                "takes once stacked into a batch (a dict of arrays keyed by input name for several inputs), or pass "
                "`fn_batch_collate` returning (x, y)."
            ) from exc
        custom = shipped_custom_objects(self.custom_objects)
        try:
            data = model_to_bytes(self.model)
            rebuilt = model_from_bytes(data, custom)
            optimizer = keras.optimizers.deserialize(keras.optimizers.serialize(self.optimizer), custom_objects=custom)
            _metric_configs(self.metric_specs)
            got = _outputs(rebuilt, x)
        except Exception as exc:
            raise TypeError(
                f"Could not rebuild the Keras model the way each worker must ({type(exc).__name__}: "
                f"{str(exc)[:600]}). HINT: pass keras_custom_objects={{'MyLayer': MyLayer, ...}} naming every custom "
                "layer, model, loss and metric class the model uses (a subclassed model's own class included), "
                "and give each a get_config() returning its constructor arguments."
            ) from exc
        worst = _max_difference(expected, got)
        if not worst <= 1e-5 * max(1.0, _max_abs(expected)):
            raise TypeError(
                f"The Keras model rebuilt from its saved form computes other outputs than `model` on the first "
                f"batch (max difference {worst:.3g}), so the workers would train another model. HINT: a custom "
                "layer's or model's get_config() must return every constructor argument that call() or build() "
                "uses, and from_config() must restore them; see keras_custom_objects."
            )
        self._shipped = {
            "model": data,
            "optimizer": keras.optimizers.serialize(optimizer),
            "optimizer_state": [v.numpy() for v in self.optimizer.variables] if self.optimizer.built else None,
            "custom_objects": custom,
            "metrics": _metric_configs(self.metric_specs),
        }

    def __getstate__(self) -> dict[str, Any]:
        if self._shipped is None:
            raise RuntimeError("KerasAdapter.check_rebuild() must run before the job is serialized")
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_tf")}
        state.update(model=None, optimizer=None, metric_specs=None)
        if not isinstance(self.loss_spec, str):  # instances and callables travel by value (cloudpickle)
            state["loss_function"] = self.loss_spec
        else:
            state["loss_function"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # -- set-up ---------------------------------------------------------------------------
    def setup(self, device: str, num_threads: int) -> None:
        _configure_tensorflow(device, num_threads)
        import keras
        import tensorflow as tf

        shipped = self._shipped
        assert shipped is not None
        custom = shipped["custom_objects"]
        self._device = device
        self._tf_device = "/GPU:0" if device.startswith("cuda") else "/CPU:0"
        with tf.device(self._tf_device):
            self.model = model_from_bytes(shipped["model"], custom)
            self.optimizer = keras.optimizers.deserialize(shipped["optimizer"], custom_objects=custom)
            self.optimizer.build(self.model.trainable_variables)
            if shipped["optimizer_state"] is not None:
                _assign_all(self.optimizer.variables, shipped["optimizer_state"], "optimizer")
        if self.loss_function is None:
            self.loss_function = resolve_loss(self.loss_spec)
        self.metric_specs = _metrics_from_configs(shipped["metrics"], custom)
        self._build_functions()

    def _build_functions(self) -> None:
        import tensorflow as tf

        model = self.model
        self._train_vars = list(model.trainable_variables)
        for v in self._train_vars:
            if v.dtype != "float32":
                raise TypeError(f"Only float32 trainable variables are supported; {v.path} is {v.dtype}.")
        others = [v for v in model.variables if not v.trainable]
        self._seed_vars = [v for v in others if v.path.endswith("seed_generator_state")]
        self._fwd_vars = [v for v in others if v.dtype == "float32" and not v.path.endswith("seed_generator_state")]
        self._fwd_start = [tf.Variable(v.value, trainable=False) for v in self._fwd_vars]
        self._n_grad = sum(int(np.prod(v.shape)) for v in self._train_vars)
        self._n_fwd = sum(int(np.prod(v.shape)) for v in self._fwd_vars)
        self._n_flags = len(self._train_vars)
        self._size = self._n_grad + self._n_fwd + self._n_flags + len(self.stat_names) + 2
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

    def collate(self, samples: Sequence[Any]) -> Any:
        return self._collate_fn(samples) if self._collate_fn is not None else collate_numpy(samples)

    # -- traced functions -----------------------------------------------------------------
    def _metrics(self, y_true: Any, y_pred: Any) -> list[Any]:
        if self._metrics_resolved is None:  # "accuracy" depends on the shapes, as in compile()
            self._metrics_resolved = [
                accuracy_for(y_true.shape, y_pred.shape) if isinstance(m, str) and m in ACCURACY_NAMES else m
                for m in self.metric_specs
            ]
        return self._metrics_resolved

    def _stat_values(self, y: Any, out: Any, loss: Any, n: Any) -> list[Any]:
        import keras
        import tensorflow as tf

        values = [loss * n]
        for metric in self._metrics(y, out):
            if isinstance(metric, keras.metrics.Metric):
                metric.reset_state()
                metric.update_state(y, out)
                value = metric.result()
            else:
                value = tf.reduce_mean(tf.cast(metric(y, out), tf.float32))
            values.append(tf.cast(value, tf.float32) * n)
        return values

    def _loss(self, y: Any, out: Any) -> Any:
        import tensorflow as tf

        return tf.reduce_mean(tf.cast(self.loss_function(y, out), tf.float32))

    def _forward_backward(self, x: Any, y: Any, seed: Any) -> tuple[list[Any], list[Any], list[Any]]:
        """(gradients, None where a variable got none; stat sums; ...) of one micro-batch, traced."""
        import tensorflow as tf

        for k, v in enumerate(self._seed_vars):
            v.assign(tf.cast(tf.stack([seed, tf.constant(k, tf.int64)]), v.dtype))
        with tf.GradientTape() as tape:
            out = self.model(x, training=True)
            loss = self._loss(y, out)
            total = loss + tf.add_n(self.model.losses) if self.model.losses else loss
        grads = tape.gradient(total, self._train_vars)
        n = tf.cast(_leading_dim(y), tf.float32)
        return list(grads), self._stat_values(y, out, loss, n), [n]

    def _micro_batch(self, x: Any, y: Any, weight: Any, seed: Any, acc: Any = None) -> Any:
        import tensorflow as tf

        for v, start in zip(self._fwd_vars, self._fwd_start):
            v.assign(start)
        grads, stats, count = self._forward_backward(x, y, seed)
        flags = [tf.constant([0.0 if g is None else 1.0]) for g in grads]
        grads = [tf.zeros_like(v) if g is None else g for g, v in zip(grads, self._train_vars)]
        parts = [tf.reshape(tf.convert_to_tensor(g), [-1]) for g in grads]
        parts += [tf.reshape(v.value - s, [-1]) for v, s in zip(self._fwd_vars, self._fwd_start)]
        weighted = tf.concat(parts, 0) if parts else tf.zeros([0])
        if weight is not None:  # None: the step's only micro-batch, weight 1 (saves a pass over the buffer)
            weighted = weighted * weight
        tail = tf.stack(stats + count + [tf.constant(0.0)])
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
            self.optimizer.apply([g for g, _ in pairs], [v for _, v in pairs])
        for v in self._seed_vars:
            v.assign(tf.zeros_like(v))
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
            self.optimizer.apply([g for g, _ in pairs], [v for _, v in pairs])
        # Seed states are reset every micro-batch; a fixed value between steps keeps the
        # replicas' variables identical whichever micro-batches each one ran.
        for v in self._seed_vars:
            v.assign(tf.zeros_like(v))

    def _snapshot(self) -> None:
        for v, start in zip(self._fwd_vars, self._fwd_start):
            start.assign(v)

    def _evaluate(self, x: Any, y: Any) -> Any:
        import tensorflow as tf

        out = self.model(x, training=False)
        n = tf.cast(_leading_dim(y), tf.float32)
        return tf.stack(self._stat_values(y, out, self._loss(y, out), n) + [n])

    # -- a step ---------------------------------------------------------------------------
    @property
    def step_buffer(self) -> torch.Tensor:
        if self._view is None:
            import tensorflow as tf

            with tf.device(self._tf_device):
                self._acc = tf.zeros([self._size], tf.float32)
            self._view = _torch_view(self._acc)
        return self._view

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
                self._view = torch.zeros(len(self.stat_names) + 2)  # stat sums, count, vote
                return
            weight = None if num_samples == step_samples else tf.constant(num_samples / step_samples, tf.float32)
            self._acc = self._tf_micro(x, y, weight, seed_t, self._acc)
        # A view of TensorFlow's buffer, not a copy: the allreduce writes into it in place.
        self._view = _torch_view(self._acc)

    def all_reduce(self, collective: Any) -> None:
        buffer = self.step_buffer
        if buffer.is_cuda:  # TensorFlow's kernels run on its own stream: finish them before NCCL reads
            import tensorflow as tf

            tf.test.experimental.sync_devices()
        collective.wait(collective.all_reduce_start(buffer))
        if buffer.is_cuda:  # TensorFlow reads the buffer on its own stream next
            torch.cuda.current_stream(buffer.device).synchronize()

    def finish_step(self) -> list[float]:
        if self._solo is not None:
            import tensorflow as tf

            with tf.device(self._tf_device):
                stats = self._tf_solo(*self._solo).numpy().tolist()
            vote = float(self.step_buffer[-1])
            self._solo, self._view, self._in_step = None, None, False
            return stats + [vote]
        buffer = self.step_buffer
        flags = buffer[self._n_grad + self._n_fwd : self._n_grad + self._n_fwd + self._n_flags]
        used = tuple(bool(f > 0) for f in flags.tolist())
        self._tf_apply(self._acc, used)
        tail = buffer[self._n_grad + self._n_fwd + self._n_flags :].tolist()
        self._acc, self._view, self._in_step = None, None, False
        return tail

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
        total = torch.zeros(len(self.stat_names) + 1, dtype=torch.float64)
        for indices, batch in batches:
            total += self.evaluate(batch, len(indices))
        return total

    def evaluate(self, batch: Any, num_samples: int) -> torch.Tensor:
        import tensorflow as tf

        x, y = split_keras_batch(batch)
        with tf.device(self._tf_device):
            values = self._tf_eval(x, y)
        return torch.tensor(values.numpy(), dtype=torch.float64)

    def model_state(self) -> dict[str, Any]:
        return _variables_state(self.model.variables)

    def optimizer_state(self) -> dict[str, Any]:
        return _variables_state(self.optimizer.variables) if self.optimizer.built else {}

    def load_state(self, model_state: dict[str, Any], optimizer_state: dict[str, Any]) -> None:
        _assign_all(self.model.variables, [t.numpy() for t in model_state.values()], "model")
        if optimizer_state:
            if not self.optimizer.built:
                self.optimizer.build(self.model.trainable_variables)
            _assign_all(self.optimizer.variables, [t.numpy() for t in optimizer_state.values()], "optimizer")


def _torch_view(tensor: Any) -> torch.Tensor:
    """A torch tensor sharing ``tensor``'s memory (CPU or GPU), through a DLPack capsule."""
    import tensorflow as tf

    return torch.utils.dlpack.from_dlpack(tf.experimental.dlpack.to_dlpack(tensor))


def _outputs(model: Any, x: Any) -> list[np.ndarray]:
    import keras

    return [np.asarray(o) for o in keras.tree.flatten(model(x, training=False))]


def _max_abs(arrays: list[np.ndarray]) -> float:
    return max((float(np.max(np.abs(a), initial=0.0)) for a in arrays), default=0.0)


def _max_difference(ours: list[np.ndarray], theirs: list[np.ndarray]) -> float:
    if len(ours) != len(theirs) or any(a.shape != b.shape for a, b in zip(ours, theirs)):
        return float("inf")
    diffs = [np.abs(a.astype(np.float64) - b.astype(np.float64)) for a, b in zip(ours, theirs)]
    return max((float(np.max(d, initial=0.0)) for d in diffs), default=0.0)


def _describe(x: Any) -> str:
    """Shapes and dtypes of a batch's inputs, for error messages."""
    if isinstance(x, Mapping):
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in x.items()) + "}"
    if isinstance(x, tuple | list):
        return f"{type(x).__name__} of {len(x)}: (" + ", ".join(_describe(v) for v in x) + ")"
    return f"array{tuple(np.shape(x))} {getattr(x, 'dtype', type(x).__name__)}"


def _metric_label(metric: Any, position: int, taken: set[str]) -> str:
    if isinstance(metric, str):
        name = metric
        taken_name, suffix = name, 1
        while taken_name in taken or taken_name == "loss":
            suffix += 1
            taken_name = f"{name}_{suffix}"
        taken.add(taken_name)
        return taken_name
    return metric_name(metric, position, taken)


def _metric_configs(metrics: list[Any]) -> list[tuple[str, Any]]:
    """Metrics as they travel: names and callables as they are, Metric objects (which hold
    variables) as their Keras config."""
    import keras

    shipped: list[tuple[str, Any]] = []
    for m in metrics:
        if isinstance(m, keras.metrics.Metric):
            shipped.append(("config", keras.metrics.serialize(m)))
        else:
            shipped.append(("value", m))
    return shipped


def _metrics_from_configs(shipped: list[tuple[str, Any]], custom: dict[str, Any]) -> list[Any]:
    import keras

    return [keras.metrics.deserialize(v, custom_objects=custom) if kind == "config" else v for kind, v in shipped]


def _variables_state(variables: Sequence[Any]) -> dict[str, torch.Tensor]:
    """Variables as CPU torch tensors keyed by position and path (positions, not paths, are
    what match between processes: Keras numbers auto-named objects per process)."""
    state = {}
    for i, v in enumerate(variables):
        array = np.asarray(v.numpy())
        if array.dtype == np.uint32:  # torch's uint32 support is partial; the value fits int64
            array = array.astype(np.int64)
        state[f"{i:05d}:{v.path}"] = torch.from_numpy(array.copy())  # copy(): keeps 0-d shapes, owns its memory
    return state


def _assign_all(variables: Sequence[Any], values: Sequence[Any], what: str) -> None:
    if len(variables) != len(values):
        raise ValueError(f"{what} state has {len(values)} variables; this {what} has {len(variables)}")
    for v, value in zip(variables, values):
        array = np.asarray(value)
        if tuple(array.shape) != tuple(v.shape):
            raise ValueError(f"{what} state for {v.path} has shape {array.shape}; the variable has {tuple(v.shape)}")
        v.assign(array.astype(v.dtype))


def _configure_tensorflow(device: str, num_threads: int) -> None:
    """Threads and the visible GPU, before TensorFlow starts its runtime."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    with contextlib.suppress(RuntimeError):  # the runtime already started (a custom object used TF)
        tf.config.threading.set_intra_op_parallelism_threads(num_threads)
        tf.config.threading.set_inter_op_parallelism_threads(1 if device == "cpu" else 2)
    gpus = tf.config.list_physical_devices("GPU")
    with contextlib.suppress(RuntimeError):
        if device.startswith("cuda") and gpus:
            index = int(device.split(":")[1]) if ":" in device else 0
            tf.config.set_visible_devices(gpus[index], "GPU")
            tf.config.experimental.set_memory_growth(gpus[index], True)  # leave memory to torch's NCCL buffers
        elif gpus:
            tf.config.set_visible_devices([], "GPU")
