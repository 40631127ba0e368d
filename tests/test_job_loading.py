"""How a worker unpickles its job and picks its device (worker/job_loading.py), in-process: the
job's tensors come back as they were; where the job's workers train and what this host has
decide the device, and a host that cannot take part is refused, named, before it trains.

A state pickled on a GPU is not made up here: the CUDA case runs in tests/test_gpu.py where a
GPU is lent."""

from __future__ import annotations

import logging

import cloudpickle
import pytest
import torch

from fabric_model.worker.job_loading import HostUnfit, fit_device, load_job


def test_a_job_unpickles_as_cloudpickle_would_with_nothing_mapped():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    job = {"model": model, "optimizer": optimizer, "fn": lambda x: x + 1}
    loaded, mapped = load_job(cloudpickle.dumps(job))
    assert mapped == set()
    expected = cloudpickle.loads(cloudpickle.dumps(job))
    for (name, a), b in zip(loaded["model"].state_dict().items(), expected["model"].state_dict().values()):
        assert torch.equal(a, b), name
    assert loaded["optimizer"].state_dict()["state"][0]["exp_avg"].equal(optimizer.state_dict()["state"][0]["exp_avg"])
    assert loaded["fn"](1) == 2


def test_a_cpu_job_trains_on_the_cpu_and_a_gpu_job_on_this_host_s_gpu():
    assert fit_device(None, set(), on_gpus=False, gpus=0) == "cpu"
    assert fit_device(None, set(), on_gpus=False, gpus=2) == "cpu"  # the job's workers are CPU workers
    assert fit_device(None, set(), on_gpus=True, gpus=2) == "cuda:0"  # a worker started by hand on a GPU host
    assert fit_device("cuda:1", set(), on_gpus=True, gpus=2) == "cuda:1"  # --device, or the driver's slot


def test_a_state_mapped_from_cuda_trains_on_the_cpu_in_a_cpu_job_and_says_so_once(caplog):
    with caplog.at_level(logging.WARNING, logger="fabric_model"):
        assert fit_device(None, {"cuda:0"}, on_gpus=False, gpus=0, host="cpu-host-7") == "cpu"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "cpu-host-7" in lines[0] and "cuda:0" in lines[0] and "mapped to the CPU" in lines[0]


@pytest.mark.parametrize("given", [None, "cpu"])
@pytest.mark.parametrize("mapped", [set(), {"cuda:0"}])
def test_a_host_without_a_gpu_is_refused_by_a_job_on_gpus_naming_the_host(given, mapped):
    with pytest.raises(HostUnfit, match=r"host cpu-host-7 has no GPU .* the job's workers train on GPUs"):
        fit_device(given, mapped, on_gpus=True, gpus=0, host="cpu-host-7")


def test_a_gpu_device_given_to_a_host_without_one_is_refused_naming_both():
    with pytest.raises(HostUnfit, match=r"host cpu-host-7 has no GPU .* given device 'cuda:0'"):
        fit_device("cuda:0", set(), on_gpus=False, gpus=0, host="cpu-host-7")


def test_a_gpu_host_told_to_use_its_cpu_in_a_job_on_gpus_is_refused():
    with pytest.raises(
        HostUnfit, match=r"on host gpu-host-2 was given device 'cpu', but the job's workers train on GPUs"
    ):
        fit_device("cpu", set(), on_gpus=True, gpus=4, host="gpu-host-2")
