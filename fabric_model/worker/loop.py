"""The worker's training loop: steps across generations of workers (docs/architecture.md, "The step", "Elasticity").

A worker runs units (steps and validation slots, see :class:`~fabric_model.step.plan.Schedule`)
from a position every member of its generation shares. Two things end a generation:

- a collective fails (a peer died or hung): the interrupted step is undone, the worker
  reports how far it got, and waits for the driver's next generation;
- the members vote, inside the step's allreduce, to switch (someone asked to join, or a member
  was told to leave: worker/notice.py): every replica sees the same vote, so all stop after the
  same committed step, and a member that leaves exits then.

Entering a generation: join its process group, take the state from the member that holds
the latest committed step (when members differ, or a newcomer needs it), resume at the
agreed unit with that step's micro-batches re-divided among the new members.
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import numpy as np

from ..context import WorkerContext
from ..profiling import phases as ph
from ..profiling.phases import Phases
from ..profiling.session import StepProfiler
from ..setup.config import TrainConfig, threads_per_worker
from ..setup.job import Job
from ..state.checkpoint import decode_state
from ..state.layouts import layout_for
from ..state.slices import StateLost
from ..state.uploader import StateUploader
from ..step.data import (
    EpochShuffledBatches,
    Loader,
    PrefetchLoader,
    fetch,
    first_of,
    is_batch_level,
    is_sample_list,
    loader_threads,
    own_shuffle,
    reads_at_once,
)
from ..step.digest import check_due, state_fingerprint
from ..step.loop_state import LoopState
from ..step.member_steps import MemberSteps
from ..step.metrics import stat_means, validation_means
from ..step.plan import (
    MicroBatchSeeds,
    Plan,
    Schedule,
    eval_batches,
    eval_segment_batches,
)
from ..step.sample_seeds import VALIDATION, SampleSeeds, SeededReads, global_generators, numpy_generators_of
from ..step.sampling import order_of, weighting_of
from ..streams.reader import StreamedDataset
from ..transport import protocol as p
from ..transport.collective import Collective, CollectiveError
from ..transport.control import Channel
from .inbox import REPORT_WITHIN, Inbox
from .notice import LeaveNotice

log = logging.getLogger(__name__)


#: Step reports a worker keeps for a driver that comes back (at most this many steps uncommitted
#: when the driver vanished are recorded from them; older ones are committed with inferred shares).
REPORTS_KEPT = 1024


#: The loop's parts of a step that a profile window's named ranges time (profiling/phases.py,
#: ``Phases.follow``): outside a window they run as they are, with no ``with`` on the step's path.
STEP_RANGES = {"_step": ph.STEP, "_next_batch": ph.DATA, "_all_reduce": ph.REDUCE, "_report": ph.REPORT}


class WorkerLeft(Exception):
    """This worker left the job after a step, told to by a preemption signal (worker/notice.py)."""


class TrainingLoop:
    """Runs the schedule to its end as a member of successive generations."""

    def __init__(
        self,
        job: Job,
        config: TrainConfig,
        plan: Plan,
        channel: Channel,
        inbox: Inbox,
        collective: Collective,
        datasets: tuple[Any, Any],
        context: WorkerContext,
        notice: LeaveNotice | None = None,
        threads: int | None = None,
        own_threads: Callable[[], int] | None = None,
    ) -> None:
        self.job, self.config, self.plan = job, config, plan
        self.check_steps = config.replica_check_steps  # replicas compare fingerprints every this many steps
        self.adapter = job.adapter
        self.channel, self.inbox, self.collective = channel, inbox, collective
        self.train_set, self.test_set = datasets
        # Items are addressed as epoch * len + item, so each epoch draws its own sample order
        # (a sharded dataset's too: its epochs read the shards in different orders).
        self._epoch_items = own_shuffle(self.train_set) or isinstance(self.train_set, StreamedDataset)
        if own_shuffle(self.train_set):
            generators = [*global_generators(), *numpy_generators_of(self.train_set)]
            generators += self.adapter.read_generators(self.train_set)
            self.train_set = EpochShuffledBatches(self.train_set, plan.seed, SampleSeeds(plan.seed, generators))
        # Each epoch's order and each micro-batch's weight in its step: the plan's, or the
        # dataset's own (step/sampling.py).
        self.order = order_of(self.train_set, plan)
        self.weighting = weighting_of(self.train_set, plan.num_samples)
        self.context = context
        self._seeded_reads: dict[int, SeededReads] = {}  # by dataset: step/sample_seeds.py
        # This worker's core budget (its intra-op threads): the data loader's threads are a share of it.
        self.cores = threads if threads is not None else threads_per_worker(config.sizing.max_workers)
        # A hand-started worker's share of its host, asked again at each generation: every member
        # of one has registered on its host by then (worker/host_share.py).
        self.own_threads = own_threads
        self.notice = notice or LeaveNotice()
        self.leavers = 0  # members that voted to leave after the last step
        self.voted_leave = False  # this worker among them (a notice that came after its vote waits a step)
        self.recovery_timeout = config.timeouts.recovery
        self.schedule = Schedule(plan, config.epochs, config.validation_freq, self.test_set is not None)
        self.next_unit = 0
        # The last epoch end this worker ran, and whether the save branch due there ran here (or
        # none was due): what Finished tells the driver (docs/architecture.md, "User errors").
        self.end_epoch, self.end_saved = -1, True
        self.entered_once = False  # it entered a generation: its state is the run's (worker/reattach.py)
        self.iterations = 0  # steps this worker took part in
        # Its latest step reports, rank 0's sent, every member's kept: sent with its position when
        # it leaves a generation (rank 0 may have died before sending the last), and to a driver
        # that comes back after vanishing (docs/elasticity.md, "A lost driver").
        self.sent_reports: collections.deque[p.StepDone] = collections.deque(maxlen=REPORTS_KEPT)
        self._seeds = MicroBatchSeeds(plan)  # micro_batch_seed, a block of steps at a time
        self._steps = MemberSteps(plan, 0, 1)  # this member's micro-batches a step (each generation's: _run_generation)
        self.hooks = job.hooks
        # The scheduler, the epoch's sums and the callbacks' state: they travel with the optimizer state.
        self.loop_state = LoopState(self.adapter.stat_names, job.lr_scheduling, self.hooks.callbacks)
        # Asked once: the metrics a logger would get are not computed each step for nobody.
        self._logs_train = self.hooks.defines("log_train_metrics")
        self._logs_test = self.hooks.defines("log_test_metrics")
        # Rank 0 uploads checkpoints and snapshots to the driver (state/uploader.py).
        self.uploads = StateUploader(channel, self.schedule, config)
        inbox.on_written = self.uploads.confirmed  # the driver's word that a checkpoint is on disk
        # Named ranges of the step, free unless this worker profiles (train(profile=...): profiling/).
        self.phases = self.adapter.phases = Phases()
        # The step's parts that are another object's method, held bound (STEP_RANGES).
        self._next_batch: Callable[[Iterator[Any]], Any] = next  # a micro-batch from the loader
        self._all_reduce: Callable[[Collective], None] = self.adapter.all_reduce
        self.phases.follow(self, STEP_RANGES)
        device = str(getattr(collective, "device", "cpu"))
        self.profiler = StepProfiler(config.profile, self.phases, channel, device, context.worker_id)
        # What this worker holds of the state and how it moves (state/layouts.py): replicated, or
        # with train(shard_optimizer_state=True) its slices of the optimizer state
        # (docs/elasticity.md, "Sharded optimizer state").
        self.layout = layout_for(config)
        self.layout.attach(self.adapter, self.loop_state)
        context.state_bytes = self.layout.state_bytes
        context.grad_bytes = self.adapter.gradient_bytes

    # -- generations ----------------------------------------------------------------------
    def run_joined(self) -> None:
        """Train from the position of the generation entered (``enter``) to the schedule's end.
        Raises :class:`~fabric_model.worker.inbox.TrainingHalted` when the driver asks for the
        state in place of a next generation (replicas diverged)."""
        self.hooks.on_train_begin()
        while True:
            try:
                self._run_generation()
                if self.next_unit >= self.schedule.total_units:
                    self.layout.finish(self.collective)  # the user's optimizer holds the whole state
                    break
                if self.voted_leave or self.leavers >= self.collective.world_size:
                    self._leave()  # does not return (every member leaves when one voted to stop)
                failed, reason = False, "switch"
            except CollectiveError as exc:
                self.adapter.abort_step()
                failed, reason = True, str(exc).splitlines()[0][:300]
            self.profiler.close(partial=True)  # a window this generation left open ends here
            self.collective.shutdown()
            self.channel.send(self.position(failed, reason))
            self._reenter()
        self.hooks.on_train_end()

    def _reenter(self) -> None:
        """Enter the driver's next generation; a failure while entering waits for the one after."""
        while True:
            generation = self.inbox.expect(p.EnterGeneration, self.recovery_timeout)
            if generation.generation <= self.collective.generation:
                continue  # a late answer for a generation already left
            try:
                self.enter(generation)
                return
            except CollectiveError as exc:
                self.collective.shutdown()
                self.channel.send(self.position(True, str(exc).splitlines()[0][:300]))

    def _leave(self) -> None:
        """Leave the job after the step the generation voted to end at (docs/architecture.md,
        "Preemption"): when every member leaves, rank 0 first hands the driver the state, so no
        committed step is lost; then the position, marked as leaving, and exit 0."""
        collective = self.collective
        if self.leavers >= collective.world_size and self.layout.takes_part_in_uploads(collective.rank):
            self._upload("snapshot")  # a sharded state: every member hands its slices to rank 0's
            self.uploads.flush(self.notice.grace)
        collective.shutdown()
        reason = f"leaves ({self.notice.signal_name or self.inbox.stop_together})"
        left = p.LeftGeneration(collective.generation, self.next_unit, False, reason, True, self._last_report())
        self.channel.send(left)
        raise WorkerLeft(reason)

    def position(self, failed: bool, reason: str = "") -> p.LeftGeneration:
        """How far this worker got in the generation it leaves."""
        return p.LeftGeneration(self.collective.generation, self.next_unit, failed, reason, last=self._last_report())

    def _last_report(self) -> p.StepDone | None:
        """This member's copy of the report of the last step it finished in its generation."""
        last = self.sent_reports[-1] if self.sent_reports else None
        return last if last is not None and last.generation == self.collective.generation else None

    def enter(self, generation: p.EnterGeneration) -> None:
        """Join ``generation``; take the agreed state from its source member when told to."""
        started = time.monotonic()
        self.collective.configure(generation.generation, generation.rank, generation.world_size)
        formed = time.monotonic()
        self.context.generation = generation.generation
        self.context.rank, self.context.world_size = generation.rank, generation.world_size
        if self.own_threads is not None:
            self.cores = self.own_threads()
            self.adapter.resize_threads(self.cores)
        source = generation.source_rank
        restore = generation.checkpoint.restore
        if generation.state is not None:  # a resumed run, or no holder of the state left: all load it
            state = decode_state(generation.state, self.plan, str(restore))
            if state["unit"] != generation.resume_unit:
                raise RuntimeError(f"{restore} holds unit {state['unit']}, not {generation.resume_unit}")
            self.layout.load(state, generation.resume_unit)  # complete, from the driver
        self.uploads.entered(generation.checkpoint, generation.resume_unit, generation.world_size)
        if generation.rank == 0:  # a checkpoint a vanished driver never wrote (state/uploader.py)
            self.uploads.send_unconfirmed(generation.generation, generation.checkpoint.written)
        self.notice.holds_state = True  # from here a notice to leave waits for a step boundary
        try:  # the members that lack the agreed state take it (from ``source``, or by slices)
            self.layout.enter(self.collective, source, generation.resume_unit, self._held_unit(generation))
        except StateLost as exc:
            self._leave_incomplete(exc)
        self.next_unit = generation.resume_unit
        self.entered_once = True
        # A callback that stopped training at the step a switch followed stops the new generation
        # before it steps: a joiner's copy of the callback says so too (its state_dict travels with
        # the state, step/loop_state.py), so every member ends alike.
        self._stopping()
        # What entering took, for the run's start-up record (run/startup.py).
        self.entered_in = {"group formed": formed - started, "state loaded or pulled": time.monotonic() - formed}
        log.info(
            "generation %d: rank %d/%d at unit %d (group %.3f s, state %s %.3f s)",
            generation.generation,
            self.collective.rank,
            self.collective.world_size,
            self.next_unit,
            formed - started,
            "pulled" if source >= 0 else ("loaded" if generation.state is not None else "kept"),
            time.monotonic() - formed,
        )

    def _leave_incomplete(self, exc: StateLost) -> None:
        """No member holds part of the sharded state (an owner and its buddy were lost together):
        this worker's state is of no use. It leaves the job as a preempted worker does; its slot
        is filled by a fresh worker, and with every member gone the driver goes on from its newest
        saved state, as when every holder is lost (docs/elasticity.md, "Sharded optimizer state")."""
        log.warning("%s; leaving, for a fresh worker to take this slot", exc)
        self.collective.shutdown()
        reason = "leaves (the sharded optimizer state is incomplete)"
        self.channel.send(p.LeftGeneration(self.collective.generation, -1, False, reason, True))
        raise WorkerLeft(f"{reason}: {exc}") from exc

    def _held_unit(self, generation: p.EnterGeneration) -> int:
        """The unit whose state this member holds entering ``generation``: a state just loaded,
        its own from the generations it was in, or, fresh, the job's initial state: the state of
        unit 0, and of no later unit (-1)."""
        resume = generation.resume_unit
        if generation.state is not None:
            return resume
        return self.next_unit if self.entered_once else (0 if resume == 0 else -1)

    def _upload(self, kind: str) -> None:
        """Rank 0's ``kind`` of the state before ``next_unit`` to the driver (state/uploader.py).
        A sharded optimizer state is gathered from every member first (each calls this)."""
        self.layout.upload(kind, self.next_unit, self.collective, self.uploads)

    def fingerprint(self) -> dict[str, int]:
        """Per tensor, a fingerprint of this replica's state: the model's, the optimizer's and the loop's."""
        return {**self.adapter.state_fingerprint(), **state_fingerprint(self.loop_state.state(), "loop")}

    def _send_fingerprint(self, step: int) -> None:
        """Every ``check_steps`` steps and after each epoch's last, each member of a generation of
        several sends its state's fingerprint; the driver compares them (docs/architecture.md,
        "Replica checks"). Only then: it reads every tensor once."""
        collective = self.collective
        if collective.world_size < 2:  # a lone worker has no replica to compare with
            return
        last_of_epoch = step == self.plan.steps_per_epoch - 1
        if not check_due(self.context.global_step, last_of_epoch, self.check_steps):
            return
        with self.phases(ph.FINGERPRINT):
            message = p.Fingerprint(
                collective.generation, self.next_unit, collective.rank, collective.world_size, self.fingerprint()
            )
            self.channel.send(message)

    def _upload_due(self, kind: str) -> None:
        """Upload the ``kind`` due before ``next_unit`` (``StateUploader.kind_due``: rank 0's; a
        sharded state is gathered by every member, all deciding alike: uploader.py, ``agreed``)."""
        with self.phases(ph.CHECKPOINT if kind == "checkpoint" else ph.SNAPSHOT):
            self._upload(kind)

    # -- one generation -------------------------------------------------------------------
    def _run_generation(self) -> None:
        """Run units until the schedule ends or the members agree to switch generation."""
        loader = self._loader_for(self.train_set)
        self._steps = MemberSteps(self.plan, self.collective.rank, self.collective.world_size)
        try:
            batches = loader.iterate(self._micro_batches(self.next_unit))
            phases, profiler, per_epoch = self.phases, self.profiler, self.plan.steps_per_epoch
            hooks, uploads, collective = self.hooks, self.uploads, self.collective
            # Decided once a generation, not asked each step (docs/architecture.md, "What a step
            # costs beyond the math"): the hooks no object defines are not dispatched, a run
            # without a profile window never asks the profiler, a lone worker has no replica to
            # compare fingerprints with, and this member's part in uploads is its rank's.
            epoch_begins = hooks.dispatches("on_epoch_begin")
            batch_begins, batch_ends = hooks.dispatches("on_batch_begin"), hooks.dispatches("on_batch_end")
            profiling = self.config.profile is not None
            replicas = collective.world_size > 1
            upload_rank = self.layout.upload_rank(collective.rank)
            while self.next_unit < self.schedule.total_units:
                epoch, step = self.schedule.locate(self.next_unit)
                if profiling and step is not None:  # a profile window opens at its first step (profiling/)
                    profiler.step_begins(epoch * per_epoch + step, collective.rank, collective.world_size)
                kind = uploads.kind_due(self.next_unit, upload_rank)  # (all replicas are identical)
                if kind is not None:
                    self._upload_due(kind)
                if step is None:
                    with phases(ph.VALIDATION):
                        val_stats = self._validate(epoch) if self.schedule.validation_due(epoch) else None
                    self.next_unit += 1
                    with phases(ph.CALLBACKS):
                        stopped = self._end_epoch(epoch, val_stats)
                    if stopped:
                        return
                    continue
                if batch_begins or (epoch_begins and step == 0):
                    with phases(ph.CALLBACKS):
                        if step == 0:
                            hooks.on_epoch_begin(epoch)
                        hooks.on_batch_begin(step)
                switch = self._step(epoch, step, batches)
                self.next_unit += 1
                if batch_ends:
                    with phases(ph.CALLBACKS):
                        hooks.on_batch_end(step)
                failure = self.adapter.failure_after_step()
                if failure is not None:  # the step is done here; the generation is not (worker/loop.py docstring)
                    raise failure
                if replicas:
                    self._send_fingerprint(step)
                if profiling:
                    profiler.step_ends(epoch * per_epoch + step)
                if self._stopping() or switch:  # (a stop is decided before a switch leaves)
                    return
        finally:
            loader.close()

    def _end_epoch(self, epoch: int, val_stats: list[float] | None) -> bool:
        """Keras' ``on_epoch_end(epoch, logs)``, after validation, then an epoch scheduler's step;
        returns whether a callback stopped training."""
        logs = self.loop_state.epoch_logs(epoch, val_stats)
        # IBM's save_model: at the epochs whose end writes the model, in one worker (rank 0, which
        # uploads it), so that a callback exporting the model there writes it once.
        freq = self.config.checkpoint_freq
        saves = epoch == self.config.epochs - 1 or (freq > 0 and (epoch + 1) % freq == 0)
        self.end_epoch, self.end_saved = epoch, not saves or self.collective.rank == 0
        self.hooks.on_epoch_end(epoch, logs, save_model=saves and self.collective.rank == 0)
        self.loop_state.epoch_done(logs)
        return self._stopping()

    def _stopping(self) -> bool:
        """Every replica decides alike (same logs, same carried state): all skip to the schedule's
        end after the same unit, and the driver sees them finish (docs/architecture.md, "Training features")."""
        if not self.loop_state.should_stop(self.adapter.model):
            return False
        log.info("a callback stopped training at unit %d", self.next_unit)
        self.next_unit = self.schedule.total_units
        return True

    def _loader_for(self, dataset: Any, validation: bool = False) -> Loader:
        """Reads ``dataset``'s micro-batches: in one gather where the framework can, and with
        the loader threads the user asked for, else a share of this worker's cores (step/data.py);
        every sample a user's code reads after its seeds are set (step/sample_seeds.py)."""
        batch_level = is_batch_level(dataset) or isinstance(dataset, EpochShuffledBatches)
        collate: Callable[[Any], Any] = first_of if batch_level else self.adapter.collate
        reader = None if batch_level else self.adapter.reader(dataset)
        at_once = reads_at_once(dataset, reader) or batch_level
        threads = loader_threads(self.config.num_dataloader_threads, reads_at_once(dataset, reader), self.cores)
        if isinstance(dataset, StreamedDataset):
            # A stream is read front to back: one thread reads ahead, in the plan's order.
            threads = min(threads, 1) if self.config.num_dataloader_threads is not None else 1
        if reader is not None or (is_sample_list(dataset) and self.adapter.own_collate):
            return PrefetchLoader(dataset, collate, threads, reader)  # no user code reads: none draws
        seeded = self._seeded_reads.get(id(dataset))
        if seeded is None:  # one per dataset: its first read, made once, says where the rest run
            seeds = SampleSeeds(
                self.plan.seed,
                [*global_generators(), *numpy_generators_of(dataset), *self.adapter.read_generators(dataset)],
            )
            whole: Callable[[np.ndarray], Any] | None = None
            if at_once:
                whole = reader if reader is not None else functools.partial(fetch, dataset, collate=collate)
            seeded = SeededReads(seeds, None if at_once else dataset.__getitem__, whole, collate)
            self._seeded_reads[id(dataset)] = seeded
        epoch_of = _validation_epoch if validation else _training_epoch
        processes = self.config.num_dataloader_processes
        if processes and not isinstance(dataset, StreamedDataset):  # a stream's cursors are this process's
            loader = self.adapter.process_loader(dataset, seeded, processes, epoch_of)
            if loader is not None:
                return loader
        return PrefetchLoader(dataset, collate, threads, reader, seeded, epoch_of)

    def _check_abort(self) -> None:
        """Leave a long step or validation early when the driver ends this generation."""
        if self.inbox.abort_generation >= self.collective.generation:
            raise CollectiveError(f"generation {self.collective.generation} aborted by the driver")

    def _abortable(self, batches: Iterator[tuple[Hashable, np.ndarray, Any]]) -> Iterator[tuple[np.ndarray, Any]]:
        for _, indices, batch in batches:
            self._check_abort()
            yield indices, batch

    def _micro_batches(self, start_unit: int) -> Iterator[tuple[Hashable, np.ndarray]]:
        """The micro-batches this member computes, in order, from ``start_unit`` on."""
        steps = self._steps
        perm: np.ndarray | None = None
        perm_epoch = -1
        for unit in range(start_unit, self.schedule.total_units):
            epoch, step = self.schedule.locate(unit)
            if step is None:
                continue
            if epoch != perm_epoch and not self.plan.sharded_data:  # sharded data draws its own order
                perm, perm_epoch = self.order.permutation(epoch), epoch
            for j in steps.full if step < steps.full_steps else steps.mine(epoch, step):
                indices = self.plan.micro_batch_indices(epoch, step, j, perm)
                yield (epoch, step, j), indices + epoch * self.plan.num_samples if self._epoch_items else indices

    def _step(self, epoch: int, step: int, batches: Iterator[tuple[Hashable, np.ndarray, Any]]) -> bool:
        """One step; returns whether the members voted to switch generation after it. (In a
        profile window, the ``fabric_model/step`` range: STEP_RANGES.)"""
        plan, adapter, collective, next_batch = self.plan, self.adapter, self.collective, self._next_batch
        self.context.epoch, self.context.step = epoch, step
        self.context.global_step = epoch * plan.steps_per_epoch + step
        step_weight = self.weighting.step_total(plan, self.order, epoch, step)
        weigh = self.weighting.micro
        steps = self._steps
        mine = steps.full if step < steps.full_steps else steps.mine(epoch, step)
        inbox, generation = self.inbox, collective.generation
        adapter.begin_step(collective)
        for position, j in enumerate(mine):
            if inbox.abort_generation >= generation:  # (_check_abort's test, without its call)
                self._check_abort()
            key, indices, batch = next_batch(batches)
            assert key == (epoch, step, j), f"loader out of order: {key} != {(epoch, step, j)}"
            seed = self._seeds(epoch, step, j)
            adapter.train_micro_batch(batch, weigh(indices), step_weight, seed, last=position == len(mine) - 1)
        # The micro-batch count and the switch vote ride in the same allreduce, so every
        # member reads the same sums. A lone worker sums nothing: its count is its own
        # (``_step_done``), and a tensor write a step is a tenth of a null step's overhead.
        if collective.world_size > 1:
            adapter.count_micro_batches(len(mine))
        stopping = self.inbox.stop_together is not None  # the job stops: every member leaves
        leaving = self.voted_leave = self.notice.requested or stopping
        if leaving or self.inbox.pending_generation > collective.generation:
            adapter.vote_switch(leaving, stopping)
        # A sharded state's snapshot: rank 0's clock decides for every member (state/uploader.py).
        if self.uploads.agreed and collective.rank == 0 and self.uploads.snapshot_due(self.next_unit + 1):
            adapter.vote_snapshot()
        self._all_reduce(collective)
        result = adapter.finish_step()
        return self._step_done(epoch, step, mine, result)

    def _step_done(self, epoch: int, step: int, mine: Any, result: Any) -> bool:
        """The step's stats into the loop's sums, its report, the loggers; returns the switch vote."""
        adapter, collective = self.adapter, self.collective
        stats, switch, self.leavers = result.stats, result.switch, result.leaving
        self.uploads.voted = result.snapshot
        self.loop_state.step_done(epoch, stats)
        self.iterations += 1
        report = p.StepDone(
            collective.generation,
            epoch,
            step,
            collective.rank,
            collective.world_size,
            tuple(mine),
            tuple(stats),
            result.micro_batches if collective.world_size > 1 else len(mine),
            result.grad_norm,
        )
        self._report(report)
        if self._logs_train:
            with self.phases(ph.CALLBACKS):
                metrics = stat_means(adapter.stat_names, stats)
                self.hooks.log_train_metrics(metrics, self.iterations, epoch, collective.world_size)
        return switch

    def _report(self, report: p.StepDone) -> None:
        """Rank 0 reports the step for its generation, every member keeps its copy: one message a
        step, not one a member (docs/architecture.md, "Scale")."""
        self.sent_reports.append(report)
        if self.collective.rank != 0:
            return
        if self.collective.world_size == 1:
            # A lone worker's fast steps share frames (docs/architecture.md, "What a step costs
            # beyond the math"). Held reports go out before any state this worker uploads, so
            # the driver never holds a state past the steps it knows of: losing them at a
            # SIGKILL costs their records only, which a rollback redoes.
            self.channel.send_soon(report, within=REPORT_WITHIN)
        else:
            self.channel.send(report)

    def _validate(self, epoch: int) -> list[float]:
        adapter, collective = self.adapter, self.collective
        loader = self._loader_for(self.test_set, validation=True)
        try:
            # A batch-level dataset's items are batches already: one item per evaluation batch.
            chunk = 1 if is_batch_level(self.test_set) else self.config.batch_size
            batches_of = eval_segment_batches if isinstance(self.test_set, StreamedDataset) else eval_batches
            chunks = batches_of(len(self.test_set), chunk, collective.rank, collective.world_size)
            batches = loader.iterate((i, idx) for i, idx in enumerate(chunks))
            sums = adapter.evaluate_batches(self._abortable(batches))
        finally:
            loader.close()
        reduced = sums.to(collective.device)  # where the collective reduces (NCCL: the GPU)
        collective.all_reduce_sum(reduced)
        stats = reduced.cpu().tolist()
        # Every rank reports: if rank 0's allreduce failed where others' succeeded, the
        # validation still counts (the driver keeps the first report of an epoch).
        self.channel.send(p.EvalDone(epoch, tuple(stats)))
        if self._logs_test:
            self.hooks.log_test_metrics(validation_means(adapter.stat_names, stats), self.iterations, epoch)
        return stats


def _training_epoch(key: Hashable) -> int:
    return int(key[0])  # type: ignore[index]  # the training schedule's keys: (epoch, step, j)


def _validation_epoch(key: Hashable) -> int:
    return VALIDATION
