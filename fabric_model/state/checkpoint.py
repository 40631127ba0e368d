"""Checkpoints and resume (docs/architecture.md, "Run directory" and "Elasticity").

A checkpoint is the state after the last step of every ``checkpoint_freq``-th epoch and, with
``train(checkpoint_steps=k)``, after every ``k``-th optimizer step of the run (global steps,
counted from the run's first over epochs; :func:`checkpoint_due`): one ``torch.save`` file,
``<run_dir>/checkpoints/ckpt-unit-<unit, 8 digits>.pt``, named after the *unit* the run goes
on from (an epoch's validation slot, or the unit that follows the step, see
:class:`~fabric_model.step.plan.Schedule`). Where a step's checkpoint falls on an epoch's last
step that also ends with a checkpoint, the two are one file, at the validation slot. Every
checkpoint counts alike in ``keep_checkpoints``; ``BestCheckpoints`` scores only those at an
epoch's end (state/best.py). It holds a dict of plain values and tensors::

    {"format": FORMAT, "framework": "torch" | "keras" | "tf_keras", "unit": next unit to run,
     "epoch": e, "step": e's last step done, "steps_done": steps committed so far,
     "batch_size": train()'s batch_size, "plan": {num_samples, items_per_micro_batch, micro_batches, seed},
     "model": adapter.model_state(), "optimizer": adapter.optimizer_state(), "time": ...}

The data order and every RNG of a run are functions of ``(seed, epoch, step,
micro-batch)``, so the plan and the unit are the whole data and RNG position. A snapshot
has the same shape at any step boundary: kept in the driver's memory, and the newest committed
one on disk as ``checkpoints/snapshot.pt`` (:mod:`fabric_model.state.durable`), which a resume
takes when it is newer than every checkpoint.

Rank 0 of a generation builds the bytes (:func:`state_record`, :func:`encode_state`) and
uploads them to the driver, which writes the file: no shared storage is needed, and the
driver accepts state only from rank 0 of its current generation. Writes are atomic
(:func:`fabric_model.run.rundir.atomic_write`): a temporary file in the same directory, fsynced,
renamed over the final name, then the directory fsynced. A crash in the
middle leaves a temporary file that every reader ignores and the driver removes; the newest
complete checkpoint is never touched.
Reading uses ``torch.load(..., weights_only=True)`` only: nothing but tensors and plain
values is ever unpickled. torch is imported inside the functions that use it, so that
``import fabric_model`` stays light.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import re
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import IO, Any

from ..run.rundir import RunDirectory, atomic_write
from ..step.plan import Plan, Schedule

log = logging.getLogger(__name__)

FORMAT = "fabric_model.state.checkpoint/1"
#: Checkpoints a run keeps by default (``train(keep_checkpoints=...)``); older ones are deleted.
DEFAULT_KEEP = 3
#: ``wrap_stream(file, unit) -> file``: the file a checkpoint of ``unit`` is written through
#: (``Hooks.wrap_checkpoint_stream`` of the driver's hooks: a fault injector's seam; by
#: default the file itself).
StreamWrapper = Callable[[IO[bytes], int], Any]
_WRITE_CHUNK = 1 << 22  # 4 MiB a write

_NAME = re.compile(r"^ckpt-unit-(\d{8})\.pt$")
#: The newest committed snapshot, on disk (:mod:`fabric_model.state.durable`): one file, replaced.
SNAPSHOT_NAME = "snapshot.pt"
_TEMP = re.compile(r"^\.(?:ckpt-unit-\d{8}|snapshot)\.pt\.(\d+)\.tmp$")  # atomic_write's temporary name


def checkpoint_name(unit: int) -> str:
    return f"ckpt-unit-{unit:08d}.pt"


def checkpoint_due(schedule: Schedule, freq: int, unit: int, steps: int = 0) -> bool:
    """Whether a checkpoint is taken before running ``unit``: the validation slot that
    follows the last step of every ``freq``-th epoch (``freq`` 0: none), and, with ``steps`` > 0,
    the unit that follows every ``steps``-th step of the run (global steps counted from 1 over
    epochs: :func:`step_checkpoint_unit`). Where the two meet, at the validation slot after an
    epoch's last step, it is one checkpoint."""
    if not 0 <= unit < schedule.total_units:
        return False
    epoch, step = schedule.locate(unit)
    if step is None and freq > 0 and (epoch + 1) % freq == 0:
        return True
    if steps <= 0 or unit == 0 or schedule.locate(unit - 1)[1] is None:
        return False  # no step ends right before ``unit`` (it follows a validation slot)
    return schedule.steps_before(unit) % steps == 0


def step_checkpoint_unit(schedule: Schedule, step: int) -> int:
    """The unit that follows global step ``step`` (counted from 1): the checkpoint taken after
    it is taken before this unit (the epoch's validation slot after its last step)."""
    epoch, k = divmod(step - 1, schedule.plan.steps_per_epoch)
    return schedule.unit(epoch, k) + 1


def next_checkpoint_unit(schedule: Schedule, freq: int, steps: int, after: int) -> int:
    """The first unit past ``after`` before which :func:`checkpoint_due` takes a checkpoint;
    ``schedule.total_units`` when none is left."""
    found = schedule.total_units
    if freq > 0:
        epoch = max(0, (after + 1) // schedule.units_per_epoch)
        epoch += (freq - (epoch + 1) % freq) % freq  # the next epoch a checkpoint ends
        found = min(found, schedule.unit(epoch, schedule.plan.steps_per_epoch))
    if steps > 0:
        done = schedule.steps_before(max(after + 1, 0))
        step = max(steps, -(-done // steps) * steps)  # the first multiple of ``steps`` not yet passed
        unit = step_checkpoint_unit(schedule, step)
        while unit <= after:
            step += steps
            unit = step_checkpoint_unit(schedule, step)
        found = min(found, unit)
    return min(found, schedule.total_units)


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """What a complete checkpoint says about itself (its tensors are not kept)."""

    path: Path
    unit: int
    epoch: int
    steps_done: int
    framework: str
    batch_size: int
    plan: Plan


# -- the state's bytes (built by rank 0 of a generation, written or kept by the driver) ------
def state_record(
    schedule: Schedule,
    unit: int,
    framework: str,
    batch_size: int,
    model_state: dict[str, Any],
    optimizer_state: dict[str, Any],
) -> dict[str, Any]:
    """The checkpoint dict (module docstring) of the state before ``unit``; a snapshot taken
    inside an epoch has the same shape, ``epoch`` and ``step`` naming its last step."""
    plan = schedule.plan
    done = schedule.steps_before(unit)
    epoch, step = divmod(max(done - 1, 0), plan.steps_per_epoch)
    return {
        "format": FORMAT,
        "framework": framework,
        "unit": unit,
        "epoch": epoch,
        "step": step,
        "steps_done": done,
        "batch_size": batch_size,
        "plan": dataclasses.asdict(plan),
        "model": model_state,
        "optimizer": optimizer_state,
        "time": time.time(),
    }


def encode_state(record: dict[str, Any]) -> bytes:
    """``torch.save`` of a :func:`state_record`, in memory."""
    import torch

    buffer = io.BytesIO()
    torch.save(record, buffer)
    return buffer.getvalue()


def decode_state(data: bytes, plan: Plan | None = None, where: str = "the state received") -> dict[str, Any]:
    """The inverse of :func:`encode_state`, checked like :func:`load_checkpoint` (``weights_only``)."""
    import torch

    state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    info = _info(Path(where), state)
    if plan is not None and info.plan != plan:
        raise ValueError(f"{where} belongs to another plan: {info.plan}, this run's is {plan}")
    return state


def write_checkpoint(directory: Path, unit: int, data: bytes, wrap_stream: StreamWrapper | None = None) -> Path:
    """Write ``data`` (:func:`encode_state`'s bytes) as the checkpoint of ``unit`` atomically;
    returns its path.

    Args:
        directory: the run's ``checkpoints/``.
        unit: the unit the checkpoint resumes at (it names the file).
        data: the checkpoint's bytes.
        wrap_stream: the seam through which the file is written (see ``StreamWrapper``).

    Raises ``OSError`` (a full disk, say) after removing its temporary file."""

    def save(raw: IO[bytes]) -> None:
        stream = wrap_stream(raw, unit) if wrap_stream is not None else raw
        view = memoryview(data)
        for start in range(0, len(view), _WRITE_CHUNK):
            stream.write(view[start : start + _WRITE_CHUNK])

    return atomic_write(directory / checkpoint_name(unit), save)


# -- reading -------------------------------------------------------------------------------
def load_checkpoint(path: Path, plan: Plan | None = None) -> dict[str, Any]:
    """A checkpoint's contents (tensors on the CPU), checked; with ``plan``, it must be its plan."""
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True)  # never unpickle arbitrary objects
    info = _info(path, state)
    if plan is not None and info.plan != plan:
        raise ValueError(f"Checkpoint {path} belongs to another plan: {info.plan}, this run's is {plan}")
    return state


def read_info(path: Path) -> CheckpointInfo:
    """A checkpoint's metadata; raises when the file is not a complete checkpoint. Tensors are
    memory-mapped, not read."""
    import torch

    return _info(path, torch.load(path, map_location="cpu", weights_only=True, mmap=True))


def _info(path: Path, state: Any) -> CheckpointInfo:
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path} is not a fabric_model checkpoint (format {FORMAT})")
    missing = {"unit", "epoch", "steps_done", "framework", "batch_size", "plan", "model", "optimizer"} - set(state)
    if missing:
        raise ValueError(f"{path} lacks {sorted(missing)}")
    return CheckpointInfo(
        path=path,
        unit=int(state["unit"]),
        epoch=int(state["epoch"]),
        steps_done=int(state["steps_done"]),
        framework=str(state["framework"]),
        batch_size=int(state["batch_size"]),
        plan=Plan.from_record(state["plan"]),
    )


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """``(unit, path)`` of the files named as checkpoints, oldest first (temporary files never)."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


def newest_checkpoint(directory: Path) -> CheckpointInfo | None:
    """The newest checkpoint that reads back complete; unreadable ones are skipped (logged)."""
    for unit, path in reversed(list_checkpoints(directory)):
        try:
            info = read_info(path)
        except Exception as exc:  # truncated, foreign or corrupt: any reason makes it unusable
            log.warning("skipping checkpoint %s: %s", path, str(exc).splitlines()[0] if str(exc) else repr(exc))
            continue
        if info.unit == unit:
            return info
        log.warning("skipping checkpoint %s: it holds unit %d", path, info.unit)
    return None


def newest_resume_state(directory: Path) -> CheckpointInfo | None:
    """What a resume goes on from: the newest complete checkpoint, or the snapshot on disk
    (:data:`SNAPSHOT_NAME`) where it reads back complete and is newer."""
    info = newest_checkpoint(directory)
    path = directory / SNAPSHOT_NAME
    if not path.is_file():
        return info
    try:
        snapshot = read_info(path)
    except Exception as exc:  # a foreign or damaged file: the checkpoints stand
        log.warning("skipping %s: %s", path, str(exc).splitlines()[0] if str(exc) else repr(exc))
        return info
    return snapshot if info is None or snapshot.unit > info.unit else info


# -- the driver's housekeeping -------------------------------------------------------------
def prune(directory: Path, keep: int, spare: Collection[int] = ()) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints and the units in ``spare`` (the best ones;
    see :mod:`fabric_model.state.best`), and temporary files of dead writers."""
    remove_temp_files(directory, only_dead_writers=True)
    removed = [path for unit, path in list_checkpoints(directory)[:-keep] if unit not in spare]
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


def remove_temp_files(directory: Path, only_dead_writers: bool = False) -> None:
    """Remove the leftovers of interrupted writes."""
    if not directory.is_dir():
        return
    for path in directory.iterdir():
        match = _TEMP.match(path.name)
        if match and not (only_dead_writers and pid_alive(int(match.group(1)))):
            path.unlink(missing_ok=True)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a writer of a temp file, a worker's registration)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def set_aside_after(directory: Path, unit: int) -> None:
    """Rename checkpoints past ``unit`` (the one resumed from) that failed to read, so they are
    neither counted as the newest nor kept instead of good ones."""
    for later, path in list_checkpoints(directory):
        if later > unit:
            path.rename(path.with_name(path.name + ".unreadable"))
            log.warning("set aside unreadable checkpoint %s", path.name)


# -- resume, checked in the caller before anything starts -----------------------------------
#: ``train(resume=...)``'s value that decides by itself (docs/run-directory.md, "Resume").
AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class ResumeChoice:
    """``train(resume=...)`` resolved: whether to continue the run in the run directory, and
    for ``resume="auto"`` the line that says which and why; ``warning``: that there was nothing
    to resume from. Both are logged once the run's log is open, so they reach the screen as the
    display shows its lines (and ``driver.log``)."""

    resume: bool
    said: str | None = None
    warning: str | None = None


def choose_resume(resume: bool | str, run_dir: str | os.PathLike[str] | None) -> ResumeChoice:
    """Resolve ``resume`` (already checked: True, False or ``"auto"``).

    ``"auto"`` continues a run that did not finish and left a checkpoint: its ``run.json`` says it
    ended failed, interrupted or preempted, or says no end (the process was killed). It starts
    afresh with no run directory named, no checkpoint, or a finished run, so that a requeued
    Slurm job or a restarted pod runs the same command unchanged.
    """
    if resume != AUTO:
        return ResumeChoice(bool(resume))
    run = RunDirectory.named(run_dir)
    if run is None:  # every run gets a new directory: there is never one to go on with
        return ResumeChoice(False, 'resume="auto": no run_dir or $RESULT_DIR names a run to go on with; a new run')
    end = run.end_state()
    if end is not None and end["state"] == "finished":
        return ResumeChoice(False, f'resume="auto": the run in {run.path} finished; starting afresh')
    info = newest_resume_state(run.checkpoints)
    if info is None and end is None and run.read_join_info() is not None:
        # Its driver vanished before any checkpoint: its workers may wait to be taken back.
        return ResumeChoice(True, f'resume="auto": the driver of the run in {run.path} vanished; going on with it')
    if info is None:
        what = "no checkpoint to resume from" if run.path.exists() else "no run"
        return ResumeChoice(False, f'resume="auto": {run.path} holds {what}; starting afresh')
    how = f"ended {end['state']}" if end is not None else "recorded no end (its process was killed)"
    source = info.path.name
    if end is None and run.read_join_info() is not None:  # its workers may wait for it (docs/elasticity.md)
        source = f"the workers that wait for it, else {source}"
    return ResumeChoice(True, f'resume="auto": the run in {run.path} {how}; resuming from {source}')


def find_resume_point(
    run_dir: str | os.PathLike[str] | None, seed: int | None
) -> tuple[CheckpointInfo | None, int | None, str | None]:
    """The newest complete checkpoint of the run to continue, the seed to use, and a warning.

    With no checkpoint (a first attempt, or a job that died before its first one) training
    starts from the beginning, with the warning (the caller logs it once the run's log is open),
    and with the seed that ``run.json`` recorded, so that the restarted run is the run that was
    started. Where the run's driver vanished, its workers may still be taken back instead.
    """
    run = RunDirectory.resolve(run_dir, for_resume=True)
    info = newest_resume_state(run.checkpoints)
    if info is None:
        recorded = run.recorded_seed()
        chosen = seed if seed is not None else recorded
        seeded = f" (seed {chosen}, from run.json)" if seed is None and recorded is not None else ""
        unless = ", unless its vanished driver's workers come back" if run.read_join_info() is not None else ""
        starts = f"training starts from the beginning{unless}{seeded}"
        return None, chosen, f"resume=True: {run.path} holds no complete checkpoint; {starts}"
    if seed is not None and seed != info.plan.seed:
        raise ValueError(
            f"Expected `seed` to be None or {info.plan.seed}, the seed of the run being resumed ({info.path}). "
            f"Received: seed={seed}. HINT: leave seed out when resuming; pass resume=False for a new run."
        )
    log.info(
        "resuming from %s: %d steps done (epoch %d), unit %d", info.path, info.steps_done, info.epoch + 1, info.unit
    )
    return info, info.plan.seed, None


def check_resumable(
    info: CheckpointInfo,
    *,
    plan: Plan,
    framework: str,
    epochs: int,
    batch_size: int,
    engines_number: int | None,
    effective_batch_size: int | None,
) -> None:
    """Refuse a resume whose steps would differ from the checkpointed run's."""
    where = f"the run being resumed ({info.path})"
    if framework != info.framework:
        raise ValueError(f"Expected a {info.framework} model, as in {where}. Received: a {framework} model.")
    if plan.num_samples != info.plan.num_samples:
        raise ValueError(
            f"Expected the training dataset from `datasets_function` to hold {info.plan.num_samples} items, "
            f"as in {where}. "
            f"Received: {plan.num_samples}. HINT: the data order is fixed by the dataset length; pass resume=False "
            "to train afresh on different data."
        )
    if batch_size != info.batch_size:
        raise ValueError(
            f"Expected `batch_size` to be {info.batch_size}, as in {where}. Received: batch_size={batch_size}."
        )
    if plan.micro_batches != info.plan.micro_batches:
        want = info.batch_size * info.plan.micro_batches
        raise ValueError(
            f"Expected the global batch to be {want} samples, as in {where}. "
            f"Received: {batch_size * plan.micro_batches} (batch_size={batch_size}, engines_number={engines_number}, "
            f"effective_batch_size={effective_batch_size}). "
            f"HINT: pass effective_batch_size={want}; any engines_number then runs the same steps."
        )
    if plan.shard_lengths != info.plan.shard_lengths:
        changed = [i for i, (a, b) in enumerate(zip(plan.shard_lengths, info.plan.shard_lengths)) if a != b]
        raise ValueError(
            f"Expected the sharded training dataset to hold the {len(info.plan.shard_lengths)} shards of {where}, "
            f"with the same samples each. Received: {len(plan.shard_lengths)} shards"
            + (f"; shards {changed[:5]} differ in length" if changed else "")
            + ". HINT: each epoch's order is drawn from the shards' lengths; pass resume=False to train afresh "
            "on different data."
        )
    if plan != info.plan:
        raise ValueError(f"Expected the plan of {where}: {info.plan}. Received: {plan}.")
    if epochs < info.epoch + 1:
        raise ValueError(
            f"Expected `epoch_number` to be at least {info.epoch + 1}: {where} has trained {info.epoch + 1} epochs. "
            f"Received: epoch_number={epochs}."
        )
