"""Augmentation inside the guarantee (step/sample_seeds.py): a dataset that augments its images
with torch's, NumPy's and Python's global generators and with generators of its own trains to
the same bits for any worker count and through a kill, in deterministic mode, and to float32
rounding without it.

The transforms draw as torchvision's do (``torch.randint`` for a crop's place, ``torch.rand``
for a flip, ``torch.empty(1).uniform_`` for a jitter factor): torchvision's wheel on the package
registry does not import beside the CPU build of torch the tests pin, so they are written here.
"""

from __future__ import annotations

import copy
import os
import random

import numpy as np
import psutil
import pytest
import torch
import torch.nn.functional as F

from fabric_model import FabricModel
from fabric_model.step.plan import Plan
from fabric_model.testing import FaultInjector, Kill, fired_at

from .helpers import final_train_records, sample_indices_of_steps

pytestmark = pytest.mark.processes

SEED, EPOCHS, BATCH, GLOBAL = 1, 4, 4, 12  # 3 micro-batches a step, 4 steps an epoch


class RandomResizedCrop:
    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        h = int(torch.randint(self.size // 2, img.shape[-1] + 1, (1,)))
        top = int(torch.randint(0, img.shape[-2] - h + 1, (1,)))
        left = int(torch.randint(0, img.shape[-1] - h + 1, (1,)))
        crop = img[..., top : top + h, left : left + h]
        return F.interpolate(crop[None], size=(self.size, self.size), mode="bilinear", align_corners=False)[0]


class RandomHorizontalFlip:
    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        return img.flip(-1) if torch.rand(1) < 0.5 else img


class ColorJitter:
    def __init__(self, brightness: float) -> None:
        self.brightness = brightness

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        factor = float(torch.empty(1).uniform_(1 - self.brightness, 1 + self.brightness))
        return (img * factor).clamp(0, 1)


class Compose:
    def __init__(self, transforms) -> None:
        self.transforms = transforms

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        for t in self.transforms:
            img = t(img)
        return img


class AugmentedImages(torch.utils.data.Dataset):
    """Images of two classes; every read crops, flips, jitters and adds noise, drawing from
    torch's global generator (the transforms), NumPy's and Python's, and its own two."""

    def __init__(self, n: int = 48, record_dir: str | None = None) -> None:
        self.record_dir = record_dir  # a file per process that reads, named by its pid
        g = torch.Generator().manual_seed(0)
        self.labels = torch.arange(n) % 2
        base = torch.rand(n, 1, 10, 10, generator=g)
        base[self.labels == 1, :, :, :5] += 0.5  # the left half is brighter in class 1
        self.images = base.clamp(0, 1)
        self.transform = Compose([RandomResizedCrop(8), RandomHorizontalFlip(), ColorJitter(0.3)])
        self.noise = torch.Generator().manual_seed(5)
        self.rng = np.random.default_rng(9)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        if self.record_dir is not None:
            open(os.path.join(self.record_dir, str(os.getpid())), "a").close()
        x = self.transform(self.images[i])
        x = x + 0.1 * torch.randn_like(x)  # torch's global generator
        x = x + 0.01 * torch.randn(x.shape, generator=self.noise)  # the dataset's own
        x = x * float(1 + 0.05 * np.random.randn()) + 0.02 * float(self.rng.random()) + 0.01 * random.random()
        return x, int(self.labels[i])


class SmallCNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.drop = torch.nn.Dropout(0.3)
        self.fc = torch.nn.Linear(4 * 4 * 4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(torch.relu(self.conv(x)), 2)
        return self.fc(self.drop(x.flatten(1)))


def train(
    run_dir, workers: int, deterministic: bool = True, faults=(), marker_dir=None, record_dir=None, **kwargs
) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = SmallCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    injector = FaultInjector(list(faults), marker_dir) if faults else None
    record = None if record_dir is None else str(record_dir)
    fm = FabricModel(
        model,
        lambda: (AugmentedImages(48, record), AugmentedImages(12)),
        F.cross_entropy,
        opt,
        worker_logger_callback=injector,
    )
    fm.train(
        EPOCHS,
        BATCH,
        workers,
        seed=SEED,
        run_dir=run_dir,
        deterministic=deterministic,
        effective_batch_size=GLOBAL,
        num_dataloader_threads=2,  # reader threads exist; the torch draws keep reads off them
        **kwargs,
    )
    return copy.deepcopy(model.state_dict())


def assert_bitwise(state, reference) -> None:
    differ = [k for k in reference if not torch.equal(state[k], reference[k])]
    assert not differ, f"not bitwise equal: {differ}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(tmp_path_factory.mktemp("aug") / "run", 1)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_augmented_training_is_bitwise_alike_for_any_worker_count(workers, reference, tmp_path):
    assert_bitwise(train(tmp_path / "run", workers), reference)


def test_augmented_training_is_bitwise_alike_through_a_kill(reference, tmp_path):
    state = train(tmp_path / "run", 2, faults=[Kill(1, 5)], marker_dir=tmp_path)
    assert fired_at(tmp_path, 0) is not None
    assert_bitwise(state, reference)


def test_without_deterministic_mode_augmented_training_agrees_to_rounding(tmp_path):
    one = train(tmp_path / "one", 1, deterministic=False)
    two = train(tmp_path / "two", 2, deterministic=False)
    for k in one:
        assert torch.allclose(one[k], two[k], rtol=1e-4, atol=1e-5), k


def test_reader_processes_read_the_same_bits_and_end_with_a_killed_worker(reference, tmp_path):
    """``num_dataloader_processes=2``: the samples are read in processes forked from each worker,
    seeded as on the training thread; a SIGKILLed worker's readers end with it."""
    readers = tmp_path / "readers"
    readers.mkdir()
    state = train(
        tmp_path / "run", 2, faults=[Kill(1, 5)], marker_dir=tmp_path, record_dir=readers, num_dataloader_processes=2
    )
    assert fired_at(tmp_path, 0) is not None
    assert_bitwise(state, reference)
    used = sample_indices_of_steps(Plan(48, BATCH, GLOBAL // BATCH, SEED), final_train_records(tmp_path / "run"))
    assert all(sorted(used[epoch]) == list(range(48)) for epoch in range(EPOCHS))  # each sample once an epoch
    pids = [int(f.name) for f in readers.iterdir() if int(f.name) != os.getpid()]  # the caller checks 2 samples
    assert len(pids) >= 4, pids  # 2 readers a worker, and more after the kill's new generation
    alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"reader processes left running: {alive}"
