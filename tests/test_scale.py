"""The control plane with many simulated workers (fabric_model/testing/simulated.py): the real
driver in a process of its own, 256 workers speaking the real protocol over real sockets, through
a crash, a join storm and a preemption of a quarter; the driver's ledger checks exactly-once on
every committed step (it fails the job otherwise). docs/architecture.md, "Scale"."""

from __future__ import annotations

import pytest

from fabric_model.testing.simulated import Simulation

from .load import scaled

pytestmark = pytest.mark.processes

WORKERS = 256


@pytest.mark.timeout(300)
def test_256_simulated_workers_through_a_crash_a_join_storm_and_a_preemption(tmp_path):
    sim = Simulation(tmp_path / "run", max_workers=WORKERS + WORKERS // 4, processes=4)
    try:
        bound = scaled(120)
        sim.form(WORKERS, bound)
        sim.step()
        sim.crash(bound)
        sim.step()
        sim.join_storm(WORKERS // 4, bound)
        sim.step()
        sim.preempt(WORKERS // 4, bound)
        for _ in range(3):
            sim.step()
        expected = WORKERS - 1 + WORKERS // 4 - WORKERS // 4
        assert sim.totals()["at"] == expected
        # 8 steps, the votes' and the notice's among them, each counted once, from rank 0's reports
        # (and one a vote more where joiners were read after the first vote: their generation's).
        joined = WORKERS - 1 + WORKERS // 4
        assert sim.join_sizes[-1] == joined
        before_all = sim.join_sizes[:-1]
        steps = 8 + len(before_all)
        sim.wait_until(lambda t: len(sim.committed()) >= steps, bound, f"{steps} committed steps")
        assert sim.driver.poll() is None, "the driver ended (an exactly-once violation fails it)"
        records = sim.committed()
        assert [r["iteration"] for r in records] == list(range(1, steps + 1))
        counts = [WORKERS] + [WORKERS - 1] * 2 + before_all + [joined] * 2 + [expected] * 3
        assert [r["workers"] for r in records] == counts
    finally:
        sim.close()
