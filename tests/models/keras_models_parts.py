"""What tests/models/test_keras_models.py cannot define without Keras: its dict of losses and its Model
subclasses, registered with Keras. The test module loads this one at a test's first use of it
(tests/helpers.py, Lazily), so that collecting it imports no TensorFlow; a worker unpickling these
classes imports it."""

from __future__ import annotations

from fabric_model import quiet_tensorflow

with quiet_tensorflow():
    import keras
    import tensorflow as tf

LOSSES = {"cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "reg": "mse"}


@keras.saving.register_keras_serializable("fabric_model_tests")
class OwnStep(keras.Model):
    """Keras' guide's pattern: its own train_step (the loss tracker updated by hand) and a compute_loss
    that adds a penalty on the outputs' size."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training=training)
        return loss + 0.1 * tf.reduce_mean(tf.square(y_pred["reg"]))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            pred = self(x, training=True)
            loss = self.compute_loss(x, y, pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        for metric in self.metrics:
            if metric.name == "loss":  # compute_loss updates the per-output losses' own trackers
                metric.update_state(loss)
        return {m.name: m.result() for m in self.metrics}


@keras.saving.register_keras_serializable("fabric_model_tests")
class OwnLoss(keras.Model):
    """compute_loss overridden with a loss of its own: the mean squared error plus an L2 penalty on the
    weights. Nothing is compiled (loss_function=None), so it does not call super().compute_loss."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        mse = tf.reduce_mean(tf.square(y_pred - tf.cast(y, y_pred.dtype)))
        return mse + 1e-2 * tf.add_n([tf.reduce_sum(tf.square(w)) for w in self.trainable_weights])
