"""What user code sees of a sharded optimizer (``train(shard_optimizer_state=True)``, docs/elasticity.md,
"Sharded optimizer state"): which subclasses are accepted, the same in any process; and a worker's
optimizer read mid-run, which raises naming ``shard_optimizer_state`` instead of looking empty."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fabric_model import FabricModel, worker_context
from fabric_model.callbacks import Callback
from fabric_model.frameworks.torch.sharded import HiddenState, ShardedOptimizer, ShardedStateError

from .test_sharded_state import BATCH, DATA, GLOBAL, SEED, fresh

REPO = Path(__file__).resolve().parents[1]

#: Run as is in a fresh interpreter, and exec'd in this one: each class is built here for the first
#: time, before (in the fresh one) or after any torch.optim.Adam was built.
VERDICTS = '''
import torch
from fabric_model.frameworks.torch.sharded import check_shardable


def make_classes():
    class Plain(torch.optim.Adam):
        pass

    class Overrides(torch.optim.Adam):
        def step(self, closure=None):
            return super().step(closure)

    class Inherits(Overrides):
        pass

    return Plain, Overrides, Inherits


def verdicts():
    out = {}
    for cls in make_classes():
        try:
            check_shardable(cls([torch.nn.Parameter(torch.zeros(3))]))
            out[cls.__name__] = "accepted"
        except ValueError as exc:
            out[cls.__name__] = str(exc)
    return out


def adam_hooked():
    """Whether torch has wrapped Adam.step, which it does when the first Adam itself is built."""
    return bool(getattr(torch.optim.Adam.step, "hooked", False))
'''

FRESH = (
    VERDICTS
    + """
import json
hooked_at_start = adam_hooked()
before = verdicts()
torch.optim.Adam([torch.nn.Parameter(torch.zeros(3))])
print(json.dumps({"hooked_at_start": hooked_at_start, "before": before, "hooked_after": adam_hooked(),
                  "after": verdicts()}))
"""
)


@pytest.mark.processes  # a fresh interpreter: the fast tier stays in-process
def test_a_subclass_of_adam_gets_the_same_verdict_in_a_fresh_process_and_after_an_adam_was_built():
    """torch wraps ``step`` on the class of the first optimizer it builds: a plain subclass built
    before any Adam then has a ``step`` of its own (the wrapper around Adam's). It is judged by
    what it defines: accepted; one that overrides ``step()`` is refused, naming itself, the
    method and why, and so is a subclass of that one, naming the class that overrides."""
    proc = subprocess.run(
        [sys.executable, "-c", FRESH], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    fresh_run = json.loads(proc.stdout.strip().splitlines()[-1])
    # The trap is really there: Adam itself was not wrapped until one was built.
    assert fresh_run["hooked_at_start"] is False and fresh_run["hooked_after"] is True
    here: dict = {}
    exec(VERDICTS, here)
    torch.optim.Adam([torch.nn.Parameter(torch.zeros(3))])  # built in this process, whatever ran before
    assert here["adam_hooked"]()
    in_this_process = here["verdicts"]()
    assert fresh_run["before"] == fresh_run["after"] == in_this_process
    plain, overrides, inherits = (in_this_process[k] for k in ("Plain", "Overrides", "Inherits"))
    assert plain == "accepted"
    why = "overrides step(), whose update may read more than one element of a parameter"
    assert f"optimizer=Overrides: it subclasses Adam and {why}" in overrides, overrides
    assert "optimizer=Inherits: it subclasses Adam and overrides step() (in its base class Overrides)" in inherits
    assert "train(shard_optimizer_state=True)" in overrides


def test_between_steps_the_users_optimizer_refuses_reads_and_the_framework_still_reads_its_groups():
    """In one process: the user's optimizer's ``state`` and ``state_dict()`` raise, naming
    ``shard_optimizer_state``; the framework's own read gets the param groups; a step runs the
    optimizer over the held pieces; at the end the user's optimizer takes a plain state again."""
    model, opt = fresh()
    sharded = ShardedOptimizer(opt, {})
    model(DATA[0][0].unsqueeze(0).repeat(2, 1)).square().sum().backward()
    sharded.step(lambda: bool(opt.step()) or True)
    assert isinstance(opt.state, HiddenState) and "shard_optimizer_state" in repr(opt.state)
    first = next(model.parameters())
    reads = {
        "state[p]": lambda: opt.state[first],
        "p in state": lambda: first in opt.state,
        "len": lambda: len(opt.state),
        "items": lambda: list(opt.state.items()),
        "bool": lambda: bool(opt.state),
        "state_dict": opt.state_dict,
        "write": lambda: opt.state.__setitem__(first, {}),
    }
    unrefused = []
    for name, read in reads.items():
        try:
            read()
            unrefused.append(name)
        except ShardedStateError as exc:
            assert "(train(shard_optimizer_state=True)). Received: a read or write" in str(exc), name
    assert not unrefused
    groups = sharded.user_state_dict()
    assert groups["state"] == {} and groups["param_groups"][0]["lr"] == 0.01
    assert isinstance(opt.state, HiddenState)  # still hidden after the framework's read
    assert sharded.state_bytes() > 0  # the state is there, in the pieces
    sharded.release()
    assert dict(opt.state) == {}


#: How a worker's refusal of a read of its optimizer mid-run begins.
EXPECTED = (
    "Expected the optimizer's state to be read on a worker only outside a sharded run (train(shard_optimizer_state"
)


class ReadsTheOptimizer(Callback):
    """A worker-side callback that reads its optimizer after each step and at the end, and writes
    what it got to ``<out>/<pid>.json``; ``propagate``: let the first read's error through."""

    def __init__(self, out: str, propagate: bool = False) -> None:
        self.out, self.propagate = out, propagate
        self.seen: dict = {"steps": [], "end": None}

    def on_batch_end(self, step: int) -> None:
        optimizer = self.params["optimizer"]
        if self.propagate:
            optimizer.state_dict()
        first = next(self.model.parameters())
        got = []
        for read in (lambda: optimizer.state[first], lambda: len(optimizer.state), optimizer.state_dict):
            try:
                got.append(f"no error: {read()!r}"[:200])
            except ShardedStateError as exc:
                got.append(str(exc))
        context = worker_context()
        assert context is not None
        self.seen["steps"].append({"got": got, "bytes": context.optimizer_state_bytes})
        self._write()

    def on_train_end(self) -> None:
        optimizer = self.params["optimizer"]
        self.seen["end"] = {
            name: sorted(optimizer.state[p]) + [list(optimizer.state[p]["exp_avg"].shape) == list(p.shape)]
            for name, p in self.model.named_parameters()
        }
        self._write()

    def _write(self) -> None:
        Path(self.out, f"{os.getpid()}.json").write_text(json.dumps(self.seen))


def run(run_dir: Path, workers: int, callback: Callback) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, opt = fresh()
    fm = FabricModel(model, lambda: (DATA, None), F.cross_entropy, opt, user_callback=[callback])
    fm.train(
        2,
        BATCH,
        workers,
        effective_batch_size=GLOBAL,
        seed=SEED,
        run_dir=run_dir,
        shard_optimizer_state=True,
        deterministic=True,
        verbose=0,
    )
    return model, opt


@pytest.mark.processes
def test_a_worker_callback_reading_the_optimizer_mid_run_gets_an_error_naming_shard_optimizer_state(tmp_path):
    """Three workers (each holds 2 of 3 slices): every read of the optimizer's state or
    ``state_dict()`` in ``on_batch_end`` raises, though the worker holds state; in
    ``on_train_end`` the optimizer holds the whole state, one entry per parameter."""
    out = tmp_path / "seen"
    out.mkdir()
    model, opt = run(tmp_path / "run", 3, ReadsTheOptimizer(str(out)))
    seen = [json.loads(path.read_text()) for path in out.glob("*.json")]
    assert len(seen) == 3, [s["end"] for s in seen]
    for worker in seen:
        assert len(worker["steps"]) == 6  # 2 epochs of 3 steps, no failure
        for step in worker["steps"]:
            assert step["bytes"] > 0
            assert len(step["got"]) == 3
            for message in step["got"]:
                assert message.startswith(EXPECTED), message
        names = [name for name, _ in model.named_parameters()]
        assert list(worker["end"]) == names
        assert all(keys == ["exp_avg", "exp_avg_sq", "step", True] for keys in worker["end"].values()), worker["end"]
    assert len(opt.state) == len(names)  # the caller's optimizer too holds the whole state


@pytest.mark.processes
def test_the_error_of_a_read_the_callback_does_not_catch_reaches_the_caller(tmp_path):
    out = tmp_path / "seen"
    out.mkdir()
    with pytest.raises(ShardedStateError, match=r"train\(shard_optimizer_state=True\)\)\. Received: a read or write"):
        run(tmp_path / "run", 2, ReadsTheOptimizer(str(out), propagate=True))
