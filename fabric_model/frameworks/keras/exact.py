"""``deterministic=True`` for Keras: the step's gradients and variable deltas summed exactly.

:class:`ExactKerasAdapter` is the :class:`~.keras_adapter.KerasAdapter` with the differences
of :class:`~.torch_exact.ExactTorchAdapter` (docs/architecture.md, "Deterministic mode"):

- each micro-batch's flat result (weighted gradients and forward-updated variable deltas, from
  the same compiled function) is added to a fixed-point :class:`~fabric_model.step.exact_sum.ExactSum`
  on its own, instead of to the previous micro-batches' in float32; its tail (flags, stat sums,
  count) is summed in float, as metrics are logs;
- the allreduce sums the fixed-point total, maxes the exponents, and every replica redoes the
  step on a new grid when the agreed maxima ask for it; the total is then written, rounded once,
  into the TensorFlow buffer that the apply function reads;
- TensorFlow's op determinism is on (``tf.config.experimental.enable_op_determinism``), the
  thread count is the one chosen in the caller, and the one-function solo step is off (its
  gradient would skip the rounding that makes a lone worker agree with many).

The grid's exponents travel in the optimizer state (:class:`~.exact_grid.ExactGrid`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ...step.exact_sum import ExactSum
from ...step.layout import StepResult
from ..exact_grid import ExactGrid
from .adapter import KerasAdapter
from .batches import split_keras_batch
from .runtime import torch_view


class ExactKerasAdapter(ExactGrid, KerasAdapter):
    """A :class:`KerasAdapter` whose step sums are bitwise independent of how micro-batches are divided."""

    def setup(self, device: str, num_threads: int) -> None:
        super().setup(device, num_threads)
        import tensorflow as tf

        tf.config.experimental.enable_op_determinism()
        sizes = [int(np.prod(v.shape)) for v in self._train_vars + self._fwd_vars]
        self._region_size = sum(sizes)
        self._exact = ExactSum(sizes, self.max_terms, torch.device("cuda" if device.startswith("cuda") else "cpu"))
        self._replay: list[tuple[Any, int, int, int]] = []

    def begin_step(self, collective: Any = None) -> None:
        super().begin_step(collective)
        self._solo_possible = False
        self.step_buffer.zero_()  # a fresh TensorFlow buffer: the tail accumulates here, the total is written here
        self.exact_sum.zero()
        self._replay = []
        self.grid_step_begins()

    def train_micro_batch(self, batch: Any, num_samples: int, step_samples: int, seed: int, last: bool = False) -> None:
        self._replay.append((batch, num_samples, step_samples, seed))
        self._exact_micro_batch(batch, num_samples, step_samples, seed)

    def _exact_micro_batch(self, batch: Any, num_samples: int, step_samples: int, seed: int) -> None:
        import tensorflow as tf

        x, y = split_keras_batch(batch)
        with tf.device(self._tf_device):
            weight = None if num_samples == step_samples else tf.constant(num_samples / step_samples, tf.float32)
            flat = self._tf_micro(x, y, weight, tf.constant(seed, tf.int64), None)
        if flat.device.endswith("GPU:0"):
            tf.test.experimental.sync_devices()
        term = torch_view(flat)
        self.exact_sum.add(term[: self._region_size])
        self.step_buffer[self._region_size :] += term[self._region_size :]  # flags, stats, count

    def all_reduce(self, collective: Any) -> None:
        """Sum the fixed-point totals and the float tail, max the exponents; redo the step on a new grid if asked."""
        buffer = self.step_buffer
        # This member's own micro-batch count and vote, for a redo to sum again (not the sums).
        layout = self.step_layout
        own = buffer[layout.computed : layout.vote + 1].clone()
        while True:
            if collective.world_size > 1:
                works = [
                    collective.all_reduce_start(self.exact_sum.total),
                    collective.all_reduce_max_start(self.exact_sum.maxima),
                    collective.all_reduce_start(buffer[self._region_size :]),  # flags, stats, count, vote
                ]
                for work in works:
                    collective.wait(work)
            if self.exact_sum.settle():
                self.exact_sum.write(buffer[: self._region_size])
                if buffer.is_cuda:  # TensorFlow reads the buffer on its own stream next
                    torch.cuda.current_stream(buffer.device).synchronize()
                return
            self._redo(own)

    def _redo(self, own: torch.Tensor) -> None:
        """Every replica decided alike (from agreed maxima): run this step's micro-batches again;
        ``own``: this member's micro-batch count and vote, as it wrote them before the allreduce."""
        tail = self.step_buffer[self._region_size :]
        layout = self.step_layout
        tail.zero_()
        self.exact_sum.zero()
        for batch, num_samples, step_samples, seed in self._replay:
            self._exact_micro_batch(batch, num_samples, step_samples, seed)  # each starts from the step's variables
        self.step_buffer[layout.computed : layout.vote + 1] = own

    def finish_step(self) -> StepResult:
        self._replay = []
        self.grid_step_ends()
        return super().finish_step()

    def abort_step(self) -> None:
        super().abort_step()
        self._restore_step_grid()
        self._replay = []
