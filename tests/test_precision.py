"""``FabricModel(precision=, gradient_clip_norm=)`` (docs/architecture.md, "Training features"):
autocast forwards, float16's loss scale kept alike on every replica through a kill, and clipping
on the whole step's reduced gradient, each against the plain loop that does the same by hand."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from fabric_model import FabricModel
from fabric_model.step.options import check_step_options
from fabric_model.testing import FaultInjector, HoldForJoin, Kill

from .helpers import fresh_model_and_optimizer, make_data, max_rel_diff, records, reference_train

SEED, BATCH, GLOBAL = 7, 8, 24
DATA = make_data(240)  # 10 steps an epoch
CLIP = 0.05  # well below the gradient's norm on this task: every step is clipped


class ClipThenStep:
    """The plain loop's optimizer: unscale (if a scaler is given), clip the whole step's gradient, step."""

    def __init__(self, opt, model, clip, scaler=None) -> None:
        self.opt, self.model, self.clip, self.scaler = opt, model, clip, scaler
        self.scales: list[float] = []
        self.norms: list[float] = []  # each step's norm before clipping

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def step(self) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(self.opt)
        if self.clip is not None:
            self.norms.append(float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)))
        if self.scaler is None:
            self.opt.step()
            return
        self.scaler.step(self.opt)
        self.scaler.update()
        self.scales.append(self.scaler.get_scale())


def reference(epochs, data=DATA, clip=None, autocast=None, scaler=None):
    model, opt = fresh_model_and_optimizer()
    shim = ClipThenStep(opt, model, clip, scaler)
    kwargs = {"autocast": autocast, "scaler": scaler}
    reference_train(model, shim, data, seed=SEED, epochs=epochs, batch_size=BATCH, micro_batches=3, **kwargs)
    return copy.deepcopy(model.state_dict()), shim


def train(epochs, run_dir, data=DATA, workers=2, resume=False, **options):
    model, opt = fresh_model_and_optimizer()
    logger = options.pop("worker_logger_callback", None)
    fm = FabricModel(model, lambda: (data, data[:40]), F.cross_entropy, opt, worker_logger_callback=logger, **options)
    result = fm.train(epochs, BATCH, workers, effective_batch_size=GLOBAL, seed=SEED, run_dir=run_dir, resume=resume)
    return model, opt, result


@pytest.mark.processes
def test_clipping_equals_clip_grad_norm_on_the_plain_loop_s_whole_step_gradient(run_dir):
    """Two workers, three micro-batches a step: clipped once, on the reduced gradient, whose norm
    before clipping each step's record carries as the plain loop's clip_grad_norm_ returns it."""
    clipped, shim = reference(2, clip=CLIP)
    unclipped, _ = reference(2)
    assert max_rel_diff(unclipped, clipped) > 0.1  # the clip binds: the test would see it missing
    model, _, _ = train(2, run_dir, gradient_clip_norm=CLIP)
    assert max_rel_diff(model.state_dict(), clipped) < 1e-5
    norms = [r["metrics"]["grad_norm"] for r in records(run_dir, "train")]
    assert norms == pytest.approx(shim.norms, rel=1e-4) and len(norms) == 20


@pytest.mark.processes
def test_bf16_mixed_trains_like_the_autocast_loop_and_resumes(run_dir):
    """bf16-mixed: the plain loop under autocast(bfloat16); 2 epochs then a resume to 3 end where
    an uninterrupted run ends; the weights stay float32."""
    expected, _ = reference(3, autocast=torch.bfloat16)
    float32, _ = reference(3)
    assert max_rel_diff(float32, expected) > 1e-4  # bfloat16's forward is not float32's
    train(2, run_dir, precision="bf16-mixed")
    model, _, result = train(3, run_dir, resume=True, precision="bf16-mixed")
    assert max_rel_diff(model.state_dict(), expected) < 1e-4
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert [h["epoch"] for h in result.history] == [0, 1, 2]
    assert result.history[-1]["loss"] < result.history[0]["loss"]
    assert result.test_history  # validation runs under autocast too


@pytest.mark.processes
def test_16_mixed_keeps_one_loss_scale_through_a_kill(run_dir, tmp_path):
    """16-mixed on large inputs: float16 overflows in the first steps and the scale backs off, as
    torch.amp.GradScaler's does. A worker killed after that is replaced by one that pulls the
    backed-off scale with the optimizer state (with the initial scale it would overflow again and
    skip a step the plain loop takes). Clipping comes after unscaling, as in the plain loop."""
    loud = [(x * 60, y) for x, y in DATA]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    expected, shim = reference(2, loud, clip=1.0, autocast=torch.float16, scaler=scaler)
    assert shim.scales[3] < 2.0**16  # overflows happened, before the kill
    # The replacement joins at step 9 (of 20), when the scale has long backed off.
    injector = FaultInjector([Kill(worker=1, step=5), HoldForJoin(9)], tmp_path)
    model, opt, _ = train(
        2, run_dir, loud, precision="16-mixed", gradient_clip_norm=1.0, worker_logger_callback=injector
    )
    generations = records(run_dir, "generation")
    assert len(generations) == 3 and len(generations[-1]["members"]) == 2  # start, the kill, the join
    assert max_rel_diff(model.state_dict(), expected) < 1e-5
    assert set(opt.state_dict()) == {"state", "param_groups"}  # the scale stays ours


@pytest.mark.processes
@pytest.mark.parametrize(
    ("kwargs", "argument", "accepted"),
    [
        ({"precision": "fp16"}, "precision", "'bf16-mixed'"),
        ({"gradient_clip_norm": -1.0}, "gradient_clip_norm", "positive finite"),
        ({"gradient_clip_norm": "1"}, "gradient_clip_norm", "positive finite"),
        ({"precision": "16-mixed", "fn_step_train": lambda *a: (0.0, 0.0)}, "precision", "'bf16-mixed'"),
    ],
)
def test_bad_options_fail_in_the_constructor_naming_the_argument(kwargs, argument, accepted):
    model, opt = fresh_model_and_optimizer()
    with pytest.raises(ValueError, match=f"`{argument}`") as info:
        FabricModel(model, lambda: (DATA, None), F.cross_entropy, opt, **kwargs)
    assert "Received" in str(info.value) and accepted in str(info.value)


@pytest.mark.processes
def test_a_bf16_model_and_16_mixed_with_deterministic_fail_before_any_worker(run_dir):
    model, opt = fresh_model_and_optimizer()
    model.to(torch.bfloat16)
    fm = FabricModel(model, lambda: (DATA, None), F.cross_entropy, opt, precision="bf16-mixed")
    with pytest.raises(TypeError, match="`model`.*torch.bfloat16.*model.float\\(\\).*precision='bf16-mixed'"):
        fm.train(1, BATCH, 2, run_dir=run_dir)
    model, opt = fresh_model_and_optimizer()
    fm = FabricModel(model, lambda: (DATA, None), F.cross_entropy, opt, precision="16-mixed")
    with pytest.raises(ValueError, match="`precision`.*deterministic=True"):
        fm.train(1, BATCH, 2, run_dir=run_dir, deterministic=True)
    assert not (run_dir / "logs").exists()  # nothing started


def test_keras_takes_precision_from_its_dtype_policy_and_clipping_from_us():
    with pytest.raises(ValueError, match="`precision`.*keras.mixed_precision.set_dtype_policy"):
        check_step_options("bf16-mixed", None, "keras", False)

    class ClippingOptimizer:
        clipnorm, global_clipnorm, clipvalue = None, 1.0, None

    with pytest.raises(ValueError, match="gradient_clip_norm=0.5 and an optimizer with global_clipnorm=1.0"):
        check_step_options("32", 0.5, "keras", False, ClippingOptimizer())
    assert check_step_options(16, 2, "torch", False).gradient_clip_norm == 2.0
