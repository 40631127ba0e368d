"""Which steps a run profiles: ``train(profile=...)`` or ``FABRIC_MODEL_PROFILE``, checked in the caller.

A window is a range of global steps (``epoch * steps_per_epoch + step``, counted from 0) that
rank 0 of the generation running them profiles (docs/training.md, "Profiling"). It is plain
data, shipped to every worker in the ``TrainConfig``. Standard library only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

#: ``profile=True``: steps 10 to 19, past the first steps' one-off costs (allocations, imports).
DEFAULT_START, DEFAULT_STEPS = 10, 10
#: The most steps a window may hold: a trace grows with every operation it records.
MOST_STEPS = 1000

ACCEPTED = (
    "True (steps 10-19), False or None (off), a number of steps N (steps 10 to 10+N-1), "
    "a (first, stop) pair of global steps, or a range"
)


@dataclasses.dataclass(frozen=True)
class ProfileWindow:
    """Global steps ``start`` (included) to ``stop`` (excluded)."""

    start: int
    stop: int
    chosen: bool = True  # False: profile=True's default, moved into a shorter run

    @property
    def steps(self) -> int:
        return self.stop - self.start

    def holds(self, global_step: int) -> bool:
        return self.start <= global_step < self.stop

    def describe(self) -> str:
        return f"steps {self.start}-{self.stop - 1}" if self.steps > 1 else f"step {self.start}"


def profile_window(value: Any, name: str = "profile") -> ProfileWindow | None:
    """``value`` (``train(profile=...)``'s, or the setting's) as a window; None for off.

    Raises ``TypeError`` or ``ValueError`` naming ``name``, the value and what is accepted."""
    if value is None or value is False:
        return None
    if value is True:
        return ProfileWindow(DEFAULT_START, DEFAULT_START + DEFAULT_STEPS, chosen=False)
    if isinstance(value, int) and not isinstance(value, bool):
        return _checked(ProfileWindow(DEFAULT_START, DEFAULT_START + value), value, name)
    if isinstance(value, range) and value.step == 1:
        return _checked(ProfileWindow(value.start, value.stop), value, name)
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(_is_int(v) for v in value):
        return _checked(ProfileWindow(int(value[0]), int(value[1])), value, name)
    raise TypeError(f"Expected `{name}` to be {ACCEPTED}. Received: {name}={value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _checked(window: ProfileWindow, value: Any, name: str) -> ProfileWindow:
    if window.start < 0 or window.steps < 1 or window.steps > MOST_STEPS:
        raise ValueError(
            f"Expected `{name}` to be {ACCEPTED}, with at least 1 and at most {MOST_STEPS} steps from step 0 on. "
            f"Received: {name}={value!r}"
        )
    return window


def parse_setting(text: str) -> ProfileWindow | None:
    """``FABRIC_MODEL_PROFILE``'s text: ``1`` (steps 10-19), ``0``, ``N`` steps from step 10 on,
    or ``FIRST:STOP``; raises ``ValueError`` on anything else."""
    text = text.strip()
    if text in ("0", "1"):
        return profile_window(text == "1")
    try:
        if ":" in text:
            first, stop = text.split(":")
            return profile_window((int(first), int(stop)))
        return profile_window(int(text))
    except (TypeError, ValueError):
        raise ValueError(text) from None


def fit_to_run(window: ProfileWindow, total_steps: int, name: str = "profile") -> ProfileWindow:
    """``window`` within the run's ``total_steps``: cut at its end, an error when it starts past it
    (``profile=True``'s default window moves to the run's second half instead)."""
    if not window.chosen and window.start >= total_steps // 2:
        start = total_steps // 2
        return ProfileWindow(start, min(total_steps, start + window.steps), chosen=False)
    if window.start >= total_steps:
        raise ValueError(
            f"Expected `{name}` to start before the run's last step: the run has {total_steps} steps "
            f"(0 to {total_steps - 1}). Received: {window.describe()}. HINT: profile=True profiles steps "
            f"{DEFAULT_START}-{DEFAULT_START + DEFAULT_STEPS - 1}; pass a (first, stop) pair for a shorter run."
        )
    return ProfileWindow(window.start, min(window.stop, total_steps))
