"""Hugging Face models as their users train them: dict samples, ``model(**batch)``, the model's own loss.

Each model is built from a small config with random weights (nothing is downloaded). Each case
checks that it trains unchanged, that its loss falls, that ``deterministic=True`` gives bitwise
equal weights and optimizer state on 1 and 2 engines, and that those equal the loop its user
would write by hand (tests/models/harness.py).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

from ..helpers import Lazily
from .harness import Case, by_hand, differing, loss_fell, train

transformers = Lazily("transformers")
peft = Lazily("peft")

pytestmark = pytest.mark.processes

VOCAB, LENGTH, SAMPLES = 50, 12, 24


def counting_sequences(samples: int = SAMPLES, length: int = LENGTH) -> list[dict[str, torch.Tensor]]:
    """Token sequences that count up from a random start: a pattern a language model learns fast."""
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, VOCAB, (samples,), generator=g)
    ids = (starts[:, None] + torch.arange(length)) % VOCAB
    mask = torch.ones(length, dtype=torch.long)
    # .clone(): a row of ids is a view of the whole tensor, which would travel with every sample
    return [{"input_ids": ids[i].clone(), "attention_mask": mask, "labels": ids[i].clone()} for i in range(samples)]


def gpt2_config():
    return transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )


def gpt2() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(gpt2_config())
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def lora_gpt2(task_type: str | None = "CAUSAL_LM") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """peft's LoRA on GPT-2; without a ``task_type`` peft returns a plain ``PeftModel``, whose
    ``forward(*args, **kwargs)`` names nothing: its base model's signature says what it takes."""
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(gpt2_config())
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, task_type=task_type)
    model = peft.get_peft_model(base, config)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trainable, lr=1e-2)


def own_loss(model, batch):
    return model(**batch).loss


def run_case(case: Case, tmp_path):
    """Trained on 1 and 2 engines and by hand; the three must agree bitwise."""
    one = train(case, 1, tmp_path / "one")
    two = train(case, 2, tmp_path / "two")
    hand = by_hand(case)
    assert loss_fell(two), two.train_history
    assert not differing(one.state, two.state), differing(one.state, two.state)
    assert not differing(two.state, hand.state), differing(two.state, hand.state)
    return one, two, hand


def test_gpt2_on_its_own_loss_and_on_a_loss_reading_its_output(tmp_path):
    """``loss_function=None`` (1 engine): the dict goes to ``model(**batch)`` with its labels and the
    loss is ``outputs.loss``. A loss given the ``ModelOutput`` whole, and the labels as its target
    (2 engines), trains the same bits; both equal the loop by hand."""

    def loss(outputs, labels):  # (it runs in the caller's first-batch check too: a failure shows there)
        assert isinstance(outputs, transformers.modeling_outputs.CausalLMOutputWithCrossAttentions)
        assert labels.shape == (len(labels), LENGTH)
        return outputs.loss

    own = Case(gpt2, counting_sequences(), None, own_loss)
    one = train(own, 1, tmp_path / "one")
    two = train(dataclasses.replace(own, loss_function=loss), 2, tmp_path / "two")
    assert loss_fell(two), two.train_history
    assert not differing(one.state, two.state), differing(one.state, two.state)
    assert not differing(two.state, by_hand(own).state)


def classified_sequences(samples: int = SAMPLES, length: int = LENGTH) -> list[dict[str, torch.Tensor]]:
    """Random token sequences whose class is told by their first token."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (samples, length), generator=g)
    labels = (ids[:, 0] > VOCAB // 2).long()
    mask = torch.ones(length, dtype=torch.long)
    return [{"input_ids": ids[i].clone(), "attention_mask": mask, "labels": labels[i].clone()} for i in range(samples)]


def bert() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=2,
    )
    model = transformers.BertForSequenceClassification(config)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def logits_loss(outputs, labels):
    return F.cross_entropy(outputs.logits, labels)


def test_bert_classifier_with_a_loss_on_logits(tmp_path):
    run_case(Case(bert, classified_sequences(), logits_loss, own_loss), tmp_path)


@pytest.mark.parametrize("task_type", ["CAUSAL_LM", None])
def test_lora_trains_only_the_adapters(tmp_path, task_type):
    """peft LoRA, with and without a ``task_type``, on the model's own loss: the adapter weights
    train; the frozen base stays bit-identical and is never exchanged."""
    build = functools.partial(lora_gpt2, task_type)
    case = Case(build, counting_sequences(), None, own_loss)
    one, two, hand = run_case(case, tmp_path)
    if task_type is None:
        assert type(two.model) is peft.PeftModel  # the wrapper whose forward names nothing
    initial, _ = build()
    start = {f"model.{k}": v for k, v in initial.state_dict().items()}
    changed = [k for k in start if not torch.equal(two.state[k], start[k])]
    assert changed and all("lora_" in k for k in changed), changed
    trainable = sum(p.numel() for p in two.model.parameters() if p.requires_grad)
    assert trainable < sum(p.numel() for p in two.model.parameters()) // 10


class Wrapper(torch.nn.Module):
    """A user's own wrapper that passes every keyword on to a model it does not expose by a known
    name: every key of the dict sample reaches the model, ``labels`` included."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, **kwargs):
        return self.inner(**kwargs)


def wrapped_gpt2() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Wrapper(transformers.GPT2LMHeadModel(gpt2_config()))
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def test_a_user_s_keyword_wrapper_passes_the_labels_on(tmp_path):
    run_case(Case(wrapped_gpt2, counting_sequences(), None, own_loss), tmp_path)


def reversed_sequences(samples: int = SAMPLES) -> list[dict[str, torch.Tensor]]:
    """Sequence-to-sequence pairs: the target is the source reversed."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(2, VOCAB, (samples, LENGTH // 2), generator=g)
    mask = torch.ones(LENGTH // 2, dtype=torch.long)
    return [
        {"input_ids": ids[i].clone(), "attention_mask": mask, "labels": ids[i].flip(0).clone()} for i in range(samples)
    ]


def t5() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=2,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    model = transformers.T5ForConditionalGeneration(config)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def test_t5_encoder_decoder_on_its_own_loss(tmp_path):
    """An encoder-decoder: the model shifts the labels into its decoder's inputs itself."""
    run_case(Case(t5, reversed_sequences(), None, own_loss), tmp_path)
