"""What a worker's loop carries besides the model and the optimizer (docs/architecture.md,
"Training features"): the learning-rate scheduler, the epoch's running loss and metric sums
(the ``logs`` callbacks receive), the callbacks' own state, and the decision to stop.

All of it is a function of the committed steps, so it is the same on every replica; it
travels inside the optimizer state under :data:`EXTRA_KEY` (:meth:`LoopState.pack`), and so
rides along wherever that state goes: checkpoints, snapshots, the state a joining worker
pulls, roll-backs, resumes, the replica digests and the final state.

A leaf module: no torch import (a scheduler is only called).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

from .metrics import EpochAverage, stat_means, validation_means

#: The key of the loop's state inside the optimizer state it travels in.
EXTRA_KEY = "fabric_model.step.loop_state"
#: When a scheduler steps: after every optimizer step, or once per epoch (after validation).
INTERVALS = ("epoch", "step")


@dataclasses.dataclass
class LRScheduling:
    """A torch learning-rate scheduler built on the optimizer given to ``FabricModel``.

    Attributes:
        scheduler: a ``torch.optim.lr_scheduler`` instance (``ReduceLROnPlateau`` included).
        interval: ``"epoch"`` (the default, as in Lightning and the plain torch loop: ``StepLR``,
            ``CosineAnnealingLR`` over epochs) or ``"step"`` (``OneCycleLR``, warm-ups counted in steps).
        monitor: for ``ReduceLROnPlateau``, the ``logs`` key it watches (default ``"val_loss"``).
    """

    scheduler: Any
    interval: str = "epoch"
    monitor: str | None = None
    #: How errors about its ``monitor`` name it (``state.best.check_monitors``).
    argument: ClassVar[str] = "lr_scheduler"

    @property
    def on_plateau(self) -> bool:
        return type(self.scheduler).__name__ == "ReduceLROnPlateau"

    def step(self, logs: dict[str, float]) -> None:
        if not self.on_plateau:
            self.scheduler.step()
            return
        key = self.monitor or "val_loss"
        if key not in logs:  # checked in the caller: an epoch left unvalidated (validation_freq > 1)
            return
        self.scheduler.step(logs[key])


class LoopState:
    """The loop's state besides model and optimizer; one per worker (and one in the caller).

    Args:
        stat_names: ``"loss"`` and the metrics, in the order of the step's stat sums.
        scheduling: the learning-rate scheduler, if any.
        callbacks: the user's callbacks; those with ``state_dict()`` / ``load_state_dict()`` have
            their state carried (``EarlyStopping`` does), so a joining worker decides as the others.
    """

    def __init__(self, stat_names: Sequence[str], scheduling: LRScheduling | None, callbacks: Sequence[Any]) -> None:
        self.stat_names = list(stat_names)
        self.scheduling = scheduling
        self.callbacks = list(callbacks)
        self.average = EpochAverage(self.stat_names)

    # -- the loop's events ---------------------------------------------------------------------
    def step_done(self, epoch: int, stats: Sequence[float]) -> None:
        """A step was applied (every replica got the same reduced ``stats``)."""
        self.average.accumulate(epoch, stats)
        if self.scheduling is not None and self.scheduling.interval == "step":
            self.scheduling.step({})

    def epoch_logs(self, epoch: int, val_stats: Sequence[float] | None) -> dict[str, float]:
        """Keras' ``logs``: the epoch's sample-weighted training averages, and the validation
        metrics prefixed ``val_`` when the epoch was validated."""
        logs = stat_means(self.stat_names, self.average._sums) if self.average.epoch == epoch else {}
        if val_stats is not None:
            logs.update({f"val_{k}": v for k, v in validation_means(self.stat_names, val_stats).items()})
        return logs

    def epoch_done(self, logs: dict[str, float]) -> None:
        """After the epoch's callbacks: an epoch scheduler steps (``ReduceLROnPlateau`` on ``logs``)."""
        if self.scheduling is not None and self.scheduling.interval == "epoch":
            self.scheduling.step(logs)

    def should_stop(self, model: Any) -> bool:
        """A callback set ``stop_training`` (on itself, or on the model as Keras' callbacks do)."""
        # An instance's own attribute, looked up without getattr: a torch module lacking one
        # raises AttributeError inside __getattr__, microseconds a step.
        own = getattr(model, "__dict__", None)
        flag = own.get("stop_training", False) if own is not None else getattr(model, "stop_training", False)
        if flag:
            return True
        for cb in self.callbacks:  # a loop, not any() over a generator: no frame a step for none
            if getattr(cb, "stop_training", False) is True:
                return True
        return False

    # -- travelling with the optimizer state -------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Plain values only (read back with ``weights_only=True``)."""
        return {
            "epoch": self.average.epoch,
            "sums": [float(s) for s in self.average._sums],
            "lr_scheduler": self.scheduling.scheduler.state_dict() if self.scheduling is not None else None,
            "callbacks": [_callback_state(cb) for cb in self.callbacks],
        }

    def load(self, state: dict[str, Any] | None) -> None:
        """Take a state from :meth:`state`; None (a state saved without one) starts afresh."""
        if state is None:
            self.average = EpochAverage(self.stat_names)
            return
        self.average.epoch, self.average._sums = int(state["epoch"]), [float(s) for s in state["sums"]]
        if self.scheduling is not None and state["lr_scheduler"] is not None:
            self.scheduling.scheduler.load_state_dict(state["lr_scheduler"])
        for cb, saved in zip(self.callbacks, state["callbacks"]):
            if saved is not None and callable(getattr(cb, "load_state_dict", None)):
                cb.load_state_dict(saved)

    def pack(self, optimizer_state: dict[str, Any]) -> dict[str, Any]:
        """``optimizer_state`` with this state added under :data:`EXTRA_KEY`."""
        return {**optimizer_state, EXTRA_KEY: self.state()}

    def unpack(self, optimizer_state: dict[str, Any]) -> dict[str, Any]:
        """Load the state packed into ``optimizer_state``; returns the optimizer's own state."""
        own = {k: v for k, v in optimizer_state.items() if k != EXTRA_KEY}
        self.load(optimizer_state.get(EXTRA_KEY))
        return own


def _callback_state(callback: Any) -> Any:
    method = getattr(callback, "state_dict", None)
    return method() if callable(method) else None


def check_lr_scheduler(lr_scheduler: Any, optimizer: Any, framework: str) -> LRScheduling | None:
    """``FabricModel(lr_scheduler=)``: None, a torch scheduler built on ``optimizer``, or Lightning's
    dict ``{"scheduler": s, "interval": "epoch" | "step", "monitor": "val_loss"}``."""
    if lr_scheduler is None:
        return None
    if framework != "torch":
        raise TypeError(
            f"Expected `lr_scheduler` to be None for a {framework} model. Received: {lr_scheduler!r}. HINT: give the "
            "optimizer a keras.optimizers.schedules.LearningRateSchedule as its learning_rate, as with model.fit."
        )
    spec = lr_scheduler if isinstance(lr_scheduler, dict) else {"scheduler": lr_scheduler}
    unknown = set(spec) - {"scheduler", "interval", "monitor", "name"}
    scheduler, interval = spec.get("scheduler"), spec.get("interval", "epoch")
    steps = callable(getattr(scheduler, "step", None)) and callable(getattr(scheduler, "state_dict", None))
    if unknown or not steps:
        raise TypeError(
            "Expected `lr_scheduler` to be a torch.optim.lr_scheduler instance built on `optimizer`, or a dict "
            f"{{'scheduler': ..., 'interval': 'epoch' | 'step', 'monitor': ...}}. Received: {lr_scheduler!r}"
        )
    if getattr(scheduler, "optimizer", None) is not optimizer:
        raise ValueError(
            f"Expected `lr_scheduler` to be built on the optimizer given to FabricModel. Received: {scheduler!r} on "
            f"{getattr(scheduler, 'optimizer', None)!r}. HINT: build it as Scheduler(optimizer, ...)."
        )
    if interval not in INTERVALS:
        raise ValueError(f"Expected the lr_scheduler's `interval` to be one of {INTERVALS}. Received: {interval!r}")
    scheduling = LRScheduling(scheduler, interval)
    if scheduling.on_plateau:
        scheduling.monitor = spec.get("monitor", "val_loss")
    if scheduling.on_plateau and interval != "epoch":
        raise ValueError("Expected ReduceLROnPlateau's `interval` to be 'epoch': it watches an epoch's logs.")
    return scheduling
