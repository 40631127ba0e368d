"""A restarted driver whose job changed takes the old workers' state (``driver/reattach.py``)
in-process, with a fake control server: what a user relies on is that nothing the vanished
driver was given is lost (docs/elasticity.md, "A lost driver")."""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Any
from unittest import mock

from fabric_model.driver.reattach import Reattach
from fabric_model.step.plan import Plan, Schedule
from fabric_model.transport import protocol as p

PLAN = Plan(num_samples=40, items_per_micro_batch=4, micro_batches=1, seed=0)  # 10 steps an epoch


class FakeServer:
    """What the reattach uses of the control server: sends, recorded, and the queue of events."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, Any]] = []
        self.events: queue.Queue[tuple[int, Any]] = queue.Queue()

    def send(self, worker_id: int, message: Any, data: bytes | None = None) -> bool:
        self.sent.append((worker_id, message))
        return True


def test_the_rank_0_that_kept_the_unwritten_checkpoint_sends_it_though_a_peer_holds_the_furthest_state(tmp_path: Path):
    """Rank 0 uploaded epoch 0's checkpoint, the driver died writing it, and rank 1 applied one
    step more than rank 0 before the abort reached it: rank 1 hands over its state, and rank 0
    is asked too, for the checkpoint (a CI run lost it so, 2026-11-30)."""
    server, states = FakeServer(), mock.Mock()
    setup = mock.Mock(identity={}, resume=None)
    setup.config.timeouts.recovery = setup.config.timeouts.stop = 5.0
    reattach = Reattach(
        setup=setup,
        metrics=tmp_path / "metrics.jsonl",
        schedule=Schedule(PLAN, epochs=3, validation_freq=1, has_test=True),
        membership=mock.Mock(),
        progress=mock.Mock(),
        states=states,
        hosts={},
        make_server=lambda secret, port: server,
        moved_on=lambda: None,
        position=str,
    )
    reattach.listen(None)
    held = {0: p.Held(0, 13, True, unconfirmed=11), 1: p.Held(0, 14, True)}
    came = {w: p.Hello(w, 100 + w, "host", held=h) for w, h in held.items()}
    chunk = p.StateChunk(0, 11, "checkpoint", 0, b"state", last=True)
    state = p.FinalState({"w": 1}, {}, unit=14)
    for event in [(0, chunk), (1, state), (0, p.FinalState({"w": 0}, {}, unit=13))]:
        server.events.put(event)
    for worker_id in (0, 1):  # their ends, once told to stop
        server.events.put((worker_id, p.ConnectionLost("closed")))

    handed = reattach.replace_changed(came, ["the script"])

    assert handed == state  # the furthest state, rank 1's
    asked = {w for w, m in server.sent if isinstance(m, p.SendFinalState)}
    assert asked == {0, 1}
    states.chunk.assert_called_once_with(0, chunk, 0, [0])  # the checkpoint reached the book
