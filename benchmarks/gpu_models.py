"""The real-model rows of ``bench_gpu.py`` (issue 45): Hugging Face GPT-2 (6 layers, 512 wide, built
from a config, 295 MB of state with AdamW) and a ResNet-50-sized CNN (bottleneck blocks 3-4-6-3,
25.6M parameters), in fp32 and bf16-mixed, one FabricModel engine against the loop a user
writes, with snapshots and checkpoints at their defaults inside the timed span; the start-up
of the GPT-2 against the plain loop's (fresh processes), with run.json's phases; and a profile
of the GPT-2 step with ``train(profile=...)``.

Each function here runs in a child process (``bench_gpu.py --child``). ``--device cpu`` (with
``--small``) runs the same code on a CPU, small, to check the script where there is no GPU (the
children then see no GPU: ``CUDA_VISIBLE_DEVICES`` empty from their start).
"""

from __future__ import annotations

import collections
import json
import os
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

GPT2 = {"layers": 6, "width": 512, "heads": 8, "vocab": 8192, "tokens": 256, "batch": 16}
GPT2_SMALL = {"layers": 2, "width": 64, "heads": 2, "vocab": 512, "tokens": 32, "batch": 4}
RESNET = {"size": 128, "batch": 64}
RESNET_SMALL = {"size": 32, "batch": 4}


def sizes(workload: str, small: bool) -> dict[str, int]:
    if workload == "gpt2":
        return GPT2_SMALL if small else GPT2
    return RESNET_SMALL if small else RESNET


# -- the models ----------------------------------------------------------------------------
def gpt2(small: bool) -> nn.Module:
    import transformers

    s = sizes("gpt2", small)
    config = transformers.GPT2Config(
        vocab_size=s["vocab"], n_positions=s["tokens"], n_embd=s["width"], n_layer=s["layers"], n_head=s["heads"]
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * 4
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout),
        )  # fmt: skip
        self.down = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.down(x))


class ResNet50(nn.Module):
    """torchvision's resnet50 layout (bottlenecks 3-4-6-3, 25.6M parameters, 1000 classes)."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)
        )
        blocks, cin = [], 64
        for width, count, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(count):
                blocks.append(Bottleneck(cin, width, stride if i == 0 else 1))
                cin = width * 4
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def resnet50(small: bool) -> nn.Module:
    torch.manual_seed(0)
    return ResNet50()


def make(workload: str, small: bool) -> nn.Module:
    return gpt2(small) if workload == "gpt2" else resnet50(small)


def optimizer(workload: str, model: nn.Module) -> torch.optim.Optimizer:
    if workload == "gpt2":
        return torch.optim.AdamW(model.parameters(), lr=3e-4)
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


# -- the data ------------------------------------------------------------------------------
class TokenData(torch.utils.data.Dataset):
    """Dict samples with ``labels``, as a Hugging Face causal LM takes them."""

    def __init__(self, samples: int, small: bool) -> None:
        s = sizes("gpt2", small)
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, s["vocab"], (samples, s["tokens"]), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def data(workload: str, samples: int, small: bool) -> Any:
    if workload == "gpt2":
        return TokenData(samples, small)
    s = sizes("resnet50", small)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 3, s["size"], s["size"], generator=g)
    return torch.utils.data.TensorDataset(x, torch.randint(0, 1000, (samples,), generator=g))


def loss_function(workload: str) -> Any:
    return None if workload == "gpt2" else F.cross_entropy  # GPT-2: the model's own loss


# -- the runs --------------------------------------------------------------------------------
def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


#: The global steps both sides profile (FabricModel's ``train(profile=PROFILED)``).
PROFILED = (30, 40)


class SyncCount:
    """The CUDA synchronisations this thread makes, by the line of Python that made each: torch's
    sync debug mode warns at each one. Nothing to count on a CPU (``stop`` gives None)."""

    def __init__(self, device: str) -> None:
        self.on = device.startswith("cuda")
        self.where: collections.Counter[str] = collections.Counter()
        self._caught: Any = None

    def start(self) -> None:
        if not self.on:
            return
        self._caught = warnings.catch_warnings()
        self._caught.__enter__()
        warnings.simplefilter("always")  # every one, not once per line
        warnings.showwarning = self._seen
        torch.cuda.set_sync_debug_mode("warn")

    def _seen(self, message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        if "synchroniz" in str(message).lower():
            self.where[_caller()] += 1

    def stop(self) -> dict[str, int] | None:
        if not self.on or self._caught is None:
            return None
        torch.cuda.set_sync_debug_mode("default")
        self._caught.__exit__(None, None, None)
        self._caught = None
        return dict(self.where)


def _caller() -> str:
    """The innermost frame outside torch, warnings and this file, and the torch frame it called."""
    torch_dir = os.path.dirname(torch.__file__)
    inner = ""
    for frame in reversed(traceback.extract_stack()[:-3]):  # (this function, _seen, warnings' own)
        name = frame.filename
        if name == __file__ or name.endswith("warnings.py"):
            continue
        if name.startswith(torch_dir):
            inner = inner or f"{os.path.relpath(name, os.path.dirname(torch_dir))}:{frame.lineno}"
            continue
        short = name.split("/site-packages/")[-1].split("/work/")[-1]
        return f"{short}:{frame.lineno} {frame.name}" + (f" -> {inner}" if inner else "")
    return inner or "?"


class Window:
    """Watches steps ``PROFILED`` of the plain loop: the torch profiler (trace to ``trace``) and
    the CUDA synchronisations, started before the first one's batch and stopped after the last."""

    def __init__(self, device: str, trace: str) -> None:
        self.device, self.trace, self.syncs = device, trace, SyncCount(device)
        self.profiler: Any = None
        self.counted: dict[str, int] | None = None

    def begin(self, step: int) -> None:
        if step != PROFILED[0]:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.startswith("cuda"):
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        sync(self.device)
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.start()
        self.syncs.start()

    def end(self, step: int) -> None:
        if step != PROFILED[1] - 1 or self.profiler is None:
            return
        self.counted = self.syncs.stop()
        sync(self.device)  # the window's kernels are the window's time, as FabricModel's profile has it
        self.profiler.stop()
        self.profiler.export_chrome_trace(self.trace)


def plain(
    workload: str, steps: int, device: str, precision: str, small: bool, window: Window | None = None
) -> list[float]:
    """The loop a user writes: a shuffled DataLoader, the batch to the device, autocast for
    bf16-mixed, the loss read each step; a stamp at each step's end (``window``: steps
    ``PROFILED`` profiled, their synchronisations counted)."""
    model = make(workload, small).to(device)
    opt = optimizer(workload, model)
    batch = sizes(workload, small)["batch"]
    loader = torch.utils.data.DataLoader(data(workload, steps * batch, small), batch, shuffle=True)
    dtype = torch.bfloat16 if precision == "bf16-mixed" else None
    times = []
    batches = iter(loader)
    for i in range(len(loader)):
        if window is not None:
            window.begin(i)  # before the batch is read, as FabricModel's window opens
        b = next(batches)
        with torch.autocast(device.split(":")[0], dtype=dtype, enabled=dtype is not None):
            if workload == "gpt2":
                loss = model(**{k: v.to(device) for k, v in b.items()}).loss
            else:
                loss = F.cross_entropy(model(b[0].to(device)), b[1].to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss.item()
        times.append(time.perf_counter())
        if window is not None:
            window.end(i)
    return times


def plain_profile(workload: str, steps: int, device: str, precision: str, small: bool, out_dir: str) -> dict:
    """The plain loop with steps ``PROFILED`` profiled: its trace's path and the synchronisations."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    window = Window(device, str(Path(out_dir, f"{workload}-{precision}-plain.pt.trace.json")))
    plain(workload, steps, device, precision, small, window)
    return {"trace": window.trace, "syncs": window.counted}


class _Clock:
    """A worker callback: rank 0 stamps each step's end, written when training ends; with
    ``device``, it counts the CUDA synchronisations of steps ``PROFILED`` too (steps counted
    from the run's first: this benchmark redoes none)."""

    def __init__(self, path: str, device: str = "") -> None:
        self.path, self.times = path, []
        self.syncs = SyncCount(device) if device else None
        self.counted: dict[str, int] | None = None

    def on_batch_begin(self, step: int) -> None:
        if self.syncs is not None and len(self.times) == PROFILED[0]:
            self.syncs.start()

    def on_batch_end(self, step: int) -> None:
        self.times.append(time.perf_counter())
        if self.syncs is not None and len(self.times) == PROFILED[1]:
            self.counted = self.syncs.stop()

    def on_train_end(self) -> None:
        from fabric_model.context import worker_context

        context = worker_context()
        if context is not None and context.rank == 0:
            peak = torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else None
            Path(self.path).write_text(json.dumps({"times": self.times, "syncs": self.counted, "peak_bytes": peak}))


class _Quiet:
    def on_train_begin(self) -> None:
        pass


def fabric(
    workload: str,
    steps: int,
    device: str,
    precision: str,
    small: bool,
    profile: Any = None,
    out_dir: str = "",
    engines: int = 1,
    shard: bool = False,
) -> dict[str, Any]:
    """``engines`` workers (sharing the one GPU where there are several), two epochs (a
    checkpoint at the first's end, inside the timed span), snapshots at their defaults; the step
    stamps, run.json's start-up, the worker log's upload lines, the peak GPU memory of rank 0
    and, with ``profile``, the summary (the trace is copied to ``out_dir``). ``shard``: each
    worker holds its slices of the optimizer state (``shard_optimizer_state=True``)."""
    from fabric_model import Callback, FabricModel

    class Clock(_Clock, Callback):
        pass

    if engines > 1:  # (read when train() sizes the run: this child's own environment)
        os.environ["FABRIC_MODEL_WORKERS_PER_GPU" if device.startswith("cuda") else "FABRIC_MODEL_CPU_WORKERS"] = str(
            engines
        )
    model = make(workload, small)
    batch = sizes(workload, small)["batch"]  # each worker's, as train() takes it (IBM's engines' batch)
    with tempfile.TemporaryDirectory() as tmp:
        path, run_dir = os.path.join(tmp, "times.json"), Path(tmp, "run")
        fm = FabricModel(
            model, lambda: (data(workload, steps * batch * engines // 2, small), None), loss_function(workload),
            optimizer(workload, model), metrics=[], driver_logger_callback=_Quiet(),
            user_callback=[Clock(path, device if profile is not None else "")], precision=precision,
        )  # fmt: skip
        fm.train(
            2, batch, engines, run_dir=str(run_dir), seed=0, profile=profile, verbose=0, shard_optimizer_state=shard
        )
        logs = "".join(p.read_text() for p in (run_dir / "logs").glob("worker-*.log"))
        clocked = json.loads(Path(path).read_text())
        result = {
            "times": clocked["times"],
            "syncs": clocked["syncs"],
            "peak_bytes": clocked["peak_bytes"],
            "startup": json.loads((run_dir / "run.json").read_text()).get("startup"),
            "uploads": [line.split(": ", 1)[-1] for line in logs.splitlines() if " sent: " in line],
        }
        if profile is not None:
            result["summary"] = (run_dir / "profile" / "summary.txt").read_text()
            if out_dir:
                Path(out_dir).mkdir(parents=True, exist_ok=True)
                for trace in (run_dir / "profile").glob("*.pt.trace.json"):
                    copy = Path(out_dir, f"{workload}-{precision}-{trace.name}")
                    copy.write_bytes(trace.read_bytes())
                    result["trace"] = str(copy)
        return result


def plain_first_step(workload: str, device: str, small: bool) -> float:
    """Seconds from building the model to the end of the plain loop's first step (the process
    has imported torch already, as the script that calls train() has)."""
    began = time.perf_counter()
    model = make(workload, small).to(device)
    opt = optimizer(workload, model)
    b = data(workload, 1, small)[0]
    if workload == "gpt2":
        loss = model(**{k: v[None].to(device) for k, v in b.items()}).loss
    else:
        loss = F.cross_entropy(model(b[0][None].to(device)), b[1][None].to(device))
    loss.backward()
    opt.step()
    loss.item()
    sync(device)
    return time.perf_counter() - began


def fabric_first_commit(workload: str, device: str, small: bool) -> dict[str, Any]:
    """Seconds from building the model to FabricModel's first committed step, and run.json's phases."""
    from fabric_model import FabricModel

    class Stamp:
        def __init__(self) -> None:
            self.first: float | None = None

        def log_train_metrics(self, metrics: Any, iteration: int, epoch: int, workers: int) -> None:
            if self.first is None:
                self.first = time.perf_counter()

    began = time.perf_counter()
    model = make(workload, small)
    stamp = Stamp()
    batch = sizes(workload, small)["batch"]
    with tempfile.TemporaryDirectory() as tmp:
        fm = FabricModel(
            model, lambda: (data(workload, 4 * batch, small), None), loss_function(workload),
            optimizer(workload, model), metrics=[], driver_logger_callback=stamp,
        )  # fmt: skip
        fm.train(1, batch, 1, run_dir=os.path.join(tmp, "run"), seed=0, verbose=0)
        startup = json.loads(Path(tmp, "run", "run.json").read_text()).get("startup")
    assert stamp.first is not None
    return {"seconds": stamp.first - began, "startup": startup}
