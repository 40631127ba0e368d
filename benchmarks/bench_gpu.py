"""FabricModel on a CUDA GPU beside the loops a user would write by hand, from one run.

    PYTHONPATH=. python benchmarks/bench_gpu.py                 # every row, 2 rounds
    PYTHONPATH=. python benchmarks/bench_gpu.py --rows resnet,transformer --rounds 3 --steps 200
    PYTHONPATH=. python benchmarks/bench_gpu.py --rows gpt2,resnet50,startup,profile --out /tmp/traces
    PYTHONPATH=. python benchmarks/bench_gpu.py --rows gpt2,sharded,startup,profile --device cpu --small --steps 30

Rows (each figure a ratio against the baseline measured in the same round; runs interleaved;
every run a fresh process, so one run's CUDA caches and allocator do not help the next):

- ``resnet``: ResNet-18 (torchvision's layout, 11.2M parameters) on 3x32x32 images, batch 256;
- ``transformer``: a 4-layer, 256-wide transformer encoder language model, 128 tokens x 32;

  one FabricModel engine against the plain CUDA loop (the batch moved to the GPU, the loss read
  each step): throughput ratio (>= 1 is as fast) and the extra time per step in microseconds.
- ``shared``: two workers on the one GPU (``FABRIC_MODEL_WORKERS_PER_GPU=2``: gloo on CUDA
  tensors) against hand-written DDP with the same split (two ranks, batch 256 each), on NCCL
  where NCCL accepts two ranks on one GPU, else on gloo; the backend used is printed.
- ``recovery``: three workers on the GPU, one SIGKILLed inside a step: kill -> next committed
  step, and the state against an undisturbed run (bitwise, both ``deterministic=True``).
- ``gpt2``, ``resnet50`` (benchmarks/gpu_models.py): Hugging Face GPT-2 (6 x 512, 295 MB of
  state with AdamW) and a ResNet-50-sized CNN, fp32 and bf16-mixed (``--precisions``), one engine
  against the loop a user writes, over two epochs with snapshots and checkpoints at their
  defaults inside the timed span: the throughput over the whole span after the warm-up, not a
  median step, so what snapshots and checkpoints cost counts (target >= 0.98, ResNet >= 1.0).
- ``sharded``: the GPT-2 on 2 and 3 workers sharing the GPU, ``shard_optimizer_state=True``
  against the whole state on each, interleaved: throughput over the span and rank 0's peak GPU memory.
- ``startup``: the GPT-2 from building the model to the first committed step against the plain
  loop's first step, fresh processes (target: within 2 s), and run.json's start-up phases.
- ``profile``: the GPT-2's steps 30-39 on both sides: FabricModel's ``train(profile=(30, 40))``
  summary, the CUDA synchronisations each side made in those steps (torch's sync debug mode, by
  the line of Python that made each), and the two traces compared per step
  (benchmarks/trace_diff.py: operators, runtime calls, copies, kernels); ``--out`` keeps the traces.

Step times are stamped at each step's end, after the GPU finished it (both sides read the
loss), and compared as medians after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
WARMUP = 20
PROFILED = (30, 40)  # (gpu_models.PROFILED: the steps both sides profile)
BATCH = {"resnet": 256, "transformer": 32}
VOCAB, TOKENS, WIDTH = 2000, 128, 256


# -- workloads ----------------------------------------------------------------------------------
def basic_block(cin: int, cout: int, stride: int) -> nn.Module:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.down = (
                nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                if stride != 1 or cin != cout
                else nn.Identity()
            )

        def forward(self, x):
            y = F.relu(self.bn1(self.conv1(x)))
            return F.relu(self.bn2(self.conv2(y)) + self.down(x))

    return Block()


class ResNet18(nn.Module):
    """torchvision's resnet18 layout (11.2M parameters), with a CIFAR-sized stem."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [basic_block(cin, cout, stride), basic_block(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(512, classes)

    def forward(self, x):
        return self.head(self.layers(self.stem(x)).mean((2, 3)))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Parameter(torch.zeros(TOKENS, WIDTH))
        layer = nn.TransformerEncoderLayer(WIDTH, 4, 4 * WIDTH, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        mask = nn.Transformer.generate_square_subsequent_mask(TOKENS, device=tokens.device)
        return self.head(self.encoder(self.embed(tokens) + self.position, mask=mask, is_causal=True))


def lm_loss(output, target):
    return F.cross_entropy(output.flatten(0, 1), target.flatten())


def make(workload: str) -> tuple[nn.Module, object]:
    torch.manual_seed(0)
    if workload == "resnet":
        return ResNet18(), F.cross_entropy
    return TinyLM(), lm_loss


def dataset(workload: str, samples: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    if workload == "resnet":
        x = torch.randn(samples, 3, 32, 32, generator=g)
        return torch.utils.data.TensorDataset(x, torch.randint(0, 10, (samples,), generator=g))
    tokens = torch.randint(0, VOCAB, (samples, TOKENS + 1), generator=g)
    return torch.utils.data.TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


# -- one run each (in a child process) ------------------------------------------------------
def loop(model: nn.Module, loss_fn, loader) -> list[float]:
    """The textbook CUDA loop: each batch moved to the GPU, the loss read each step."""
    opt, times = optimizer(model), []
    for x, y in loader:
        x, y = x.cuda(), y.cuda()
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        loss.item()
        times.append(time.perf_counter())
    return times


def plain(workload: str, steps: int) -> list[float]:
    model, loss_fn = make(workload)
    loader = torch.utils.data.DataLoader(dataset(workload, steps * BATCH[workload]), BATCH[workload], shuffle=True)
    return loop(model.cuda(), loss_fn, loader)


class StepClock:
    """A worker callback: rank 0 stamps each step's end, written when training ends."""

    def __init__(self, path: str) -> None:
        self.path, self.times = path, []

    def on_batch_end(self, step: int) -> None:
        self.times.append(time.perf_counter())

    def on_train_end(self) -> None:
        from fabric_model.context import worker_context

        context = worker_context()
        if context is not None and context.rank == 0:
            Path(self.path).write_text(json.dumps(self.times))


class Quiet:
    def on_train_begin(self) -> None:
        pass


def fabric(workload: str, steps: int, engines: int) -> list[float]:
    from fabric_model import Callback, FabricModel

    class Clock(StepClock, Callback):
        pass

    model, loss_fn = make(workload)
    samples = steps * BATCH[workload] * engines
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "times.json")
        FabricModel(
            model, lambda: (dataset(workload, samples), None), loss_fn, optimizer(model), metrics=[],
            driver_logger_callback=Quiet(), user_callback=[Clock(path)],
        ).train(1, BATCH[workload], engines, run_dir=os.path.join(tmp, "run"), seed=0)  # fmt: skip
        return json.loads(Path(path).read_text())


def _ddp_rank(rank: int, workload: str, steps: int, port: int, backend: str, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model, loss_fn = make(workload)
        model = DistributedDataParallel(model.cuda(), device_ids=[0])
        data = dataset(workload, steps * BATCH[workload] * 2)
        sampler = torch.utils.data.distributed.DistributedSampler(data, 2, rank, shuffle=True, seed=0)
        times = loop(model, loss_fn, torch.utils.data.DataLoader(data, BATCH[workload], sampler=sampler))
        if rank == 0:
            Path(out).write_text(json.dumps(times))
    finally:
        dist.destroy_process_group()


def ddp(workload: str, steps: int, backend: str, out: str) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_rank, args=(workload, steps, port, backend, out), nprocs=2, join=True)


def recovery(steps: int) -> dict:
    """An undisturbed run and one with worker 1 SIGKILLed inside a step, both ``deterministic=True``
    (cuDNN's default kernels are not deterministic: two plain runs differ), compared bitwise."""
    from fabric_model import FabricModel
    from fabric_model.testing import FaultInjector, Kill, fired_at

    os.environ["FABRIC_MODEL_WORKERS_PER_GPU"] = "3"
    final, log, killed = [], [], 0.0
    for disturbed in (False, True):
        model, loss_fn = make("resnet")
        with tempfile.TemporaryDirectory() as tmp:
            injector = FaultInjector([Kill(1, steps // 2)] if disturbed else [], tmp)
            FabricModel(
                model, lambda: (dataset("resnet", steps * 64 * 3), None), loss_fn, optimizer(model), metrics=[],
                worker_logger_callback=injector, driver_logger_callback=Quiet(),
            ).train(1, 64, 3, run_dir=os.path.join(tmp, "run"), seed=0, deterministic=True)  # fmt: skip
            final.append({k: v.detach().cpu() for k, v in model.state_dict().items()})
            if disturbed:
                killed = fired_at(tmp, 0)
                log = [json.loads(x) for x in Path(tmp, "run", "logs", "metrics.jsonl").read_text().splitlines()]
    first = min(r["generation"] for r in log if r["type"] == "generation" and r["time"] > killed)
    after = [r for r in log if r["type"] == "train" and r["generation"] >= first]
    equal = all(torch.equal(final[0][k], final[1][k]) for k in final[0])
    return {"kill_to_next": after[0]["time"] - killed, "bitwise_equal": equal}


def hf_child(kind: str, workload: str, steps: int, out: str, extra: list[str]) -> int:
    """The rows of benchmarks/gpu_models.py: ``extra`` is device, precision, small (0/1), trace folder."""
    import gpu_models as g

    device, precision, small, traces = extra[0], extra[1], extra[2] == "1", extra[3]
    if kind == "hf-plain":
        result: object = g.plain(workload, steps, device, precision, small)
    elif kind == "hf-fabric":
        result = g.fabric(workload, steps, device, precision, small)
    elif kind == "hf-profile":
        result = g.fabric(workload, steps, device, precision, small, profile=g.PROFILED, out_dir=traces)
    elif kind in ("hf-shared", "hf-sharded"):
        engines = int(extra[4])
        result = g.fabric(workload, steps, device, precision, small, engines=engines, shard=kind == "hf-sharded")
    elif kind == "hf-plain-profile":
        result = g.plain_profile(workload, steps, device, precision, small, traces)
    elif kind == "hf-plain-first":
        result = g.plain_first_step(workload, device, small)
    else:
        result = g.fabric_first_commit(workload, device, small)
    Path(out).write_text(json.dumps(result))
    return 0


def child(argv: list[str]) -> int:
    kind, workload, steps, out = argv[0], argv[1], int(argv[2]), argv[3]
    if kind.startswith("hf-"):
        return hf_child(kind, workload, steps, out, argv[4:])
    if kind.startswith("ddp-"):
        ddp(workload, steps, kind.removeprefix("ddp-"), out)
        return 0
    if kind == "recovery":
        Path(out).write_text(json.dumps(recovery(steps)))
        return 0
    if kind == "shared":
        os.environ["FABRIC_MODEL_WORKERS_PER_GPU"] = "2"
    runs = {"plain": plain, "fabric1": lambda w, s: fabric(w, s, 1), "shared": lambda w, s: fabric(w, s, 2)}
    Path(out).write_text(json.dumps(runs[kind](workload, steps)))
    return 0


# -- the parent: interleaved rounds, ratios -------------------------------------------------
def run(kind: str, workload: str, steps: int, tmp: Path, extra: tuple[str, ...] = ()) -> object | None:
    out = tmp / f"{kind}-{workload}.json"
    path = [str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    if extra and extra[0] == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU check: workers on the CPU, as the script's plain loop
    done = subprocess.run(
        [sys.executable, __file__, "--child", kind, workload, str(steps), str(out), *extra],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    if done.returncode != 0 or not out.exists():
        print(f"  {kind} {workload} failed: {done.stderr.strip()[-1500:]}", file=sys.stderr)
        return None
    result = json.loads(out.read_text())
    out.unlink()
    return result


def step_time(times: list[float]) -> float:
    """The median step time after the warm-up."""
    gaps = [b - a for a, b in zip(times[WARMUP:], times[WARMUP + 1 :])]
    return statistics.median(gaps)


def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    if not values:
        return "-"
    s = sorted(values)
    return f"{fmt.format(statistics.median(s))} [{fmt.format(s[0])}-{fmt.format(s[-1])}]"


def one_engine(workload: str, rounds: int, steps: int, tmp: Path) -> None:
    ratios, overheads, plains = [], [], []
    for _ in range(rounds):
        base, ours = run("plain", workload, steps, tmp), run("fabric1", workload, steps, tmp)
        if base is None or ours is None:
            continue
        p, f = step_time(base), step_time(ours)  # type: ignore[arg-type]
        plains.append(p * 1e3)
        ratios.append(p / f)
        overheads.append((f - p) * 1e6)
    print(f"{workload:12s} 1 engine vs plain CUDA loop: throughput {spread(ratios)}x, "
          f"overhead {spread(overheads, '{:.0f}')} us/step, plain step {spread(plains, '{:.2f}')} ms")  # fmt: skip


def shared(workload: str, rounds: int, steps: int, tmp: Path) -> None:
    backend = "nccl" if run("ddp-nccl", workload, 30, tmp) is not None else "gloo"
    print(f"{workload:12s} hand DDP, two ranks on one GPU: NCCL {'ran' if backend == 'nccl' else 'refused'}")
    ratios, theirs = [], []
    for _ in range(rounds):
        base, ours = run(f"ddp-{backend}", workload, steps, tmp), run("shared", workload, steps, tmp)
        if base is None or ours is None:
            continue
        d, f = step_time(base), step_time(ours)  # type: ignore[arg-type]
        theirs.append(d * 1e3)
        ratios.append(d / f)
    print(f"{workload:12s} 2 workers on 1 GPU vs hand DDP ({backend}): throughput {spread(ratios)}x, "
          f"DDP step {spread(theirs, '{:.2f}')} ms")  # fmt: skip


def span_time(times: list[float]) -> float:
    """Seconds a step over the span after the warm-up: a snapshot's or checkpoint's cost counts."""
    timed = times[WARMUP:]
    return (timed[-1] - timed[0]) / (len(timed) - 1)


def slow_steps(times: list[float], count: int = 4) -> str:
    """The ``count`` longest steps after the warm-up, as ``ms@step`` (where a span's time went)."""
    gaps = [(b - a, i + 1) for i, (a, b) in enumerate(zip(times[:-1], times[1:])) if i + 1 > WARMUP]
    return ", ".join(f"{g * 1e3:.0f}ms@{i}" for g, i in sorted(gaps, reverse=True)[:count])


def real_model(workload: str, args: argparse.Namespace, tmp: Path) -> None:
    """The GPT-2 or ResNet-50 row, per precision: FabricModel against the plain loop, interleaved."""
    for precision in args.precisions.split(","):
        extra = (args.device, precision, "1" if args.small else "0", args.out)
        ratios, medians, plains, uploads, slowest = [], [], [], [], ""
        for _ in range(args.rounds):
            base = run("hf-plain", workload, args.steps, tmp, extra)
            ours = run("hf-fabric", workload, args.steps, tmp, extra)
            if base is None or ours is None:
                continue
            times: list[float] = ours["times"]  # type: ignore[index]
            p, f = span_time(base), span_time(times)  # type: ignore[arg-type]
            plains.append(p * 1e3)
            ratios.append(p / f)
            medians.append(step_time(base) / step_time(times))  # type: ignore[arg-type]
            uploads = ours["uploads"]  # type: ignore[index]
            slowest = slow_steps(times)
        sent = "; ".join(uploads) or "none"
        print(f"{workload:9s} {precision:10s} 1 engine vs the plain loop: throughput {spread(ratios)}x "
              f"(median step {spread(medians)}x), plain step {spread(plains, '{:.2f}')} ms; "
              f"slowest steps in the last run: {slowest}; uploads in the last run: {sent}")  # fmt: skip


def sharded(args: argparse.Namespace, tmp: Path) -> None:
    """The GPT-2 (AdamW) on 2 and 3 workers sharing the GPU, its optimizer state sharded against
    whole, interleaved: throughput over the span and rank 0's peak GPU memory."""
    for engines in (2, 3):
        extra = (args.device, "32", "1" if args.small else "0", args.out, str(engines))
        ratios, memory, whole_ms = [], [], []
        for _ in range(args.rounds):
            whole = run("hf-shared", "gpt2", args.steps, tmp, extra)
            ours = run("hf-sharded", "gpt2", args.steps, tmp, extra)
            if whole is None or ours is None:
                continue
            w, s = span_time(whole["times"]), span_time(ours["times"])  # type: ignore[index]
            whole_ms.append(w * 1e3)
            ratios.append(w / s)
            if whole["peak_bytes"] and ours["peak_bytes"]:  # type: ignore[index]
                memory.append(ours["peak_bytes"] / whole["peak_bytes"])  # type: ignore[index]
        print(f"sharded   gpt2 {engines} workers on 1 GPU, optimizer state sharded vs whole: throughput "
              f"{spread(ratios)}x, rank 0's peak GPU memory {spread(memory)}x (none: not on a GPU), "
              f"whole step {spread(whole_ms, '{:.2f}')} ms")  # fmt: skip


def startup(args: argparse.Namespace, tmp: Path) -> None:
    extra = (args.device, "32", "1" if args.small else "0", args.out)
    plains, ours, phases, notes = [], [], {}, {}
    for _ in range(args.rounds):
        base = run("hf-plain-first", "gpt2", 0, tmp, extra)
        fabric = run("hf-fabric-first", "gpt2", 0, tmp, extra)
        if base is None or fabric is None:
            continue
        plains.append(float(base))  # type: ignore[arg-type]
        ours.append(fabric["seconds"])  # type: ignore[index]
        for name, seconds in fabric["startup"]["phases"]:  # type: ignore[index]
            phases.setdefault(name, []).append(seconds)
        notes = fabric["startup"].get("notes", {})  # type: ignore[index]
    beyond = [o - p for o, p in zip(ours, plains)]
    plain_s, ours_s, beyond_s = spread(plains, "{:.2f}"), spread(ours, "{:.2f}"), spread(beyond, "{:+.2f}")
    print(f"startup   gpt2: model built -> first step {plain_s} s (plain), -> first commit {ours_s} s "
          f"(fabric_model), {beyond_s} s beyond")  # fmt: skip
    for name, values in phases.items():
        print(f"            {name:<42} {statistics.median(values):7.3f} s")
    for name, text in notes.items():
        print(f"            {name}: {text}")


def profile(args: argparse.Namespace, tmp: Path) -> None:
    """Steps 30-39 of the GPT-2 on both sides: the summary, the synchronisations, the traces compared."""
    from trace_diff import read, report

    traces = args.out or str(tmp / "traces")
    for precision in args.precisions.split(","):
        extra = (args.device, precision, "1" if args.small else "0", traces)
        steps = max(args.steps, 60)
        base = run("hf-plain-profile", "gpt2", steps, tmp, extra)
        ours = run("hf-profile", "gpt2", steps, tmp, extra)
        if base is None or ours is None:
            continue
        print(f"profile   gpt2 {precision}:\n{ours['summary']}")  # type: ignore[index]
        for side, result in (("plain loop", base), ("fabric_model", ours)):
            syncs = result["syncs"]  # type: ignore[index]
            if syncs is None:
                print(f"  CUDA synchronisations, {side}: none to count on a CPU")
                continue
            count = sum(syncs.values()) / (PROFILED[1] - PROFILED[0])
            print(f"  CUDA synchronisations, {side}: {count:.1f} a step")
            for where, n in sorted(syncs.items(), key=lambda item: -item[1]):
                print(f"    {n:5d}  {where}")
        if "trace" in ours:  # type: ignore[operator]
            steps_in = PROFILED[1] - PROFILED[0]
            lines = report(read(base["trace"], steps_in), read(ours["trace"], steps_in))  # type: ignore[index]
            print(f"  the two traces, steps {PROFILED[0]}-{PROFILED[1] - 1} (benchmarks/trace_diff.py):")
            print("\n".join("    " + line for line in lines))


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="resnet,transformer,shared,recovery,gpt2,resnet50,sharded,startup,profile")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--precisions", default="32,bf16-mixed", help="for the gpt2, resnet50 and profile rows")
    parser.add_argument("--device", default="cuda", help="cpu: the gpt2/resnet50/startup/profile rows on the CPU")
    parser.add_argument("--small", action="store_true", help="small sizes (a check of the script, not a figure)")
    parser.add_argument("--out", default="", help="a folder for the profile rows' traces")
    args = parser.parse_args()
    rows = args.rows.split(",")
    if args.device == "cpu":
        print(f"torch {torch.__version__} on the CPU: a check of the script, not GPU figures")
    else:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, {torch.cuda.get_device_name(0)}")
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        for workload in ("gpt2", "resnet50"):
            if workload in rows:
                real_model(workload, args, tmp)
        if "sharded" in rows:
            sharded(args, tmp)
        if "startup" in rows:
            startup(args, tmp)
        if "profile" in rows:
            profile(args, tmp)
        if args.device == "cpu":
            return 0
        for workload in ("resnet", "transformer"):
            if workload in rows:
                one_engine(workload, args.rounds, args.steps, tmp)
        if "shared" in rows:
            shared("resnet", args.rounds, args.steps, tmp)
        if "recovery" in rows:
            result = run("recovery", "resnet", 60, tmp)
            if result is not None:
                r: dict = result  # type: ignore[assignment]
                print(f"recovery     3 workers on 1 GPU, deterministic, one SIGKILLed in a step: kill -> next "
                      f"step {r['kill_to_next'] * 1e3:.0f} ms; state bitwise equal to the undisturbed run's: "
                      f"{r['bitwise_equal']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
