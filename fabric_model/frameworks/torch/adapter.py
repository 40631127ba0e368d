"""The PyTorch adapter: a ``torch.nn.Module`` with a ``torch.optim.Optimizer``."""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Callable, Collection, Hashable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import default_collate

from ...profiling import phases as ph
from ...step.data import Loader, Reader
from ...step.digest import state_fingerprint
from ...step.layout import StepLayout, StepResult
from ...step.options import StepOptions
from ...step.sample_seeds import Generator, SeededReads
from ...step.tree import map_tree
from ..base import FrameworkAdapter, metric_name
from .batches import cpu_copy, scalar, to_device
from .calling import ModelCall, detached
from .evaluation import TorchEvaluation
from .frozen import FrozenParameters, frozen_names
from .gather import tensor_reader
from .generators import OwnedGenerators, read_generators
from .ibm import Eva, accuracy, forbidden_step
from .precision import GradientStep
from .reader_processes import ProcessLoader
from .sharded import ShardedOptimizer

LossFn = Callable[[Any, Any], torch.Tensor] | None  # None: the model computes its loss (calling.model_loss)
MetricFn = Callable[[Any, Any], Any]


class _TailViews(NamedTuple):
    """Views of a step buffer past its gradients (TorchAdapter._tail_views)."""

    buffers: list[torch.Tensor]
    got_grad: torch.Tensor
    after_gradients: torch.Tensor
    tail: torch.Tensor
    stats: torch.Tensor
    sample_count: torch.Tensor
    stats_and_count: torch.Tensor


class TorchAdapter(TorchEvaluation, FrameworkAdapter):
    """Trains a ``torch.nn.Module`` micro-batch by micro-batch into one flat step buffer.

    Each parameter's ``.grad`` is a view into the step buffer, so backward accumulates
    straight into what the collective reduces: no copy before or after the allreduce.
    """

    lone_direct = True  # a lone worker's backward writes fresh gradients (begin_step)
    #: A lone worker computing a whole step leaves the buffers as its forward left them: the
    #: step's rule (start + the one micro-batch's change) up to one float rounding, without the
    #: ~0.1 ms of delta bookkeeping a step of a small model pays. Off where every configuration
    #: must give the same bits (deterministic=True).
    whole_step_buffers_in_place = True

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_function: LossFn,
        metrics: Sequence[MetricFn] | None = None,
        collate_fn: Callable[[Sequence[Any]], Any] | None = None,
        step_fn: Callable[..., Any] | None = None,
        test_fn: Callable[..., Any] | None = None,
        fn_args: Any = None,
        step_options: StepOptions | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_function = loss_function
        self.call = ModelCall.of(model, target_required=loss_function is not None)  # how batches reach forward
        # metrics None: IBM's default accuracy (frameworks/torch/ibm.py), dropped for outputs it cannot apply
        # to (drop_default_accuracy); an empty list: the loss alone, as Keras' metrics=[].
        self.default_accuracy = metrics is None and step_fn is None
        self.metrics = [accuracy] if self.default_accuracy else list(metrics or ())
        self._collate_fn = collate_fn
        self.step_fn, self.test_fn, self.fn_args = step_fn, test_fn, fn_args
        self.grad_step = GradientStep(step_options)  # precision=, gradient_clip_norm=
        self.eva = Eva(self.metrics)  # a custom step's third argument
        self.train_set: Any = None  # handed to a custom step as its ``train_loader``
        self._name_stats()
        self.device = torch.device("cpu")
        self._buf_start: list[torch.Tensor] = []
        self._in_step = False
        self._on_cpu = True
        self._py_sums: list[np.float32] | None = None

    #: The optimizer over this member's slices of the state (``train(shard_optimizer_state=True)``), or None.
    sharded: ShardedOptimizer | None = None
    #: A collective failure after this member's update was applied (the gather of updated slices):
    #: the step counts as done here, the loop raises it after (``failure_after_step``).
    _failed_after_update: Exception | None = None

    def _name_stats(self) -> None:
        taken: set[str] = set()
        if self.step_fn is not None:
            # A custom step returns (its metric, loss); IBM's take the metric from eva(outputs, labels):
            # the first metric given, else the accuracy, named so (old loggers get it in percent).
            self.stat_names = ["loss", metric_name(self.metrics[0], 0, taken) if self.metrics else "accuracy"]
        else:
            self.stat_names = ["loss"] + [metric_name(m, i, taken) for i, m in enumerate(self.metrics)]

    def drop_default_accuracy(self) -> None:
        """No accuracy for a model whose outputs are not a classifier's (before the adapter is shipped)."""
        if self.default_accuracy and self.step_fn is None:
            self.metrics = []
            self._name_stats()

    # -- set-up ---------------------------------------------------------------------------
    def resize_threads(self, num_threads: int) -> None:
        if self._on_cpu and torch.get_num_threads() != num_threads:
            torch.set_num_threads(num_threads)

    def setup(self, device: str, num_threads: int) -> None:
        began = time.monotonic()
        self.device = torch.device(device)
        self._on_cpu = self.device.type == "cpu"
        if self.device.type == "cpu":
            torch.set_num_threads(num_threads)
        else:
            torch.cuda.set_device(self.device)
            torch.zeros((), device=self.device)  # the context, made here: device init has its own time
        initialized = time.monotonic()
        self.model.to(self.device)  # moves parameters in place, so the optimizer still holds them
        moved = time.monotonic()
        self.model.train()
        # What IBM's custom steps expect to find on the model.
        optimizer, loss_function = self.optimizer, self.loss_function
        self.model.get_optimizer = lambda: optimizer
        self.model.get_loss_function = lambda: loss_function
        # The optimizer's first load_state_dict / step imports torch._dynamo (over a second).
        # Pay it now, while setting up, not while the running workers wait for a newcomer.
        importlib.import_module("torch._dynamo")
        imported = time.monotonic()
        self.setup_phases = {
            "device init": initialized - began,
            "state to the device": moved - initialized,
            "importing torch._dynamo": imported - moved,
        }

        self._owned_generators = OwnedGenerators(self.model)  # seeded with the global one (_seed)
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        self._hook_handles: list[Any] = []  # the gradient-ready hooks, while installed (_hook_gradients)
        self._track_buffers()
        self._allocate()

    def _track_buffers(self) -> None:
        """Each buffer by its slot (module, name), not by its tensor: a forward may assign a new
        tensor to it (``self.mean = 0.9 * self.mean + ...``). The tensor found at set-up stays the
        buffer's own (``self._buffers``); after each step the slot holds it again, with the step's value."""
        slots: list[tuple[torch.nn.Module, str]] = []
        own: list[torch.Tensor] = []
        seen: set[int] = set()
        for module in self.model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and id(buffer) not in seen:  # a shared buffer: once
                    seen.add(id(buffer))
                    slots.append((module, name))
                    own.append(buffer)
        self._buffer_slots = slots
        self._buffers = own
        # Float buffers (running statistics) take the step's sample-weighted mean of their
        # micro-batches' changes; integer ones (counters) the sum, as a plain accumulation loop
        # counts them (README, "What a step means").
        self._buffer_averaged = [b.is_floating_point() or b.is_complex() for b in self._buffers]

    def _restore_buffers(self, values: list[torch.Tensor]) -> None:
        """Every buffer slot holds its own tensor again, set to ``values``."""
        for (module, name), own, value in zip(self._buffer_slots, self._buffers, values):
            if module._buffers[name] is not own:  # the forward assigned a new tensor
                module._buffers[name] = own
            own.copy_(value)

    def _live_buffers(self) -> list[torch.Tensor]:
        """What the forward left in each buffer slot (its own tensor, or one it assigned)."""
        return [module._buffers[name] for module, name in self._buffer_slots]  # type: ignore[misc]

    #: Gradient bucket size, in float32 elements (4 MiB), for overlapping the allreduce with
    #: backward: big enough that per-operation overhead stays small, small enough that the
    #: first buckets go out while backward still runs.
    BUCKET_ELEMENTS = 1 << 20

    def _allocate(self) -> None:
        """The flat step buffer, with each parameter's .grad a view into it."""
        layout = self._layout = self._full_layout = StepLayout(
            n_gradients=sum(p.numel() for p in self._params),
            n_buffers=sum(b.numel() for b in self._buffers),
            n_flags=len(self._params),  # 1 where some micro-batch produced a gradient
            n_stats=len(self.stat_names),
        )
        self._full = self._flat = torch.zeros(layout.size, dtype=torch.float32, device=self.device)
        self._grad_views: list[torch.Tensor] = []
        offset = layout.gradients.start
        for p in self._params:
            view = self._flat[offset : offset + p.numel()].view_as(p)
            if p.dtype != torch.float32:
                raise TypeError(
                    f"Only float32 parameters are supported; parameter of shape {tuple(p.shape)} is {p.dtype}."
                )
            self._grad_views.append(view)
            offset += p.numel()
        self._full_views = self._tail_views(self._full, layout)
        self._lone_buffer: tuple[torch.Tensor, StepLayout, _TailViews] | None = None  # made on first use (_bind)
        self._bind_tail(self._full, layout, self._full_views)
        self._one = torch.ones((), device=self.device)
        self._scratch: torch.Tensor | None = None
        for p, view in zip(self._params, self._grad_views):
            p.grad = view
        if self.sharded is not None:  # a fresh buffer (after an abort): the slices read their gradients here
            self.sharded.bind(self._grad_view_of())
        self._build_buckets(layout.n_gradients)

    def _tail_views(self, flat: torch.Tensor, layout: StepLayout) -> _TailViews:
        """The views of what follows the gradients in ``flat`` (made once: slicing is an operation)."""
        offset, buffers = layout.buffers.start, []
        for b in self._buffers:
            buffers.append(flat[offset : offset + b.numel()].view(b.shape))
            offset += b.numel()
        return _TailViews(
            buffers,
            flat[layout.flags],
            flat[layout.n_gradients :],
            flat[layout.tail],
            flat[layout.stat_sums],
            flat[layout.count],  # a 0-d view: += writes into the buffer
            # The stat sums and the count, adjacent: a micro-batch adds [loss, metrics..., 1] * n in
            # one operation instead of three tiny ones per value (0.1 ms of a 2 ms step on CPU).
            flat[layout.stat_sums.start : layout.count + 1],
        )

    def _bind_tail(self, flat: torch.Tensor, layout: StepLayout, views: _TailViews) -> None:
        self._flat, self._layout = flat, layout
        (
            self._buf_views,
            self._got_grad,
            self._after_gradients,
            self._tail,
            self._stats,
            self._count,
            self._stats_and_count,
        ) = views

    def _bind(self, lone: bool) -> None:
        """Make the step buffer the full one, or (a lone worker whose backward writes fresh
        gradients) one without the gradient part, the full one's memory given back: the lone
        worker then holds its gradients once, as a plain loop does (docs/architecture.md)."""
        if not lone:
            if self._flat is not self._full:
                self._bind_tail(self._full, self._full_layout, self._full_views)
                self._lone_buffer = None  # (made again if the world shrinks to one)
            return
        self._release_gradients()
        if self._lone_buffer is None:
            full = self._full_layout
            layout = StepLayout(0, full.n_buffers, full.n_flags, full.n_stats)
            flat = torch.zeros(layout.size, dtype=torch.float32, device=self.device)
            self._lone_buffer = (flat, layout, self._tail_views(flat, layout))
        if self._flat is not self._lone_buffer[0]:
            self._bind_tail(*self._lone_buffer)

    def _grad_view_of(self) -> dict[int, torch.Tensor]:
        return {id(p): view for p, view in zip(self._params, self._grad_views)}

    #: Whether the step's gradients exist only within the step (begin_step; ZeRO stage 2).
    _transient = False

    def gradient_bytes(self) -> int:
        storage = self._full.untyped_storage()
        held = storage.nbytes() + (self._scratch.nbytes if self._scratch is not None else 0)
        if self._lone_buffer is not None:
            held += self._lone_buffer[0].nbytes
        # A lone worker's backward writes fresh tensors, outside the step buffer.
        fresh = {
            g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
            for g in (p.grad for p in self._params)
            if g is not None and g.untyped_storage().data_ptr() != storage.data_ptr()
        }
        return held + sum(fresh.values())

    def _release_gradients(self) -> None:
        """Give the full step buffer's memory back (its views stay, over an empty storage) and
        leave ``.grad`` None, as ``zero_grad()`` does: a sharded state's member has updated its
        slices, or a lone worker's backward writes fresh gradients."""
        storage = self._full.untyped_storage()
        if storage.nbytes():
            storage.resize_(0)
        for p in self._params:
            p.grad = None

    def _materialize(self) -> None:
        """The full step buffer's memory again, zeroed, with each ``.grad`` its view (after
        ``_release_gradients``); nothing where the lone buffer is bound."""
        storage = self._full.untyped_storage()
        if self._flat is self._full and storage.nbytes() == 0 and self._layout.size:
            storage.resize_(self._layout.size * self._flat.element_size())
            self._flat.zero_()
            for p, view in zip(self._params, self._grad_views):
                p.grad = view

    def _build_buckets(self, n_grad: int) -> None:
        """Cut the gradient part of the buffer into buckets, last parameters first (backward
        produces their gradients first); the tail (buffers, stats, vote) is reduced last."""
        self._buckets: list[tuple[int, int]] = []
        self._bucket_of: dict[int, int] = {}
        end, start = n_grad, n_grad
        members: list[int] = []
        offsets = []
        offset = 0
        for p in self._params:
            offsets.append(offset)
            offset += p.numel()
        for i in reversed(range(len(self._params))):
            start = offsets[i]
            members.append(i)
            if end - start >= self.BUCKET_ELEMENTS or i == 0:
                for m in members:
                    self._bucket_of[m] = len(self._buckets)
                self._buckets.append((start, end))
                end, members = start, []
        self._bucket_sizes = [0] * len(self._buckets)
        for b in self._bucket_of.values():
            self._bucket_sizes[b] += 1
        self._collective: Any = None
        self._overlap = False
        self._works: list[Any] = []
        self._deferred_error: Exception | None = None
        self._direct = False  # this step's gradients are fresh tensors, not views (a lone worker)
        self._got = [0.0] * len(self._params)  # the got-gradient flags, written to the buffer per micro-batch

    def _hook_gradients(self, on: bool) -> None:
        """Install or remove the gradient-ready hooks. Only a step that reads them has them: a
        lone worker's backward (``_direct``) is the plain loop's, without a Python call per
        parameter, which on CUDA is also a GIL handoff from autograd's device thread."""
        handles = self._hook_handles
        if on == bool(handles):
            return
        if on:
            for i, p in enumerate(self._params):
                handles.append(p.register_post_accumulate_grad_hook(lambda _p, i=i: self._on_grad_ready(i)))
        else:
            for handle in handles:
                handle.remove()
            handles.clear()

    def _on_grad_ready(self, index: int) -> None:
        """A parameter received a gradient; on the last micro-batch, launch its bucket once full, in order."""
        self._got[index] = 1.0  # a list: a tensor element write per parameter costs microseconds
        if not self._overlap:
            return
        bucket = self._bucket_of[index]
        self._pending[bucket] -= 1
        try:
            while self._launched < len(self._buckets) and self._pending[self._launched] == 0:
                start, end = self._buckets[self._launched]
                self._works.append(self._collective.all_reduce_start(self._flat[start:end]))
                self._launched += 1
        except Exception as exc:  # raised out of autograd it would lose its type: keep it for all_reduce
            self._overlap, self._deferred_error = False, exc

    @property
    def own_collate(self) -> bool:
        return self._collate_fn is None

    def collate(self, samples: Sequence[Any]) -> Any:
        if self._collate_fn is not None:
            return self._collate_fn(samples)
        return default_collate(list(samples))

    def reader(self, dataset: Any) -> Reader | None:
        return tensor_reader(dataset, self._collate_fn)

    def read_generators(self, dataset: Any) -> list[Generator]:
        return read_generators(dataset)

    def process_loader(
        self, dataset: Any, reads: SeededReads, processes: int, epoch_of: Callable[[Hashable], int]
    ) -> Loader | None:
        return ProcessLoader(dataset, reads, processes, epoch_of)

    # -- a step ---------------------------------------------------------------------------
    @property
    def step_buffer(self) -> torch.Tensor:
        self._materialize()  # a member without a micro-batch in the step still votes and sums
        return self._flat

    @property
    def step_layout(self) -> StepLayout:
        return self._layout

    def begin_step(self, collective: Any = None) -> None:
        self._collective = collective
        self._got = [0.0] * len(self._params)
        # A lone worker reduces nothing: backward writes fresh gradients, as in a plain loop,
        # instead of adding into a zeroed buffer (docs/architecture.md, "The step").
        direct = self._direct = self.lone_direct and getattr(collective, "world_size", 0) == 1 and self.step_fn is None
        self._hook_gradients(not direct)
        # A sharded state among several (ZeRO stage 2): the step's gradients exist only from its
        # first backward to its update (docs/elasticity.md, "Sharded optimizer state").
        self._transient = self.sharded is not None and getattr(collective, "world_size", 0) > 1
        self._bind(lone=direct)
        if self._transient:
            self._release_gradients()
        else:
            self._materialize()
        if direct:
            self._after_gradients.zero_()  # the whole lone buffer
            # A lone CPU worker adds its stat sums in Python (numpy float32: the same roundings as
            # the tensor path) instead of in three tensor operations; the step reduces nothing.
            self._py_sums = [np.float32(0.0)] * (self._layout.n_stats + 1) if self._on_cpu else None
        else:
            self._works, self._launched, self._pending = [], 0, list(self._bucket_sizes)
            self._py_sums = None
            if not self._transient:  # else zeroed where it is made
                self._flat.zero_()
                for p, view in zip(self._params, self._grad_views):
                    p.grad = view
        self._buf_start = [b.detach().clone() for b in self._live_buffers()] if self._buffers else []
        self._buffers_at_start = True  # until a micro-batch's forward runs
        self._buffers_as_left = False  # the forward's own values are the step's (whole_step_buffers_in_place)
        self._in_step = True

    def train_micro_batch(self, batch: Any, num_samples: int, step_samples: int, seed: int, last: bool = False) -> None:
        share = weight = num_samples / step_samples
        phases = self.phases
        with phases(ph.SEED):
            inputs, target = self.call.split(to_device(batch, self.device))
            # Forward-updated buffers (BatchNorm statistics) start every micro-batch from the
            # step's values, so the result does not depend on how micro-batches are divided.
            if not self._buffers_at_start:
                self._restore_buffers(self._buf_start)
            self._buffers_at_start = False
            self._seed(seed)
        if self.step_fn is not None:
            with phases(ph.FORWARD):  # the user's step: forward and backward
                self._custom_micro_batch(inputs, target, share, num_samples)
            return
        with phases(ph.FORWARD):
            if self.grad_step.mixed:
                with self.grad_step.autocast(self.device):
                    output, loss = self._forward(inputs, target)
            else:  # no context to enter: a step's every extra call is paid cold (docs/architecture.md)
                output, loss = self._forward(inputs, target)
        weight *= self.grad_step.scale  # float16's loss scale (1 otherwise), divided out after the reduction
        if not self._direct:
            self._materialize()  # after the forward: its peak memory holds no gradients (stage 2)
            self._ensure_grad_views()
        # On this worker's last micro-batch, buckets go out while backward still runs.
        self._overlap = last and self._collective is not None and self._collective.world_size > 1
        try:
            with phases(ph.BACKWARD):
                (loss if weight == 1.0 else loss * weight).backward()  # x * 1.0 == x: one op less
        finally:
            self._overlap = False
        with phases(ph.BUFFERS):
            if not self._direct:  # a lone worker's finish_step reads the flags off .grad itself
                self._write_flags()
            # No torch.no_grad() here or in finish_step: every operand is detached or a buffer, so
            # nothing is recorded, and entering the context costs ~20 us after a backward.
            if self._direct and share == 1.0 and self.whole_step_buffers_in_place:
                self._buffers_as_left = True
            else:
                self._add_buffer_deltas(share)  # unscaled: the loss scale is the gradients' only
        with phases(ph.STATS):
            self._add_stats(loss, detached(output), target, num_samples)

    def _add_stats(self, loss: torch.Tensor, output: Any, target: Any, n: int) -> None:
        """The micro-batch's loss, metrics and sample count into the step's sums."""
        if self._py_sums is not None:
            self._add_stats_in_python(loss, output, target, n)
            return
        values = [loss.detach().float()]
        if self.metrics:
            with self.phases(ph.METRICS):
                values += self._metric_values(output, target)
        values.append(self._one)
        # Multiply, then add, as value by value before: the same two roundings per sum.
        self._stats_and_count += torch.stack(values) * n

    def _forward(self, inputs: Any, target: Any) -> tuple[Any, torch.Tensor]:
        output = self.call(self.model, inputs)
        return output, self.compute_loss(output, target)

    def _metric_values(self, output: Any, target: Any) -> list[torch.Tensor]:
        # A structured output was not detached (detached()): no graph is recorded for its metrics.
        with contextlib.nullcontext() if isinstance(output, torch.Tensor) else torch.no_grad():
            return [
                torch.as_tensor(metric(output, target), dtype=torch.float32, device=self.device)
                for metric in self.metrics
            ]

    def _add_stats_in_python(self, loss: torch.Tensor, output: Any, target: Any, n: int) -> None:
        """The tensor path's ``sums += stack([loss, metrics..., 1]) * n`` in numpy float32 scalars.

        Each value is rounded to float32 once, as ``torch.as_tensor(v, dtype=float32)`` does,
        then multiplied and added in float32 (IEEE operations, correctly rounded): the same bits,
        without the tensor operations that cost 10-20 us each inside a step on CPU (cold caches).
        """
        assert self._py_sums is not None
        n32 = np.float32(n)
        values = [loss.item()]
        if self.metrics:
            grad = contextlib.nullcontext() if isinstance(output, torch.Tensor) else torch.no_grad()
            with self.phases(ph.METRICS), grad:
                values += [float(metric(output, target)) for metric in self.metrics]
        values.append(1.0)
        self._py_sums = [s + np.float32(v) * n32 for s, v in zip(self._py_sums, values)]

    def _write_flags(self) -> None:
        """This worker's got-gradient flags into the step buffer; from pinned memory on a GPU, so
        the host does not wait for the stream (a pageable copy to the device would)."""
        flags = torch.tensor(self._got)
        if self.device.type == "cuda":
            self._got_grad.copy_(flags.pin_memory(), non_blocking=True)  # the allocator keeps it until copied
        else:
            self._got_grad.copy_(flags)

    def _seed(self, seed: int) -> None:
        # torch.manual_seed also seeds every lazy accelerator backend, formatting stack
        # traces as it goes (0.1-0.5 ms a call); seed only the generators this worker uses.
        torch.default_generator.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.default_generators[self.device.index or 0].manual_seed(seed)
        if self._owned_generators:
            self._owned_generators.seed(seed)

    def _custom_micro_batch(self, inputs: Any, target: Any, weight: float, n: int) -> None:
        """Run the user's step; its backward fills a scratch gradient, added here with its weight."""
        assert self.step_fn is not None
        self._materialize()
        if self._scratch is None:
            self._scratch = torch.zeros(sum(p.numel() for p in self._params), device=self.device)
        self._scratch.zero_()
        offset = 0
        for p in self._params:
            p.grad = self._scratch[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        shadowed = "step" in vars(self.optimizer)
        previous = vars(self.optimizer).get("step")
        self.optimizer.step = forbidden_step
        try:
            with self.grad_step.autocast(self.device):  # bf16-mixed (float16 is refused with a custom step)
                metric, loss = self.step_fn(self.model, (inputs, target), self.eva, self.train_set, self.fn_args)
        finally:
            if shadowed:
                self.optimizer.step = previous
            else:
                del self.optimizer.step
        self._write_flags()
        scratch = self._scratch
        offset = 0
        for p in self._params:  # the user may have replaced .grad (clipping does not)
            if p.grad is not None and p.grad.data_ptr() != scratch[offset].data_ptr():
                scratch[offset : offset + p.numel()].copy_(p.grad.reshape(-1))
            offset += p.numel()
        with torch.no_grad():
            self._flat[: scratch.numel()].add_(scratch, alpha=weight)
            for p, view in zip(self._params, self._grad_views):
                p.grad = view
            self._add_buffer_deltas(weight)
            self._stats[0] += scalar(loss, self.device) * n
            self._stats[1] += scalar(metric, self.device) * n
            self._count += n

    def all_reduce(self, collective: Any) -> None:
        """Finish the step's allreduce: the buckets not yet launched, in order, then the tail."""
        if self._deferred_error is not None:
            error, self._deferred_error = self._deferred_error, None
            raise error
        self._materialize()
        if collective.world_size == 1:  # a group of one sums nothing: one call, not one per bucket
            collective.wait(collective.all_reduce_start(self._after_gradients))  # (still a fault seam)
            return
        while self._launched < len(self._buckets):
            start, end = self._buckets[self._launched]
            self._works.append(collective.all_reduce_start(self._flat[start:end]))
            self._launched += 1
        # The rest (buffer deltas, flags, stats, count, vote) in one piece, after the gradients.
        self._works.append(collective.all_reduce_start(self._after_gradients))
        for work in self._works:
            collective.wait(work)
        self._works = []

    def abort_step(self) -> None:
        # The step will be redone: forward-updated buffers go back to the step's start.
        if not self._in_step:
            return
        self._in_step = False
        # An abandoned collective may still write into the old buffer: take a fresh one.
        self._allocate()
        with torch.no_grad():
            self._restore_buffers(self._buf_start)

    def _ensure_grad_views(self) -> None:
        # User code (a custom step, a callback) may have replaced or cleared .grad; put the
        # view back, keeping whatever gradient had been accumulated.
        for p, view in zip(self._params, self._grad_views):
            if p.grad is None:
                p.grad = view
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
                p.grad = view

    def _add_buffer_deltas(self, weight: float) -> None:
        # Reduce what the forward pass changed, not the values: a buffer the forward leaves
        # alone (a mask, a large counter, a float64 constant) then stays exactly as it was.
        live = self._live_buffers()
        for b, start, view, averaged in zip(live, self._buf_start, self._buf_views, self._buffer_averaged):
            view.add_((b.detach() - start).to(torch.float32), alpha=weight if averaged else 1.0)

    def finish_step(self) -> StepResult:
        # Outside torch.no_grad(), as in a plain loop: the optimizer's step and clipping set
        # their own grad mode, and the buffers and gradients written here record nothing.
        with self.phases(ph.BUFFERS):
            unused = self._settle_buffers()
        # float16's unscale and overflow check, then clipping, then the optimizer's step
        with self.phases(ph.OPTIMIZER):
            self._apply_gradients()
        if not self._direct:  # (a lone worker's full buffer holds no memory: None stays, as in a plain loop)
            for i in unused:
                self._params[i].grad = self._grad_views[i]
        self._in_step = False
        tail = self._tail.tolist()
        if self._transient:  # its slices are updated: no one needs this member's gradients again
            self._release_gradients()
        if self.sharded is not None and self._collective is not None:
            try:  # the update is applied to this member's slices: a failure from here leaves the step done
                with self.phases(ph.REDUCE):
                    self.sharded.spread(self._collective)
            except Exception as exc:  # CollectiveError (imported with torch.distributed in a worker only)
                self._failed_after_update = exc
        if self._py_sums is not None:
            tail[: len(self._py_sums)] = [float(s) for s in self._py_sums]
        return self._layout.result(tail)

    def _apply_gradients(self) -> None:
        """float16's unscale and overflow check, clipping, then the optimizer's step: over this
        member's slices when the state is sharded (clipping still sees the whole gradient)."""
        if self.sharded is None:
            self.grad_step.apply(self.optimizer, self._params)
        else:
            self.sharded.step(lambda: self.grad_step.apply(self.optimizer, self._params))

    def failure_after_step(self) -> Exception | None:
        failure, self._failed_after_update = self._failed_after_update, None
        return failure

    # -- sharded optimizer state (frameworks/torch/sharded.py) ------------------------------
    def shard_optimizer_state(self) -> None:
        self.sharded = ShardedOptimizer(self.optimizer, self._grad_view_of())

    def sharded_names(self) -> set[str]:
        """The model state's names of the parameters whose slices members hold (they travel by slices)."""
        if self.sharded is None:
            return set()
        ids = {id(p) for p in self.sharded.params}
        return {name for name, v in self.model.state_dict(keep_vars=True).items() if id(v) in ids}

    def gathered_optimizer_state(self, collective: Any) -> dict[str, Any]:
        """The whole optimizer state (``state_dict``'s form), gathered from every member's slices."""
        assert self.sharded is not None
        state = self.sharded.full_state(collective)
        groups = self.sharded.user_state_dict()["param_groups"]  # the user's holds no state: the groups only
        return self.grad_step.pack({"state": state, "param_groups": groups})

    def gather_final(self, collective: Any) -> None:
        """At the end: the user's optimizer holds the whole state again, as after an unsharded run."""
        assert self.sharded is not None
        state = self.sharded.full_state(collective)
        self.sharded.release()  # its state refused every read until now (sharded.HiddenState)
        for i, values in state.items():
            self.optimizer.state[self.sharded.params[i]] = values
        self.sharded = None

    def _settle_buffers(self) -> list[int]:
        """The buffers' step values in place; ``.grad`` None where no worker produced a gradient
        (returns those parameters' indices: their views go back after the optimizer's step)."""
        if not self._direct:
            self._ensure_grad_views()
        if self._buffers_as_left:  # only a buffer the forward assigned anew goes back to its own tensor
            for (module, name), own, live in zip(self._buffer_slots, self._buffers, self._live_buffers()):
                if live is not own:
                    own.copy_(live.detach())
                    module._buffers[name] = own
        else:
            self._restore_buffers(
                [
                    start + (view if b.is_floating_point() else view.round().to(b.dtype))
                    for b, start, view in zip(self._buffers, self._buf_start, self._buf_views)
                ]
            )
        # A parameter no worker produced a gradient for keeps .grad None through the step,
        # as after zero_grad() on one device: weight decay and momentum leave it alone.
        if self._direct:  # backward gave fresh gradients: None where it produced none
            unused = [i for i, p in enumerate(self._params) if p.grad is None]
        else:
            # Every parameter got a gradient here: so it did in the sum, which need not be read
            # (on a GPU, reading it would wait for the allreduce before the optimizer's step).
            unused = [] if 0.0 not in self._got else [i for i, got in enumerate(self._got_grad.tolist()) if got == 0.0]
        for i in unused:
            self._params[i].grad = None
        return unused

    # -- state ----------------------------------------------------------------------------
    def load_state(self, model_state: dict[str, Any], optimizer_state: dict[str, Any]) -> None:
        may_lack, self._may_lack = self._may_lack, frozenset()
        if may_lack:  # a state without the frozen parameters this worker holds (load_sent_state)
            loaded = self.model.load_state_dict(model_state, strict=False)
            missing = set(loaded.missing_keys) - may_lack
            if missing or loaded.unexpected_keys:
                raise RuntimeError(
                    f"Error(s) in loading state_dict for {type(self.model).__name__}: missing keys "
                    f"{sorted(missing)}, unexpected keys {sorted(loaded.unexpected_keys)}"
                )
        else:
            self.model.load_state_dict(model_state)
        self.optimizer.load_state_dict(self.grad_step.unpack(optimizer_state))

    #: Names ``load_state`` may find missing (set by ``load_sent_state`` for one call).
    _may_lack: frozenset[str] = frozenset()

    def frozen_parameters(self) -> tuple[dict[str, Any], list[str]]:
        state = self.model.state_dict(keep_vars=True)
        frozen = {name: state[name].detach() for name in frozen_names(self.model)}
        return frozen, list(state)

    def track_frozen(self, names: Collection[str]) -> None:
        self._frozen = FrozenParameters(self.model, names)

    def _unchanged_frozen(self) -> set[str]:
        frozen = getattr(self, "_frozen", None)  # None before setup, and in the caller
        return frozen.unchanged() if frozen is not None else set()

    def state_to_send(self) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
        omitted = self._unchanged_frozen()
        model = {k: v for k, v in self.model.state_dict().items() if k not in omitted}  # detached, live
        return model, self._live_optimizer_state(), sorted(omitted)

    def final_state(self) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
        model, _, omitted = self.state_to_send()
        return {k: v.cpu().clone() for k, v in model.items()}, self.optimizer_state(), omitted

    def load_sent_state(
        self,
        model_state: dict[str, Any],
        optimizer_state: dict[str, Any],
        omitted: Collection[str] = (),
        base: Collection[str] = (),
    ) -> None:
        unchanged = self._unchanged_frozen()
        if not set(omitted) <= unchanged:
            raise RuntimeError(
                f"a state without the frozen parameters {sorted(set(omitted) - unchanged)[:5]} reached a worker "
                "whose own copies of them changed; set FABRIC_MODEL_OMIT_FROZEN=0 if your code writes to "
                'parameters that do not require a gradient (docs/training.md, "Frozen parameters")'
            )
        skip = set(base) & unchanged  # the driver's copy of the job's values: this worker holds them already
        if skip:
            model_state = {k: v for k, v in model_state.items() if k not in skip}
        # A peer's state without the sharded parameters: they come by slices (sharded.py).
        sliced = self.sharded_names() - set(model_state)
        self._may_lack = frozenset(omitted) | frozenset(skip) | frozenset(sliced)
        try:
            self.load_state(model_state, optimizer_state)
        finally:
            self._may_lack = frozenset()
        if base and getattr(self, "_frozen", None) is not None:
            self._frozen.baseline(set(base) - skip)  # loaded now, with the job's values

    def model_state(self) -> dict[str, Any]:
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def optimizer_state(self) -> dict[str, Any]:
        return map_tree(cpu_copy, self._live_optimizer_state())

    def _live_optimizer_state(self) -> dict[str, Any]:
        """The optimizer state as :meth:`optimizer_state` gives it, holding the live tensors (no copy)."""
        if self.sharded is not None:  # its param groups: the user's optimizer refuses reads of its state
            return self.grad_step.pack(self.sharded.user_state_dict())
        return self.grad_step.pack(self.optimizer.state_dict())

    def state_fingerprint(self) -> dict[str, int]:
        # The live tensors, read in place: the default's copies cost 10x the read (docs/architecture.md,
        # "Replica checks"), on a GPU a transfer of the whole state to the host. Frozen parameters
        # that still hold the job's values are read once (docs/architecture.md, "State that does not change").
        unchanged = self._unchanged_frozen()
        changing = {k: v for k, v in self.model.state_dict().items() if k not in unchanged}
        return {
            **state_fingerprint(changing, "model"),
            **(self._frozen.fingerprints() if unchanged else {}),
            **state_fingerprint(self._live_optimizer_state(), "optimizer"),
        }
