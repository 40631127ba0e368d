"""Common torch model patterns as users write them: structured outputs, named inputs, buffers a
forward reassigns or counts with, tied weights with BatchNorm and dropout, packed sequences,
bf16-mixed, noise from generators the model owns. Each trains unchanged and gives, with
``deterministic=True``, the same bits on 1 and 2 engines as the loop its user would write by
hand (tests/models/harness.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_sequence

from fabric_model import generator_seed

from .harness import Case, by_hand, differing, loss_fell, train

pytestmark = pytest.mark.processes

VOCAB, LENGTH = 20, 8


def next_token_data(n: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, VOCAB, (n,), generator=g)
    ids = (starts[:, None] + torch.arange(LENGTH + 1)) % VOCAB
    return [(ids[i, :-1].clone(), ids[i, 1:].clone()) for i in range(n)]  # not views of the whole


class TiedLM(torch.nn.Module):
    """Tied input and output embeddings, BatchNorm, dropout; a dict output; a float buffer the
    forward *reassigns* and an integer one it counts samples with."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.mix = torch.nn.Linear(16, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.drop = torch.nn.Dropout(0.1)
        self.out = torch.nn.Linear(16, VOCAB, bias=False)
        self.out.weight = self.embed.weight  # tied
        self.register_buffer("mean_norm", torch.zeros(()))
        self.register_buffer("samples_seen", torch.zeros((), dtype=torch.long))

    def forward(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.relu(self.mix(self.embed(tokens)))  # (N, T, 16)
        h = self.drop(self.norm(h.transpose(1, 2)).transpose(1, 2))
        if self.training:
            self.mean_norm = 0.9 * self.mean_norm + 0.1 * h.detach().norm(dim=-1).mean()  # a new tensor
            self.samples_seen += tokens.shape[0]
        return {"logits": self.out(h), "hidden": h}


def tied_lm() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TiedLM()
    return model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def lm_loss(output, target):
    return F.cross_entropy(output["logits"].flatten(0, 1), target.flatten())


def test_tied_lm_with_a_dict_output_and_buffers_it_reassigns_and_counts(tmp_path):
    data = next_token_data()
    case = Case(tied_lm, data, lm_loss, lambda m, b: lm_loss(m(b[0]), b[1]))
    one, two, hand = train(case, 1, tmp_path / "one"), train(case, 2, tmp_path / "two"), by_hand(case)
    assert loss_fell(two), two.train_history
    assert not differing(one.state, two.state), differing(one.state, two.state)
    assert not differing(two.state, hand.state), differing(two.state, hand.state)
    # The counter counts every sample once, as the loop by hand does, whatever the worker count.
    assert int(two.state["model.samples_seen"]) == len(data) * case.epochs
    assert float(two.state["model.mean_norm"]) > 0


def test_bf16_mixed_matches_the_autocast_loop(tmp_path):
    def hand(model, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return lm_loss(model(batch[0]), batch[1])

    case = Case(tied_lm, next_token_data(), lm_loss, hand, epochs=2, kwargs={"precision": "bf16-mixed"})
    two = train(case, 2, tmp_path / "two")
    assert not differing(two.state, by_hand(case).state)


class Tagger(torch.nn.Module):
    """A GRU over padded sequences, packed by their lengths; named inputs; a tuple output."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 12, padding_idx=0)
        self.rnn = torch.nn.GRU(12, 16, batch_first=True)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        packed = pack_padded_sequence(self.embed(tokens), lengths.cpu(), batch_first=True, enforce_sorted=False)
        _, hidden = self.rnn(packed)
        return self.head(hidden[-1]), hidden


def variable_length_data(n: int = 32) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    samples = []
    for _ in range(n):
        length = int(torch.randint(2, LENGTH, (), generator=g))
        tokens = torch.randint(1, VOCAB, (length,), generator=g)
        samples.append({"tokens": tokens, "label": torch.tensor(int(tokens[0]) % 3)})
    return samples


def collate(samples):
    """Padded tokens, their lengths, the labels: a dict the forward takes by name."""
    return {
        "tokens": pad_sequence([s["tokens"] for s in samples], batch_first=True),
        "lengths": torch.tensor([len(s["tokens"]) for s in samples]),
        "label": torch.stack([s["label"] for s in samples]),
    }


def tagger() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Tagger()
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def tuple_loss(output, target):
    prediction, _hidden = output
    return F.cross_entropy(prediction, target)


def test_packed_gru_with_named_inputs_and_a_tuple_output(tmp_path):
    data = variable_length_data()

    def hand(model, batch):
        return tuple_loss(model(batch["tokens"], batch["lengths"]), batch["label"])

    case = Case(tagger, data, tuple_loss, hand, kwargs={"fn_batch_collate": collate})
    one, two = train(case, 1, tmp_path / "one"), train(case, 2, tmp_path / "two")
    assert loss_fell(two), two.train_history
    assert not differing(one.state, two.state)
    assert not differing(two.state, by_hand(case).state)


class NoisyBlock(torch.nn.Module):
    """A layer that adds noise from a generator it owns (a denoising model's shape)."""

    def __init__(self, width: int, seed: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(width, width)
        self.noise = torch.Generator().manual_seed(seed)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc(h))
        if self.training:
            h = h + 0.3 * torch.randn(h.shape, generator=self.noise)
        return h


class Denoiser(torch.nn.Module):
    """Two owned generators, one of them nested, beside dropout from torch's global generator."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.block = NoisyBlock(16, seed=7)
        self.drop = torch.nn.Dropout(0.1)
        self.out = torch.nn.Linear(16, VOCAB)
        self.input_noise = torch.Generator().manual_seed(11)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        if self.training:
            h = h + 0.1 * torch.randn(h.shape, generator=self.input_noise)
        return self.out(self.drop(self.block(h)))


def denoiser() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Denoiser()
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def test_a_model_owning_generators_draws_the_same_noise_on_any_worker_count(tmp_path):
    """Each generator the model owns is seeded per micro-batch as the global one is
    (``generator_seed``): 1 and 2 engines and the loop that seeds them by hand agree bitwise."""

    def seed_own(model, seed):  # what the user's loop does, as docs/training.md says
        model.input_noise.manual_seed(generator_seed(seed, "input_noise"))
        model.block.noise.manual_seed(generator_seed(seed, "block.noise"))

    def hand(model, batch):
        return F.cross_entropy(model(batch[0]).flatten(0, 1), batch[1].flatten())

    case = Case(denoiser, next_token_data(), lm_loss_of_logits, hand, seed_own=seed_own)
    one, two = train(case, 1, tmp_path / "one"), train(case, 2, tmp_path / "two")
    assert loss_fell(two), two.train_history
    assert not differing(one.state, two.state), differing(one.state, two.state)
    assert not differing(two.state, by_hand(case).state)


def lm_loss_of_logits(output, target):
    return F.cross_entropy(output.flatten(0, 1), target.flatten())
