"""TensorFlow's runtime in a worker: its threads and visible GPU, and its tensors seen by torch without a copy."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch


def torch_view(tensor: Any) -> torch.Tensor:
    """A torch tensor sharing ``tensor``'s memory (CPU or GPU), through a DLPack capsule."""
    import tensorflow as tf

    return torch.utils.dlpack.from_dlpack(tf.experimental.dlpack.to_dlpack(tensor))


def configure_tensorflow(device: str, num_threads: int) -> None:
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
