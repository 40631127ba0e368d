"""Custom steps, user callbacks, and scripts written for IBM's FabricModel."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fabric_model import Callback, FabricModel
from fabric_model.step.plan import Plan
from fabric_model.testing import FaultInjector, Kill

from .helpers import accuracy, fresh_model_and_optimizer, make_data, max_rel_diff, records, sample_indices_of_steps

pytestmark = pytest.mark.processes

REPO = Path(__file__).resolve().parents[1]
DATA = make_data(120)

IBM_SCRIPT = textwrap.dedent("""
    import argparse, json, sys
    import torch, torch.nn as nn, torch.nn.functional as F
    sys.path.insert(0, {repo!r})
    from fabric_model import FabricModel, Callback

    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()           # the framework must leave sys.argv alone

    def getDatasets():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(96, 12, generator=g)
        y = (x[:, 0] > 0).long()
        return [(x[i].clone(), y[i]) for i in range(96)], [(x[i].clone(), y[i]) for i in range(32)]

    class LRSchedule(Callback):
        def on_epoch_begin(self, epoch):
            for group in self.params["optimizer"].param_groups:
                group["lr"] = args.lr * (0.5 ** epoch)

    class OldLogger:                      # IBM's older logger signature
        def __init__(self): self.calls = []
        def log_train_metrics(self, loss, acc, completed_batch, worker=0):
            self.calls.append([loss, acc, completed_batch, worker])
        def log_test_metrics(self, loss, acc, completed_batch, worker=0):
            self.calls.append(["test", loss, acc, completed_batch])

    def train_step(model, data, eva, train_loader, fn_args):
        inputs, target = data
        output = model(inputs)
        loss = model.get_loss_function()(output, target)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), fn_args["clip"])
        acc = (output.argmax(1) == target).float().mean()
        return acc, loss

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    logger = OldLogger()
    edt_model = FabricModel(model, getDatasets, F.cross_entropy, optimizer,
                            driver_logger=logger, user_callback=[LRSchedule()],
                            fn_step_train=train_step, fn_args={{"clip": 0.5}})
    result = edt_model.train(args.epochs, 16, 2, worker_memory="4g", driver_memory="2g", run_dir={run_dir!r})
    print(json.dumps({{"argv": sys.argv[1:], "lr": optimizer.param_groups[0]["lr"],
                      "digests": list(result.replica_digests.values()), "calls": logger.calls[:3],
                      "ncalls": len(logger.calls), "zip": edt_model.download()}}))
""")


def test_ibm_style_script_runs_unchanged(tmp_path):
    script = tmp_path / "ibm_script.py"
    script.write_text(IBM_SCRIPT.format(repo=str(REPO), run_dir=str(tmp_path / "run")))
    proc = subprocess.run(
        [sys.executable, str(script), "--epochs", "3", "--lr", "0.2"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["argv"] == ["--epochs", "3", "--lr", "0.2"]
    assert out["lr"] == pytest.approx(0.2 * 0.5**2)  # the schedule ran, and the caller's optimizer has it
    assert len(out["digests"]) == 2 and len(set(out["digests"])) == 1  # every replica took the same schedule
    loss, acc, completed_batch, workers = out["calls"][0]
    # The step's accuracy (a fraction) in percent, as IBM's loggers take it (they divide by 100).
    assert isinstance(loss, float) and 1 < acc <= 100 and completed_batch == 1 and workers == 2
    assert out["ncalls"] == 3 * 3 + 3  # 3 steps an epoch, plus a validation per epoch
    with zipfile.ZipFile(out["zip"]) as archive:
        assert "model/model.pt" in archive.namelist()


def plain_step(model, data, eva, train_loader, fn_args):
    inputs, target = data
    output = model(inputs)
    loss = model.get_loss_function()(output, target)
    loss.backward()
    return eva[0](output, target), loss


def test_custom_step_without_clipping_gives_the_built_in_weights(tmp_path):
    states = []
    for step in (None, plain_step):
        model, opt = fresh_model_and_optimizer()
        fm = FabricModel(model, lambda: (DATA, None), F.cross_entropy, opt, metrics=[accuracy], fn_step_train=step)
        result = fm.train(2, 8, 2, seed=5, run_dir=tmp_path / ("custom" if step else "builtin"))
        states.append(model.state_dict())
        assert len(set(result.replica_digests.values())) == 1
    assert max_rel_diff(states[1], states[0]) <= 1e-5


def test_custom_test_function_is_used_for_validation(run_dir):
    def fn_test(model, test_iter, fn_args):
        seen = [(model(x), y) for x, y in test_iter]
        out, target = torch.cat([o for o, _ in seen]), torch.cat([t for _, t in seen])
        return fn_args["scale"] * (out.argmax(1) == target).float().mean(), F.cross_entropy(out, target)

    model, opt = fresh_model_and_optimizer()
    result = FabricModel(
        model,
        lambda: (DATA, DATA[:40]),
        F.cross_entropy,
        opt,
        fn_step_train=plain_step,
        fn_test=fn_test,
        fn_args={"scale": 100.0},
        metrics=[accuracy],
    ).train(1, 8, 2, run_dir=run_dir)
    assert set(result.test_history[0]) == {"epoch", "loss", "accuracy"}
    assert 1.0 < result.test_history[0]["accuracy"] <= 100.0  # the scaled accuracy: fn_test's own value


def step_that_calls_optimizer_step(model, data, eva, train_loader, fn_args):
    loss = F.cross_entropy(model(data[0]), data[1])
    loss.backward()
    model.get_optimizer().step()
    return 0.0, loss


def test_optimizer_step_in_a_custom_step_is_refused_with_a_hint(run_dir):
    model, opt = fresh_model_and_optimizer()
    fm = FabricModel(model, lambda: (DATA, None), F.cross_entropy, opt, fn_step_train=step_that_calls_optimizer_step)
    with pytest.raises(RuntimeError, match="leave the step to fabric_model"):
        fm.train(1, 8, 2, run_dir=run_dir)


def test_custom_step_under_a_worker_kill_keeps_exactly_once(run_dir, tmp_path):
    model, opt = fresh_model_and_optimizer()
    fm = FabricModel(
        model,
        lambda: (DATA, None),
        F.cross_entropy,
        opt,
        metrics=[accuracy],
        fn_step_train=plain_step,
        worker_logger_callback=FaultInjector([Kill(1, 4)], tmp_path),
    )
    result = fm.train(2, 8, 3, seed=5, run_dir=run_dir)
    plan = Plan(len(DATA), 8, 3, 5)
    used = sample_indices_of_steps(plan, records(run_dir, "train"))
    for epoch in range(2):
        assert sorted(used[epoch]) == list(range(len(DATA)))
    assert len(set(result.replica_digests.values())) == 1
    assert any(g["workers"] < 3 for g in records(run_dir, "generation"))


class Bad:
    pass


@pytest.mark.parametrize(
    "kwargs, fragments",
    [
        (
            dict(driver_logger=object(), driver_logger_callback=object()),
            ["`driver_logger`", "`driver_logger_callback`"],
        ),
        (dict(user_callback=[Callback]), ["user_callback[0]", "instance"]),
        (dict(user_callback=[Bad()]), ["user_callback[0]", "fabric_model.Callback"]),
        (dict(fn_step_train="step"), ["`fn_step_train`", "(metric, loss)"]),
    ],
)
def test_compat_arguments_are_checked(kwargs, fragments):
    model, opt = fresh_model_and_optimizer()
    with pytest.raises(TypeError) as info:
        FabricModel(model, lambda: (DATA, None), F.cross_entropy, opt, **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_download_before_training_says_what_to_do():
    model, opt = fresh_model_and_optimizer()
    with pytest.raises(RuntimeError, match="call train"):
        FabricModel(model, lambda: (DATA, None), F.cross_entropy, opt).download()
