"""The membership state machine, driven in-process: events in, commands out, no processes."""

from __future__ import annotations

import pytest

from fabric_model.driver.commands import (
    AbortGeneration,
    Formed,
    Kill,
    Limits,
    RestorePoint,
    RollBack,
    Send,
    Settle,
    Start,
)
from fabric_model.driver.membership import USER_ERROR_LIMIT, Membership, WorkerState
from fabric_model.errors import JobError
from fabric_model.transport import protocol as p

HEARTBEAT, RECOVERY, START = 10.0, 120.0, 120.0


class FakeCheckpoints:
    """The run's saved states (checkpoints), by unit, without files."""

    def __init__(self, units: tuple[int, ...] = ()) -> None:
        self.units = set(units)

    def restore_point(self, limit: int) -> RestorePoint | None:
        unit = max((u for u in self.units if u <= limit), default=None)
        return None if unit is None else RestorePoint(unit, "checkpoint", f"ckpt-unit-{unit:08d}.pt", b"%d" % unit)

    def has_any(self) -> bool:
        return bool(self.units)

    def settings(self, restore: str | None = None) -> p.CheckpointSettings:
        return p.CheckpointSettings("checkpoints", "torch", max(self.units, default=-1), restore)


def machine(workers: int = 2, checkpoints: tuple[int, ...] = (), replace: bool = True) -> Membership:
    limits = Limits(
        workers, total_units=100, heartbeat=HEARTBEAT, recovery=RECOVERY, start=START, replace_workers=replace
    )
    return Membership(limits, FakeCheckpoints(checkpoints), log_tail=lambda ids: f"logs of {ids}")


def sent(commands, kind) -> dict[int, object]:
    """The messages of ``kind`` the commands send, by worker (an ``AbortGeneration`` sends each member an ``Abort``)."""
    out = {c.worker_id: c.message for c in commands if isinstance(c, Send) and isinstance(c.message, kind)}
    if kind is p.Abort:
        out |= {m: p.Abort(c.generation) for c in commands if isinstance(c, AbortGeneration) for m in c.members}
    return out


def formed(commands) -> Formed:
    (record,) = [c for c in commands if isinstance(c, Formed)]
    return record


def started(workers: int = 2, **kwargs) -> Membership:
    """A machine whose first generation has formed with every slot, at t=0."""
    m = machine(workers, **kwargs)
    m.start(0.0)
    for w in range(workers):
        m.seen(w, 0.0)
        m.ready(w, 1, 0.0)
    return m


def test_start_forms_the_first_generation_once_every_worker_is_ready():
    m = machine(2)
    assert m.start(0.0) == [Start(0, 0), Start(1, 1)]
    assert m.ready(0, 1, 0.5) == []  # worker 1 is still starting
    commands = m.ready(1, 1, 0.6)
    entered = sent(commands, p.EnterGeneration)
    assert {w: (g.generation, g.rank, g.world_size, g.resume_unit, g.source_rank) for w, g in entered.items()} == {
        0: (0, 0, 2, 0, -1),
        1: (0, 1, 2, 0, -1),
    }
    assert commands[0] == Settle(0, -1)  # nothing to settle, but before anyone enters
    assert formed(commands).reason == "start"
    assert m.generation == 0 and m.members == [0, 1]
    assert m.state(0) is WorkerState.MEMBER


def test_start_deadline_goes_with_the_ready_workers_or_fails_with_their_logs():
    m = machine(2)
    m.start(0.0)
    with pytest.raises(JobError, match=r"(?s)no worker became ready within 120 s.*logs of \[0, 1\]"):
        m.tick(START + 1)
    m = machine(2)
    m.start(0.0)
    m.ready(0, 1, 1.0)
    m.seen(0, START + 1)  # heartbeats while it waits
    commands = m.tick(START + 1)
    assert formed(commands).members == (0,) and m.members == [0]


def test_workers_dying_before_they_are_ready_fail_the_start_with_the_last_ones_output():
    """A worker that cannot even start (a broken environment) is no reason to retry for ever."""
    m = machine(2)
    m.start(0.0)
    now, deaths = 0.0, 0
    with pytest.raises(
        JobError,
        match=r"(?s)died before it was ready \(6 starts; the last: process exited with code 1.*logs of \[\d+\]",
    ):
        while deaths < 10:
            for w in m.alive():
                deaths += 1
                m.process_exited(w, 1, now)
            now += 60.0  # past any backoff: the replacements start
            m.tick(now)
    assert deaths == 6


def test_a_pending_worker_does_not_hold_back_the_first_generation():
    m = machine(3)
    m.start(0.0)
    m.placement({2}, 0.2)  # the cluster has room for two workers only
    m.ready(0, 1, 1.0)
    commands = m.ready(1, 1, 1.1)
    assert formed(commands).members == (0, 1) and m.state(2) is WorkerState.STARTING
    # Placed later, it joins through the vote, as any newcomer does.
    m.placement(set(), 30.0)
    commands = m.ready(2, 1, 35.0)
    assert sent(commands, p.JoinPending) == {0: p.JoinPending(1), 1: p.JoinPending(1)}


def test_a_pending_worker_counts_against_no_start_bound_until_it_is_placed():
    m = machine(2)
    m.start(0.0)
    m.placement({0, 1}, 0.1)
    assert m.tick(START * 3) == []  # nothing failed: the cluster has no room yet
    m.placement({1}, START * 3 + 1)  # worker 0 got a place: its bound starts now
    assert m.tick(START * 4) == []
    with pytest.raises(JobError, match=r"(?s)no worker became ready within 120 s.*logs of \[0\]"):
        m.tick(START * 4 + 2)


def test_a_request_that_was_never_placed_is_no_crash_and_its_backoff_does_not_grow():
    def starts(now):
        m.seen(0, now)  # the member keeps talking
        return [c for c in m.tick(now) if isinstance(c, Start)]

    m = started(2)
    m.lost(1, "process exited with code -9", 10.0)  # a first crash: slot 1 is restarted at once
    now = 10.0
    for _ in range(4):
        now += 1.01
        (start,) = starts(now)
        m.placement({start.worker_id}, now)  # no room for it
        m.process_exited(start.worker_id, -9, now)  # the node it was bound for went away
        assert not starts(now + 0.9)  # asked for again after 1 s, not 2, 4, 8 s
    now += 1.01
    (start,) = starts(now)
    m.process_exited(start.worker_id, 1, now)  # placed, then crashed: that one counts
    assert not starts(now + 1.5) and starts(now + 2.01)


def test_a_member_lost_mid_step_aborts_the_others_and_the_survivors_resume_where_they_got():
    m = started(3)
    m.committed(7)
    commands = m.lost(1, "process exited with code -9", 5.0)
    assert Kill(1) in commands
    assert sent(commands, p.Abort) == {0: p.Abort(0), 2: p.Abort(0)}
    assert [c for c in m.tick(5.1) if not isinstance(c, Start)] == []  # the survivors have not reported yet
    m.left(0, p.LeftGeneration(0, 8, failed=True, reason="allreduce failed"), 5.2)
    assert m.tick(5.3) == []
    commands = m.left(2, p.LeftGeneration(0, 7, failed=True, reason="allreduce failed"), 5.4)
    assert sent(commands, p.Abort) == {}  # once per generation
    commands = m.tick(5.5)
    entered = sent(commands, p.EnterGeneration)
    # Worker 0 got one step further (its allreduce completed): the others take its state.
    assert {w: (g.rank, g.world_size, g.resume_unit, g.source_rank) for w, g in entered.items()} == {
        0: (0, 2, 8, 0),
        2: (1, 2, 8, 0),
    }
    assert commands[0] == Settle(8, 0)


def test_a_lost_local_worker_is_replaced_at_once_then_after_a_backoff():
    m = started(2)
    m.lost(1, "process exited with code 1", 10.0)
    assert [c for c in m.tick(10.0) if isinstance(c, Start)] == [Start(1, 2)]  # slot 1, a new id, at once
    assert m.state(2) is WorkerState.STARTING
    m.seen(0, 11.0)
    m.lost(2, "process exited with code 1", 11.0)  # the slot's second crash: 2 s
    assert not [c for c in m.tick(12.9) if isinstance(c, Start)]
    assert [c for c in m.tick(13.01) if isinstance(c, Start)] == [Start(1, 3)]


def test_a_replacement_that_ends_before_it_joins_is_said_on_screen(caplog):
    """A member's loss is said by the display's generation line; a starting worker's changes no
    generation, so its own warning reaches the screen (run/console.py)."""
    from fabric_model.run.console import SAID_BY_THE_DISPLAY

    m = started(2)
    m.lost(1, "process exited with code 1", 10.0)
    assert [c for c in m.tick(10.0) if isinstance(c, Start)] == [Start(1, 2)]
    m.lost(2, "process exited with code 9", 10.5)  # the replacement dies starting
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert [r.getMessage() for r in warnings] == [
        "worker 1 lost: process exited with code 1",
        "worker 2 left before joining: process exited with code 9",
    ]
    assert [r.msg in SAID_BY_THE_DISPLAY for r in warnings] == [True, False]


def test_a_driver_without_local_workers_trains_from_the_first_joiner_on(caplog):
    """``FABRIC_MODEL_LOCAL_WORKERS=0``: nothing starts; a warning each start bound while no
    worker has joined; the first to join forms the first generation, the next joins it."""
    limits = Limits(3, total_units=100, heartbeat=HEARTBEAT, recovery=RECOVERY, start=START, local_slots=0)
    m = Membership(limits, FakeCheckpoints(), log_tail=lambda ids: "")
    assert m.start(0.0) == []
    m.tick(START + 1.0)
    assert "no worker has joined yet: waiting for workers started by hand (join.json)" in caplog.text
    m.seen(7, START + 2.0)
    assert formed(m.ready(7, 1, START + 2.0)).members == (7,)
    m.seen(8, START + 3.0)
    assert sent(m.ready(8, 1, START + 3.0), p.JoinPending) == {7: p.JoinPending(1)}  # joins the running job


def test_a_frozen_member_is_removed_after_the_heartbeat_bound():
    """Silence is judged from the messages handled (``seen``) and from what the control server
    heard (``heard``: heartbeats end there), whichever came last."""
    m = started(3)
    m.seen(0, 9.0)  # worker 0 keeps talking, worker 1's heartbeats reach the server only,
    m.heard = {1: 9.0, 2: 0.0}  # worker 2 went silent at t=0
    commands = m.tick(HEARTBEAT + 0.5)
    assert Kill(2) in commands and sent(commands, p.Abort) == {0: p.Abort(0), 1: p.Abort(0)}
    assert m.state(2) is WorkerState.GONE and m.state(0) is m.state(1) is WorkerState.MEMBER


def test_a_join_is_voted_and_the_newcomer_pulls_the_state():
    m = machine(2, replace=False)
    m.start(0.0)
    m.ready(0, 1, 0.0)
    m.lost(1, "process exited with code 1", 0.5)  # slot 1 failed to start
    m.tick(1.0)
    assert m.members == [0]
    m.seen(7, 20.0)  # a worker started by hand
    commands = m.ready(7, 1, 20.0)
    assert sent(commands, p.JoinPending) == {0: p.JoinPending(1)}
    m.seen(0, 21.0)
    commands = m.left(0, p.LeftGeneration(0, 30, failed=False, reason="switch"), 21.0)
    assert sent(commands, p.Abort) == {}  # a voted switch aborts nothing
    entered = sent(m.tick(21.1), p.EnterGeneration)
    assert {w: (g.rank, g.resume_unit, g.source_rank) for w, g in entered.items()} == {0: (0, 30, 0), 7: (1, 30, 0)}


def test_a_member_told_to_go_leaves_without_an_abort_and_the_others_go_on_from_the_same_unit():
    """docs/architecture.md, "Preemption": the leaver is gone (nothing to kill, nothing aborted),
    the others resume where all stopped with no state moved, and the slot comes back later."""
    m = started(3)
    m.seen(0, 5.0)
    m.seen(2, 5.0)
    switch = p.LeftGeneration(0, 12, failed=False, reason="switch")
    assert m.left(0, switch, 5.0) == []  # a peer's report may come first
    commands = m.left(1, p.LeftGeneration(0, 12, False, "leaves (SIGTERM)", leaving=True), 5.0)
    assert commands == [] and m.state(1) is WorkerState.GONE
    m.left(2, switch, 5.0)
    commands = m.tick(5.1)
    assert not [c for c in commands if isinstance(c, (Kill, AbortGeneration, RollBack))]
    record = formed(commands)
    assert record.members == (0, 2) and record.resume_unit == 12 and record.source_rank == -1
    assert record.reason == "worker 1 leaves (SIGTERM)"
    # Its local slot is asked for again after the slot's backoff, not at once (a notice, not a crash).
    assert not [c for c in commands if isinstance(c, Start)]
    m.seen(0, 6.2)
    m.seen(2, 6.2)
    assert [c for c in m.tick(6.2) if isinstance(c, Start)] == [Start(1, 3)]


def test_a_generation_names_every_worker_that_left_or_was_lost_not_the_peer_that_reported_first():
    """A peer's report ("worker 0: allreduce failed") often begins a change before the driver
    learns its cause; the next generation names the causes: each lost or leaving worker, and
    the joiners it took in, as the screen shows them (docs/architecture.md, "Elasticity")."""
    m = started(4)
    for w in range(4):
        m.seen(w, 5.0)
    m.left(0, p.LeftGeneration(0, 12, failed=True, reason="allreduce failed"), 5.0)
    m.lost(1, "process exited with code -9", 5.0)
    m.lost(2, "process exited with code -9", 5.1)
    m.seen(9, 5.1)
    m.ready(9, 1, 5.1)  # started by hand, ready while the change is under way: taken in
    m.left(3, p.LeftGeneration(0, 12, failed=True, reason="allreduce failed"), 5.2)
    record = formed(m.tick(5.3))
    assert record.members == (0, 3, 9) and record.subjects == (1, 2, 9)
    assert record.reason == "workers 1, 2 lost: process exited with code -9; worker 9 joins"


def test_workers_that_leave_together_are_named_together_and_a_joiner_without_room_is_not_named():
    m = started(3, replace=False)
    for w in range(3):
        m.seen(w, 5.0)
    m.left(1, p.LeftGeneration(0, 12, False, "leaves (SIGTERM)", leaving=True), 5.0)
    m.left(0, p.LeftGeneration(0, 12, failed=False, reason="switch"), 5.0)
    m.left(2, p.LeftGeneration(0, 12, False, "leaves (SIGTERM)", leaving=True), 5.0)
    record = formed(m.tick(5.1))
    assert (record.members, record.reason, record.subjects) == ((0,), "workers 1, 2 leave (SIGTERM)", (1, 2))
    for w in (7, 8, 9):  # three hand-started workers ready at once: room for two
        m.seen(w, 6.0)
        m.ready(w, 1, 6.0)
    m.seen(0, 6.0)
    m.left(0, p.LeftGeneration(1, 20, failed=False, reason="switch"), 6.0)
    record = formed(m.tick(6.1))
    assert (record.members, record.reason, record.subjects) == ((0, 7, 8), "workers 7, 8 join", (7, 8))


def test_a_join_beyond_engines_number_is_refused():
    m = started(2)
    m.seen(9, 3.0)
    (command,) = m.ready(9, 1, 3.0)
    assert command.worker_id == 9 and "join refused: all 2 slots are taken" in command.message.reason
    assert m.state(9) is WorkerState.GONE
    assert m.seen(9, 3.1) is False  # its later messages are ignored


def replaced_generation(m: Membership, lost_at: float = 5.0) -> list:
    """Every member of a 2-worker machine lost at once; the replacements become ready."""
    m.lost(0, "process exited with code -9", lost_at)
    m.lost(1, "process exited with code -9", lost_at)
    replacements = [c for c in m.tick(lost_at + 0.1) if isinstance(c, Start)]  # a first loss: at once
    assert [c.slot for c in replacements] == [0, 1]
    commands = []
    for c in replacements:
        m.seen(c.worker_id, lost_at + 3)
        commands += m.ready(c.worker_id, 1, lost_at + 3)
    return commands + m.tick(lost_at + 3.1)


def test_every_holder_lost_without_a_saved_state_rolls_back_to_the_start():
    m = started(2)
    m.committed(12)
    commands = replaced_generation(m)
    entered = sent(commands, p.EnterGeneration)
    assert len(entered) == 2 and all(g.resume_unit == 0 and g.state is None for g in entered.values())
    assert commands[:2] == [Settle(0, 0), RollBack(0)]
    assert formed(commands).rolled_back_from == 12 and m.committed_unit == 0


def test_every_holder_lost_with_a_checkpoint_goes_on_from_it():
    m = started(2, checkpoints=(12,))
    m.committed(12)
    commands = replaced_generation(m)
    entered = sent(commands, p.EnterGeneration)
    assert len(entered) == 2
    assert all(g.resume_unit == 12 and g.source_rank == -1 and g.state == b"12" for g in entered.values())
    assert all(g.checkpoint.restore == "ckpt-unit-00000012.pt" for g in entered.values())
    record = formed(commands)
    assert (record.checkpoint, record.restored, record.rolled_back_from) == (
        "ckpt-unit-00000012.pt",
        "checkpoint",
        None,
    )
    assert not any(isinstance(c, RollBack) for c in commands)


def test_every_holder_lost_past_a_checkpoint_rolls_back_to_it():
    m = started(2, checkpoints=(5, 12))
    m.committed(17)
    commands = replaced_generation(m)
    assert all(g.resume_unit == 12 and g.state == b"12" for g in sent(commands, p.EnterGeneration).values())
    assert RollBack(12) in commands and formed(commands).rolled_back_from == 17
    assert m.committed_unit == 12


def test_no_worker_left_and_none_startable_fails_with_the_resume_hint():
    m = started(2, checkpoints=(12,), replace=False)
    m.committed(17)
    m.lost(0, "process exited with code -9", 5.0)
    m.lost(1, "process exited with code -9", 5.0)
    with pytest.raises(JobError, match=r"no worker left .*resume=True"):
        m.tick(5.1)


def test_the_same_user_error_three_times_fails_the_job_with_it():
    m = started(4)
    m.committed(5)
    error = ValueError("bad batch")
    for worker in range(USER_ERROR_LIMIT - 1):
        commands = m.user_error(worker, error, "ValueError: bad batch", 3.0)
        assert Kill(worker) in commands
    with pytest.raises(ValueError, match="bad batch"):
        m.user_error(USER_ERROR_LIMIT - 1, error, "ValueError: bad batch", 3.0)


def test_a_user_error_on_every_worker_at_once_fails_at_once():
    m = started(2)
    error = KeyError("label")
    m.user_error(0, error, "KeyError: 'label'", 1.0)
    with pytest.raises(KeyError):
        m.user_error(1, error, "KeyError: 'label'", 1.0)


def test_the_same_user_error_on_every_member_at_the_same_unit_fails_at_once_whatever_is_committed():
    """A bug in forward at step 5 hits every member there; the committed unit may lag one report
    (the peer's last step report still on its way), so the workers' own units decide."""
    m = started(2)
    m.committed(4)
    error = ValueError("forward cannot take step 5")
    commands = m.user_error(0, error, "ValueError: forward cannot take step 5", 1.0, unit=5)
    assert Kill(0) in commands
    m.committed(5)  # worker 1's report of step 4 arrived after worker 0's failure
    with pytest.raises(ValueError, match="step 5"):
        m.user_error(1, error, "ValueError: forward cannot take step 5", 1.1, unit=5)
    assert m.generation == 0  # no generation formed, nothing rolled back


def test_a_user_error_on_one_member_or_at_different_units_loses_the_worker():
    m = started(3)
    m.committed(5)
    error = ValueError("flaky read")
    assert Kill(0) in m.user_error(0, error, "ValueError: flaky read", 1.0, unit=5)
    assert Kill(1) in m.user_error(1, error, "ValueError: flaky read", 1.0, unit=6)  # another unit: not the same error
    assert m.state(2) is WorkerState.MEMBER


def test_a_user_error_after_the_last_step_fails_at_once():
    """Nothing redoes an end-of-run callback (one worker's export on save_model=True, say): after
    every step is committed, or once a peer finished, one worker's error is the job's."""
    m = started(4)
    m.committed(99)  # total_units=100: the final validation slot is all that is left
    with pytest.raises(ValueError, match="export"):
        m.user_error(0, ValueError("export"), "ValueError: export", 3.0)
    m = started(2)
    m.committed(40)
    m.finished(1, 100)
    with pytest.raises(ValueError, match="export"):
        m.user_error(0, ValueError("export"), "ValueError: export", 3.0)
    m = started(2)
    m.committed(98)  # the peer's report of the last step is still on its way
    with pytest.raises(ValueError, match="export"):
        m.user_error(0, ValueError("export"), "ValueError: export", 3.0, unit=100)  # the worker was past it
    m = started(2)
    m.committed(98)
    assert Kill(0) in m.user_error(0, ValueError("oom"), "ValueError: oom", 3.0, unit=98)  # mid-run: a lost worker


def test_the_end_asks_one_finished_replica_for_the_final_state_and_another_if_it_is_lost():
    m = started(2)
    m.finished(0, 100)
    assert sent(m.tick(1.0), p.SendFinalState) == {}
    m.finished(1, 100)
    assert sent(m.tick(1.1), p.SendFinalState) == {0: p.SendFinalState()}
    assert sent(m.lost(0, "connection lost", 1.2), p.SendFinalState) == {1: p.SendFinalState()}
    late = 1.1 + RECOVERY + 1
    m.seen(1, late)  # alive, but its final state never comes
    with pytest.raises(JobError, match="no final state from worker 1"):
        m.tick(late)


def test_a_survivor_runs_the_save_branch_when_the_member_that_ran_it_was_lost_before_finishing():
    """Rank 0 runs the last epoch's save branch (IBM's export) after its peer finished; lost
    there, the finished peer is asked to run it before it hands over the state."""
    m = started(2)
    m.finished(1, 100, saved=False)  # rank 1: the save branch was rank 0's
    commands = m.lost(0, "process exited with code -9", 1.0) + m.tick(1.1)
    assert sent(commands, p.SendFinalState) == {1: p.SendFinalState(save_branch=True)}
    m = started(2)
    m.finished(1, 100, saved=False)
    m.finished(0, 100, saved=True)  # rank 0 ran it, then was lost: not again
    assert sent(m.lost(0, "connection lost", 1.0) + m.tick(1.1), p.SendFinalState) == {1: p.SendFinalState()}
    m = machine(2)  # a restarted driver knows it from what the workers held
    kept = {w: p.Held(2, 100, True, finished=p.Finished("digest", 100, saved=False)) for w in (1, 2)}
    assert sent(m.rejoined(kept, {}, 0.0), p.SendFinalState) == {1: p.SendFinalState(save_branch=True)}


# -- a restarted driver takes back its vanished predecessor's workers (docs/elasticity.md, "A lost driver")
def test_workers_taken_back_form_a_generation_above_theirs_from_the_furthest_holder():
    m = machine(3)
    held = {0: p.Held(4, 37, launched=True), 6: p.Held(4, 38, launched=False)}
    commands = m.rejoined(held, {0: 0, 6: None}, 0.0)
    record = formed(commands)
    assert (record.generation, record.members, record.resume_unit, record.reason) == (
        5,
        (0, 6),
        38,
        "the driver restarted",
    )
    assert Settle(38, 4) in commands  # steps below 38 completed in generation 4's allreduce
    entered = sent(commands, p.EnterGeneration)
    assert {w: (g.generation, g.rank, g.resume_unit, g.source_rank) for w, g in entered.items()} == {
        0: (5, 0, 38, 1),  # worker 6 (rank 1) holds unit 38 and hands it to worker 0
        6: (5, 1, 38, 1),
    }
    # The free local slots are started afresh, under ids that are nobody's yet; they join by the vote.
    assert m.start(0.0, taken={0}) == [Start(1, 1), Start(2, 2)]
    assert m.allocate_id() == 7  # above every id taken back


def test_workers_taken_back_after_the_schedule_hand_over_the_final_state():
    m = machine(2)
    done = p.Finished("digest", 100)
    commands = m.rejoined({0: p.Held(2, 100, True, finished=done), 1: p.Held(2, 100, True, finished=done)}, {}, 0.0)
    assert not [c for c in commands if isinstance(c, Formed)]
    assert list(sent(commands, p.SendFinalState)) == [0] and m.finishing


def test_survivors_below_a_step_rank_0_reported_redo_it_as_after_a_rollback():
    """Rank 0 reported step 4 (unit 5 committed) and died; the survivor's allreduce of that step
    failed and it undid it, so it holds unit 4: the step is redone, and the ledger is told to
    un-count it (docs/architecture.md, "Scale")."""
    from fabric_model.driver.ledger import CommittedUnit

    committed = CommittedUnit()
    limits = Limits(2, total_units=100, heartbeat=HEARTBEAT, recovery=RECOVERY, start=START, replace_workers=False)
    m = Membership(limits, FakeCheckpoints(), log_tail=lambda ids: "", committed=committed)
    m.start(0.0)
    for w in (0, 1):
        m.ready(w, 1, 0.0)
    committed.advance(5)
    m.lost(0, "process exited with code -9", 1.0)
    commands = m.left(1, p.LeftGeneration(0, 4, failed=True, reason="peer lost"), 1.0)
    commands += m.tick(1.0, heartbeats=False)
    assert [c for c in commands if isinstance(c, (Settle, RollBack))] == [Settle(4, 0), RollBack(4)]
    record = formed(commands)
    assert (record.members, record.resume_unit, record.rolled_back_from) == ((1,), 4, 5)
    assert committed.unit == 4


def test_readiness_counts_every_worker_by_state_as_they_come_and_go():
    """The roster's counts (driver/roster.py) stay those of a scan: 4 slots, 6 workers ready in
    turn, two refused; one lost makes room for the next."""
    m = machine(4, replace=False)
    m.start(0.0)
    for w in range(4):
        m.ready(w, 1, 0.0)
    assert m.members == [0, 1, 2, 3]
    for w in (10, 11):
        m.seen(w, 0.0)
        assert sent(m.ready(w, 1, 0.0), p.Stop)  # every slot taken
        assert m.state(w) is WorkerState.GONE
    m.lost(2, "gone", 1.0)
    m.seen(12, 1.0)
    assert not sent(m.ready(12, 1, 1.0), p.Stop)
    assert m.workers.count(WorkerState.READY) == 1 and m.alive() == [0, 1, 3, 12]
    assert m.workers.in_states(WorkerState.MEMBER) == [0, 1, 3]
