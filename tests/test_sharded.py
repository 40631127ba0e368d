"""Sharded datasets in process (docs/data.md): the plan covers every sample once per epoch for any
shard lengths, a stream taken over in any order reads what the plan says, shards that change or
fail are named, and what cannot be sharded is refused before any worker starts."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from fabric_model import ShardedDataset, ShardReadError
from fabric_model.setup.checks import check_datasets
from fabric_model.step import stream_order as order
from fabric_model.step.plan import Plan, eval_segment_batches
from fabric_model.streams.datasets import in_caller, in_order
from fabric_model.streams.lengths import count_shards
from fabric_model.streams.reader import StreamedDataset
from fabric_model.streams.sharded import as_sharded

from .helpers import need

LENGTHS = [7, 0, 13, 5, 21, 1, 9, 16, 3, 11, 0, 8, 4]  # 13 shards, two of them empty


def shards_of(lengths):
    return [[(i, k) for k in range(n)] for i, n in enumerate(lengths)]


def sample_at(plan: Plan, epoch: int, position: int) -> tuple[int, int]:
    """(shard, offset) of a sequence position: the layout, independently of the reader."""
    ids, starts = order.epoch_layout(plan.seed, epoch, plan.shard_lengths, plan.shuffle_shards)
    k, offset = order.locate(starts, position)
    return int(ids[k]), offset


def micro_batches(plan: Plan, epoch: int):
    for step in range(plan.steps_per_epoch):
        for j in range(plan.num_micro_batches(epoch, step)):
            yield step, j, plan.micro_batch_indices(epoch, step, j)


@pytest.mark.parametrize("lengths", [LENGTHS, [50], [0, 0, 3], [1] * 40])
@pytest.mark.parametrize("streams,batch,window", [(3, 4, 1), (3, 4, 5), (4, 8, 64), (1, 7, 3), (5, 2, 1)])
def test_every_sample_once_per_epoch_in_full_steps_but_the_last(lengths, streams, batch, window):
    plan = Plan(sum(lengths), batch, streams, 11, shard_lengths=lengths, shuffle_window=window)
    for epoch in range(3):
        used = [sample_at(plan, epoch, int(p)) for _, _, idx in micro_batches(plan, epoch) for p in idx]
        assert sorted(used) == sorted(s for shard in shards_of(lengths) for s in shard)
        sizes = [plan.step_samples(epoch, s) for s in range(plan.steps_per_epoch)]
        assert all(n == plan.global_batch for n in sizes[:-1]), sizes  # the global batch stays the same
        assert 0 < sizes[-1] <= plan.global_batch
        for step in range(plan.steps_per_epoch):  # the streams still running come first
            got = [len(plan.micro_batch_indices(epoch, step, j)) for j in range(plan.num_micro_batches(epoch, step))]
            assert all(n > 0 for n in got) and got == sorted(got, reverse=True)
            assert sum(got) == plan.step_samples(epoch, step)


def test_each_epoch_reads_its_own_order_drawn_from_the_seed():
    plan = Plan(sum(LENGTHS), 4, 3, 11, shard_lengths=LENGTHS, shuffle_window=8)
    firsts = {tuple(plan.micro_batch_indices(e, 0, 0)) for e in range(4)}
    assert len(firsts) > 1
    again = Plan(sum(LENGTHS), 4, 3, 11, shard_lengths=tuple(LENGTHS), shuffle_window=8)
    assert again == plan and np.array_equal(again.micro_batch_indices(2, 3, 1), plan.micro_batch_indices(2, 3, 1))
    ordered = Plan(sum(LENGTHS), 4, 3, 11, shard_lengths=LENGTHS, shuffle_shards=False)
    positions = np.concatenate([idx for _, j, idx in micro_batches(ordered, 0) if j == 0])
    assert positions.tolist() == list(range(len(positions)))  # unshuffled: stream 0 is the data's head


def test_a_plan_read_back_from_json_is_the_same_plan():
    plan = Plan(sum(LENGTHS), 4, 3, 11, shard_lengths=LENGTHS)
    assert Plan(**{**plan.__dict__, "shard_lengths": list(LENGTHS)}) == plan


@pytest.mark.parametrize("window", [1, 6])
def test_streams_taken_over_in_any_order_read_what_the_plan_says(window):
    """As workers come and go, a stream is read from wherever it stands, in any order of steps."""
    plan = Plan(sum(LENGTHS), 4, 3, 11, shard_lengths=LENGTHS, shuffle_window=window)
    source = ShardedDataset(shards_of(LENGTHS), iter, shuffle_window=window)
    bounds = order.segment_bounds(plan.num_samples, plan.micro_batches)
    entries = [(e, s, j, idx) for e in range(2) for s, j, idx in micro_batches(plan, e)]
    for seed in range(3):
        data = StreamedDataset(source, plan.shard_lengths, plan.seed, True, bounds, window)
        random.Random(seed).shuffle(entries)
        for epoch, _, _, idx in entries:
            got = data.__getitems__(idx + epoch * plan.num_samples)
            assert got == [sample_at(plan, epoch, int(p)) for p in idx]


def test_a_worker_reading_its_streams_in_order_reads_each_sample_once():
    reads: list[tuple[int, int]] = []

    def read(shard):
        for sample in shard:
            reads.append(sample)
            yield sample

    plan = Plan(sum(LENGTHS), 4, 1, 11, shard_lengths=LENGTHS)  # one stream: nothing to skip to
    data = StreamedDataset(ShardedDataset(shards_of(LENGTHS), read), LENGTHS, 11, True, np.array([0, 98]), 1)
    for _, _, idx in micro_batches(plan, 0):
        data.__getitems__(idx)
    assert sorted(reads) == sorted(s for shard in shards_of(LENGTHS) for s in shard) and data.skipped == 0


def test_evaluate_and_predict_count_a_dataset_once_and_train_counts_afresh():
    opened: list[object] = []

    def read(shard):
        opened.append(shard)
        return iter(shard)

    dataset = ShardedDataset(shards_of(LENGTHS), read, shuffle=False)
    first = in_order(dataset)
    counted = len(opened)
    assert counted == len(LENGTHS)  # every shard read once to count it
    second = in_order(dataset)  # the next evaluate(): no shard read to count
    assert len(opened) == counted and len(second) == len(first) == sum(LENGTHS)
    assert count_shards(dataset).lengths == tuple(LENGTHS) and len(opened) == 2 * counted  # train(): afresh


def test_a_read_shard_that_takes_start_begins_there_instead_of_skipping():
    opened: list[tuple[int, int]] = []
    shards = shards_of(LENGTHS)

    def read(shard, start=0):
        opened.append((shard[0][0], start))
        return iter(shard[start:])

    data = StreamedDataset(ShardedDataset(shards, read), LENGTHS, 0, False)
    assert data.__getitems__([30, 31]) == [(4, 5), (4, 6)]  # shards 0, 2, 3 hold 25 samples before shard 4
    assert opened == [(4, 5)] and data.skipped == 0
    plain = StreamedDataset(ShardedDataset(shards, iter), LENGTHS, 0, False)
    assert plain.__getitems__([30, 31]) == [(4, 5), (4, 6)] and plain.skipped == 5  # read and dropped


def test_a_shard_that_changed_since_it_was_counted_is_named():
    grown = [list(s) for s in shards_of(LENGTHS)]
    grown[2].append((2, 99))
    data = StreamedDataset(ShardedDataset(grown, iter), LENGTHS, 0, False)
    with pytest.raises(ShardReadError, match=r"shard 2 .* more samples than the 13"):
        data.__getitems__(list(range(25)))
    shrunk = [list(s) for s in shards_of(LENGTHS)]
    shrunk[4].pop()
    data = StreamedDataset(ShardedDataset(shrunk, iter), LENGTHS, 0, False)
    with pytest.raises(ShardReadError, match=r"shard 4 .* fewer samples than the 21"):
        data.__getitems__(list(range(20, 50)))


def failing_read(shard):
    if shard == "bad":
        raise OSError("no such file: bad")
    yield from range(3)


def test_counting_names_a_shard_that_fails_or_skips_it_when_asked():
    assert count_shards(ShardedDataset(["a", "b"], failing_read)).lengths == (3, 3)
    with pytest.raises(ShardReadError, match=r"shard 1 \('bad'\) failed: OSError: no such file.*skip_unreadable=True"):
        count_shards(ShardedDataset(["a", "bad", "c"], failing_read))
    counted = count_shards(ShardedDataset(["a", "bad", "c"], failing_read, skip_unreadable=True))
    assert counted.lengths == (3, 0, 3) and counted.skipped[0][0] == "shard 1 ('bad')"
    assert count_shards(ShardedDataset(["x"], failing_read, lengths=[9])).lengths == (9,)  # given: nothing read
    with pytest.warns(UserWarning, match="train dataset's shard 1 .*was skipped"):
        data = in_caller(ShardedDataset(["a", "bad", "c"], failing_read, skip_unreadable=True), None)
    assert len(data.train) == 6 and data.record()["train"]["skipped"][0]["shard"] == "shard 1 ('bad')"


def test_a_worker_reads_its_own_contiguous_stretch_of_a_sharded_test_set():
    batches = [eval_segment_batches(23, 4, r, 3) for r in range(3)]
    flat = np.concatenate([b for rank in batches for b in rank])
    assert flat.tolist() == list(range(23))
    assert all(np.all(np.diff(np.concatenate(rank)) == 1) for rank in batches)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"shards": "data/*.jsonl"}, r"Expected `shards` to be a list or tuple.*Received: str"),
        ({"shards": []}, r"at least one shard"),
        ({"read_shard": None}, r"Expected `read_shard` to be a function"),
        ({"lengths": [1, 2]}, r"Expected `lengths` to be None or a list of 3 sample counts"),
        ({"lengths": [1, -2, 3]}, r"int >= 0. Received: \[-2\]"),
        ({"shuffle_window": 0}, r"Expected `shuffle_window` to be an int >= 1.*Received: shuffle_window=0"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    args = {"shards": ["a", "b", "c"], "read_shard": iter, **kwargs}
    with pytest.raises((TypeError, ValueError), match=message):
        ShardedDataset(args.pop("shards"), args.pop("read_shard"), **args)


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from range(10)


@pytest.mark.parametrize("dataset", [Stream(), (x for x in range(3))], ids=["torch-iterable", "generator"])
def test_an_iterable_without_shards_is_refused_saying_how_to_shard_it(dataset):
    with pytest.raises(
        TypeError, match=r"map-style .* or sharded .*Received: \w+\. HINT: .*ShardedDataset\(shards, read_shard\)"
    ):
        check_datasets(lambda: (dataset, None))


def test_a_hugging_face_iterable_dataset_is_read_shard_by_shard():
    datasets = need("datasets")
    rows = {"x": [[float(i)] for i in range(30)], "label": [i % 3 for i in range(30)]}
    hf = datasets.Dataset.from_dict(rows).to_iterable_dataset(num_shards=8)
    sharded = as_sharded(hf)
    assert sharded is not None and len(sharded.shards) == 8
    data = in_caller(hf, None)
    assert data.train_count.lengths == (4, 4, 4, 4, 4, 4, 3, 3)
    assert [data.train[i]["x"] for i in (0, 29)] == [[0.0], [29.0]]
    assert check_datasets(lambda: (hf, None))[0] is hf
