"""The caller's torch switches hold in its workers (frameworks/torch/numerics.py): TF32 and the
float32 matmul precision, cuDNN's, deterministic algorithms, the default dtype, autocast's default
dtypes and the attention kernels, as the user set them before ``train()``, also after the warm process was started; and
deterministic mode's own on top. Real worker processes and fresh interpreters; the switches this
test process changes are put back."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fabric_model import FabricModel
from fabric_model.frameworks.torch.numerics import Numerics

from .helpers import fresh_model_and_optimizer, make_data

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def switches():
    """This process's switches, put back after the test."""
    before = Numerics.here()
    yield
    before.apply()


class Record:
    """A worker callback: the worker's switches, pickled where the test reads them."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_begin(self) -> None:
        self.path.write_bytes(pickle.dumps(Numerics.here()))


@pytest.mark.processes
@pytest.mark.parametrize("deterministic", [False, True])
def test_switches_set_after_construction_hold_in_the_worker(run_dir, switches, deterministic):
    model, opt = fresh_model_and_optimizer()
    recorded = run_dir.parent / "numerics"
    data = make_data(64)
    fm = FabricModel(model, lambda: (data, None), F.cross_entropy, opt, worker_logger_callback=Record(recorded))
    # After FabricModel(): the warm process its workers fork from has not seen these.
    torch.set_float32_matmul_precision("medium")
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.enable_flash_sdp(False)
    torch.use_deterministic_algorithms(False)
    caller = Numerics.here()
    fm.train(1, 16, 1, run_dir=run_dir, verbose=0, deterministic=deterministic)
    worker: Numerics = pickle.loads(recorded.read_bytes())
    assert (worker.legacy, worker.fp32, worker.attention) == (caller.legacy, caller.fp32, caller.attention)
    assert caller.legacy is not None and dict(caller.legacy)["float32_matmul_precision"] == "medium"
    assert worker.default_dtype == torch.float32
    switched = dict(worker.switches)
    if deterministic:  # its own on top: deterministic algorithms (and on a GPU, cuDNN's)
        assert worker.algorithms == (True, False)
    else:
        assert worker.algorithms == (False, False) and switched == dict(caller.switches)
        assert switched["cudnn.benchmark"] is True and dict(worker.legacy or ())["cudnn.allow_tf32"] is False


#: Ways of setting float32 precision that leave torch's legacy getters refusing: the legacy calls
#: mixed, and the new API (torch >= 2.9). (The legacy calls alone: the runs above.)
PRECISIONS = {
    "medium, then TF32": "torch.set_float32_matmul_precision('medium'); torch.backends.cuda.matmul.allow_tf32 = True",
    "the new API, and every other switch": (
        "torch.backends.cuda.matmul.fp32_precision = 'tf32'; torch.backends.mkldnn.conv.fp32_precision = 'bf16'; "
        "torch.backends.cudnn.benchmark = True; torch.set_default_dtype(torch.float64); "
        "torch.use_deterministic_algorithms(True, warn_only=True); torch.backends.cuda.enable_flash_sdp(False); "
        "torch.set_autocast_dtype('cuda', torch.bfloat16)"
    ),
}
CAPTURE = (
    "import pickle, sys, torch\n{}\n"
    "from fabric_model.frameworks.torch.numerics import Numerics\n"
    "sys.stdout.buffer.write(pickle.dumps(Numerics.here()))\n"
)
APPLY = (
    "import pickle, sys, torch\n"
    "from fabric_model.frameworks.torch.numerics import Numerics\n"
    "wanted = pickle.loads(sys.stdin.buffer.read())\n"
    "wanted.apply()\n"
    "sys.stdout.buffer.write(pickle.dumps(Numerics.here()))\n"
)


@pytest.mark.processes
def test_a_fresh_interpreter_is_left_with_the_callers_precision_and_the_same_getters_answering():
    """Each way of setting the precision, captured in one fresh interpreter and applied in
    another: the same values, and torch's legacy getters answer (or refuse) in both alike."""
    if not hasattr(torch.backends, "fp32_precision"):
        pytest.skip(f"torch {torch.__version__} has no fp32_precision API (added in 2.9): one way only")
    env = dict(os.environ, PYTHONPATH=str(ROOT))

    def run_all(scripts: list[str], inputs: list[bytes | None]) -> list[bytes]:
        runs = [
            subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
            for code in scripts
        ]
        outputs = [run.communicate(data, timeout=120)[0] for run, data in zip(runs, inputs)]
        assert all(run.returncode == 0 for run in runs)
        return outputs

    captured = run_all([CAPTURE.format(code) for code in PRECISIONS.values()], [None] * len(PRECISIONS))
    applied = run_all([APPLY] * len(PRECISIONS), captured)
    wanted = [pickle.loads(out) for out in captured]
    assert [n.legacy for n in wanted] == [None, None]  # the getters refuse a mix, as after the new API
    assert wanted[1].default_dtype == torch.float64 and wanted[1].algorithms == (True, True)
    assert dict(wanted[1].autocast)["cuda"] == torch.bfloat16
    assert [pickle.loads(out) for out in applied] == wanted
