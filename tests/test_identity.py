"""A job's identity (driver/identity.py): the same script's job has the same identity in any
process, seeded or not, and a change to what trains is named by the part it changed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fabric_model.driver import identity
from fabric_model.run.hooks import Hooks
from fabric_model.setup.job import Job

from .helpers import Lazily

keras = Lazily("keras")  # at a test's first use: collecting this module imports no TensorFlow

REPO = Path(__file__).resolve().parents[1]


class Logger:
    def __init__(self, tag: str) -> None:
        self.tag = tag

    def log_train_metrics(self, metrics, iteration, epoch, workers) -> None:
        print(self.tag, iteration)


def datasets():
    return [(torch.zeros(4), 0)] * 8, None


def job_of(loss=torch.nn.functional.cross_entropy, lr: float = 0.1, tag: str = "v1", seed: int | None = 0) -> Job:
    """A torch job as train() ships it (the adapter stands for the model, loss and optimizer)."""
    if seed is not None:
        torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    adapter = {"model": model, "loss": loss, "optimizer": optimizer}
    return Job(adapter, datasets, Hooks.for_worker(Logger(tag), []))


class Adapter(dict):
    def identity_view(self):
        return self


def ident(job: Job) -> identity.Identity:
    """The job's parts as identify() digests them (its config and plan are train()'s)."""
    return {
        identity.MODEL: identity.digest(Adapter(job.adapter).identity_view()),
        identity.DATA: identity.digest(job.get_datasets),
        identity.CALLBACKS: identity.digest(job.hooks),
    }


def scaled_loss(output, target):
    return 2 * torch.nn.functional.cross_entropy(output, target)


def test_the_same_job_has_the_same_identity_whatever_its_initial_weights():
    assert ident(job_of(seed=0)) == ident(job_of(seed=0)) == ident(job_of(seed=None))


@pytest.mark.parametrize(
    ("changed", "part"),
    [
        ({"loss": scaled_loss}, identity.MODEL),
        ({"lr": 0.2}, identity.MODEL),
        ({"tag": "v2"}, identity.CALLBACKS),
    ],
)
def test_a_change_is_named_by_its_part(changed, part):
    before, after = ident(job_of()), ident(job_of(**changed))
    assert identity.differences(before, after) == [part]


def test_code_moved_in_its_file_is_the_same_code():
    source = "def loss(output, target):\n    return output.sum() * 2\n"
    first, moved = {}, {}
    exec(compile(source, "script.py", "exec"), first)
    exec(compile("\n\n# a comment\n" + source, "elsewhere.py", "exec"), moved)
    changed = {}
    exec(compile(source.replace("* 2", "* 3"), "script.py", "exec"), changed)
    assert identity.digest(first["loss"]) == identity.digest(moved["loss"])
    assert identity.digest(first["loss"]) != identity.digest(changed["loss"])


@pytest.mark.tensorflow
def test_a_keras_model_s_identity_does_not_depend_on_which_equal_strings_are_one_object():
    """Whether a Keras model's and its optimizer's dtype strings are one object depends on the
    process's history (interned by code that ran before): the same job counted as changed in a
    test runner that had trained other models first."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    optimizer = keras.optimizers.SGD(momentum=0.9)
    optimizer.build(model.trainable_variables)
    before = identity.digest({"model": model, "optimizer": optimizer})
    kernel = model.trainable_variables[0]
    assert kernel.dtype == "float32"
    kernel._dtype = "".join(["float", "32"])  # equal, but not the interned object the others share
    assert identity.digest({"model": model, "optimizer": optimizer}) == before


@pytest.mark.processes
def test_sets_do_not_depend_on_the_hash_seed():
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from fabric_model.driver.identity import digest
        print(digest({{"names": {{"alpha", "beta", "gamma", "delta", "epsilon"}}}}))
    """)
    seen = {
        subprocess.run(
            [sys.executable, "-c", script], env={"PYTHONHASHSEED": seed}, capture_output=True, text=True, timeout=120
        ).stdout
        for seed in ("1", "2", "3")
    }
    assert len(seen) == 1 and "" not in seen, seen


@pytest.mark.processes
def test_a_class_the_script_defines_has_the_same_identity_in_every_process():
    """cloudpickle sends a class defined in ``__main__`` by value, under a random id per process:
    the identity leaves that id out, so a script's own model or logger class is the same job."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from fabric_model.driver.identity import digest

        class Logger:
            def __init__(self, flag):
                self.flag = flag

            def log_train_metrics(self, metrics, iteration, epoch, workers):
                print(self.flag, iteration)

        print(digest([Logger("pace"), Logger("pace")]))
    """)
    seen = {
        subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120).stdout
        for _ in range(2)
    }
    assert len(seen) == 1 and "" not in seen and "unknown" not in next(iter(seen)), seen
