"""Which Keras a model belongs to: Keras 3 (``keras``) or Keras 2 (``tf_keras``, what ``tf.keras`` is
under ``TF_USE_LEGACY_KERAS=1``), and the few operations the two spell differently.

The Keras framework is written once; where Keras 2 and 3 differ (the optimizer's variables and
update call, how a saved model loads, how random layers draw, what a nested output flattens to),
it asks the model's :class:`Flavor`. Keras 3's answers are here; Keras 2's are in :mod:`.keras2`,
which is imported only for a ``tf_keras`` model, so the package never imports ``tf_keras`` (an
optional extra) for anyone else. A flavor pickles as its name: the worker's adapter resolves the
same Keras, whatever ``tf.keras`` means in the worker's environment.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

#: What a custom step's optimizer call hands over: ``record(gradients, their variables or None)``.
Record = Callable[[Sequence[Any], Sequence[Any] | None], None]


class RandomState:
    """How a model's random layers (Dropout, GaussianNoise...) are made to draw from the micro-batch's
    seed, so that randomness depends on the micro-batch, never on the worker that computed it."""

    #: Model variables that hold random state: not forward-updated buffers, never reduced.
    variables: list[Any] = []

    def reseed(self, seed: Any) -> None:
        """Inside the traced micro-batch, before its forward pass: draw from ``seed`` (an int64 tensor)."""

    def clear(self) -> None:
        """Inside the traced apply, after the step: a fixed value, equal on every replica."""


class Flavor:
    """Keras 3: the answers the adapter and the framework get for a ``keras.Model``."""

    #: The framework's name (run records, checkpoints, messages) and the package imported.
    name = "keras"
    package = "keras"
    #: How messages name it.
    label = "Keras 3 (keras)"

    def __reduce__(self) -> tuple[Callable[[str], Flavor], tuple[str]]:
        return flavor_named, (self.name,)

    def module(self) -> ModuleType:
        """The Keras package: ``keras`` or ``tf_keras``."""
        return importlib.import_module(self.package)

    # -- objects ---------------------------------------------------------------------------
    def optimizer_types(self) -> tuple[type, ...]:
        """The optimizer classes this Keras trains with."""
        return (self.module().optimizers.Optimizer,)

    def optimizer_names(self) -> str:
        """The accepted optimizer classes, as an error message names them."""
        return "a keras.optimizers.Optimizer"

    def is_model(self, obj: Any) -> bool:
        return isinstance(obj, self.module().Model)

    def flatten(self, tree: Any) -> list[Any]:
        """A nested output's leaves (dicts by sorted key, as this Keras flattens them)."""
        return list(self.module().tree.flatten(tree))

    # -- shipping --------------------------------------------------------------------------
    def optimizer_config(self, optimizer: Any) -> Any:
        """What rebuilds ``optimizer`` in a worker (its class and arguments, not its state)."""
        return self.module().optimizers.serialize(optimizer)

    def optimizer_from_config(self, config: Any, custom_objects: dict[str, Any]) -> Any:
        return self.module().optimizers.deserialize(config, custom_objects=custom_objects)

    def load_model(self, path: str, custom_objects: dict[str, Any]) -> Any:
        """The model saved at ``path`` (a ``.keras`` file), uncompiled."""
        return self.module().saving.load_model(path, custom_objects=custom_objects, compile=False)

    def registered_objects(self) -> dict[str, Any]:
        """Classes registered with ``register_keras_serializable``: a worker has not run the code that did it."""
        return dict(self.module().saving.get_custom_objects())

    # -- the optimizer in a worker ---------------------------------------------------------
    def optimizer_built(self, optimizer: Any) -> bool:
        """Whether ``optimizer`` has its state variables (moments, iteration count)."""
        return bool(optimizer.built)

    def build_optimizer(self, optimizer: Any, variables: Sequence[Any]) -> None:
        """Make ``optimizer``'s state variables for ``variables``, unless it has them (Keras 3's ``build``
        would make them twice)."""
        if not optimizer.built:
            optimizer.build(variables)

    def optimizer_variables(self, optimizer: Any) -> list[Any]:
        """The optimizer's state variables, in an order that is the same in every process."""
        return list(optimizer.variables)

    def user_optimizer_state(self, optimizer: Any, trainable: Sequence[Any]) -> list[Any] | None:
        """The variables of the user's ``optimizer`` whose values travel to the workers; None while it
        is fresh (a worker builds the same fresh state)."""
        return self.optimizer_variables(optimizer) if self.optimizer_built(optimizer) else None

    def apply(self, optimizer: Any, grads: Sequence[Any], variables: Sequence[Any]) -> None:
        """One optimizer update (traced): ``grads`` for ``variables``."""
        optimizer.apply(list(grads), list(variables))

    def set_global_clipnorm(self, optimizer: Any, clip_norm: float) -> None:
        optimizer.global_clipnorm = clip_norm

    def compile(self, model: Any, optimizer: Any, loss: Any, metrics: list[Any] | None) -> None:
        """``keras.Model.compile``, Keras' own (a subclass's compile may take other arguments, a GAN's
        optimizers), so that ``model.optimizer``, ``compute_loss`` and ``train_step`` work as after ``fit``."""
        self.module().Model.compile(
            model,
            optimizer=optimizer,
            loss=loss,
            metrics=metrics,
            auto_scale_loss=False,  # model.optimizer stays the optimizer whose apply is captured
        )

    def random_state(self, model: Any) -> RandomState:
        """Keras 3's random layers draw from ``SeedGenerator`` state variables, set from the micro-batch's seed."""
        return SeedGeneratorStates(model)

    # -- a custom step's gradients (:mod:`.capture`) -------------------------------------------
    @contextlib.contextmanager
    def intercepting(self, optimizer: Any, record: Record, refuse: Callable[[Any], None]) -> Iterator[None]:
        """Within the block, ``optimizer``'s update calls hand ``record`` the gradients instead of applying
        them, and any other optimizer's update calls ``refuse(that_optimizer)``."""
        from keras.src.optimizers.base_optimizer import BaseOptimizer

        def apply(grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> None:
            record(grads, trainable_variables)

        def foreign_apply(other: Any, grads: Any, trainable_variables: Any = None) -> None:
            refuse(other)

        # apply_gradients calls self.apply: the instance's own attribute wins over the class's.
        with _instance_method(optimizer, "apply", apply), _class_method(BaseOptimizer, "apply", foreign_apply):
            yield

    def model_method(self, name: str) -> Any:
        """``keras.Model``'s own ``name`` (``train_step``, ``compute_loss``), to tell an override."""
        return getattr(self.module().Model, name)

    # -- export ----------------------------------------------------------------------------
    def has_onnx_exporter(self) -> bool:
        """Whether ``model.export(format="onnx")`` exists (Keras 3.x; older Keras 3 and Keras 2 lack it)."""
        return importlib.util.find_spec("keras.src.export.onnx") is not None


class SeedGeneratorStates(RandomState):
    """Keras 3: each ``SeedGenerator`` state variable is set to ``[seed, k]`` before a micro-batch."""

    def __init__(self, model: Any) -> None:
        self.variables = [v for v in model.variables if not v.trainable and v.path.endswith("seed_generator_state")]

    def reseed(self, seed: Any) -> None:
        import tensorflow as tf

        for k, v in enumerate(self.variables):
            v.assign(tf.cast(tf.stack([seed, tf.constant(k, tf.int64)]), v.dtype))

    def clear(self) -> None:
        import tensorflow as tf

        for v in self.variables:
            v.assign(tf.zeros_like(v))


@contextlib.contextmanager
def _instance_method(obj: Any, name: str, function: Callable[..., Any]) -> Iterator[None]:
    """``obj.name`` is ``function`` within the block (set past Keras' tracking ``__setattr__``)."""
    shadowed = name in vars(obj)
    previous = vars(obj).get(name)
    object.__setattr__(obj, name, function)
    try:
        yield
    finally:
        if shadowed:
            object.__setattr__(obj, name, previous)
        else:
            object.__delattr__(obj, name)


@contextlib.contextmanager
def _class_method(cls: type, name: str, function: Callable[..., Any]) -> Iterator[None]:
    """``cls.name`` is ``function`` within the block."""
    own = name in vars(cls)
    previous = vars(cls).get(name)
    setattr(cls, name, function)
    try:
        yield
    finally:
        if own:
            setattr(cls, name, previous)
        else:
            delattr(cls, name)


#: Framework name -> (module, attribute) of its flavor; the Keras 2 module is imported only when asked for.
_FLAVORS = {"keras": (__name__, "KERAS3"), "tf_keras": (f"{__package__}.keras2", "KERAS2")}


def flavor_named(name: str) -> Flavor:
    """The flavor called ``name`` ("keras" or "tf_keras")."""
    if name not in _FLAVORS:
        raise ValueError(f"Expected a Keras flavor, one of {tuple(_FLAVORS)}. Received: {name!r}")
    module, attribute = _FLAVORS[name]
    flavor: Flavor = getattr(importlib.import_module(module), attribute)
    return flavor


def flavor_name(model: Any) -> str:
    """ "tf_keras" for a model of a ``tf_keras`` class, else "keras", from the modules of its classes
    (importing nothing)."""
    for cls in type(model).__mro__:
        module = cls.__module__ or ""
        if module == "tf_keras" or module.startswith("tf_keras."):
            return "tf_keras"
        if module == "keras" or module.startswith("keras."):
            return "keras"
    return "keras"


def flavor_of(model: Any) -> Flavor:
    """The flavor of ``model`` (see :func:`flavor_name`)."""
    return flavor_named(flavor_name(model))


KERAS3 = Flavor()
