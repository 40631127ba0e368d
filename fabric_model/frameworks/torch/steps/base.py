"""What every torch step strategy shares: a micro-batch's forward, backward, buffers and sums.

A strategy (docs/architecture.md, "Adding a step mode") is made for one generation by
:func:`~.choice.choose_step` and runs each of its steps: :meth:`TorchStep.begin`, one
:meth:`TorchStep.micro_batch` per micro-batch this worker computes, :meth:`TorchStep.all_reduce`,
:meth:`TorchStep.finish`. It owns how gradients reach the step buffer, how the buffer is reduced,
and (through its :class:`~.update.WholeUpdate`) how the update is applied; the adapter owns the
framework's part: the model's call, its buffers, metrics, seeding and the device.

The parts of a micro-batch and of a step that a profile window times are methods named in
:attr:`TorchStep.ranges` (profiling/phases.py, ``Phases.follow``): outside a window they run as
they are, with no ``with`` on the step's path.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any

import torch

from ....profiling import phases as ph
from ....step.layout import StepResult
from ..step_buffer import StepBuffer
from .sums import PythonSums, TensorSums
from .update import WholeUpdate


class TorchStep:
    """A step whose gradients accumulate in the step buffer's views (``fresh`` False) or, where a
    subclass says so, are written fresh by backward, as in a plain loop (``fresh`` True)."""

    #: A lone worker computing a whole step leaves the buffers as its forward left them: the
    #: step's rule (start + the one micro-batch's change) up to one float rounding, without the
    #: ~0.1 ms of delta bookkeeping a step of a small model pays. Off where every configuration
    #: must give the same bits (deterministic=True).
    buffers_in_place = False

    #: The methods a profile window's named ranges time (``Phases.follow``: the adapter's phases follow the strategy).
    ranges = {
        "prepare": ph.SEED,
        "forward": ph.FORWARD,
        "backward": ph.BACKWARD,
        "record_buffers": ph.BUFFERS,
        "add_stats": ph.STATS,
        "settle_buffers": ph.BUFFERS,
        "apply_update": ph.OPTIMIZER,
        "read_tail": ph.RESULTS,
    }

    def __init__(self, adapter: Any, buffer: StepBuffer, update: WholeUpdate, world_size: int) -> None:
        self.adapter, self.buffer, self.update, self.world_size = adapter, buffer, update, world_size
        self.params: list[torch.Tensor] = adapter.params
        self.collective: Any = None
        self.in_step = False
        self.fresh = False  # this micro-batch's backward writes fresh gradients, not into the views
        self.got = [0.0] * len(self.params)  # the got-gradient flags, written to the buffer per micro-batch
        self.buf_start: list[torch.Tensor] = []
        self.held_start: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # start_values' (held, sources)
        self.sums: TensorSums | PythonSums = self.make_sums()
        # Parts that are another object's method, held bound (no call of ours around them, ``ranges``).
        self.forward: Callable[[Any, Any], tuple[Any, torch.Tensor]] = adapter.forward
        self.add_stats: Callable[[torch.Tensor, Any, Any, int], None] = self.sums.add
        self.apply_update: Callable[[], None] = update.apply
        self.seed_generators = adapter.seeder()  # (decided once: the model's generators are found at set-up)
        #: Whether the model has forward-updated buffers to carry through the step (decided once).
        self.has_buffers = bool(adapter.buffer_slots)

    def make_sums(self) -> TensorSums | PythonSums:
        """Where the step's stat sums are added (decided once)."""
        return TensorSums(self.adapter, self.buffer)

    # -- a generation -----------------------------------------------------------------------
    def activate(self) -> None:
        """This strategy runs the generation's steps from now on."""

    def deactivate(self) -> None:
        """Another strategy takes over (the world's size changed)."""

    # -- a step -----------------------------------------------------------------------------
    def begin(self, collective: Any) -> None:
        self.collective = collective
        self.got = [0.0] * len(self.params)
        self.begin_buffer()
        self.sums.begin()
        adapter = self.adapter
        self.buf_start = self.start_values(adapter.live_buffers()) if self.has_buffers else []
        self.buffers_at_start = True  # until a micro-batch's forward runs
        self.buffers_as_left = False  # the forward's own values are the step's (buffers_in_place)
        self.in_step = True

    def start_values(self, live: list[torch.Tensor]) -> list[torch.Tensor]:
        """The buffers' values at the step's start (what a redone step starts from, and deltas are
        taken against), which nothing writes: copied in one call into tensors held across steps
        when every slot holds its own tensor (after any step, the adapter's ``keep_live_buffers``
        or ``restore_buffers`` put it back), else cloned. Five clones were ~7 us a step; one
        ``_foreach_copy_`` ~2 us (docs/architecture.md, "What a step costs beyond the math")."""
        own = self.adapter.model_buffers
        if all(map(operator.is_, live, own)):
            if self.held_start is None:  # (the detached sources share the own tensors' memory)
                self.held_start = [b.detach().clone() for b in own], [b.detach() for b in own]
            held, sources = self.held_start
            torch._foreach_copy_(held, sources)
            return held
        return [b.detach().clone() for b in live]

    def begin_buffer(self) -> None:
        """The step buffer bound and zeroed, the gradients where this step's backward adds them."""
        raise NotImplementedError

    def micro_batch(self, batch: Any, num_samples: int, step_samples: int, seed: int, last: bool) -> None:
        """One micro-batch of this worker's share of the step (``last``: its last one): the batch
        on the device, the buffers at the step's values, the generators seeded, then :meth:`learn`."""
        inputs, target = self.prepare(batch, seed)
        self.learn(inputs, target, num_samples / step_samples, num_samples, last)

    def prepare(self, batch: Any, seed: int) -> tuple[Any, Any]:
        """The batch's ``(inputs, target)`` on the device, the buffers at the step's values, the generators seeded."""
        adapter = self.adapter
        inputs, target = adapter.on_device(batch)
        # Forward-updated buffers (BatchNorm statistics) start every micro-batch from the
        # step's values, so the result does not depend on how micro-batches are divided.
        if not self.buffers_at_start and self.has_buffers:
            adapter.restore_buffers(self.buf_start)
        self.buffers_at_start = False
        self.seed_generators(seed)
        return inputs, target

    #: The micro-batch's computation, for a strategy whose ``micro_batch`` wraps it (one name, no extra call).
    compute = micro_batch

    def learn(self, inputs: Any, target: Any, share: float, num_samples: int, last: bool) -> None:
        """The model's forward and loss, backward into the gradients, the buffers' changes, the sums."""
        output, loss = self.forward(inputs, target)
        weight = share * self.adapter.grad_step.scale  # float16's loss scale (1 otherwise), divided out after
        if not self.fresh:
            self.buffer.materialize()  # after the forward: its peak memory holds no gradients (stage 2)
            self.buffer.ensure_grad_views()
        self.backward(loss, weight, last)
        # A fresh step's finish reads the flags off .grad itself: with its buffers left as the
        # forward left them, or none, it has nothing to write here.
        if self.fresh and share == 1.0 and self.buffers_in_place:
            self.buffers_as_left = True
        elif not self.fresh or self.has_buffers:
            self.record_buffers(share)
        self.add_stats(loss, output, target, num_samples)

    def backward(self, loss: torch.Tensor, weight: float, last: bool) -> None:
        (loss if weight == 1.0 else loss * weight).backward()  # x * 1.0 == x: one op less

    def record_buffers(self, share: float) -> None:
        """The micro-batch's got-gradient flags (gradients in the views) and buffer changes into the step buffer."""
        if not self.fresh:
            self.write_flags()
        # No torch.no_grad() here or in finish: every operand is detached or a buffer, so
        # nothing is recorded, and entering the context costs ~20 us after a backward.
        if self.has_buffers:
            self.add_buffer_deltas(share)  # unscaled: the loss scale is the gradients' only

    def add_buffer_deltas(self, weight: float) -> None:
        # Reduce what the forward pass changed, not the values: a buffer the forward leaves
        # alone (a mask, a large counter, a float64 constant) then stays exactly as it was.
        adapter = self.adapter
        live = adapter.live_buffers()
        for b, start, view, averaged in zip(live, self.buf_start, self.buffer.views.buffers, adapter.buffer_averaged):
            view.add_((b.detach() - start).to(torch.float32), alpha=weight if averaged else 1.0)

    def write_flags(self) -> None:
        """This worker's got-gradient flags into the step buffer; from pinned memory on a GPU, so
        the host does not wait for the stream (a pageable copy to the device would)."""
        flags = torch.tensor(self.got)
        got_grad = self.buffer.views.got_grad
        if self.adapter.device.type == "cuda":
            got_grad.copy_(flags.pin_memory(), non_blocking=True)  # the allocator keeps it until copied
        else:
            got_grad.copy_(flags)

    def all_reduce(self, collective: Any) -> None:
        """Sum the step buffer over the group."""
        raise NotImplementedError

    def finish(self) -> StepResult:
        # Outside torch.no_grad(), as in a plain loop: the optimizer's step and clipping set
        # their own grad mode, and the buffers and gradients written here record nothing.
        buffer = self.buffer
        unused: list[int] = []
        if not self.fresh or self.has_buffers:  # (fresh gradients and no buffers: nothing to settle)
            unused = self.settle_buffers()
        self.apply_update()  # float16's unscale and overflow check, then clipping, then the step
        if not self.fresh:  # (a lone worker's full buffer holds no memory: None stays, as in a plain loop)
            for i in unused:
                self.params[i].grad = buffer.grad_views[i]
        self.in_step = False
        tail = self.read_tail()
        self.update.after(buffer, self.collective, self.adapter.phases)
        self.sums.into(tail)
        result = buffer.layout.result(tail)
        norm = self.update.grad_step.last_norm
        return result if norm is None else dataclasses.replace(result, grad_norm=float(norm))

    def read_tail(self) -> list[float]:
        """The reduced tail's values (stat sums, count, micro-batches, votes)."""
        return self.buffer.views.tail.tolist()

    def settle_buffers(self) -> list[int]:
        """The buffers' step values in place; ``.grad`` None where no worker produced a gradient
        (returns those parameters' indices: their views go back after the optimizer's step)."""
        adapter, buffer = self.adapter, self.buffer
        if not self.fresh:
            buffer.ensure_grad_views()
        if self.buffers_as_left:  # only a buffer the forward assigned anew goes back to its own tensor
            adapter.keep_live_buffers()
        elif self.has_buffers:
            adapter.restore_buffers(
                [
                    start + (view if b.is_floating_point() else view.round().to(b.dtype))
                    for b, start, view in zip(adapter.model_buffers, self.buf_start, buffer.views.buffers)
                ]
            )
        # A parameter no worker produced a gradient for keeps .grad None through the step,
        # as after zero_grad() on one device: weight decay and momentum leave it alone.
        unused: list[int] = []
        if not self.fresh:  # (fresh gradients are None where backward produced none: no view goes back)
            # Every parameter got a gradient here: so it did in the sum, which need not be read
            # (on a GPU, reading it would wait for the allreduce before the optimizer's step).
            flags = buffer.views.got_grad
            unused = [] if 0.0 not in self.got else [i for i, got in enumerate(flags.tolist()) if got == 0.0]
        for i in unused:
            self.params[i].grad = None
        return unused

    def abort(self) -> list[torch.Tensor] | None:
        """The step will be redone: the buffers' values at its start (None when no step was running)."""
        if not self.in_step:
            return None
        self.in_step = False
        return self.buf_start
