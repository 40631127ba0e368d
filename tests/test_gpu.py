"""The GPU path on a CUDA device: workers on the GPU, their collectives, state moved and saved
from CUDA tensors, mixed precision and deterministic mode there (docs/architecture.md, "Devices").

Marked ``gpu`` and skipped, with the reason printed, where torch sees no CUDA device (CI has
none): ``pytest -m gpu tests/test_gpu.py`` on a machine with one. With a single GPU, the
multi-worker tests share it (``FABRIC_MODEL_WORKERS_PER_GPU``), which reduces over gloo on the
CUDA tensors: NCCL refuses two ranks on one device. The NCCL tests need one GPU per worker.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fabric_model import FabricModel
from fabric_model.run.rundir import RunDirectory
from fabric_model.state.checkpoint import list_checkpoints
from fabric_model.step.plan import Plan
from fabric_model.testing import FaultInjector, HoldForJoin, Kill, WorkerStarter

from .helpers import make_data, max_rel_diff, records, reference_train, sample_indices_of_steps

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.processes,
    pytest.mark.skipif(GPUS == 0, reason="no CUDA GPU: the GPU path runs only where torch sees one"),
]

SEED, EPOCHS, BATCH, GLOBAL = 5, 3, 8, 24
DATA = make_data(240)  # 10 steps an epoch
PLAN = Plan(len(DATA), BATCH, GLOBAL // BATCH, SEED)


class Net(nn.Module):
    """Dropout (the CUDA generator), BatchNorm (float and integer buffers on the device)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 32)
        self.norm = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(32, 3)

    def forward(self, x):
        return self.fc2(self.drop(F.relu(self.norm(self.fc1(x)))))


def on_cuda(output, target):
    """A metric: 1 where the model ran on a GPU; an epoch's mean of 1.0 means every micro-batch did."""
    return torch.tensor(float(output.is_cuda))


def fresh(device: str = "cpu", adam: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net().to(device)
    if adam:
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters, on the CPU: what a plain accumulation loop must agree with. Its BatchNorm
    running statistics move once per micro-batch, FabricModel's once per step by the mean of the
    micro-batches' changes (docs/architecture.md, "The step"), so buffers are compared only
    between FabricModel runs."""
    return {k: v.detach().cpu().clone() for k, v in model.named_parameters()}


def reference(epochs: int = EPOCHS, autocast: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The plain loop on the GPU over the documented plan."""
    model, opt = fresh("cuda")
    reference_train(
        model, opt, DATA, seed=SEED, epochs=epochs, batch_size=BATCH, micro_batches=GLOBAL // BATCH,
        autocast=autocast, device="cuda",
    )  # fmt: skip
    return cpu_state(model)


@pytest.fixture(scope="module")
def undisturbed() -> dict[str, torch.Tensor]:
    return reference()


@pytest.fixture
def share_the_gpu(monkeypatch):
    """Up to three workers on each GPU (the one GPU of a single-GPU machine)."""
    monkeypatch.setenv("FABRIC_MODEL_WORKERS_PER_GPU", "3")


def train(run_dir, workers, *, device="cpu", adam=False, faults=(), marker_dir=None, epochs=EPOCHS, **kwargs):
    model, opt = fresh(device, adam)
    injector = FaultInjector(list(faults), marker_dir) if faults else None
    result = FabricModel(
        model, lambda: (DATA, DATA[:40]), F.cross_entropy, opt, metrics=[on_cuda], worker_logger_callback=injector,
        **kwargs.pop("options", {}),
    ).train(epochs, BATCH, workers, effective_batch_size=GLOBAL, seed=SEED, run_dir=run_dir, **kwargs)  # fmt: skip
    return model, opt, result


def backend(run_dir) -> str:
    return json.loads((run_dir / "run.json").read_text())["config"]["backend"]


def assert_ran_on_the_gpu(result) -> None:
    assert [h["on_cuda"] for h in result.history] == [1.0] * len(result.history), result.history


def assert_exactly_once(run_dir) -> None:
    final = {(r["epoch"], r["step"]): r for r in records(run_dir, "train")}  # a redone step supersedes
    assert sorted(final) == [(e, s) for e in range(EPOCHS) for s in range(PLAN.steps_per_epoch)]
    used = sample_indices_of_steps(PLAN, list(final.values()))
    for epoch in range(EPOCHS):
        assert sorted(used[epoch]) == list(range(len(DATA))), f"epoch {epoch}: not every sample exactly once"


def optimizer_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    for i, p in enumerate(model.parameters()):
        for name, value in opt.state[p].items():
            state[f"opt.{i}.{name}"] = value.detach().cpu().clone() if torch.is_tensor(value) else torch.tensor(value)
    return state


def assert_bitwise_equal(state, expected) -> None:
    assert state.keys() == expected.keys()
    differ = [k for k in expected if not torch.equal(state[k], expected[k])]
    assert not differ, f"not bitwise equal: {differ}"


# -- one worker ---------------------------------------------------------------------------------
def test_a_cuda_model_trains_on_the_gpu_like_the_plain_cuda_loop(undisturbed, run_dir):
    """The model handed over on the GPU (as most torch scripts have it): one worker on cuda:0,
    three micro-batches accumulated a step, the plain CUDA loop's weights; the caller's model
    stays on the GPU and holds them."""
    model, _, result = train(run_dir, 1, device="cuda")
    assert_ran_on_the_gpu(result)
    assert next(model.parameters()).is_cuda
    assert max_rel_diff(cpu_state(model), undisturbed) < 1e-5
    assert backend(run_dir) == "nccl"  # one worker per GPU


def test_a_cpu_model_is_moved_to_the_gpu_by_the_workers(undisturbed, run_dir):
    """IBM's scripts hand over a CPU model: the workers train it on the GPU, the caller's model
    gets the weights back on the CPU."""
    model, _, result = train(run_dir, 1)
    assert_ran_on_the_gpu(result)
    assert not next(model.parameters()).is_cuda
    assert max_rel_diff(cpu_state(model), undisturbed) < 1e-5


# -- workers sharing the GPU: gloo on CUDA tensors --------------------------------------------
def test_two_workers_on_one_gpu_agree_with_the_plain_loop(undisturbed, run_dir, share_the_gpu):
    model, _, result = train(run_dir, 2, device="cuda")
    assert_ran_on_the_gpu(result)
    assert {r["workers"] for r in records(run_dir, "train")} == {2}
    assert len(set(result.replica_digests.values())) == 1
    assert max_rel_diff(cpu_state(model), undisturbed) < 1e-5
    assert backend(run_dir) == "gloo"  # shared GPUs never use NCCL


class Wide(nn.Module):
    """3.2M parameters: four 4 MiB gradient buckets, the first sent while backward still runs."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU())
        self.more = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU())
        self.out = nn.Linear(1024, 3)

    def forward(self, x):
        return self.out(self.more(self.net(x)))


def test_buckets_sent_during_backward_on_cuda_streams_sum_what_the_plain_loop_sums(run_dir, share_the_gpu):
    """Each bucket's allreduce starts from the autograd hook while later gradients are still being
    computed on the GPU: it must wait for its own gradients' kernels, and the optimizer for it."""

    def wide(device):
        torch.manual_seed(0)
        model = Wide().to(device)
        return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    model, opt = wide("cuda")
    reference_train(model, opt, DATA, seed=SEED, epochs=1, batch_size=BATCH, micro_batches=2, device="cuda")
    expected = cpu_state(model)
    model, opt = wide("cuda")
    FabricModel(model, lambda: (DATA, None), F.cross_entropy, opt).train(1, BATCH, 2, seed=SEED, run_dir=run_dir)
    assert max_rel_diff(cpu_state(model), expected) < 1e-5


def test_a_worker_killed_mid_allreduce_on_the_gpu_is_regrouped_and_replaced(
    undisturbed, run_dir, tmp_path, share_the_gpu
):
    """Worker 1 SIGKILLed just before its allreduce (the others are in it): the survivors' group
    on the GPU is abandoned and re-formed, the step redone, a replacement joins and pulls the
    state onto the GPU; every sample once, the plain loop's weights."""
    faults = [Kill(1, 4), HoldForJoin(7)]
    model, _, result = train(run_dir, 3, device="cuda", faults=faults, marker_dir=tmp_path)
    assert_ran_on_the_gpu(result)
    assert_exactly_once(run_dir)
    sizes = [g["workers"] for g in records(run_dir, "generation")]
    assert sizes[:2] == [3, 2] and sizes[-1] == 3, sizes
    assert len(set(result.replica_digests.values())) == 1 and len(result.replica_digests) == 3
    assert max_rel_diff(cpu_state(model), undisturbed) < 1e-5


# -- a host without a GPU ----------------------------------------------------------------------
def test_a_worker_on_a_host_without_a_gpu_is_refused_by_a_job_on_gpus(run_dir, tmp_path, monkeypatch):
    """A worker started by hand where torch sees no GPU (``CUDA_VISIBLE_DEVICES=""``: a CPU host's
    shape) joins a job training a CUDA model on the GPU: its copy of the state unpickles (mapped to
    the CPU, not torch's error), it is refused before it trains, naming its host, and the job goes
    on on the GPU without it (worker/job_loading.py)."""
    monkeypatch.setenv("FABRIC_MODEL_LOCAL_WORKERS", "1")
    starter = WorkerStarter(run_dir, [], at_start=1, env={"CUDA_VISIBLE_DEVICES": ""})
    model, opt = fresh("cuda")
    pace = FaultInjector([], tmp_path, step_delay=0.3)  # 9 s: the worker starts and is refused within
    try:
        result = FabricModel(
            model, lambda: (DATA, None), F.cross_entropy, opt, metrics=[on_cuda], worker_logger_callback=pace,
            driver_logger_callback=starter,
        ).train(EPOCHS, BATCH, 2, effective_batch_size=GLOBAL, seed=SEED, run_dir=run_dir)  # fmt: skip
    finally:
        starter.close()
    assert starter.processes[0].returncode == 1
    log = RunDirectory(run_dir).joined_log(0).read_text()
    assert "has no GPU (torch sees no CUDA device), but the job's workers train on GPUs" in log, log[-2000:]
    assert "deserialize" not in log
    assert_ran_on_the_gpu(result)


# -- deterministic mode, checkpoints and resume ---------------------------------------------
@pytest.fixture(scope="module")
def deterministic_lone(tmp_path_factory) -> dict[str, torch.Tensor]:
    run_dir = tmp_path_factory.mktemp("lone") / "run"
    model, opt, result = train(run_dir, 1, device="cuda", adam=True, deterministic=True)
    assert_ran_on_the_gpu(result)
    return optimizer_state(model, opt)


def test_deterministic_on_cuda_one_and_two_workers_are_bitwise_equal(deterministic_lone, run_dir, share_the_gpu):
    model, opt, _ = train(run_dir, 2, device="cuda", adam=True, deterministic=True)
    assert_bitwise_equal(optimizer_state(model, opt), deterministic_lone)


def test_a_join_pulls_adam_state_onto_the_gpu_bitwise(deterministic_lone, run_dir, tmp_path, share_the_gpu):
    """A replacement pulls weights, BatchNorm buffers and Adam's moments from a peer, to its GPU."""
    model, opt, result = train(
        run_dir, 2, device="cuda", adam=True, deterministic=True, faults=[Kill(1, 2), HoldForJoin(4)],
        marker_dir=tmp_path,
    )  # fmt: skip
    assert_bitwise_equal(optimizer_state(model, opt), deterministic_lone)
    generations = records(run_dir, "generation")
    assert [g["workers"] for g in generations][-1] == 2 and any(g["source_rank"] >= 0 for g in generations)


def test_checkpoints_of_cuda_tensors_resume_bitwise_and_load_without_a_gpu(deterministic_lone, run_dir):
    train(run_dir, 1, device="cuda", adam=True, deterministic=True, epochs=2)
    for _, path in list_checkpoints(run_dir / "checkpoints"):  # no map_location: as a CPU-only host loads it
        state = torch.load(path, weights_only=True)
        tensors = [*state["model"].values()]
        assert tensors and all(t.device.type == "cpu" for t in tensors), path
    model, opt, result = train(run_dir, 1, device="cuda", adam=True, deterministic=True, resume=True)
    assert records(run_dir, "resume"), "the second call did not resume"
    assert [h["epoch"] for h in result.history] == [0, 1, 2]
    assert_bitwise_equal(optimizer_state(model, opt), deterministic_lone)


# -- sharded optimizer state (ZeRO stage 1 with a buddy: docs/elasticity.md) ---------------------
def cuda_optimizer_state(opt: torch.optim.Optimizer) -> list[torch.device]:
    return [v.device for state in opt.state.values() for v in state.values() if torch.is_tensor(v) and v.dim()]


def test_sharded_adam_on_three_workers_sharing_the_gpu_is_bitwise_the_lone_unsharded_run(
    deterministic_lone, run_dir, share_the_gpu
):
    """Slices of the flat parameters on the GPU, each member's update of its own and its buddy's
    slice, and the gather of the updated slices (gloo on CUDA tensors); the user's optimizer ends
    with the whole state, on the GPU."""
    model, opt, result = train(run_dir, 3, device="cuda", adam=True, deterministic=True, shard_optimizer_state=True)
    assert_ran_on_the_gpu(result)
    assert_bitwise_equal(optimizer_state(model, opt), deterministic_lone)
    devices = cuda_optimizer_state(opt)
    assert devices and all(d.type == "cuda" for d in devices), devices


def test_a_sharded_worker_killed_on_the_gpu_loses_nothing_and_its_replacement_takes_slices(
    deterministic_lone, run_dir, tmp_path, share_the_gpu
):
    """The survivors re-divide the slices from the buddies' copies on the GPU, without a rollback;
    the replacement takes its slices from their holders."""
    model, opt, _ = train(
        run_dir, 3, device="cuda", adam=True, deterministic=True, shard_optimizer_state=True,
        faults=[Kill(1, 4), HoldForJoin(7)], marker_dir=tmp_path,
    )  # fmt: skip
    assert_bitwise_equal(optimizer_state(model, opt), deterministic_lone)
    generations = records(run_dir, "generation")
    sizes = [g["workers"] for g in generations]
    assert sizes[:2] == [3, 2] and sizes[-1] == 3, sizes
    assert not [g for g in generations if "rolled_back_from" in g], generations
    assert_exactly_once(run_dir)


class PeersAddNothing:
    """A collective whose peers add nothing: a worker's own step path, in this process."""

    rank = 0

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def all_reduce_start(self, tensor: torch.Tensor) -> None:
        return None

    def wait(self, work: None) -> None:
        pass


def cuda_bytes_after_three_steps(world: int | None, shard: bool = False) -> int:
    """CUDA memory held after three Adam steps of a 4.2M-parameter MLP (16 MiB of gradients):
    by the plain loop (``world`` None) or by a worker's step path in a group of ``world``."""
    from fabric_model.frameworks.torch.adapter import TorchAdapter

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)]).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(64, 1024, generator=g), torch.randn(64, 1024, generator=g)) for _ in range(3)]
    if world is None:
        for x, y in batches:
            opt.zero_grad()
            F.mse_loss(model(x.cuda()), y.cuda()).backward()
            opt.step()
    else:
        adapter = TorchAdapter(model, opt, F.mse_loss)
        adapter.drop_default_accuracy()  # a regression: no classifier's accuracy
        adapter.setup("cuda:0", 1)
        if shard:
            adapter.shard_optimizer_state()
        group = PeersAddNothing(world)
        for k, batch in enumerate(batches):
            adapter.begin_step(group)
            adapter.train_micro_batch(batch, 64, 64, seed=k, last=True)
            adapter.all_reduce(group)
            adapter.finish_step()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    del model, opt
    return held


def test_between_steps_a_lone_cuda_worker_holds_what_the_plain_loop_holds_and_a_sharded_member_no_gradient():
    """A lone worker's backward writes fresh gradients as the plain loop's does, and its step
    buffer's gradient part gives its memory back: it holds its gradients once (it held them
    twice). A sharded member among several gives back the whole step buffer after its update
    (storage ``resize_`` on CUDA), so it holds the plain loop's memory less the gradients."""
    gradients = 4 * sum(1024 * 1024 + 1024 for _ in range(4))
    slack = 1 << 20  # the step buffer's tail, the loss, the generator's state
    plain = cuda_bytes_after_three_steps(None)
    assert plain >= 4 * gradients  # weights, gradients, Adam's two moments
    assert cuda_bytes_after_three_steps(1) <= plain + slack
    assert cuda_bytes_after_three_steps(1, shard=True) <= plain + slack
    assert cuda_bytes_after_three_steps(3, shard=True) <= plain - gradients + slack


# -- precision and export ----------------------------------------------------------------------
def test_bf16_mixed_on_cuda_trains_like_the_cuda_autocast_loop(undisturbed, run_dir):
    expected = reference(autocast=torch.bfloat16)
    assert max_rel_diff(expected, undisturbed) > 1e-4  # bfloat16's forward is not float32's
    model, _, result = train(run_dir, 1, device="cuda", options={"precision": "bf16-mixed"})
    assert_ran_on_the_gpu(result)
    assert max_rel_diff(cpu_state(model), expected) < 1e-4
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_onnx_export_of_a_cuda_model(run_dir):
    pytest.importorskip("onnxruntime", reason="onnxruntime is not installed")
    model, _, result = train(run_dir, 1, device="cuda", epochs=1, options={"save_to_onnx": True})
    path = run_dir / "model" / "model.onnx"
    assert path.is_file()
    assert result.onnx_max_diff is not None and result.onnx_max_diff < 1e-4
    import numpy as np
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = torch.randn(5, 12)
    model.eval()
    with torch.no_grad():
        expected = model(x.cuda()).cpu().numpy()
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    assert np.abs(got - expected).max() < 1e-4


# -- NCCL: one GPU per worker ----------------------------------------------------------------
def test_an_aborted_nccl_group_is_replaced_by_a_new_one_in_the_same_process():
    """What the collective layer relies on when a generation ends on NCCL (collective.py): an
    operation is polled with ``is_completed`` (NCCL's ``wait(timeout)`` would tear the
    communicator down), ``abort()`` frees the communicator at once, and the same process then
    forms the next generation's group on the same GPU, its tensors still usable. A group of one
    rank: a single GPU cannot hold two NCCL ranks."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.HashStore()
    tensor = torch.ones(1 << 20, device="cuda")
    for generation in range(3):
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=30)
        group = dist.ProcessGroupNCCL(dist.PrefixStore(f"generation/{generation}/", store), 0, 1, options)
        work = group.allreduce([tensor])
        while not work.is_completed():
            pass
        work.wait()
        group.abort()
    assert torch.equal(tensor, torch.ones_like(tensor))  # a sum over one rank, three times
    tensor.mul_(2)
    torch.cuda.synchronize()


@pytest.mark.skipif(
    GPUS < 2, reason=f"NCCL needs a GPU per rank (it refuses two ranks on one GPU); this host has {GPUS}"
)
def test_nccl_workers_regroup_after_a_kill_and_keep_the_result(undisturbed, run_dir, tmp_path):
    workers = min(GPUS, 3)
    model, _, result = train(run_dir, workers, device="cuda", faults=[Kill(1, 4), HoldForJoin(7)], marker_dir=tmp_path)
    assert backend(run_dir) == "nccl"
    assert_exactly_once(run_dir)
    sizes = [g["workers"] for g in records(run_dir, "generation")]
    assert sizes[:2] == [workers, workers - 1] and sizes[-1] == workers, sizes
    assert max_rel_diff(cpu_state(model), undisturbed) < 1e-5
