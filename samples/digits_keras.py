"""Train a small Keras MLP on scikit-learn's handwritten digits with FabricModel.

The 8x8 digit images (1,797 of them, shipped with scikit-learn, no download) are
standardized and split 80/20 into train and test sets. FabricModel trains the Keras model
data-parallel on ``--engines`` worker processes (default 2): each step, every worker
computes the gradient of one micro-batch of ``--batch-size`` samples in a compiled
``tf.function``, the gradients are averaged over the global batch, and every worker applies
the same Keras SGD update. The script prints the final test accuracy and where the trained
model was saved (``<run_dir>/model/model.keras``), and exits with status 1 if the accuracy is
below 95%. Logs and per-step metrics go to ``./fabric_runs/<run-id>/`` (or ``--run-dir``).
Takes about 20 s on 2 CPU cores, a good part of it TensorFlow's start-up in the workers.

Run it from the repository root, after ``pip install -e ".[tensorflow]"`` (or with ``PYTHONPATH=.``):

    python3 samples/digits_keras.py [--engines 2] [--epochs 20] [--batch-size 32] [--run-dir DIR]
"""

import argparse
import os
import sys

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler

from fabric_model import FabricModel, quiet_tensorflow

with quiet_tensorflow():  # TensorFlow's start-up notices off the screen (TF_CPP_MIN_LOG_LEVEL=0 shows them)
    import keras


def get_datasets():
    """(train, test) lists of (features, label) samples. Runs in every worker."""
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    scaler = StandardScaler().fit(x_train)  # fit on the training set only

    def to_dataset(features, labels):
        features = scaler.transform(features).astype(np.float32)
        return [(features[i], np.int64(labels[i])) for i in range(len(labels))]

    return to_dataset(x_train, y_train), to_dataset(x_test, y_test)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per-worker micro-batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", default=None, help="where logs and the model go (default ./fabric_runs/<id>)")
    args = parser.parse_args()

    keras.utils.set_random_seed(args.seed)  # the initial weights
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(10),  # logits
        ]
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)
    fm = FabricModel(model, get_datasets, loss, optimizer, metrics=["accuracy"])
    result = fm.train(args.epochs, args.batch_size, args.engines, seed=args.seed, run_dir=args.run_dir)

    test_accuracy = result.test_history[-1]["accuracy"]
    run_dir = os.path.relpath(result.run_dir)  # short: the lines fit a narrow terminal
    print(f"test accuracy: {test_accuracy:.4f} on {args.engines} workers; run: {run_dir}")
    print(f"trained model: {os.path.join(run_dir, 'model', 'model.keras')} (keras.saving.load_model)")
    # `model` now holds the trained weights too and can be used directly, e.g. model.predict(x).
    if test_accuracy < 0.95:
        print("FAILED: test accuracy is below 0.95", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
