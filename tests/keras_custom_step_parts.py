"""What tests/test_keras_custom_step.py cannot define without Keras: its loss and its Model subclasses.
The test module loads this one at a test's first use of it (tests/helpers.py, Lazily), so that
collecting it imports no TensorFlow."""

from __future__ import annotations

from fabric_model import quiet_tensorflow

with quiet_tensorflow():
    import keras
    import tensorflow as tf

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class Doubled(keras.Sequential):
    """compute_loss overridden: the loss given, twice (a train_step-free subclass)."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return 2.0 * super().compute_loss(x, y, y_pred, sample_weight, training=training)


class OwnTrainStep(keras.Sequential):
    """train_step overridden with a loss of its own: nothing compiled is needed."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = LOSS(y, self(x, training=True))
        self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_variables), self.trainable_variables))
        return {"loss": loss}


class OwnLoss(keras.Sequential):
    """compute_loss overridden with a loss of its own (not super()'s, which has no loss compiled)."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return 2.0 * LOSS(y, y_pred)
