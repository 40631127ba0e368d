"""ONNX export as trained: the file is traced on the call training makes (``model(**batch)`` for named
inputs), a compiled model exports its original module, structured outputs are flattened alike on
both sides, and a model torch.export cannot trace (packed sequences) fails with a clear warning while
its trained model is kept. Exports run in-process where no training is needed; three short runs
train with FabricModel."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_sequence

from fabric_model import FabricModel
from fabric_model.frameworks.export import ExportError, export_onnx, onnx_max_diff

from ..helpers import need

pytestmark = pytest.mark.processes

TOLERANCE = 1e-4


@pytest.fixture(autouse=True)
def onnx_deps() -> None:
    for module in ("onnx", "onnxruntime", "onnxscript"):
        need(module)


def io_names(path: Any) -> tuple[list[str], list[str]]:
    """The file's input and output names."""
    import onnx

    graph = onnx.load(str(path)).graph
    return [i.name for i in graph.input], [o.name for o in graph.output]


def run_by_name(path: Any, feeds: dict[str, torch.Tensor]) -> list[np.ndarray]:
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {name: x.numpy() for name, x in feeds.items()})


def onnx_records(run_dir: Any) -> list[dict[str, Any]]:
    lines = (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("type") == "onnx"]


def train(model: torch.nn.Module, data: list[Any], loss: Any, run_dir: Any, **kwargs: Any) -> Any:
    """One short epoch on one worker, with save_to_onnx."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    fm = FabricModel(model, lambda: (data, None), loss, optimizer, metrics=[], save_to_onnx=True, **kwargs)
    return fm.train(1, 8, 1, seed=3, run_dir=run_dir, verbose=0, tensorboard=False)


# ------------------------------------------------------------------------ named inputs, torch.compile


class Named(torch.nn.Module):
    """A forward of named inputs with an optional mask (what ``model(**batch)`` fills by name)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Linear(4, 8)
        self.extra = torch.nn.Linear(2, 8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, features: torch.Tensor, extra: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        hidden = torch.relu(self.features(features) + self.extra(extra))
        return self.head(hidden if mask is None else hidden * mask[:, None])


def named_samples(n: int = 24) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        {"extra": torch.randn(2, generator=g), "features": torch.randn(4, generator=g), "label": torch.tensor(i % 3)}
        for i in range(n)
    ]


def test_a_compiled_model_of_named_inputs_trained_on_dicts_exports_as_called(run_dir):
    torch.manual_seed(0)
    model = torch.compile(Named(), backend="eager")  # eager: compiling costs nothing, the wrapper is what counts
    result = train(model, named_samples(), F.cross_entropy, run_dir)

    path = run_dir / "model" / "model.onnx"
    inputs, outputs = io_names(path)
    assert inputs == ["extra", "features"] and outputs == ["output"]  # the dict's keys, in the batch's order
    assert result.onnx_max_diff is not None and result.onnx_max_diff < TOLERANCE
    assert onnx_records(run_dir)[0]["path"] == "model/model.onnx"
    # Fed by name at a batch size the export did not see, the file computes model(**batch).
    batch = {"features": torch.randn(5, 4), "extra": torch.randn(5, 2)}
    original = model._orig_mod
    original.eval()
    with torch.no_grad():
        expected = original(**batch).numpy()
    [got] = run_by_name(path, batch)
    assert np.abs(got - expected).max() < TOLERANCE
    assert onnx_max_diff(path, "torch", model, [batch]) < TOLERANCE


def test_a_compiled_model_exports_its_original_module(tmp_path):
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    compiled = torch.compile(mlp)  # never called: nothing is compiled, the export traces mlp itself
    path = tmp_path / "compiled.onnx"
    assert export_onnx("torch", compiled, torch.randn(4, 3), path) < TOLERANCE
    assert onnx_max_diff(path, "torch", mlp, [torch.randn(6, 3)]) < TOLERANCE


# ---------------------------------------------------------------------------------- structured outputs


@dataclasses.dataclass
class Prediction:
    logits: torch.Tensor
    aux: torch.Tensor | None  # None: no output
    parts: tuple[torch.Tensor, dict[str, torch.Tensor]]


class Structured(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.linear = torch.nn.Linear(3, 2)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> Any:
        logits, total = self.linear(a) * b, a.sum(dim=1)
        if self.kind == "tuple":
            return logits, (total, None), 7  # a number and a None are no outputs
        if self.kind == "dict":
            return {"logits": logits, "stats": {"total": total, "max": a.amax(dim=1)}}
        return Prediction(logits, None, (total, {"scaled": logits * 2}))


@pytest.mark.parametrize(
    ("kind", "names"),
    [
        ("tuple", ["output_0", "output_1_0"]),
        ("dict", ["logits", "stats_total", "stats_max"]),
        ("dataclass", ["logits", "parts_0", "parts_1_scaled"]),
    ],
)
def test_structured_outputs_are_flattened_alike_in_the_file_and_the_check(tmp_path, kind, names):
    torch.manual_seed(0)
    model = Structured(kind)
    path = tmp_path / f"{kind}.onnx"
    assert export_onnx("torch", model, (torch.randn(4, 3), torch.randn(4, 1)), path) < TOLERANCE
    assert io_names(path) == (["input_0", "input_1"], names)
    assert onnx_max_diff(path, "torch", model, [(torch.randn(7, 3), torch.randn(7, 1))]) < TOLERANCE


# ---------------------------------------------------------------------------------------- Hugging Face


def test_a_hugging_face_classifier_trained_on_its_own_loss_exports_without_its_labels(run_dir):
    from .test_transformers import bert  # the corpus' BERT (vocabulary of 50)

    model, _ = bert()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 50, (16, 10), generator=g)
    mask = torch.ones(16, 10, dtype=torch.long)
    mask[::3, 7:] = 0  # padded samples: the mask is a real input
    data = [{"input_ids": ids[i], "attention_mask": mask[i], "labels": ids[i, 0] % 2} for i in range(16)]

    result = train(model, data, None, run_dir)

    path = run_dir / "model" / "model.onnx"
    # Called as trained, model(**batch), less the labels: an inference file, whose output is the logits.
    assert io_names(path) == (["input_ids", "attention_mask"], ["logits"])
    assert result.onnx_max_diff is not None and result.onnx_max_diff < TOLERANCE
    batch = {"input_ids": ids[:5], "attention_mask": mask[:5]}
    model.eval()
    with torch.no_grad():
        expected = model(**batch).logits.numpy()
    [got] = run_by_name(path, batch)
    assert np.abs(got - expected).max() < TOLERANCE


# -------------------------------------------------------------------------------------- packed sequences


class PackedGRU(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(20, 6, padding_idx=0)
        self.rnn = torch.nn.GRU(6, 8, batch_first=True)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(self.embed(tokens), lengths.cpu(), batch_first=True, enforce_sorted=False)
        _, hidden = self.rnn(packed)
        return self.head(hidden[-1])


def sequences(n: int = 16) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(2, 8, (n,), generator=g)
    return [
        {"tokens": torch.randint(1, 20, (int(length),), generator=g), "label": torch.tensor(i % 3)}
        for i, length in enumerate(lengths)
    ]


def pad(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {
        "tokens": pad_sequence([s["tokens"] for s in samples], batch_first=True),
        "lengths": torch.tensor([len(s["tokens"]) for s in samples]),
        "label": torch.stack([s["label"] for s in samples]),
    }


PACKED = r"(?s)PackedGRU.*could not trace the model: it runs an RNN on packed sequences.*hint: torch.export cannot"


def test_packed_sequences_fail_to_export_with_a_plain_error(tmp_path):
    batch = pad(sequences(4))
    del batch["label"]
    with pytest.raises(ExportError, match=PACKED):
        export_onnx("torch", PackedGRU(), batch, tmp_path / "model.onnx")
    assert list(tmp_path.iterdir()) == []


def test_a_packed_gru_trains_and_its_failed_export_keeps_the_trained_model(run_dir):
    torch.manual_seed(0)
    model = PackedGRU()
    before = model.head.weight.detach().clone()
    with pytest.warns(UserWarning, match=r"(?s)ONNX export failed.*The trained model is saved: model/model.pt\..*"):
        result = train(model, sequences(), F.cross_entropy, run_dir, fn_batch_collate=pad)
    assert result.onnx_max_diff is None
    assert (run_dir / "model" / "model.pt").is_file()
    assert not (run_dir / "model" / "model.onnx").exists()
    assert not torch.equal(model.head.weight, before)  # trained
    [record] = onnx_records(run_dir)
    assert record["path"] is None and "packed sequences" in record["error"]
