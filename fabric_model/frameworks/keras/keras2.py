"""Keras 2 (``tf_keras``, ``tf.keras`` under ``TF_USE_LEGACY_KERAS=1``): its answers to :class:`.flavor.Flavor`.

Imported only for a ``tf_keras`` model. What differs from Keras 3, and why it is answered so:

- Optimizers: two families, ``tf.keras.optimizers.Optimizer`` (``build``, ``variables``) and
  ``tf.keras.optimizers.legacy.Optimizer`` (``OptimizerV2``: slots made on first use,
  ``variables()`` a method, in creation order). The update is ``apply_gradients(pairs)`` for both.
  An optimizer travels as its class and ``get_config()`` (a serialized config names a class only by
  name, which the two families share: ``Adam``), and a legacy optimizer's variables are
  listed in an order fixed by the optimizer, not by which hyperparameter a script happened to read
  first, so state moves between processes by position as Keras 3's does.
- Random layers draw from a ``RandomGenerator`` that is usually TensorFlow's stateful, per-process
  random ops: :mod:`.keras2_random` points them at generators reset from the micro-batch's seed.
- Nested outputs flatten with ``tf.nest`` (``tf_keras`` has no ``tree``); ``.keras`` files load with
  ``tf_keras.saving.load_model``; there is no ONNX exporter of Keras' own (tf2onnx converts a
  ``tf.function`` over the model, as for older Keras 3).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .flavor import Flavor, RandomState, Record, _class_method, _instance_method


def _is_legacy(optimizer: Any) -> bool:
    """An ``OptimizerV2`` (``tf.keras.optimizers.legacy.*``): its slots are made by ``_create_all_weights``."""
    return hasattr(optimizer, "_create_all_weights")


class Keras2Flavor(Flavor):
    """Keras 2, the ``tf_keras`` package."""

    name = "tf_keras"
    package = "tf_keras"
    label = "Keras 2 (tf_keras)"

    def optimizer_types(self) -> tuple[type, ...]:
        optimizers = self.module().optimizers
        return (optimizers.Optimizer, optimizers.legacy.Optimizer)

    def optimizer_names(self) -> str:
        return "a tf.keras.optimizers.Optimizer or tf.keras.optimizers.legacy.Optimizer of tf_keras (Keras 2)"

    def flatten(self, tree: Any) -> list[Any]:
        import tensorflow as tf

        return list(tf.nest.flatten(tree))

    # -- shipping --------------------------------------------------------------------------
    def optimizer_config(self, optimizer: Any) -> Any:
        # The class itself (pickled by reference, or by value when the script defines it) and its
        # arguments: a legacy Adam stays a legacy Adam.
        return type(optimizer), optimizer.get_config()

    def optimizer_from_config(self, config: Any, custom_objects: dict[str, Any]) -> Any:
        cls, arguments = config
        return cls.from_config(dict(arguments), custom_objects=custom_objects)

    def registered_objects(self) -> dict[str, Any]:
        return dict(self.module().saving.get_custom_objects())

    # -- the optimizer in a worker ---------------------------------------------------------
    def optimizer_built(self, optimizer: Any) -> bool:
        if _is_legacy(optimizer):
            # Its variables are made piecemeal: a script that read `optimizer.lr` made the hyperparameters
            # alone, which a fresh optimizer in a worker makes alike. A step (or a build) makes the rest.
            return bool(optimizer._slots) or (optimizer._hypers_created and optimizer._iterations is not None)
        return bool(getattr(optimizer, "_built", False))

    def build_optimizer(self, optimizer: Any, variables: Sequence[Any]) -> None:
        if _is_legacy(optimizer):
            optimizer._create_all_weights(list(variables))
        else:
            optimizer.build(list(variables))

    def optimizer_variables(self, optimizer: Any) -> list[Any]:
        if not _is_legacy(optimizer):
            return list(optimizer.variables)
        import tensorflow as tf

        # Iterations, the hyperparameters by name, then each slot kind over the variables in order.
        hypers = [value for _, value in sorted(optimizer._hyper.items()) if isinstance(value, tf.Variable)]
        slots = [
            by_name[slot]
            for slot in optimizer.get_slot_names()
            for by_name in optimizer._slots.values()
            if slot in by_name
        ]
        return [optimizer.iterations, *hypers, *slots]

    def user_optimizer_state(self, optimizer: Any, trainable: Sequence[Any]) -> list[Any] | None:
        if not self.optimizer_built(optimizer):
            return None
        # A legacy optimizer may hold part of its variables (slots are made per variable list): all travel.
        self.build_optimizer(optimizer, trainable)
        return self.optimizer_variables(optimizer)

    def apply(self, optimizer: Any, grads: Sequence[Any], variables: Sequence[Any]) -> None:
        optimizer.apply_gradients(list(zip(grads, variables)))

    def compile(self, model: Any, optimizer: Any, loss: Any, metrics: list[Any] | None) -> None:
        self.module().Model.compile(model, optimizer=optimizer, loss=loss, metrics=metrics)

    def random_state(self, model: Any) -> RandomState:
        from .keras2_random import SeededGenerators

        return SeededGenerators(model)

    # -- a custom step's gradients -----------------------------------------------------------
    @contextlib.contextmanager
    def intercepting(self, optimizer: Any, record: Record, refuse: Callable[[Any], None]) -> Iterator[None]:
        from tf_keras.src.optimizers.legacy.optimizer_v2 import OptimizerV2
        from tf_keras.src.optimizers.optimizer import Optimizer, _BaseOptimizer

        def apply_gradients(grads_and_vars: Any, *args: Any, **kwargs: Any) -> None:
            pairs = list(grads_and_vars)
            record([g for g, _ in pairs], [v for _, v in pairs])

        def foreign(other: Any, *args: Any, **kwargs: Any) -> None:
            refuse(other)

        # minimize() and a train_step's update end in self.apply_gradients: the instance's attribute wins.
        with contextlib.ExitStack() as stack:
            stack.enter_context(_instance_method(optimizer, "apply_gradients", apply_gradients))
            for cls in (OptimizerV2, Optimizer, _BaseOptimizer):
                stack.enter_context(_class_method(cls, "apply_gradients", foreign))
            yield

    def has_onnx_exporter(self) -> bool:
        return False


KERAS2 = Keras2Flavor()
