"""``train(shard_optimizer_state=True)`` (docs/elasticity.md, "Sharded optimizer state"): each
worker holds its slices of the optimizer state, and the run's weights and optimizer state are
bitwise those of an unsharded run (deterministic mode), through kills, joins, a preemption, an
owner and its buddy lost together (a rollback), and a resume from a checkpoint on fewer workers."""

from __future__ import annotations

import copy
import random
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fabric_model import FabricModel
from fabric_model.frameworks import framework_named
from fabric_model.frameworks.torch.sharded import ELEMENTWISE, ShardedOptimizer, check_shardable
from fabric_model.state import slices
from fabric_model.state.slices import Holding, StateLost
from fabric_model.testing import FailCollective, FaultInjector, HoldForJoin, Kill, Preempt
from fabric_model.transport.collective import Collective

from .helpers import make_data, max_rel_diff, records, run_killed_job
from .test_deterministic import Net, assert_bitwise_equal  # dropout, BatchNorm, slices cut through its tensors

SEED, EPOCHS, BATCH, GLOBAL = 5, 6, 8, 24  # 3 micro-batches a step, 3 steps an epoch: 18 steps
DATA = make_data(72)


def fresh() -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net()
    return model, torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.01)


def train(run_dir, workers, faults=(), marker_dir=None, driver_logger=None, shard=True, frozen=False, **kwargs):
    model, opt = fresh()
    if frozen:  # a frozen base layer the optimizer holds too (a LoRA's shape): it never gets a gradient
        model.fc1.weight.requires_grad_(False)
    injector = FaultInjector(list(faults), marker_dir) if faults else None
    fm = FabricModel(
        model,
        lambda: (DATA, None),
        F.cross_entropy,
        opt,
        worker_logger_callback=injector,
        driver_logger_callback=driver_logger,
    )
    kwargs.setdefault("epochs", EPOCHS)
    kwargs.setdefault("deterministic", True)
    epochs = kwargs.pop("epochs")
    fm.train(
        epochs,
        BATCH,
        workers,
        effective_batch_size=GLOBAL,
        seed=SEED,
        run_dir=run_dir,
        shard_optimizer_state=shard,
        verbose=0,
        **kwargs,
    )
    return model, opt


def final_state(model, opt) -> dict[str, torch.Tensor]:
    """Weights, buffers and every optimizer state tensor, by name."""
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, p in enumerate(model.parameters()):
        for key, value in opt.state[p].items():
            state[f"optimizer.{i}.{key}"] = value
    return state


def rollbacks(run_dir) -> list[dict]:
    return [g for g in records(run_dir, "generation") if "rolled_back_from" in g]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The unsharded run on one worker."""
    model, opt = train(tmp_path_factory.mktemp("reference") / "run", 1, shard=False)
    return copy.deepcopy(final_state(model, opt))


# -- the division, without processes ------------------------------------------------------------
def test_each_member_holds_its_slice_and_its_buddys_and_any_one_loss_leaves_all_held():
    total = 103
    for world in (1, 2, 3, 5):
        cuts = slices.bounds(total, world)
        assert cuts[0][0] == 0 and cuts[-1][1] == total
        assert all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))
        held = [Holding(7, r, world) for r in range(world)]
        assert {(a, b) for a, b, _ in slices.sources(held, 7, total)} and slices.sources(held, 7, total)[0][2] == 0
        for lost in range(world if world > 1 else 0):
            survivors = [h for r, h in enumerate(held) if r != lost]
            stretches = slices.sources(survivors, 7, total)
            assert stretches[0][0] == 0 and stretches[-1][1] == total  # every element still held


def test_buddies_are_on_other_hosts_so_a_whole_host_lost_loses_nothing_where_hosts_alternate():
    total, a, b, c = 1000, 11, 22, 33
    for hosts in ([a, a, b, b], [a, a, a, b, b, b], [a, b, a, c, b, c], [a, a, a, b, b, c], [c, a, b, a, b]):
        positions = slices.cycle(hosts)
        assert sorted(positions) == list(range(len(hosts)))
        world = len(hosts)
        by_position = {k: hosts[r] for r, k in enumerate(positions)}
        assert all(by_position[k] != by_position[(k + 1) % world] for k in range(world)), (hosts, positions)
        for lost in set(hosts):  # a whole host goes: every slice is still held by a member elsewhere
            survivors = [Holding(5, k, world, host=h) for h, k in zip(hosts, positions) if h != lost]
            assert slices.sources(survivors, 5, total)[-1][1] == total
    positions = slices.cycle([a, a, a, b])  # more than half on one host: one owner and buddy share it
    assert sorted(positions) == [0, 1, 2, 3]
    assert slices.cycle([a, a, a]) == [0, 1, 2]  # one host: ranks in order


def test_an_owner_and_its_buddy_lost_together_is_named_and_a_member_elsewhere_holds_nothing():
    held = [Holding(7, 2, 3)]  # ranks 0 and 1 lost: slice 0 had 0 as owner and 1 as buddy
    with pytest.raises(StateLost, match=r"no member holds elements \[0, 35\)"):
        slices.sources(held, 7, 103)
    with pytest.raises(StateLost):  # a member one unit behind holds nothing of unit 7
        slices.sources([Holding(6, 0, 1)], 7, 103)


def test_elementwise_optimizers_are_accepted_and_others_refused_naming_themselves_and_why():
    params = [torch.nn.Parameter(torch.zeros(3))]
    for accepted in (
        torch.optim.SGD(params, lr=0.1, momentum=0.9),
        torch.optim.AdamW(params),
        torch.optim.Rprop(params),
    ):
        check_shardable(accepted)
    with pytest.raises(ValueError, match=r"optimizer=LBFGS: it keeps a history of whole-gradient vectors"):
        check_shardable(torch.optim.LBFGS(params))

    class Lamb(torch.optim.Adam):
        def step(self, closure=None):  # scales by a whole tensor's norm
            return super().step(closure)

    with pytest.raises(ValueError, match=r"optimizer=Lamb: it subclasses Adam and overrides step\(\)"):
        check_shardable(Lamb(params))
    model, _ = fresh()
    fm = FabricModel(model, lambda: (DATA, None), F.cross_entropy, torch.optim.LBFGS(model.parameters()))
    with pytest.raises(TypeError, match="shard_optimizer_state"):  # checked first, as every argument
        fm.train(1, BATCH, 1, shard_optimizer_state="yes")
    with pytest.raises(ValueError, match="shard_optimizer_state=True"):  # before any worker starts
        fm.train(1, BATCH, 1, shard_optimizer_state=True)
    with pytest.raises(ValueError, match="for a keras model: only a torch optimizer's state can be sharded"):
        framework_named("keras").check_shardable(None)


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_a_lone_members_pieces_update_as_the_whole_optimizer_does_and_its_state_bytes_halve_with_a_buddy(name):
    """In one process: a sharded optimizer that holds everything steps bitwise as the user's
    optimizer; cut to its slices of 4 members, it holds half the state (its own and a buddy's)."""
    torch.manual_seed(1)
    options = {"SGD": {"lr": 0.1, "momentum": 0.9}}.get(name, {})
    plain_model, model = torch.nn.Linear(7, 5), torch.nn.Linear(7, 5)
    model.load_state_dict(plain_model.state_dict())
    plain = getattr(torch.optim, name)(plain_model.parameters(), **options)
    mine = getattr(torch.optim, name)(model.parameters(), **options)
    sharded = ShardedOptimizer(mine, {})
    for step in range(4):
        for m in (plain_model, model):
            m.zero_grad()
            m(torch.randn(3, 7, generator=torch.Generator().manual_seed(step))).square().sum().backward()
        plain.step()
        sharded.step(lambda: bool(mine.step()) or True)
    assert all(torch.equal(a, b) for a, b in zip(plain_model.parameters(), model.parameters()))
    full = sum(v.nbytes for s in plain.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())
    assert sharded.state_bytes() - _scalar_bytes(sharded) == full
    # Its state, moved as checkpoints and joins move it (by element rows and scalars), is the optimizer's.
    gathered, whole = sharded.full_state(SimpleNamespace(rank=0, world_size=1)), plain.state_dict()["state"]
    assert gathered.keys() == whole.keys()
    for i in whole:
        assert gathered[i].keys() == whole[i].keys()
        for key, value in whole[i].items():
            same = torch.equal(gathered[i][key], value) if torch.is_tensor(value) else gathered[i][key] == value
            assert same and type(gathered[i][key]) is type(value), (name, i, key)
    sharded.position, sharded.world, sharded.positions = 1, 4, [0, 1, 2, 3]
    sharded._slice_locally(slices.held_intervals(1, 4, sharded.total))
    held = sharded.state_bytes() - _scalar_bytes(sharded)
    assert abs(held - full / 2) <= 8 * len(plain.state[plain_model.weight]), (held, full)  # 2 of 4 slices
    for step in range(4, 6):  # its slices, cut through the weight, go on as the whole optimizer's elements
        plain_model.zero_grad()
        plain_model(torch.randn(3, 7, generator=torch.Generator().manual_seed(step))).square().sum().backward()
        for mine_p, plain_p in zip(model.parameters(), plain_model.parameters()):  # the reduced gradient
            mine_p.grad = plain_p.grad.clone()
        plain.step()
        sharded.step(lambda: bool(mine.step()) or True)
    plain_flat = torch.cat([p.detach().view(-1) for p in plain_model.parameters()])
    for start, end in sharded.intervals:
        assert torch.equal(
            torch.cat([p.detach().view(-1) for p in model.parameters()])[start:end], plain_flat[start:end]
        )


def _scalar_bytes(sharded: ShardedOptimizer) -> int:
    """The per-tensor step counts, one per piece."""
    return sum(v.nbytes for s in sharded.state.values() for v in s.values() if torch.is_tensor(v) and not v.dim())


@pytest.mark.parametrize("rounds", ["one", "several"])
def test_members_in_threads_divide_join_and_gather_the_state_as_the_whole_optimizer_steps(rounds, monkeypatch):
    """Real gloo groups between threads: 2 members step, a third joins and takes its slices
    from them, all three step and gather; every member's weights, and the whole state
    gathered from the slices, are bitwise the unsharded optimizer's. With "several", the
    updated slices are gathered in rounds of 30 elements in all (10 rounds, cut through tensors),
    as a large model's are, through scratch of that size."""
    if rounds == "several":
        monkeypatch.setattr(ShardedOptimizer, "SPREAD_ELEMENTS", 30)
    store = dist.HashStore()
    plain_model, plain = fresh()
    members = [fresh() for _ in range(3)]
    sharded = [ShardedOptimizer(opt, {}) for _, opt in members]
    collectives = [Collective(store, "gloo", timedelta(seconds=30)) for _ in members]

    def backward(model, step):
        model.zero_grad()
        model.eval()  # the same batch statistics in every copy
        model(torch.randn(4, 12, generator=torch.Generator().manual_seed(step))).square().sum().backward()

    def generation(number, ranks, holdings, steps, gather=None):
        def member(rank, index):
            collective, mine = collectives[index], sharded[index]
            collective.configure(number, rank, len(ranks))
            mine.redivide(collective, holdings, steps[0])
            for step in steps:
                backward(members[index][0], step)
                mine.step(lambda: bool(members[index][1].step()) or True)
                mine.spread(collective)
            if gather is not None:
                gather[index] = mine.full_state(collective)

        threads = [threading.Thread(target=member, args=(rank, index)) for rank, index in enumerate(ranks)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)

    generation(1, [0, 1], [Holding(0, 0, 1)] * 2, range(0, 3))
    joined = [Holding(3, sharded[0].position, 2), Holding(3, sharded[1].position, 2), Holding(-1, 0, 1)]
    gathered: dict[int, dict] = {}
    generation(2, [0, 1, 2], joined, range(3, 7), gathered)
    for step in range(7):
        backward(plain_model, step)
        plain.step()
    for model, _ in members:
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain_model.parameters()))
    assert sharded[2].state_bytes() < sharded[0].total * 4 * 2  # the joiner holds 2 of 3 slices, not all
    scratch = [b.numel() for b in sharded[0]._spread_out]
    assert scratch == ([3 * 97] if rounds == "one" else [30, 30])  # 291 elements: slices of 97
    whole = plain.state_dict()["state"]
    for state in gathered.values():
        assert state.keys() == whole.keys()
        assert all(torch.equal(state[i][k], whole[i][k]) for i in whole for k in whole[i])


class OneOfThree:
    """A collective of three whose peers contribute nothing: the sum is this rank's buffer."""

    world_size, rank = 3, 0

    def all_reduce_start(self, tensor: torch.Tensor) -> None:
        return None

    def wait(self, work: None) -> None:
        pass


def test_a_sharded_members_gradients_exist_only_from_its_backward_to_its_update():
    """ZeRO stage 2's memory: the step buffer (every gradient, flat) is given back once the
    member has updated its slices and made again, zeroed, at the next step's first backward, so
    a forward's peak memory holds no gradient, and between steps ``.grad`` is None, as after
    ``zero_grad()``. The weights and the reported sums are bitwise those of the kept buffer."""
    from fabric_model.frameworks.torch.adapter import TorchAdapter

    def run(shard: bool) -> tuple[list[torch.Tensor], list[list[float]], list[tuple[bool, int]]]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        adapter = TorchAdapter(model, torch.optim.Adam(model.parameters(), lr=0.01), F.cross_entropy)
        adapter.setup("cpu", 1)
        if shard:
            adapter.shard_optimizer_state()
        seen: list[tuple[bool, int]] = []  # in each forward: any .grad, the gradient bytes held
        model.register_forward_pre_hook(
            lambda *_: seen.append((any(p.grad is not None for p in model.parameters()), adapter.gradient_bytes()))
        )
        g, sums = torch.Generator().manual_seed(1), []
        for step in range(4):
            adapter.begin_step(OneOfThree())
            for j in range(2):
                batch = (torch.randn(5, 12, generator=g), torch.randint(0, 3, (5,), generator=g))
                adapter.train_micro_batch(batch, 5, 10, seed=step * 10 + j, last=j == 1)
            adapter.all_reduce(OneOfThree())
            sums.append(adapter.finish_step().stats)
            if shard:
                assert all(p.grad is None for p in model.parameters())
                assert adapter.gradient_bytes() == 0
        return [p.detach().clone() for p in model.parameters()], sums, seen

    kept, kept_sums, kept_seen = run(shard=False)
    released, released_sums, released_seen = run(shard=True)
    assert all(torch.equal(a, b) for a, b in zip(kept, released)) and kept_sums == released_sums
    assert all(has_grad and size > 0 for has_grad, size in kept_seen)  # unsharded: the buffer stays
    # Stage 2: no gradient in the first forward of a step; in its second, only the step's own.
    assert [s for k, s in enumerate(released_seen) if k % 2 == 0] == [(False, 0)] * 4, released_seen


# -- whole runs ----------------------------------------------------------------------------------
@pytest.mark.processes
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_sharded_adam_is_bitwise_the_unsharded_run(workers, reference, run_dir, tmp_path, monkeypatch):
    """Snapshots by time alone, on a fast clock: rank 0's clock decides for every member, whose
    slices the snapshot gathers mid-run without changing a bit of it. With 3, one of them dies
    in such a gather: the other two hold its slices and go on, without rollback."""
    monkeypatch.setenv("FABRIC_MODEL_SNAPSHOT_STEPS", "0")
    monkeypatch.setenv("FABRIC_MODEL_SNAPSHOT_SECONDS", "0.001")  # due at nearly every unit
    monkeypatch.setenv("FABRIC_MODEL_SNAPSHOT_SHARE", "0")
    faults = [Kill(2, 7, "in_exchange")] if workers == 3 else []
    assert_bitwise_equal(final_state(*train(run_dir, workers, faults, tmp_path, checkpoint_freq=0)), reference)
    if workers == 3:
        assert not rollbacks(run_dir) and [g["workers"] for g in records(run_dir, "generation")][:2] == [3, 2]
        assert (tmp_path / "fault-0").exists()  # it died in a gather: the step's own collectives are not sums
        return
    assert {r["workers"] for r in records(run_dir, "train")} == {workers}
    logs = "".join(path.read_text() for path in (run_dir / "logs").glob("worker-*.log"))
    assert "snapshot of unit" in logs, logs[-3000:]


@pytest.mark.processes
def test_a_frozen_parameter_in_the_optimizer_keeps_its_value_and_the_run_is_bitwise(tmp_path):
    """The slices cut through a frozen tensor too: it gets no state and nobody writes it, so it
    stays the job's (and keeps travelling with the job only: every replica agrees at the end)."""
    lone = final_state(*train(tmp_path / "lone", 1, shard=False, frozen=True))
    model, opt = train(tmp_path / "three", 3, frozen=True)
    assert_bitwise_equal(final_state(model, opt), lone)
    assert torch.equal(model.fc1.weight, fresh()[0].fc1.weight)


@pytest.mark.processes
def test_sharded_adam_without_deterministic_mode_is_the_unsharded_run_to_float32_rounding(tmp_path):
    lone = final_state(*train(tmp_path / "lone", 1, shard=False, deterministic=False))
    three = final_state(*train(tmp_path / "three", 3, deterministic=False))
    assert three.keys() == lone.keys()
    assert max_rel_diff(three, lone) <= 1e-4


@pytest.mark.processes
@pytest.mark.parametrize("seed", [1, 2])
def test_a_worker_killed_at_a_random_step_loses_nothing_and_a_replacement_joins(seed, reference, run_dir, tmp_path):
    """SIGKILL one of 3 workers at a step drawn from ``seed``, before the step's allreduce or after
    its own update (before the updated slices are gathered); its replacement joins later."""
    draw = random.Random(seed)
    step, when, victim = draw.randrange(2, 9), draw.choice(["before_allreduce", "before_spread"]), draw.randrange(3)
    faults = [Kill(victim, step, when), HoldForJoin(step + 4)]
    assert_bitwise_equal(final_state(*train(run_dir, 3, faults, tmp_path)), reference)
    sizes = [g["workers"] for g in records(run_dir, "generation")]
    assert sizes[:2] == [3, 2] and sizes[-1] == 3, (sizes, step, when)  # the kill, then the replacement
    assert not rollbacks(run_dir), "a single loss rolled back"
    steps = [(r["epoch"], r["step"]) for r in records(run_dir, "train")]
    assert len(set(steps)) == EPOCHS * 3, steps  # every step committed, once (a redone step's record is final)


@pytest.mark.processes
def test_a_preempted_worker_leaves_after_its_step_without_loss(reference, run_dir, tmp_path):
    model, opt = train(run_dir, 3, [Preempt(2, 5)], tmp_path)
    assert_bitwise_equal(final_state(model, opt), reference)
    generations = records(run_dir, "generation")
    assert [g["workers"] for g in generations][:2] == [3, 2] and "SIGTERM" in generations[1]["reason"], generations
    assert not rollbacks(run_dir)


@pytest.mark.processes
def test_an_owner_and_its_buddy_killed_together_roll_back_say_so_and_change_nothing(
    reference, run_dir, tmp_path, monkeypatch
):
    """Ranks 0 and 1 die in one step: slice 0 had them as owner and buddy. The survivor says so and
    leaves; fresh workers go on from the newest snapshot, which rank 0 gathered from every member's slices."""
    monkeypatch.setenv("FABRIC_MODEL_SNAPSHOT_STEPS", "4")
    monkeypatch.setenv("FABRIC_MODEL_SNAPSHOT_SHARE", "0")
    model, opt = train(run_dir, 3, [Kill(0, 10), Kill(1, 10)], tmp_path, checkpoint_freq=0)
    assert_bitwise_equal(final_state(model, opt), reference)
    (back,) = rollbacks(run_dir)
    assert back["resume_unit"] < back["rolled_back_from"] and back.get("restored") == "snapshot", back
    said = (run_dir / "logs" / "driver.log").read_text()
    assert "worker 2 leaves (the sharded optimizer state is incomplete)" in said, said
    assert "rolling back to unit" in said, said
    assert "no member holds elements [0, " in (run_dir / "logs" / "worker-2.log").read_text()


@pytest.mark.processes
def test_a_worker_killed_in_the_ends_gather_loses_nothing(reference, run_dir, tmp_path, monkeypatch):
    """After the last step every member gathers every slice into the user's optimizer; one of
    them dies there. The survivors hold its slices (buddies): they re-divide and gather again."""
    monkeypatch.setenv("FABRIC_MODEL_SNAPSHOT_STEPS", "0")
    monkeypatch.setenv("FABRIC_MODEL_SNAPSHOT_SECONDS", "0")
    model, opt = train(run_dir, 3, [Kill(1, EPOCHS * 3 - 1, "in_exchange")], tmp_path, checkpoint_freq=0)
    assert_bitwise_equal(final_state(model, opt), reference)
    assert not rollbacks(run_dir)
    assert [g["workers"] for g in records(run_dir, "generation")][:2] == [3, 2]


@pytest.mark.processes
def test_a_checkpoint_of_3_sharded_workers_resumes_on_2_and_loads_into_the_users_optimizer(reference, tmp_path):
    run_dir = tmp_path / "run"
    run_killed_job(tmp_path, "tests.test_sharded_state", f"{str(run_dir)!r}, 3", kill_at=13, run_dir=run_dir)
    newest = sorted((run_dir / "checkpoints").glob("ckpt-unit-*.pt"))[-1]
    saved = torch.load(newest, weights_only=True)
    model, opt = fresh()
    model.load_state_dict(saved["model"])
    opt.load_state_dict({k: saved["optimizer"][k] for k in ("state", "param_groups")})  # the whole state
    assert all(opt.state[p]["exp_avg"].shape == p.shape for p in model.parameters())
    model, opt = train(run_dir, 2, resume=True)
    resumed = records(run_dir, "resume")[-1]
    assert 0 < resumed["resume_unit"], resumed
    assert_bitwise_equal(final_state(model, opt), reference)


@pytest.mark.processes
def test_a_member_that_gave_up_an_allreduce_its_peers_finished_takes_its_slices_from_them(reference, run_dir, tmp_path):
    """Worker 1's wait fails once the step's gradients are through on it: its peers finish the
    allreduce, apply the step to their slices, and fail only in the gather. Worker 1 is a step
    behind them and kept no gradient to redo it from (stage 2): every slice it held has another
    holder among them, which hands it on; nothing is rolled back."""
    model, opt = train(run_dir, 3, [FailCollective(1, 6, "in_allreduce")], tmp_path)
    assert_bitwise_equal(final_state(model, opt), reference)
    assert not rollbacks(run_dir)
    assert [g["workers"] for g in records(run_dir, "generation")][:2] == [3, 3]


def test_every_member_decides_alike_when_a_sharded_state_is_gathered_for_an_upload():
    """Members' clocks differ, and every member takes part in a sharded state's gather: the
    snapshot rules of time and cost are rank 0's alone, voted in a step's allreduce, and every
    member follows the vote; checkpoints fall at units the schedule fixes (every 2nd epoch's
    end, every 4th step: train(checkpoint_steps=4)); an upload in flight is waited for."""
    from fabric_model.setup.config import SnapshotCadence
    from fabric_model.state.uploader import StateUploader
    from fabric_model.step.plan import Plan, Schedule
    from fabric_model.transport import protocol as p

    schedule = Schedule(Plan(72, BATCH, 3, SEED), EPOCHS, 1, False)
    cadence = SnapshotCadence(steps=0, seconds=0.001, share=0)  # by time alone: due at nearly every unit
    config = SimpleNamespace(
        checkpoint_freq=2, checkpoint_steps=4, batch_size=BATCH, snapshots=cadence, shard_optimizer_state=True
    )
    members = [StateUploader(channel=None, schedule=schedule, config=config) for _ in range(3)]  # type: ignore[arg-type]
    in_flight = threading.Event()
    for uploads in members:
        uploads.entered(p.CheckpointSettings("", "torch", written=-1), resume_unit=0, members=3)
        uploads._thread = threading.Thread(target=in_flight.wait)  # rank 0's last upload, still sending
        uploads._thread.start()
    assert all(uploads.agreed for uploads in members)
    decided = []
    try:
        for unit in range(schedule.total_units):
            kinds = {uploads.kind_due(unit, 0) for uploads in members}
            assert len(kinds) == 1, (unit, kinds)
            kind = kinds.pop()
            if kind:
                decided.append((unit, kind))
                for uploads in members:
                    uploads.mark(kind, unit)
            members[2]._last_time = time.monotonic()  # this member's clock says no time has passed
            time.sleep(0.002)
            vote = members[0].snapshot_due(unit + 1)  # rank 0, in the step's allreduce
            for uploads in members:
                uploads.voted = vote  # the step's result, the same sum on every member
    finally:
        in_flight.set()
        for uploads in members:
            uploads.flush()
    kinds = [k for _, k in decided]
    # After steps 4, 8 (units 5, 10), 12 (epoch 3's last: with its end's, unit 15), 16 (unit 21);
    # epochs 1, 3, 5's ends (units 7, 15, 23).
    assert [u for u, k in decided if k == "checkpoint"] == [5, 7, 10, 15, 21, 23], decided
    assert kinds.count("snapshot") >= schedule.total_units // 2, decided
    # Alone, a member decides by its own clock, as an unsharded rank 0 does.
    alone = StateUploader(channel=None, schedule=schedule, config=config)  # type: ignore[arg-type]
    alone.entered(p.CheckpointSettings("", "torch", written=-1), resume_unit=0, members=1)
    time.sleep(0.002)
    assert not alone.agreed and alone.kind_due(1, 0) == "snapshot"
