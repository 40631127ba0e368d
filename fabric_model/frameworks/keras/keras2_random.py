"""Keras 2's random layers drawing from the micro-batch's seed (the Keras 2 half of the step's
"randomness depends on the micro-batch, never on the worker", docs/architecture.md, "The step").

A ``tf_keras`` random layer (Dropout, SpatialDropout, GaussianNoise, GaussianDropout, AlphaDropout,
the random preprocessing layers) draws through its ``_random_generator``, a
``tf_keras.src.backend.RandomGenerator``. By default that uses TensorFlow's stateful random ops,
whose state is per process and per traced function: two workers running the same micro-batch would
drop different units, and a replacement worker would not redo what the lost one did. So in a worker
each such generator is switched to its ``"stateful"`` mode over a ``tf.random.Generator`` of our own
(Philox), and before every micro-batch generator ``k`` is reset to key ``seed``, counter ``(0, k)``:
layers draw independent streams, each a function of the micro-batch's seed alone. The generators are
not model variables (``model.variables`` is unchanged), so nothing of them travels or is reduced.

Not covered: a custom layer that calls ``tf.random.*`` itself (its draws stay per process); it may
use ``self._random_generator`` (``tf.keras.__internal__.layers.BaseRandomLayer``) instead.
"""

from __future__ import annotations

from typing import Any

from .flavor import RandomState


def random_generators(model: Any) -> list[Any]:
    """Every layer's ``RandomGenerator`` in ``model`` (nested models and layers included), in layer order."""
    from tf_keras.src.backend import RandomGenerator

    found: list[Any] = []
    for layer in model._flatten_layers(include_self=True, recursive=True):
        generator = getattr(layer, "_random_generator", None)
        if isinstance(generator, RandomGenerator) and all(generator is not g for g in found):
            found.append(generator)
    return found


class SeededGenerators(RandomState):
    """The model's random layers, each over a Philox generator reset from the micro-batch's seed."""

    variables: list[Any] = []

    def __init__(self, model: Any) -> None:
        import tensorflow as tf

        self._generators = []
        for layer_generator in random_generators(model):
            generator = tf.random.Generator.from_seed(0, alg="philox")
            # The "stateful" mode draws from `_generator` in dropout, random_uniform, random_normal...
            layer_generator._rng_type = layer_generator.RNG_STATEFUL
            layer_generator._generator = generator
            layer_generator._built = True  # _maybe_init would make a generator of its own
            self._generators.append(generator)

    def reseed(self, seed: Any) -> None:
        import tensorflow as tf

        for k, generator in enumerate(self._generators):
            generator.reset_from_key_counter(seed, tf.constant([0, k], tf.int64))
