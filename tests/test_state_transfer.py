"""A replica's state crosses a real gloo group as flat per-dtype buffers and comes back equal."""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from fabric_model.state.transfer import broadcast_state
from fabric_model.transport.collective import Collective

from .helpers import fresh_model_and_optimizer


def _trained_state():
    model, opt = fresh_model_and_optimizer(adam=True)
    model(torch.randn(5, 12)).sum().backward()
    opt.step()
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": opt.state_dict(),
        "extra": {"flags": torch.tensor([True, False, True]), "count": torch.tensor(7), "empty": torch.zeros(0, 3)},
        "plain": [1, 2.5, "x", None, (3, 4)],
    }


def _assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def test_state_broadcast_over_gloo_arrives_bit_for_bit():
    store = dist.HashStore()  # threads of one process; the driver's store is tested in tests/test_store.py
    state = _trained_state()
    results: dict[int, object] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            collective = Collective(store, "gloo", timedelta(seconds=30))
            collective.configure(0, r, 3)
            results[r] = broadcast_state(collective, state if r == 1 else None, source=1)
            collective.shutdown()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert sorted(results) == [0, 1, 2]
    for r in (0, 2):
        _assert_same(state, results[r])
    assert results[1] is state  # the source keeps its own
    model, opt = fresh_model_and_optimizer(adam=True)
    model.load_state_dict(results[0]["model"])
    opt.load_state_dict(results[0]["optimizer"])  # what a newcomer does with it


class _Recorder:
    """The source's side of a collective whose device is not the CPU (``meta`` stands in for a
    GPU on a host without one): what each broadcast was handed."""

    rank, device = 0, torch.device("meta")

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []

    def broadcast_bytes(self, data, source):
        return data

    def broadcast(self, tensor, source):
        self.sent.append(tensor)


def test_a_state_on_several_devices_is_sent_from_the_collectives_device():
    """On a GPU, Adam's ``step`` counts are CPU tensors beside moments on the GPU, in one dtype's
    buffer: each goes to the collective's device before they are joined (a join on a GPU failed so)."""
    collective = _Recorder()
    state = {"step": torch.tensor(3.0), "exp_avg": torch.zeros(4, device="meta"), "count": torch.tensor(7)}
    assert broadcast_state(collective, state, source=0) is state
    assert [(t.device.type, t.dtype, t.numel()) for t in collective.sent] == [
        ("meta", torch.float32, 5),
        ("meta", torch.int64, 1),
    ]
