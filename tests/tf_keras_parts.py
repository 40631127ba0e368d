"""What tests/test_tf_keras.py cannot define without tf_keras: its loss, its Model subclasses and its
custom layer. The test module loads this one at a test's first use of it (tests/helpers.py, Lazily),
so that collecting it imports no TensorFlow; a worker unpickling these classes imports it."""

from __future__ import annotations

from fabric_model import quiet_tensorflow

with quiet_tensorflow():
    import tensorflow as tf
    import tf_keras

LOSS = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class OwnStep(tf_keras.Model):
    """A functional model with the usual Keras 2 train_step: compiled_loss, minimize, compute_metrics."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            pred = self(x, training=True)
            loss = self.compiled_loss(y, pred)
        self.optimizer.minimize(loss, self.trainable_variables, tape=tape)  # collected, not applied here
        return self.compute_metrics(x, y, pred, None)


class OwnLoss(tf_keras.Model):
    """A functional model with its own compute_loss (Keras 2's signature: no `training`), twice the loss given."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None):
        return 2.0 * tf.reduce_mean(LOSS(y, y_pred))


class Scale(tf_keras.layers.Layer):
    """A custom layer with a weight and a constructor argument."""

    def __init__(self, init: float = 1.0, **kwargs):
        super().__init__(**kwargs)
        self.init = init

    def build(self, input_shape):
        self.scale = self.add_weight(
            name="scale", shape=(input_shape[-1],), initializer=tf_keras.initializers.Constant(self.init)
        )

    def call(self, x):
        return x * self.scale

    def get_config(self):
        return {**super().get_config(), "init": self.init}


class Subclassed(tf_keras.Model):
    def __init__(self, hidden: int = 16, **kwargs):
        super().__init__(**kwargs)
        self.hidden = hidden
        self.dense = tf_keras.layers.Dense(hidden, activation="relu")
        self.scale = Scale(0.5)
        self.out = tf_keras.layers.Dense(3)

    def call(self, x):
        return self.out(self.scale(self.dense(x)))

    def get_config(self):
        return {"hidden": self.hidden}
