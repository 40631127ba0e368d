"""The per-step path's shortcuts change nothing a user relies on (no processes: the pieces alone).

- a lone worker's gradients are fresh tensors, not views into the step buffer, and its stat
  sums are added in Python: the weights and the reported sums come out bit-identical to the
  buffer path's;
- a ``TensorDataset`` is read in one gather, a dataset with ``__getitems__`` in one call:
  the batches are the ones item-by-item reading and ``default_collate`` give;
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset, default_collate

from fabric_model.frameworks.torch import gather
from fabric_model.frameworks.torch.adapter import TorchAdapter
from fabric_model.frameworks.torch.gather import tensor_reader
from fabric_model.step.data import PrefetchLoader, fetch, loader_threads, reads_at_once


class OneOfTwo:
    """A collective of two whose peer contributes nothing: the sum is this rank's buffer, so
    the adapter takes its reducing path with the lone worker's numbers."""

    world_size, rank = 2, 0

    def all_reduce_start(self, tensor: torch.Tensor) -> None:
        return None

    def wait(self, work: None) -> None:
        pass


class Alone(OneOfTwo):
    world_size = 1


class WithUnused(nn.Module):
    """BatchNorm statistics, and a layer no step gives a gradient (weight decay must leave it alone)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
        self.unused = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def float64_error(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A metric in float64 (rounded to float32 once, on either path)."""
    return (output.double().softmax(1).max(1).values - 1 / 3).mean()


def python_number(output: torch.Tensor, target: torch.Tensor) -> float:
    return float(target.sum()) / 7


def train(
    collective: object, micro_batches: int, held: list[tuple[int, int]] | None = None
) -> tuple[dict[str, torch.Tensor], list[list[float]]]:
    """Four steps; ``collective`` is one for all, or a list of one a step. ``held`` gets, after
    each step, the adapter's gradient bytes and the bytes of the ``.grad`` tensors."""
    torch.manual_seed(0)
    model = WithUnused()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    metrics = [lambda o, t: (o.argmax(1) == t).float().mean(), float64_error, python_number]
    adapter = TorchAdapter(model, optimizer, F.cross_entropy, metrics)
    adapter.setup("cpu", 1)
    g = torch.Generator().manual_seed(1)
    reported = []
    for step in range(4):
        group = collective[step] if isinstance(collective, list) else collective
        adapter.begin_step(group)
        for j in range(micro_batches):
            n = 5 + j  # uneven micro-batches: sums of products that are not exact in float32
            batch = (torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))
            adapter.train_micro_batch(batch, n, 6 * micro_batches, seed=step * 10 + j, last=j == micro_batches - 1)
        adapter.all_reduce(group)
        reported.append(adapter.finish_step().stats)
        if held is not None:
            grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
            held.append((adapter.gradient_bytes(), grads))
    return {k: v.clone() for k, v in model.state_dict().items()}, reported


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_a_lone_worker_takes_the_buffer_paths_weights_and_sums_bit_for_bit(micro_batches: int) -> None:
    (alone, alone_sums), (reduced, reduced_sums) = train(Alone(), micro_batches), train(OneOfTwo(), micro_batches)
    torch.manual_seed(0)
    assert torch.equal(alone["unused.weight"], WithUnused().unused.weight)  # untouched by decay and momentum
    for name in reduced:
        assert torch.equal(alone[name], reduced[name]), name
    assert alone_sums == reduced_sums  # loss, three metrics, sample count: the same floats
    assert len(alone_sums[0]) == 5 and alone_sums[0][-1] == sum(5 + j for j in range(micro_batches))


def test_a_lone_worker_holds_its_gradients_once_and_gets_the_buffer_back_when_the_world_grows() -> None:
    """A lone worker's backward writes fresh gradients, as a plain loop's does; the step buffer's
    gradient part, unused meanwhile, gives its memory back (it held every gradient twice: about
    500 MB on GPT-2), and is made again when a second worker joins. At every switch the weights
    and sums are bit for bit the buffer path's."""
    n_gradients = sum(p.numel() for p in WithUnused().parameters())
    switching: list[tuple[int, int]] = []
    buffered: list[tuple[int, int]] = []
    weights, sums = train([Alone(), OneOfTwo(), Alone(), Alone()], 2, switching)
    reduced, reduced_sums = train(OneOfTwo(), 2, buffered)
    assert sums == reduced_sums and all(torch.equal(weights[name], reduced[name]) for name in reduced)
    full, _ = buffered[0]  # the step buffer: every gradient, then buffer deltas, flags and sums
    assert [held for held, _ in buffered] == [full] * 4
    tail = full - 4 * n_gradients
    for step, (held, grads) in enumerate(switching):
        if step == 1:  # two workers: the full buffer again, each .grad its view
            assert held == full, switching
        else:  # alone: the fresh gradients once, and the buffer's tail
            assert grads > 0 and held == grads + tail, switching


TENSOR_DATASETS = {
    "float32 and int64": lambda: (torch.randn(50, 3, 4), torch.randint(0, 9, (50,))),
    "strided, float64, bool": lambda: (torch.randn(4, 3, 50).permute(2, 1, 0), torch.rand(50).double() > 0.5),
    "uint8, bfloat16 (torch's gather)": lambda: (
        torch.randint(0, 255, (50, 6), dtype=torch.uint8),
        torch.randn(50).bfloat16(),
    ),
}


@pytest.mark.parametrize("tensors", TENSOR_DATASETS.values(), ids=TENSOR_DATASETS.keys())
def test_a_tensor_dataset_is_read_in_one_gather_as_item_by_item(tensors) -> None:  # type: ignore[no-untyped-def]
    data = TensorDataset(*tensors())
    original = [t.clone() for t in data.tensors]
    adapter = TorchAdapter(nn.Linear(4, 2), torch.optim.SGD(nn.Linear(4, 2).parameters(), lr=0.1), F.mse_loss)
    reader = adapter.reader(data)
    assert reader is not None and reads_at_once(data, reader)
    indices = np.array([7, 3, 49, 0, 3])
    gathered, collated = reader(indices), default_collate([data[int(i)] for i in indices])
    assert len(gathered) == len(collated) == 2
    for a, b in zip(gathered, collated):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        a.zero_()  # a batch is a copy: training code may write into it
    assert all(torch.equal(t, u) for t, u in zip(data.tensors, original))
    # A user's collate, or a subclass that may override __getitem__, is read item by item.
    assert TorchAdapter(nn.Linear(4, 2), adapter.optimizer, F.mse_loss, collate_fn=default_collate).reader(data) is None

    class Shifted(TensorDataset):
        def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
            x, y = super().__getitem__(i)
            return x + 1, y

    assert adapter.reader(Shifted(*data.tensors)) is None


SAMPLE_LISTS = {
    "(tensor, label) tuples": lambda g: [(torch.randn(3, 4, generator=g), torch.tensor(i % 3)) for i in range(50)],
    "lists, int32 and bool": lambda g: [
        [torch.randint(0, 9, (2,), dtype=torch.int32, generator=g), torch.rand((), generator=g) > 0.5]
        for _ in range(50)
    ],
    "dicts, one shared mask (a tokenizer's)": lambda g: [
        {"input_ids": torch.randint(0, 99, (8,), generator=g), "attention_mask": MASK, "labels": torch.tensor(1)}
        for _ in range(50)
    ],
    "bare tensors, bfloat16 (torch's gather)": lambda g: [torch.randn(5, generator=g).bfloat16() for _ in range(50)],
    "NumPy features, Python int labels": lambda g: [
        (np.random.default_rng(i).standard_normal(4).astype(np.float32), i % 3) for i in range(50)
    ],
    "Python floats and bools, a uint8 array": lambda g: [
        {"w": i / 7, "keep": i % 2 == 0, "pixels": np.full((2, 2), i, dtype=np.uint8)} for i in range(50)
    ],
}
MASK = torch.ones(8, dtype=torch.long)


def _same(a: Any, b: Any) -> bool:
    """The same structure, container types, key order, dtypes, shapes and values."""
    if isinstance(b, torch.Tensor):
        return type(a) is torch.Tensor and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if type(a) is not type(b) or len(a) != len(b):
        return False
    if isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in b)
    return all(_same(x, y) for x, y in zip(a, b))


def _leaves(batch: Any) -> list[torch.Tensor]:
    return list(batch.values()) if isinstance(batch, dict) else list(batch) if isinstance(batch, list) else [batch]


@pytest.mark.parametrize("make", SAMPLE_LISTS.values(), ids=SAMPLE_LISTS.keys())
def test_a_list_of_samples_is_read_in_one_gather_as_default_collate_gives_it(make) -> None:  # type: ignore[no-untyped-def]
    """A list of equally shaped samples (tensors, numbers, NumPy arrays; tuples, lists or dicts
    of them) is stacked once and each micro-batch gathered: what default_collate gives the same
    samples, and a copy."""
    samples = make(torch.Generator().manual_seed(0))
    adapter = TorchAdapter(nn.Linear(4, 2), torch.optim.SGD(nn.Linear(4, 2).parameters(), lr=0.1), F.mse_loss)
    reader = adapter.reader(samples)
    assert reader is not None and reads_at_once(samples, reader) and adapter.reader(samples) is reader
    for indices in (np.array([7, 3, 49, 0, 3]), np.array([12])):
        gathered = reader(indices)
        assert _same(gathered, default_collate([samples[int(i)] for i in indices]))
    for t in _leaves(gathered):
        t.zero_()  # training code may write into a batch: the samples stay as they are
    assert _same(reader(indices), default_collate([samples[int(i)] for i in indices]))
    assert tensor_reader(tuple(samples), None) is not None


def test_a_list_the_stack_would_change_is_read_item_by_item(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Samples whose stack differs from their micro-batches' (mixed types or dtypes: each
    micro-batch promotes as its own samples say; shapes that differ), values default_collate
    does not stack, samples of other forms, a copy past STACK_BYTES, and a user's collate keep
    the item-by-item read."""
    x = torch.randn(3)
    refused = {
        "mixed dtypes": [(x, torch.tensor(1))] * 3 + [(x.double(), torch.tensor(1))],
        "shapes differ": [x, torch.randn(4)],
        "ints and bools": [(x, 1), (x, True)],
        "an int past int64": [(x, 1), (x, 1 << 63)],
        "strings": [(x, "a"), (x, "b")],
        "object arrays": [np.array([None]), np.array([None])],
        "needs a gradient": [torch.randn(3, requires_grad=True)] * 3,
        "keys differ": [{"a": x}, {"b": x}],
        "nested": [({"a": x},)] * 3,
        "forms differ": [(x,), [x]],
        "empty": [],
    }
    for name, samples in refused.items():
        assert tensor_reader(samples, None) is None, name
    assert tensor_reader([x] * 4, default_collate) is None
    monkeypatch.setattr(gather, "STACK_BYTES", 10 * x.nbytes)
    assert tensor_reader([x] * 11, None) is None
    assert tensor_reader([x] * 10, None) is not None


def test_a_dataset_with_getitems_is_asked_once_per_micro_batch() -> None:
    class Batched:
        def __init__(self) -> None:
            self.calls: list[list[int]] = []

        def __len__(self) -> int:
            return 10

        def __getitem__(self, i: int) -> tuple[int, int]:
            raise AssertionError("read item by item")

        def __getitems__(self, indices: list[int]) -> list[tuple[int, int]]:
            self.calls.append(indices)
            return [(i, -i) for i in indices]

    data = Batched()
    assert fetch(data, np.array([4, 1]), list) == [(4, -4), (1, -1)]
    assert data.calls == [[4, 1]] and reads_at_once(data, None)
    loader = PrefetchLoader(data, list, threads=0)
    got = [batch for _, _, batch in loader.iterate([("a", np.array([2])), ("b", np.array([3, 5]))])]
    assert got == [[(2, -2)], [(3, -3), (5, -5)]]


def test_a_list_of_samples_is_taken_at_once_and_read_on_the_training_thread() -> None:
    """A list's samples are in memory: a micro-batch is its items taken in one call, in the
    plan's order, collated on the training thread by default (no reader thread to hand over from:
    benchmarks/README.md, "Real models, one engine beside their plain loops"). A subclass may
    override ``__getitem__``, so it is read item by item, as before."""
    samples = [(i, -i) for i in range(10)]
    assert fetch(samples, np.array([7, 2, 7]), list) == [(7, -7), (2, -2), (7, -7)]
    assert fetch(tuple(samples), np.array([3]), list) == [(3, -3)]
    assert reads_at_once(samples, None) and reads_at_once(tuple(samples), None)
    assert loader_threads(None, reads_at_once(samples, None), 2) == 0

    class Augmented(list):
        def __getitem__(self, i):  # type: ignore[no-untyped-def]
            return ("augmented", super().__getitem__(i))

    assert not reads_at_once(Augmented(samples), None)
    assert fetch(Augmented(samples), np.array([1]), list) == [("augmented", (1, -1))]


def test_loader_threads_default_counts_the_workers_cores() -> None:
    assert loader_threads(3, True, 2) == 3  # the user's number stands
    assert loader_threads(None, True, 16) == 0  # one gather: no thread to hand it over
    assert [loader_threads(None, False, c) for c in (1, 2, 4, 8, 16)] == [1, 1, 2, 4, 4]
