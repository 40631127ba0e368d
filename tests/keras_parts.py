"""What tests/test_keras.py cannot define without Keras: its loss, its custom layers and Model subclass,
and its batch-level dataset. The test module loads this one at a test's first use of it
(tests/helpers.py, Lazily), so that collecting it imports no TensorFlow; a worker unpickling these
classes imports it."""

from __future__ import annotations

import os

from fabric_model import quiet_tensorflow
from fabric_model.frameworks.keras.adapter import collate_numpy

with quiet_tensorflow():
    import keras

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@keras.saving.register_keras_serializable(package="fabric_tests")
class Registered(keras.layers.Layer):
    """Registered with Keras: found without keras_custom_objects."""

    def call(self, x):
        return x * 1.0


class Scale(keras.layers.Layer):
    """A custom layer with a weight and a constructor argument."""

    def __init__(self, init: float = 1.0, **kwargs):
        super().__init__(**kwargs)
        self.init = init

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer=keras.initializers.Constant(self.init))

    def call(self, x):
        return x * self.scale

    def get_config(self):
        return {**super().get_config(), "init": self.init}


class Subclassed(keras.Model):
    def __init__(self, hidden: int = 16, **kwargs):
        super().__init__(**kwargs)
        self.hidden = hidden
        self.dense = keras.layers.Dense(hidden, activation="relu")
        self.scale = Scale(0.5)
        self.registered = Registered()
        self.out = keras.layers.Dense(3)

    def call(self, x):
        return self.out(self.registered(self.scale(self.dense(x))))

    def get_config(self):
        return {**super().get_config(), "hidden": self.hidden}


class Forgetful(keras.layers.Layer):
    """Its get_config() leaves out `factor`: rebuilt, it multiplies by 1, not by `factor`."""

    def __init__(self, factor: float = 1.0, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x):
        return x * self.factor

    def get_config(self):  # overridden without `factor` (Keras fills it in only when not overridden)
        return super().get_config()


class Batches(keras.utils.PyDataset):
    """A batch-level dataset, as ImageDataGenerator().flow() returns: item i is batch i. It
    records the items it serves in ``<record_dir>/reads-<pid>.txt``."""

    def __init__(self, samples, batch_size, record_dir=None, **kwargs):
        super().__init__(**kwargs)
        self.samples, self.batch_size, self.record_dir = samples, batch_size, record_dir

    def __len__(self):
        return -(-len(self.samples) // self.batch_size)

    def __getitem__(self, i):
        if self.record_dir is not None:
            with open(os.path.join(self.record_dir, f"reads-{os.getpid()}.txt"), "a") as f:
                f.write(f"{i}\n")
        return collate_numpy(self.samples[i * self.batch_size : (i + 1) * self.batch_size])
