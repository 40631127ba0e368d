"""A small training run for the display tests, run as its own process (a terminal, a pipe, SIGINT).

python tests/display_job.py RUN_DIR EPOCHS STEP_DELAY [VERBOSE]
"""

import sys
import time

import torch
import torch.nn.functional as F

from fabric_model import FabricModel
from tests.helpers import MLP, accuracy, make_data


class Pace:
    """Worker logger: each step takes at least ``delay`` seconds (so a test can interrupt mid-run)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def log_train_metrics(self, metrics, iteration, epoch, workers):
        time.sleep(self.delay)


def datasets():
    data = make_data(240)
    return data[:192], data[192:]


if __name__ == "__main__":
    run_dir, epochs, delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    verbose = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fm = FabricModel(model, datasets, F.cross_entropy, opt, metrics=[accuracy], worker_logger_callback=Pace(delay))
    fm.train(epochs, 16, 2, run_dir=run_dir, verbose=verbose, seed=1)
    print("done", flush=True)
