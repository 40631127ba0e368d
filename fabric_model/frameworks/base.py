"""The two halves of a framework: ``Framework`` in the caller's process, ``FrameworkAdapter`` in
each worker. Only these know which framework a model belongs to; see docs/architecture.md,
"Frameworks"."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Collection, Hashable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ..profiling import phases as ph
from ..step.data import Loader, Reader, is_batch_level
from ..step.digest import state_fingerprint
from ..step.layout import LEAVE_VOTE, STOP_VOTE
from ..step.options import StepOptions
from ..step.sample_seeds import Generator, SeededReads

#: The keys under which a dict sample holds its target, looked for in this order (every framework).
TARGET_KEYS = ("target", "label", "labels", "y")

if TYPE_CHECKING:  # annotations only: importing this module must not import torch
    import numpy as np
    import torch

    from ..step.layout import StepLayout, StepResult


class FrameworkAdapter(abc.ABC):
    """One framework's model, optimizer, loss and metrics, seen by the framework-neutral loop.

    A step is ``begin_step``, then ``train_micro_batch`` for each micro-batch this worker
    holds, then perhaps ``vote_switch``, then one in-place sum-allreduce of ``step_buffer``,
    then ``finish_step``. The buffer is a flat float32 ``torch.Tensor`` laid out by
    :class:`~fabric_model.step.layout.StepLayout`, so a single collective carries everything a
    step needs (see docs/architecture.md, "The step").
    """

    #: Names of the statistics at the tail of the step buffer: "loss", metrics..., in order.
    stat_names: list[str]
    #: The user's model and optimizer, as the worker holds them (callbacks see these).
    model: Any
    optimizer: Any
    #: The worker's training dataset, handed to a custom step as ``train_loader``.
    train_set: Any = None
    #: The loop's named ranges (profiling/phases.py): off until a worker's loop hands over its own.
    phases: ph.Phases = ph.OFF
    #: How long ``setup``'s parts took (run/startup.py); empty where an adapter does not say.
    setup_phases: dict[str, float] = {}  # never mutated: setup replaces it
    #: The FLOPs of the first batch's forward pass, counted in the caller where the framework can
    #: (frameworks/torch/flops.py); None: not counted. The run's intra-op threads follow from it.
    first_forward_flops: int | None = None

    @abc.abstractmethod
    def setup(self, device: str, num_threads: int) -> None:
        """Place the model on ``device`` and allocate the step buffer."""

    def resize_threads(self, num_threads: int) -> None:
        """Use ``num_threads`` intra-op threads from now on where the framework can (torch can;
        TensorFlow fixes them at its start): a hand-started worker's share of its host changes
        as the job's workers there come and go (worker/host_share.py)."""
        return None  # the default: a framework that cannot keeps the threads it started with

    @abc.abstractmethod
    def collate(self, samples: Sequence[Any]) -> Any:
        """Turn a list of dataset samples into one batch (the user's ``fn_batch_collate`` if given)."""

    def reader(self, dataset: Any) -> Reader | None:
        """A way to read a micro-batch of ``dataset`` in one go, faster than item by item and
        ``collate`` with the same result; None where there is none (``data.fetch`` then)."""
        return None

    @property
    def own_collate(self) -> bool:
        """Whether ``collate`` is the framework's own, no user code (then a list of samples is
        read without seeds: nothing in the read can draw)."""
        return False

    def process_loader(
        self, dataset: Any, reads: SeededReads, processes: int, epoch_of: Callable[[Hashable], int]
    ) -> Loader | None:
        """A loader reading ``dataset`` in ``processes`` processes (``num_dataloader_processes``);
        None where the framework has none (the caller refuses the argument first: setup/checks.py)."""
        return None

    def read_generators(self, dataset: Any) -> list[Generator]:
        """The framework's generators a read of ``dataset`` may draw from, seeded before each
        sample as NumPy's and Python's are (step/sample_seeds.py); none by default."""
        return []

    @abc.abstractmethod
    def begin_step(self, collective: Any = None) -> None:
        """Zero the step buffer and remember the step's starting buffer values. With a
        ``collective``, the last micro-batch may start reducing gradients during backward."""

    @abc.abstractmethod
    def all_reduce(self, collective: Any) -> None:
        """Sum the step buffer across the group (finishing what backward started)."""

    @abc.abstractmethod
    def train_micro_batch(self, batch: Any, num_samples: int, step_samples: int, seed: int, last: bool = False) -> None:
        """Forward and backward one micro-batch of ``num_samples`` out of the step's ``step_samples``.

        Adds the gradient of its mean loss, weighted by ``num_samples / step_samples``, to the
        buffer, after seeding the framework's RNG with ``seed``.
        """

    @property
    @abc.abstractmethod
    def step_buffer(self) -> torch.Tensor:
        """The flat buffer to sum-allreduce (laid out by ``step_layout``)."""

    @property
    @abc.abstractmethod
    def step_layout(self) -> StepLayout:
        """The layout of the current ``step_buffer``."""

    def count_micro_batches(self, count: int) -> None:
        """Say, inside this step's allreduce, how many micro-batches this member computed (the
        driver checks the sum: driver/ledger.py)."""
        self.step_buffer[self.step_layout.computed] = float(count)

    @abc.abstractmethod
    def gradient_bytes(self) -> int:
        """Bytes of gradients (and of the step's sums made of them) this adapter holds now."""

    def vote_snapshot(self) -> None:
        """Ask, inside this step's allreduce, that every member gather a snapshot before the next
        unit (rank 0 of a sharded optimizer state: state/uploader.py, ``snapshot_due``)."""
        self.step_buffer[self.step_layout.snapshot] = 1.0

    def vote_switch(self, leaving: bool = False, stopping: bool = False) -> None:
        """Vote, inside this step's allreduce, to end the generation after the step (and, when
        ``leaving``, to leave the job then; when ``stopping``, that every member leaves then:
        step/layout.py, ``LEAVE_VOTE`` and ``STOP_VOTE``)."""
        vote = 1.0 + (LEAVE_VOTE if leaving or stopping else 0.0) + (STOP_VOTE if stopping else 0.0)
        self.step_buffer[self.step_layout.vote] = vote

    @abc.abstractmethod
    def finish_step(self) -> StepResult:
        """Apply the reduced buffer (set buffers, step the optimizer); return the step's stats and vote."""

    def failure_after_step(self) -> Exception | None:
        """A collective failure that came after this member applied the step (its update is kept:
        the step is done here), once; None for none. Only a sharded optimizer state has one."""
        return None

    def shard_optimizer_state(self) -> Any:
        """Hold and update only this member's slices of the optimizer state from now on; returns
        what holds them (the sharded state layout moves them: state/layouts.py)."""
        raise ValueError(f"shard_optimizer_state=True is not available for {type(self).__name__}")

    @abc.abstractmethod
    def abort_step(self) -> None:
        """Undo what an unfinished step changed (forward-updated buffers), so it can be redone."""

    @abc.abstractmethod
    def load_state(self, model_state: dict[str, Any], optimizer_state: dict[str, Any]) -> None:
        """Take weights and optimizer state pulled from a peer."""

    # -- the state that travels (docs/architecture.md, "State that does not change") ------------
    def frozen_parameters(self) -> tuple[dict[str, Any], list[str]]:
        """In the caller: the model's parameters that need no gradient, by state name (its own
        tensors, not copies), and every state name in order. This default: none."""
        return {}, []

    def identity_view(self) -> Any:
        """What identifies this adapter's part of the job (driver/identity.py digests it): itself,
        unless the way it travels holds what differs between two builds of the same script."""
        return self

    def track_frozen(self, names: Collection[str]) -> None:
        """After ``setup``: ``names`` (the job's frozen parameters, as the driver counted them) hold
        the job's values, which the driver and every worker have; the state that travels may leave
        them out while they provably still do. This default tracks none: every state is whole."""
        return None

    def state_to_send(self) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
        """``(model state, optimizer state, omitted)`` for an upload or a join: what a step can
        change, as live objects (the receiver or the uploader copies them), and the names of the
        frozen parameters left out (:meth:`track_frozen`). This default: copies of the whole state."""
        return self.model_state(), self.optimizer_state(), []

    def final_state(self) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
        """:meth:`state_to_send`'s state as CPU copies, for the driver at the end."""
        return self.model_state(), self.optimizer_state(), []

    def load_sent_state(
        self,
        model_state: dict[str, Any],
        optimizer_state: dict[str, Any],
        omitted: Collection[str] = (),
        base: Collection[str] = (),
    ) -> None:
        """Load a state another process sent: ``omitted`` names were left out (this worker holds the
        job's values for them), ``base`` names hold the job's values (the driver filled them in)."""
        if omitted:
            raise ValueError(f"a state without {sorted(omitted)[:3]}... reached an adapter that tracks no frozen state")
        self.load_state(model_state, optimizer_state)

    @abc.abstractmethod
    def evaluate_batches(self, batches: Any) -> torch.Tensor:
        """Stat sums and sample count over an iterator of ``(indices, batch)`` test batches, float64 on the CPU."""

    @abc.abstractmethod
    def model_state(self) -> dict[str, Any]:
        """Model weights, as CPU objects that pickle without the framework's model class."""

    @abc.abstractmethod
    def optimizer_state(self) -> dict[str, Any]:
        """Optimizer state (moments, step counts), as CPU objects."""

    def state_fingerprint(self) -> dict[str, int]:
        """One integer per tensor of the model state (buffers included) and the optimizer state,
        keyed ``"model/<name>"`` and ``"optimizer/<path>"`` (:func:`~fabric_model.step.digest.state_fingerprint`):
        replicas compare these every few steps (docs/architecture.md, "Replica checks").

        This default reads ``model_state()`` and ``optimizer_state()``, which copy every tensor;
        an adapter that can reach its live tensors may fingerprint those instead, with the same keys."""
        return {
            **state_fingerprint(self.model_state(), "model"),
            **state_fingerprint(self.optimizer_state(), "optimizer"),
        }


@dataclasses.dataclass(frozen=True)
class UserObjects:
    """What the user handed ``FabricModel`` that the worker half is made of (already checked)."""

    model: Any
    optimizer: Any
    loss_function: Any
    metrics: Sequence[Any] | None  # None: the framework's default (IBM's accuracy)
    collate: Callable[[Sequence[Any]], Any] | None = None
    custom_objects: dict[str, Any] | None = None  # Keras only
    fn_step_train: Callable[..., Any] | None = None  # the user's step (torch: docs/training.md; Keras: docs/keras.md)
    fn_test: Callable[..., Any] | None = None  # the user's validation
    fn_args: Any = None
    step_options: StepOptions = StepOptions()  # precision=, gradient_clip_norm=


class Framework(abc.ABC):
    """One framework seen from the caller's process: checks the user's arguments, makes the
    adapter that travels to the workers (deterministic or not), and puts the trained state back
    into the user's objects; what is done with the trained model after that is :attr:`trained`'s."""

    #: The framework's name, as run records, checkpoints and messages spell it.
    name: ClassVar[str]

    # -- arguments ----------------------------------------------------------------------------
    def check_options(self, *, fn_step_train: Any, fn_test: Any, keras_custom_objects: Any) -> None:
        """Reject the framework-specific arguments this framework does not take."""
        if keras_custom_objects is not None and not isinstance(keras_custom_objects, dict):
            raise TypeError(
                "Expected `keras_custom_objects` to be a dict of name -> class or None. "
                f"Received: keras_custom_objects={keras_custom_objects!r}"
            )

    @abc.abstractmethod
    def check_loss(self, loss_function: Any, *, model: Any = None, fn_step_train: Any = None) -> None:
        """Raise when ``loss_function`` is no loss this framework can use (for ``model``, with the
        custom step ``fn_step_train``: None may be accepted where they compute the loss)."""

    @abc.abstractmethod
    def check_metrics(self, metrics: Any) -> list[Any] | None:
        """Check ``metrics``; return them as a list, or None where the adapter picks the default."""

    @abc.abstractmethod
    def check_optimizer(self, model: Any, optimizer: Any) -> None:
        """Raise when ``optimizer`` is no optimizer for ``model``."""

    def check_shardable(self, optimizer: Any) -> None:
        """Raise unless ``optimizer``'s state can be sharded by elements (``train(shard_optimizer_state=True)``)."""
        raise ValueError(
            "Expected `shard_optimizer_state` to be False for a "
            f"{self.name} model: only a torch optimizer's state can be sharded so far. "
            "Received: shard_optimizer_state=True."
        )

    def check_reader_processes(self, processes: int) -> None:
        """Raise unless the workers can read in ``processes`` processes (``train(num_dataloader_processes=...)``)."""
        raise ValueError(
            f"Expected `num_dataloader_processes` to be 0 or None for a {self.name} model: reading "
            "in processes is for torch models so far (num_dataloader_threads reads on threads). "
            f"Received: num_dataloader_processes={processes}."
        )

    @abc.abstractmethod
    def make_adapter(self, user: UserObjects) -> FrameworkAdapter:
        """The worker half for the user's objects (checked first)."""

    # -- batches and shipping -----------------------------------------------------------------
    @abc.abstractmethod
    def split_batch(self, batch: Any) -> tuple[Any, Any]:
        """``(inputs, target)`` of a collated batch."""

    def first_batch(self, adapter: FrameworkAdapter, train_set: Any) -> Any:
        """The first two training samples collated into a batch, so a wrong sample fails in the caller
        (two: a per-sample loss or metric then shows as a non-scalar)."""
        try:
            if is_batch_level(train_set):
                batch = train_set[0]
            else:
                batch = adapter.collate([train_set[i] for i in range(first_batch_items(train_set))])
            self.split_batch(batch)
        except Exception as exc:
            keys = ", ".join(repr(k) for k in TARGET_KEYS)
            raise TypeError(
                f"Could not make a batch from the first training sample: {str(exc).rstrip('.')}. Expected samples "
                f"to be (input, target) tuples or dicts with a target under one of the keys {keys}, of tensors, "
                "numpy arrays or numbers (or pass `fn_batch_collate` returning (inputs, target))."
            ) from exc
        return batch

    def prepare_for_shipping(self, adapter: FrameworkAdapter, first_batch: Any) -> FrameworkAdapter:
        """Check that ``adapter`` will work in a worker as it does here; return what is shipped."""
        return adapter

    @abc.abstractmethod
    def draw_seed(self) -> int:
        """A run seed from the global generator that the framework's own seeding call sets."""

    # -- the trained model --------------------------------------------------------------------
    def load_final_state(
        self, adapter: FrameworkAdapter, model_state: dict[str, Any], optimizer_state: dict[str, Any]
    ) -> None:
        """Put the trained state into the user's model and optimizer (those the caller's adapter holds)."""
        adapter.load_state(model_state, optimizer_state)

    def hand_over(self, adapter: FrameworkAdapter) -> None:
        """Last touches to the user's trained model once it is saved (Keras: compiled)."""
        return None  # torch: nothing to do

    @abc.abstractmethod
    def save_model(self, model_dir: Path, model: Any, model_state: dict[str, Any]) -> Path:
        """Write the trained model into ``model_dir`` in the framework's own format (aside, then renamed)."""

    @abc.abstractmethod
    def deterministic(self, adapter: FrameworkAdapter, max_micro_batches: int) -> FrameworkAdapter:
        """The adapter of ``deterministic=True`` for steps of up to ``max_micro_batches``: step sums
        that do not depend on which worker added what (docs/deterministic.md)."""

    @property
    @abc.abstractmethod
    def trained(self) -> TrainedModel:
        """What is done with the trained model in the caller: inference and the ONNX export."""


class TrainedModel(abc.ABC):
    """One framework's trained model in the caller: ``FabricModel.evaluate``/``predict`` and the
    ONNX export (:mod:`fabric_model.frameworks.export`), apart from training's :class:`Framework`."""

    def __init__(self, framework: Framework) -> None:
        self.framework = framework
        self.name = framework.name

    def export_inputs(self, adapter: FrameworkAdapter, train_set: Any) -> Any:
        """Model inputs of a real training batch (up to 4 samples), to trace and check an export on."""
        if is_batch_level(train_set):
            batch = train_set[0]
        else:
            batch = adapter.collate([train_set[i] for i in range(min(len(train_set), 4))])
        return self.framework.split_batch(batch)[0]

    @abc.abstractmethod
    def evaluate(self, adapter: FrameworkAdapter, dataset: Any, batch_size: int) -> dict[str, float]:
        """``FabricModel.evaluate``: the loss and metrics of the caller's trained model on ``dataset``."""

    @abc.abstractmethod
    def predict(self, adapter: FrameworkAdapter, dataset: Any, batch_size: int) -> Any:
        """``FabricModel.predict``: the caller's trained model's outputs on ``dataset``."""

    @abc.abstractmethod
    def onnx_requirements(self) -> tuple[str, ...]:
        """The modules an ONNX export needs (checked before training)."""

    @abc.abstractmethod
    def write_onnx(self, model: Any, sample: Any, path: str) -> None:
        """Export ``model`` traced on ``sample`` to ``path`` with a dynamic batch; raise ExportError."""

    @abc.abstractmethod
    def onnx_inputs(self, batch: Any, input_names: list[str]) -> list[Any]:
        """The arrays of ``batch`` in the order of the ONNX file's ``input_names``."""

    @abc.abstractmethod
    def inference_outputs(self, model: Any, batch: Any) -> tuple[list[np.ndarray], list[str] | None]:
        """The model's outputs on ``batch`` in inference mode, flattened; with their names when the
        file's outputs are to be matched by name."""

    @abc.abstractmethod
    def grow_batch(self, sample: Any) -> Any:
        """``sample`` with its first row repeated at the end: a batch size the export did not see."""


def metric_name(metric: Callable[..., Any], position: int, taken: set[str] | None = None) -> str:
    """A readable, unique name for a metric callable (its ``__name__`` or ``name``)."""
    name = getattr(metric, "name", None) or getattr(metric, "__name__", None) or f"metric_{position}"
    if name == "<lambda>":
        name = f"metric_{position}"
    taken = taken if taken is not None else set()
    base, suffix = str(name), 1
    while name in taken or name == "loss":
        suffix += 1
        name = f"{base}_{suffix}"
    taken.add(str(name))
    return str(name)


def first_batch_items(train_set: Any) -> int:
    """The dataset items in :meth:`Framework.first_batch`'s batch: two samples (one, in a dataset
    of one), or a batch-level dataset's first batch."""
    return 1 if is_batch_level(train_set) else min(2, len(train_set))
