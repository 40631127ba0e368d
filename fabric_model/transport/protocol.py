"""The control-plane protocol: every message between the driver and its workers.

Each message is a frozen dataclass, sent as it is over the authenticated channel of
:mod:`fabric_model.transport.control` and dispatched by its type on arrival. Nothing is unpickled
before the peer has proven it holds the job's secret (docs/architecture.md, "The protocol").

A worker's life in messages::

    worker                           driver
    Hello ------------------------->
          <------------------------- Assigned (only when the worker had no id)
          <------------------------- JobSpec
    Ready ------------------------->                 (set up: job, datasets, device)
          <------------------------- EnterGeneration (rank, world size, where to resume)
    StepDone / EvalDone / Heartbeat / StateChunk / ProfilePart ...
    Fingerprint ------------------->                 (every N steps, in a generation of several)
          <------------------------- JoinPending     (vote to switch after a step)
          <------------------------- Abort           (a member was lost: give up collectives)
    LeftGeneration ---------------->                 (how far it got), then EnterGeneration again
    Finished ---------------------->
          <------------------------- SendFinalState
    FinalState -------------------->
          <------------------------- Stop
    WorkerFailed (at any time: an exception, with its traceback)

Replicas that diverged (their fingerprints differ) end training early: the driver sends the
members ``Abort`` and rank 0 ``SendFinalState``, which rank 0 answers with ``FinalState`` in
place of entering a next generation; then ``Stop``. A driver told to go does the same, unless
the optimizer state is sharded: then it sends every member ``StopTogether``, and they vote to
leave after the same step, rank 0 uploading the state gathered from their slices.

A second connection, opened with ``StoreOpen``, carries the rendezvous store's frames
(:mod:`fabric_model.transport.store.wire`), not these messages.
"""

from __future__ import annotations

import dataclasses
from typing import Any


# -- worker -> driver -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Hello:
    """The first message on a connection. ``worker_id`` None asks the driver to assign one.
    ``held``: a worker whose driver vanished comes back to its successor holding this."""

    worker_id: int | None
    pid: int
    host: str
    held: Held | None = None


@dataclasses.dataclass(frozen=True)
class Held:
    """What a worker whose driver vanished holds when it reaches the restarted driver
    (docs/elasticity.md, "A lost driver").

    ``generation``: the last it entered; ``next_unit``: every unit below it is done in its state;
    ``finished``: it ran the schedule to its end and waits to hand over the final state, having
    sent ``finished_report`` (its :class:`Finished`); ``launched``: a launcher started it on the
    driver's host (it takes a local slot, of its ``device``); ``reports``: its latest step reports,
    whose records the vanished driver may not have written."""

    generation: int
    next_unit: int
    launched: bool
    device: str | None = None
    finished: Finished | None = None
    reports: tuple[StepDone, ...] = ()
    #: The identity of the job it runs (driver/identity.py): a restarted driver whose job differs
    #: does not let it go on with the old code (driver/take_back.py).
    identity: dict[str, str] = dataclasses.field(default_factory=dict)
    #: A checkpoint it uploaded whose writing the vanished driver never confirmed (:class:`Written`),
    #: which it still holds and sends again when it is rank 0 of the next generation; -1: none.
    unconfirmed: int = -1


@dataclasses.dataclass(frozen=True)
class Ready:
    """Set up (job, datasets, device) and waiting to enter a generation; ``attempt`` counts pulls;
    ``phases``: how long the set-up's parts took, ``(name, seconds)`` (run/startup.py)."""

    attempt: int = 1
    phases: tuple[tuple[str, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class Entered:
    """The worker entered ``generation`` (its first): how long forming the group and taking the
    state took, ``(name, seconds)`` (run/startup.py)."""

    generation: int
    phases: tuple[tuple[str, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class LeftGeneration:
    """The worker left ``generation`` at ``next_unit`` (-1: it never entered it).

    ``failed`` False: it stopped after the step its generation voted to switch at;
    True: a collective failed (a peer died or the driver aborted) and the step was undone.
    ``leaving``: it leaves the job now (a preemption signal) and exits; it holds nothing for the
    next generation. ``last``: its copy of the report of the last step it finished in
    ``generation``, which rank 0 may have died before sending (driver/ledger.py)."""

    generation: int
    next_unit: int
    failed: bool
    reason: str = ""
    leaving: bool = False
    last: StepDone | None = None


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    """Sent from a thread at a fixed interval: a frozen process goes silent."""


@dataclasses.dataclass(frozen=True)
class StepDone:
    """Step ``step`` of ``epoch`` finished in a generation of ``world_size``: ``stats`` are the
    step's stat sums (loss, metrics..., sample count) and ``computed`` the micro-batches computed,
    both reduced over every member; ``micro_batches`` those rank ``rank`` computed. Rank 0 alone
    sends it, for the whole generation; every member keeps its own copy (docs/architecture.md,
    "Scale")."""

    generation: int
    epoch: int
    step: int
    rank: int
    world_size: int
    micro_batches: tuple[int, ...]
    stats: tuple[float, ...]
    computed: int
    grad_norm: float | None = None  # the gradient's norm before clipping (gradient_clip_norm=)


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """Rank ``rank`` of ``world_size`` holds a state whose tensors fingerprint to ``tensors``
    (name -> :func:`~fabric_model.step.digest.tensor_fingerprint`) with every unit below
    ``unit`` done; the driver compares the members' (docs/architecture.md, "Replica checks")."""

    generation: int
    unit: int
    rank: int
    world_size: int
    tensors: dict[str, int] = dataclasses.field(repr=False)


@dataclasses.dataclass(frozen=True)
class Batch:
    """Messages sent in one frame, in order: a worker's step reports of fast steps, held back
    briefly so that the driver is woken once for several (``Channel.send_soon``)."""

    messages: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class EvalDone:
    """A validation's reduced stat sums (loss, metrics..., count)."""

    epoch: int
    stats: tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class Finished:
    """The schedule is done; ``digest`` (a SHA-256) and ``fingerprint`` (per tensor, to name
    what differs) fingerprint the replica's weights and optimizer state. ``saved``: the save
    branch due at its last epoch's end ran here (it was rank 0), or none was due."""

    digest: str
    next_unit: int
    fingerprint: dict[str, int] = dataclasses.field(default_factory=dict, repr=False)
    saved: bool = True


@dataclasses.dataclass(frozen=True)
class FinalState:
    """The trained state, sent by the one worker the driver asks (a finished one; rank 0 when
    replicas diverged), with every unit below ``unit`` done; ``omitted``: the frozen parameters
    left out, which hold the job's values (the driver fills them in)."""

    model_state: dict[str, Any]
    optimizer_state: dict[str, Any]
    unit: int = -1
    omitted: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class WorkerFailed:
    """An exception in the worker. ``exception`` is the cloudpickled exception (None if it
    does not pickle); ``collective`` marks failures that are not the user's code's; ``unit`` is
    the worker's position when it failed (-1 before it trained): past the last step, nothing
    would redo the failed code."""

    traceback: str
    exception: bytes | None
    collective: bool
    unit: int = -1


# -- driver -> worker -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Assigned:
    """The id the driver gave a worker that connected without one."""

    worker_id: int


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """The job: the cloudpickled :class:`~fabric_model.setup.job.Job`, its configuration (timeouts
    included, resolved once in the caller) and plan, device and threads. The rendezvous store
    is at the address the worker reached the driver at (a :class:`StoreOpen` connection)."""

    payload: bytes
    config: Any  # fabric_model.setup.config.TrainConfig
    plan: Any  # fabric_model.step.plan.Plan
    device: str | None
    threads: int
    #: The threads are the run's, not the host's: ``deterministic=True`` (a GEMM's rounding
    #: depends on them) or a Ray actor's CPUs. A hand-started worker otherwise sizes its own.
    threads_fixed: bool = False
    #: What identifies the job (driver/identity.py), which the worker says again to a restarted driver.
    identity: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Written:
    """The checkpoint of ``unit`` is on disk: the rank that uploaded it may drop the copy it kept
    until then (state/uploader.py), which it would otherwise send again to a restarted driver."""

    unit: int


@dataclasses.dataclass(frozen=True)
class CheckpointSettings:
    """The driver's checkpoint bookkeeping as a generation sees it: the driver's ``checkpoints/``
    (informational: the driver writes the files), the framework, the newest checkpoint the
    driver has, and the name of the state every member loads first (``EnterGeneration.state``)."""

    directory: str
    framework: str
    written: int
    restore: str | None = None


@dataclasses.dataclass(frozen=True)
class EnterGeneration:
    """Enter ``generation`` as ``rank`` of ``world_size`` and resume at ``resume_unit``; the
    member at ``source_rank`` (-1: none) broadcasts the state. ``attempt`` answers a Ready.
    ``state``: the bytes of a checkpoint or snapshot every member loads first (a resumed run, or
    no holder of the state left; docs/architecture.md, "Elasticity"), None to keep its own."""

    generation: int
    rank: int
    world_size: int
    resume_unit: int
    source_rank: int
    checkpoint: CheckpointSettings
    attempt: int = 1
    state: bytes | None = dataclasses.field(default=None, repr=False)


@dataclasses.dataclass(frozen=True)
class JoinPending:
    """A worker waits to join: vote to switch to ``generation`` after the next step."""

    generation: int


@dataclasses.dataclass(frozen=True)
class Abort:
    """A member of ``generation`` was lost: give up that generation's collectives."""

    generation: int


@dataclasses.dataclass(frozen=True)
class StopTogether:
    """The job was told to go (``signal_name``) and its optimizer state is sharded: vote to stop,
    so that every member leaves after the same step, their slices gathered to rank 0's upload
    (docs/elasticity.md, "Sharded optimizer state")."""

    signal_name: str


@dataclasses.dataclass(frozen=True)
class SendFinalState:
    """Send :class:`FinalState`: at the end, or, while training, in place of entering a next
    generation (replicas diverged: training ends with rank 0's state). ``unconfirmed``: first
    send again the checkpoint kept unconfirmed, if any (a restarted driver whose job changed
    takes the state of a worker that waited for it: driver/driver.py). ``save_branch``: first
    run the save branch of the last epoch's end, which no member that finished ran (the one
    that did was lost in it: docs/architecture.md, "User errors")."""

    unconfirmed: bool = False
    save_branch: bool = False


@dataclasses.dataclass(frozen=True)
class Stop:
    """Exit now. A ``reason`` means the driver turned this worker away (a join refused, or a
    worker removed from the job and fenced out): it prints it and exits non-zero. ``ended``
    says how a job that did not finish ended (preempted, interrupted, failed), for the console
    of a worker started by hand: it prints it and exits 0. ``rejoin``: a worker started by hand
    whose job was replaced by a restarted driver's changed one starts again as a new worker of
    that driver (it runs its own command line anew), as its user would have."""

    reason: str = ""
    ended: str = ""
    rejoin: bool = False


# -- worker -> driver: the state, uploaded (docs/architecture.md, "Elasticity", "Run directory") --
@dataclasses.dataclass(frozen=True)
class StateChunk:
    """Part ``index`` of the state of ``unit`` that rank 0 of ``generation`` uploads: ``kind``
    "checkpoint" (the driver writes it to ``checkpoints/``) or "snapshot" (kept in memory).
    The bytes are a checkpoint's dict as :mod:`fabric_model.state.wire` lays it out, cut into
    chunks so that heartbeats and step reports travel between them; ``last`` marks the final
    chunk. ``data`` may be sent as a ``pickle.PickleBuffer`` over a tensor's memory (pickled
    in-band: it arrives as bytes)."""

    generation: int
    unit: int
    kind: str
    index: int
    data: bytes = dataclasses.field(repr=False)
    last: bool


# -- worker -> driver: a profile (docs/training.md, "Profiling") ------------------------------
@dataclasses.dataclass(frozen=True)
class ProfilePart:
    """Part ``index`` of the profile the sender took as rank 0: its torch profiler's Chrome trace,
    gzip-compressed and cut like a state upload; the last part carries ``figures``, what the
    summary is made of (:func:`fabric_model.profiling.summary.render`)."""

    index: int
    data: bytes = dataclasses.field(repr=False)
    last: bool
    figures: dict[str, Any] | None = None


# -- inside the driver ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ConnectionLost:
    """Raised by the driver's reader thread when a worker's connection closes."""

    reason: str


# -- worker -> driver, opening a store connection ----------------------------------------------
@dataclasses.dataclass(frozen=True)
class StoreOpen:
    """The first message on a worker's second connection: it carries rendezvous-store frames
    (:mod:`fabric_model.transport.store.wire`), served to ``worker_id`` while it is a member."""

    worker_id: int


WorkerMessage = (
    Hello | Ready | LeftGeneration | Heartbeat | StepDone | Fingerprint | EvalDone | Finished | FinalState
) | (WorkerFailed | StateChunk | ProfilePart | Entered)
DriverMessage = Assigned | JobSpec | EnterGeneration | JoinPending | Abort | StopTogether | SendFinalState | Stop
