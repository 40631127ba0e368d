"""The PyTorch adapter: a ``torch.nn.Module`` with a ``torch.optim.Optimizer``."""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Collection, Hashable, Sequence
from typing import Any

import torch
from torch.utils.data import default_collate

from ...step.data import Loader, Reader
from ...step.digest import state_fingerprint
from ...step.layout import StepLayout, StepResult
from ...step.options import StepOptions
from ...step.sample_seeds import Generator, SeededReads
from ...step.tree import map_tree
from ..base import FrameworkAdapter, metric_name
from .batches import cpu_copy, to_device
from .calling import ModelCall
from .evaluation import TorchEvaluation
from .frozen import FrozenParameters, frozen_names
from .gather import tensor_reader
from .generators import OwnedGenerators, read_generators
from .ibm import Eva, accuracy
from .numerics import Numerics
from .precision import GradientStep
from .reader_processes import ProcessLoader
from .sharded import ShardedOptimizer, WholeOptimizer
from .step_buffer import StepBuffer
from .steps.base import TorchStep
from .steps.choice import Summing, choose_step

#: The batch types ``TorchAdapter.on_device`` reads as ``(inputs, target)`` directly (not a namedtuple).
_PAIRS = (list, tuple)

LossFn = Callable[[Any, Any], torch.Tensor] | None  # None: the model computes its loss (calling.model_loss)
MetricFn = Callable[[Any, Any], Any]


class TorchAdapter(TorchEvaluation, FrameworkAdapter):
    """Trains a ``torch.nn.Module`` micro-batch by micro-batch into one flat step buffer
    (step_buffer.py), each step run by the generation's step strategy (steps/).

    The adapter keeps what is the framework's: the model's call and loss, its buffers, the
    metrics, the generators and the device; the strategy, how a step's gradients are summed
    and applied (docs/architecture.md, "Adding a step mode").
    """

    #: How the step's terms are summed (deterministic=True's subclasses: exact.py, ordered.py).
    summing = Summing.FLOAT

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
        self._readers: dict[int, tuple[Any, Reader | None]] = {}  # reader(): by dataset
        self.step_fn, self.test_fn, self.fn_args = step_fn, test_fn, fn_args
        self.grad_step = GradientStep(step_options)  # precision=, gradient_clip_norm=
        # Made by train() in the caller: its TF32, cuDNN, dtype switches, set again in each worker.
        self.numerics = Numerics.here()
        self.eva = Eva(self.metrics)  # a custom step's third argument
        self.train_set: Any = None  # handed to a custom step as its ``train_loader``
        self._name_stats()
        self.device = torch.device("cpu")
        self._on_cpu = True
        #: How this member holds the optimizer state: whole, or its slices (shard_optimizer_state).
        self.held_optimizer: WholeOptimizer | ShardedOptimizer = WholeOptimizer(optimizer)
        self._step: TorchStep | None = None  # the generation's step strategy (begin_step)

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

    def kernels(self, device: str) -> None:
        """The caller's numerics (numerics.py), before any kernel runs here."""
        self.numerics.apply()

    def setup(self, device: str, num_threads: int) -> None:
        began = time.monotonic()
        self.kernels(device)
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
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self._track_buffers()
        self._allocate()

    def _track_buffers(self) -> None:
        """Each buffer by its slot (module, name), not by its tensor: a forward may assign a new
        tensor to it (``self.mean = 0.9 * self.mean + ...``). The tensor found at set-up stays the
        buffer's own (``self.model_buffers``); after each step the slot holds it again, with the step's value."""
        slots: list[tuple[torch.nn.Module, str]] = []
        own: list[torch.Tensor] = []
        seen: set[int] = set()
        for module in self.model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and id(buffer) not in seen:  # a shared buffer: once
                    seen.add(id(buffer))
                    slots.append((module, name))
                    own.append(buffer)
        self.buffer_slots = slots
        self.model_buffers = own
        # Float buffers (running statistics) take the step's sample-weighted mean of their
        # micro-batches' changes; integer ones (counters) the sum, as a plain accumulation loop
        # counts them (README, "What a step means").
        self.buffer_averaged = [b.is_floating_point() or b.is_complex() for b in own]

    def restore_buffers(self, values: list[torch.Tensor]) -> None:
        """Every buffer slot holds its own tensor again, set to ``values``."""
        for (module, name), own, value in zip(self.buffer_slots, self.model_buffers, values):
            if module._buffers[name] is not own:  # the forward assigned a new tensor
                module._buffers[name] = own
            own.copy_(value)

    def live_buffers(self) -> list[torch.Tensor]:
        """What the forward left in each buffer slot (its own tensor, or one it assigned)."""
        return [module._buffers[name] for module, name in self.buffer_slots]  # type: ignore[misc]

    def keep_live_buffers(self) -> None:
        """The forward's values are the step's: only a buffer it assigned anew goes back to its own tensor."""
        for (module, name), own, live in zip(self.buffer_slots, self.model_buffers, self.live_buffers()):
            if live is not own:
                own.copy_(live.detach())
                module._buffers[name] = own

    def _allocate(self) -> None:
        """A fresh step buffer (at set-up, and after an abort: an abandoned collective may still
        write into the old one); the step strategy is chosen again at the next step."""
        self._buffer = StepBuffer(self.params, self.model_buffers, len(self.stat_names), self.device)
        self.held_optimizer.bind(self._buffer.grad_view_of())  # sharded: the slices read their gradients here
        self._drop_step()

    def _drop_step(self) -> None:
        if self._step is not None:
            self._step.deactivate()
            self.phases.unfollow(self._step)
        self._step = None

    def gradient_bytes(self) -> int:
        return self._buffer.gradient_bytes()

    @property
    def own_collate(self) -> bool:
        return self._collate_fn is None

    def collate(self, samples: Sequence[Any]) -> Any:
        if self._collate_fn is not None:
            return self._collate_fn(samples)
        return default_collate(list(samples))

    def reader(self, dataset: Any) -> Reader | None:
        # Made once a dataset: a list's stacked copy is not made again at every generation.
        kept = self._readers.get(id(dataset))
        if kept is None or kept[0] is not dataset:
            kept = self._readers[id(dataset)] = (dataset, tensor_reader(dataset, self._collate_fn))
        return kept[1]

    def read_generators(self, dataset: Any) -> list[Generator]:
        return read_generators(dataset)

    def process_loader(
        self, dataset: Any, reads: SeededReads, processes: int, epoch_of: Callable[[Hashable], int]
    ) -> Loader | None:
        return ProcessLoader(dataset, reads, processes, epoch_of)

    # -- a step: run by the generation's strategy (steps/; docs/architecture.md, "Adding a step mode")
    @property
    def step_buffer(self) -> torch.Tensor:
        buffer = self._buffer
        buffer.materialize()  # a member without a micro-batch in the step still votes and sums
        buffer.lent = True  # (written outside the strategy: a lone step zeroes it again)
        return buffer.flat

    @property
    def step_layout(self) -> StepLayout:
        return self._buffer.layout

    def begin_step(self, collective: Any = None) -> None:
        world_size = getattr(collective, "world_size", 0)
        step = self._step
        if step is None or step.world_size != world_size:  # a new generation's size: its strategy
            self._drop_step()
            step = self._step = choose_step(self, self._buffer, world_size)
            step.activate()
            self.phases.follow(step, step.ranges)  # its parts in a profile window's ranges (profiling/phases.py)
        step.begin(collective)

    def train_micro_batch(self, batch: Any, num_samples: int, step_samples: int, seed: int, last: bool = False) -> None:
        assert self._step is not None
        self._step.micro_batch(batch, num_samples, step_samples, seed, last)

    def all_reduce(self, collective: Any) -> None:
        assert self._step is not None
        self._step.all_reduce(collective)

    def finish_step(self) -> StepResult:
        assert self._step is not None
        return self._step.finish()

    def failure_after_step(self) -> Exception | None:
        step = self._step
        if step is None or step.update.failure is None:  # (the common answer, without a call)
            return None
        return step.update.take_failure()

    def abort_step(self) -> None:
        # The step will be redone: forward-updated buffers go back to the step's start.
        started = self._step.abort() if self._step is not None else None
        if started is None:
            return
        self._allocate()  # (an abandoned collective may still write into the old buffer)
        with torch.no_grad():
            self.restore_buffers(started)

    # -- what the strategies call: the model, its buffers, the generators ---------------------
    def forward(self, inputs: Any, target: Any) -> tuple[Any, torch.Tensor]:
        """The model's output and loss (in autocast for a mixed precision)."""
        if self.grad_step.mixed:
            with self.grad_step.autocast(self.device):
                output = self.call(self.model, inputs)
                return output, self.compute_loss(output, target)
        # no context to enter: a step's every extra call is paid cold (docs/architecture.md),
        # and a tensor input goes to the model and a loss function is called without the
        # calls that decide it (ModelCall.__call__, compute_loss)
        output = self.model(inputs) if isinstance(inputs, torch.Tensor) else self.call(self.model, inputs)
        if self.loss_function is not None:
            return output, self.loss_function(output, target)
        return output, self.compute_loss(output, target)

    def seed(self, seed: int) -> None:
        # torch.manual_seed also seeds every lazy accelerator backend, formatting stack
        # traces as it goes (0.1-0.5 ms a call); seed only the generators this worker uses.
        torch.default_generator.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.default_generators[self.device.index or 0].manual_seed(seed)
        if self._owned_generators:
            self._owned_generators.seed(seed)

    def seeder(self) -> Callable[[int], Any]:
        """What seeds a micro-batch's generators (:meth:`seed`), for a step strategy to keep: on a
        CPU, for a model without generators of its own, the global generator's ``manual_seed``
        itself (no Python call a micro-batch)."""
        if self.device.type != "cuda" and not self._owned_generators:
            return torch.default_generator.manual_seed
        return self.seed

    def on_device(self, batch: Any) -> tuple[Any, Any]:
        """``(inputs, target)`` of a collated batch (``calling.ModelCall.split``), its tensors on the device."""
        if type(batch) in _PAIRS and len(batch) == 2:
            x, y = batch
            if type(x) is torch.Tensor and type(y) is torch.Tensor:
                # A batch's usual form, without the walk of its tree: ``to`` returns a tensor
                # that is on the device already, so on a CPU it is left as it is.
                if self._on_cpu and x.is_cpu and y.is_cpu:
                    return x, y
                return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        return self.call.split(to_device(batch, self.device))

    # -- how the optimizer state is held (frameworks/torch/sharded.py) -------------------------
    def shard_optimizer_state(self) -> ShardedOptimizer:
        """Hold and update only this member's slices of the optimizer state from now on."""
        sharded = ShardedOptimizer(self.optimizer, self._buffer.grad_view_of())
        self.held_optimizer = sharded
        self._drop_step()  # the next step's update is the slices'
        return sharded

    def sharded_names(self) -> set[str]:
        """The model state's names of the parameters whose slices members hold (they travel by slices)."""
        ids = {id(p) for p in self.held_optimizer.sliced_params}
        if not ids:
            return set()
        return {name for name, v in self.model.state_dict(keep_vars=True).items() if id(v) in ids}

    def gathered_optimizer_state(self, collective: Any) -> dict[str, Any]:
        """The whole optimizer state (``state_dict``'s form), gathered from every member's slices."""
        sharded = self.held_optimizer
        assert isinstance(sharded, ShardedOptimizer)
        state = sharded.full_state(collective)
        groups = sharded.user_state_dict()["param_groups"]  # the user's holds no state: the groups only
        return self.grad_step.pack({"state": state, "param_groups": groups})

    def gather_final(self, collective: Any) -> None:
        """At the end: the user's optimizer holds the whole state again, as after an unsharded run."""
        sharded = self.held_optimizer
        assert isinstance(sharded, ShardedOptimizer)
        state = sharded.full_state(collective)
        sharded.release()  # its state refused every read until now (sharded.HiddenState)
        for i, values in state.items():
            self.optimizer.state[sharded.params[i]] = values
        self.held_optimizer = WholeOptimizer(self.optimizer)
        self._drop_step()

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
        """The optimizer state as :meth:`optimizer_state` gives it, holding the live tensors (no copy);
        sharded, its param groups only: the user's optimizer refuses reads of its state."""
        return self.grad_step.pack(self.held_optimizer.user_state_dict())

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
