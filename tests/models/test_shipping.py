"""Models plain pickling refuses or loses reach the workers (fabric_model/frameworks/torch/shipping.py):
parametrized modules, ``torch.compile``, a module's own ``torch.Generator``, gradient checkpointing,
a Hugging Face model with checkpointing and a peft LoRA model. A job's round trip keeps the
optimizer on the rebuilt model's tensors; training gives the plain loop's result, bitwise alike on
1 and 2 workers with ``deterministic=True``; a job that cannot travel names the part that failed."""

from __future__ import annotations

import pickle
import threading
import types
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import orthogonal, spectral_norm, weight_norm
from torch.utils.checkpoint import checkpoint

from fabric_model import FabricModel
from fabric_model.frameworks.shipping import dumps
from fabric_model.orchestrator.run_setup import serialize_job
from fabric_model.setup.job import Job

from ..helpers import MLP, make_data, max_rel_diff, reference_train

pytestmark = pytest.mark.processes

SEED, EPOCHS, BATCH, GLOBAL = 5, 4, 8, 24  # 3 micro-batches a step, 3 steps an epoch
DATA = make_data(72)


class LowRankDelta(nn.Module):
    """A LoRA-style parametrization: the (frozen) weight plus a trained low-rank product."""

    def __init__(self, rows: int, cols: int, rank: int = 2) -> None:
        super().__init__()
        self.down = nn.Parameter(torch.randn(rows, rank) * 0.1)
        self.up = nn.Parameter(torch.zeros(rank, cols))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self.down @ self.up


class Parametrized(nn.Module):
    """weight_norm, spectral_norm (its power iteration's buffers move in every forward), orthogonal,
    and a LoRA delta over a frozen weight."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = weight_norm(nn.Linear(12, 16))
        self.spectral = spectral_norm(nn.Linear(16, 16))
        self.orthogonal = orthogonal(nn.Linear(16, 16))
        self.head = nn.Linear(16, 3)
        parametrize.register_parametrization(self.head, "weight", LowRankDelta(3, 16))
        self.head.parametrizations.weight.original.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.spectral(torch.relu(self.norm(x))))
        return self.head(torch.tanh(self.orthogonal(x)))


class Noise(nn.Module):
    """Adds noise from its own ``torch.Generator``, reseeded from torch's global generator, which
    the workers seed per micro-batch: any worker count draws the same noise."""

    def __init__(self, scale: float = 0.1) -> None:
        super().__init__()
        self.scale = scale
        self.generator = torch.Generator().manual_seed(1234)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        self.generator.manual_seed(int(torch.randint(2**62, ())))
        return x + self.scale * torch.randn(x.shape, generator=self.generator)


class Checkpointed(nn.Module):
    """A generator's noise, then a block with dropout recomputed in backward (``checkpoint``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 32)
        self.noise = Noise()
        self.block = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Dropout(0.2))
        self.fc2 = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.block, self.noise(torch.relu(self.fc1(x))), use_reentrant=False)
        return self.fc2(h)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.2, momentum=0.9)


def made(cls: Callable[[], nn.Module]) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = cls()
    return model, sgd(model)


def in_place_compiled() -> nn.Module:
    model = MLP(p=0.0)
    model.compile(backend="eager")
    return model


def gpt2_config(**kwargs):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0, **kwargs
    )


def checkpointed_gpt2() -> nn.Module:
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel(gpt2_config(use_cache=False))
    with warnings.catch_warnings():  # transformers 5 renames it activation_checkpointing_enable
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable()
    return model


def peft_gpt2() -> nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2LMHeadModel

    config = LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True, task_type="CAUSAL_LM")
    return get_peft_model(GPT2LMHeadModel(gpt2_config()), config)


def round_trip(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``model`` and ``optimizer`` as a worker unpickles them from its job."""
    job = pickle.loads(dumps(Job(types.SimpleNamespace(model=model, optimizer=optimizer), lambda: (DATA, None))))
    return job.adapter.model, job.adapter.optimizer


def described(model: nn.Module) -> list[tuple]:
    """Each module's class, whether it is parametrized, compiled in place, checkpointing."""
    return [
        (
            type(m).__name__,
            parametrize.is_parametrized(m),
            m.__dict__.get("_compiled_call_impl") is not None,
            getattr(m, "gradient_checkpointing", None),
        )
        for m in model.modules()
    ]


def outputs(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out if isinstance(out, torch.Tensor) else out.logits


TOKENS = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(0))
ROUND_TRIPS: dict[str, tuple[Callable[[], nn.Module], torch.Tensor]] = {
    "weight_norm": (lambda: weight_norm(nn.Linear(12, 3)), DATA[0][0][None]),
    "spectral_norm": (lambda: spectral_norm(nn.Linear(12, 3)), DATA[0][0][None]),
    "orthogonal": (lambda: orthogonal(nn.Linear(12, 12)), DATA[0][0][None]),
    "all parametrizations": (Parametrized, torch.stack([DATA[i][0] for i in range(4)])),
    "generator and checkpoint": (Checkpointed, torch.stack([DATA[i][0] for i in range(4)])),
    "compiled": (lambda: torch.compile(MLP(p=0.0), backend="eager"), DATA[0][0][None]),
    "compiled in place": (in_place_compiled, DATA[0][0][None]),
    "compiled parametrized": (lambda: torch.compile(Parametrized(), backend="eager"), DATA[0][0][None]),
    "gpt2 checkpointed": (checkpointed_gpt2, TOKENS),
    "gpt2 peft lora": (peft_gpt2, TOKENS),
}


@pytest.mark.parametrize("name", ROUND_TRIPS)
def test_a_round_trip_keeps_the_optimizer_on_the_model_and_its_results(name):
    build, x = ROUND_TRIPS[name]
    model, optimizer = made(build)
    shipped, shipped_optimizer = round_trip(model, optimizer)

    held = [p for group in shipped_optimizer.param_groups for p in group["params"]]
    own = {id(p): n for n, p in shipped.named_parameters()}
    assert [own.get(id(p)) for p in held] == [n for n, p in model.named_parameters() if p.requires_grad]
    assert described(shipped) == described(model)
    model.eval()
    shipped.eval()
    with torch.no_grad():
        assert torch.equal(outputs(shipped, x), outputs(model, x))
    # One step on each: the shipped optimizer moves the shipped model's tensors as the original's.
    model.train()
    shipped.train()
    for m, opt in ((model, optimizer), (shipped, shipped_optimizer)):
        torch.manual_seed(1)
        outputs(m, x).square().mean().backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(shipped.state_dict().values(), model.state_dict().values()))


def test_a_compiled_module_is_compiled_again_with_its_options():
    model = MLP(p=0.0)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=False)
    shipped, _ = round_trip(compiled, sgd(compiled))
    assert isinstance(shipped, type(compiled)) and shipped._orig_mod is not model
    assert (shipped.dynamo_ctx.fullgraph, shipped.dynamo_ctx._dynamic) == (True, False)
    from fabric_model.frameworks.torch.shipping import compile_options

    assert compile_options(shipped.dynamo_ctx) == compile_options(compiled.dynamo_ctx)


def test_a_generator_keeps_its_state():
    noise = Noise()
    torch.randn(3, generator=noise.generator)
    shipped, _ = round_trip(noise, torch.optim.SGD([nn.Parameter(torch.zeros(1))]))
    assert shipped.generator.device == noise.generator.device
    assert torch.equal(shipped.generator.get_state(), noise.generator.get_state())


class Logging(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 3)
        self.lock = threading.Lock()


def serialize_error(model: nn.Module, loss: Callable = F.cross_entropy) -> str:
    adapter = types.SimpleNamespace(model=model, optimizer=sgd(model), loss_function=loss)
    with pytest.raises(TypeError, match="Could not serialize the job") as info:
        serialize_job(Job(adapter, lambda: (DATA, None)))
    return str(info.value)


def test_a_job_that_cannot_travel_names_the_part_and_what_works():
    message = serialize_error(nn.Sequential(nn.Linear(12, 12), Logging()))
    assert "`model.1.lock` (a _thread.lock)" in message and "cannot pickle '_thread.lock'" in message
    assert "Logging.__getstate__" in message and "parametrized" in message
    lock = threading.Lock()
    message = serialize_error(nn.Linear(12, 3), lambda out, target: (lock, F.cross_entropy(out, target))[1])
    assert "`loss_function's variable 'lock'`" in message and "create them inside datasets_function" in message
    message = serialize_error(torch.jit.script(nn.Linear(12, 3)))
    assert "TorchScript" in message and "pass the Python module" in message


# -- real workers ----------------------------------------------------------------------------
def train(cls: Callable[[], nn.Module], workers: int, run_dir, **kwargs):
    model, optimizer = made(cls)
    fm = FabricModel(model, lambda: (DATA, None), F.cross_entropy, optimizer, metrics=[])
    result = fm.train(EPOCHS, BATCH, workers, seed=SEED, run_dir=run_dir, effective_batch_size=GLOBAL, **kwargs)
    assert result.history[-1]["loss"] < result.history[0]["loss"]
    return model, optimizer


def reference(cls: Callable[[], nn.Module], data=DATA, loss_fn=F.cross_entropy, epochs=EPOCHS) -> dict:
    model, optimizer = made(cls)
    reference_train(
        model,
        optimizer,
        data,
        seed=SEED,
        epochs=epochs,
        batch_size=BATCH,
        micro_batches=GLOBAL // BATCH,
        loss_fn=loss_fn,
    )
    return model.state_dict()


def final_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    held = [p for group in optimizer.param_groups for p in group["params"]]
    return [*model.state_dict().values(), *(optimizer.state[p]["momentum_buffer"] for p in held)]


@pytest.mark.parametrize("cls", [Parametrized, Checkpointed], ids=["parametrizations", "generator+checkpoint"])
def test_bitwise_alike_on_one_and_two_workers(cls, tmp_path):
    one = train(cls, 1, tmp_path / "one", deterministic=True)
    two = train(cls, 2, tmp_path / "two", deterministic=True)
    assert all(torch.equal(a, b) for a, b in zip(final_state(*one), final_state(*two), strict=True))
    if cls is Checkpointed:  # spectral_norm's buffers start each micro-batch from the step's: no plain loop
        assert max_rel_diff(one[0].state_dict(), reference(cls)) <= 1e-5


def test_a_compiled_model_trains_as_the_plain_loop(tmp_path):
    compiled, _ = train(lambda: torch.compile(MLP(p=0.0)), 2, tmp_path / "run")
    assert max_rel_diff(compiled._orig_mod.state_dict(), reference(lambda: MLP(p=0.0))) <= 1e-5


def token_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    sequences = [torch.arange(start, start + 17) % 100 for start in torch.randint(0, 100, (48,), generator=g)]
    return [(s[:-1].clone(), s[1:].clone()) for s in sequences]  # predict the next token: learnable


def next_token_loss(output, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1), target.flatten())


def test_a_checkpointed_hugging_face_model_trains_as_the_plain_loop(tmp_path):
    data = token_data()
    model, optimizer = made(checkpointed_gpt2)
    fm = FabricModel(model, lambda: (data, None), next_token_loss, optimizer, metrics=[])
    result = fm.train(2, BATCH, 2, seed=SEED, run_dir=tmp_path / "run", effective_batch_size=GLOBAL)
    assert result.history[-1]["loss"] < result.history[0]["loss"]
    expected = reference(checkpointed_gpt2, data, next_token_loss, epochs=2)
    assert max_rel_diff(model.state_dict(), expected) <= 1e-5
