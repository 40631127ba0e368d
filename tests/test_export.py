"""ONNX export: the files agree with their frameworks at batch sizes the export did not see."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from fabric_model.frameworks.export import ExportError, export_onnx, onnx_max_diff

from .helpers import need
from .load import scaled

TOLERANCE = 1e-4


@pytest.fixture
def onnx_deps():
    for module in ("onnxruntime", "onnx", "onnxscript"):
        need(module)


@pytest.fixture
def keras_deps(onnx_deps):
    need("tensorflow")
    need("tf2onnx")
    import keras

    return keras


def batch_is_symbolic(path) -> bool:
    import onnx

    dims = [i.type.tensor_type.shape.dim[0] for i in onnx.load(str(path)).graph.input]
    return bool(dims) and all(d.dim_param and not d.HasField("dim_value") for d in dims)


# ------------------------------------------------------------------------------------------------- torch


class TorchCNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(1, 4, 3, padding=1),
            torch.nn.BatchNorm2d(4),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
        )
        self.head = torch.nn.Linear(4 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


def test_torch_cnn_agrees_at_other_batch_sizes(onnx_deps, tmp_path, caplog):
    torch.manual_seed(0)
    model = TorchCNN()
    for _ in range(3):  # running statistics unlike the batch's: eval and train mode now give different outputs
        model(torch.randn(16, 1, 8, 8) * 2 + 1)
    model.features[2].eval()  # a submodule the user froze stays frozen
    before = {k: v.clone() for k, v in model.state_dict().items()}
    path = tmp_path / "model" / "model.onnx"

    with caplog.at_level(logging.INFO, logger="fabric_model.frameworks.export"):
        diff = export_onnx("torch", model, torch.randn(4, 1, 8, 8), path)

    assert diff < TOLERANCE
    assert "max abs difference" in caplog.text
    assert batch_is_symbolic(path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.onnx"]  # one file, no staging left behind
    for n in (1, 7):
        assert onnx_max_diff(path, "torch", model, [torch.randn(n, 1, 8, 8)]) < TOLERANCE
    assert model.training and model.features[0].training and model.head.training
    assert not model.features[2].training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class TwoInputs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(5, 2)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.linear(torch.cat([a, b], dim=1)), a.sum(dim=1)


def test_torch_tuple_input_from_a_one_sample_batch(onnx_deps, tmp_path):
    torch.manual_seed(0)
    model = TwoInputs()
    path = tmp_path / "two.onnx"
    assert export_onnx("torch", model, (torch.randn(1, 3), torch.randn(1, 2)), path) < TOLERANCE
    assert batch_is_symbolic(path)
    assert onnx_max_diff(path, "torch", model, [(torch.randn(7, 3), torch.randn(7, 2))]) < TOLERANCE


class DataDependent(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # a Python branch on a tensor's value: torch.export cannot trace it
            return self.linear(x)
        return -self.linear(x)


class FixedBatch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).reshape(4, 2)  # the exporter quietly makes the batch dimension static


@pytest.mark.parametrize(
    ("model", "message"),
    [(DataDependent(), "could not trace"), (FixedBatch(), "batch dimension is fixed")],
    ids=["data-dependent", "fixed-batch"],
)
def test_torch_failure_is_a_clear_error_and_keeps_the_old_file(onnx_deps, tmp_path, model, message):
    path = tmp_path / "model.onnx"
    path.write_bytes(b"previous export")
    with pytest.raises(ExportError) as info:
        export_onnx("torch", model, torch.randn(4, 3), path)
    text = str(info.value)
    assert "torch" in text and type(model).__name__ in text and message in text and "hint:" in text
    assert path.read_bytes() == b"previous export"
    assert [p.name for p in tmp_path.iterdir()] == ["model.onnx"]
    assert model.training


@pytest.mark.parametrize("missing", ["onnxruntime", "onnxscript"])
def test_missing_dependency_gives_the_install_hint(onnx_deps, tmp_path, monkeypatch, missing):
    monkeypatch.setitem(sys.modules, missing, None)  # makes `import missing` raise ImportError
    with pytest.raises(ExportError, match=r"(?s)TorchCNN.*not installed.*pip install") as info:
        export_onnx("torch", TorchCNN(), torch.randn(2, 1, 8, 8), tmp_path / "model.onnx")
    assert missing in str(info.value)
    assert isinstance(info.value.__cause__, ImportError)
    assert list(tmp_path.iterdir()) == []


def test_unknown_framework_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="framework"):
        export_onnx("jax", TorchCNN(), torch.randn(2, 1, 8, 8), tmp_path / "model.onnx")


# ------------------------------------------------------------------------------------------------- keras


def randomize_batch_norm(model) -> None:
    """Moving statistics and scales away from their initial 0/1, so inference mode is what is compared."""
    rng = np.random.default_rng(1)
    for layer in model.layers:
        if "BatchNormalization" in type(layer).__name__:
            for variable in (layer.gamma, layer.beta, layer.moving_mean):
                variable.assign(rng.normal(size=variable.shape).astype("float32"))
            layer.moving_variance.assign(rng.uniform(0.5, 2.0, size=layer.moving_variance.shape).astype("float32"))


def keras_cnn(keras):
    inputs = keras.Input((8, 8, 1), name="image")
    x = keras.layers.Conv2D(4, 3, padding="same")(inputs)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Flatten()(x)
    return keras.Model(inputs, keras.layers.Dense(3)(x))


@pytest.mark.tensorflow
def test_keras_cnn_agrees_at_other_batch_sizes(keras_deps, tmp_path):
    keras = keras_deps
    keras.utils.set_random_seed(0)
    model = keras_cnn(keras)  # never called before the export
    randomize_batch_norm(model)
    rng = np.random.default_rng(0)
    path = tmp_path / "model" / "model.onnx"

    diff = export_onnx("keras", model, rng.normal(size=(4, 8, 8, 1)).astype("float32"), path)

    assert diff < TOLERANCE
    assert batch_is_symbolic(path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.onnx"]
    for n in (1, 7):
        assert onnx_max_diff(path, "keras", model, [rng.normal(size=(n, 8, 8, 1)).astype("float32")]) < TOLERANCE


EXPORT_IN_A_FRESH_PROCESS = """
import sys, numpy as np
from fabric_model import quiet_tensorflow
with quiet_tensorflow():
    import keras
from fabric_model.frameworks.export import export_onnx
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
print(export_onnx("keras", model, np.ones((3, 4), "float32"), sys.argv[1]))
"""


@pytest.mark.processes
def test_a_keras_export_prints_nothing_of_the_libraries_it_uses(keras_deps, tmp_path):
    """The export runs in the user's process after training: Keras' numpy probe (a FutureWarning
    on np.object, said once per process) and TensorFlow's notices stay off their screen."""
    out = subprocess.run(
        [sys.executable, "-c", EXPORT_IN_A_FRESH_PROCESS, str(tmp_path / "model.onnx")],
        capture_output=True, text=True, timeout=scaled(120),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout) < TOLERANCE and out.stderr == "", out.stderr


@pytest.mark.tensorflow
def test_keras_subclassed_model_with_dict_input(keras_deps, tmp_path):
    keras = keras_deps

    class TwoTower(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.dense = keras.layers.Dense(6, activation="relu")
            self.norm = keras.layers.BatchNormalization()
            self.out = keras.layers.Dense(2)

        def call(self, inputs, training=False):
            x = keras.ops.concatenate([inputs["a"], inputs["b"]], axis=-1)
            return self.out(self.norm(self.dense(x), training=training))

    keras.utils.set_random_seed(0)
    model = TwoTower()
    rng = np.random.default_rng(0)

    def batch(n):
        return {"a": rng.normal(size=(n, 3)).astype("float32"), "b": rng.normal(size=(n, 2)).astype("float32")}

    model(batch(2))  # builds the weights, so the BatchNormalization statistics can be set
    randomize_batch_norm(model)
    path = tmp_path / "sub.onnx"

    assert export_onnx("keras", model, batch(4), path) < TOLERANCE
    assert batch_is_symbolic(path)
    for n in (1, 7):
        assert onnx_max_diff(path, "keras", model, [batch(n)]) < TOLERANCE


@pytest.mark.tensorflow
def test_keras_failures_are_clear_errors(keras_deps, tmp_path):
    keras = keras_deps

    class UsesNumpy(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x).numpy()  # eager only: no graph to convert

    sample = np.ones((4, 3), "float32")
    path = tmp_path / "model.onnx"
    with pytest.raises(ExportError, match=r"(?s)keras model .*UsesNumpy.*caused by.*hint:"):
        export_onnx("keras", UsesNumpy(), sample, path)
    with pytest.raises(ExportError, match="not a keras.Model"):
        export_onnx("keras", keras.layers.Dense(2), sample, path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.tensorflow
def test_keras_without_tf2onnx_gives_the_install_hint(keras_deps, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tf2onnx", None)
    monkeypatch.setitem(sys.modules, "tf2onnx.convert", None)  # an earlier test may have imported it
    with pytest.raises(ExportError, match=r"(?s)tf2onnx is not installed.*pip install tf2onnx"):
        export_onnx("keras", keras_cnn(keras_deps), np.ones((2, 8, 8, 1), "float32"), tmp_path / "model.onnx")


# ------------------------------------------------------------------------------------ through FabricModel


@pytest.mark.processes
def test_fabric_model_writes_a_checked_onnx_file_for_torch(onnx_deps, run_dir):
    from fabric_model import FabricModel

    torch.manual_seed(0)
    images = [(torch.randn(1, 8, 8), i % 3) for i in range(48)]
    model = TorchCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    result = FabricModel(model, lambda: (images, None), torch.nn.functional.cross_entropy, opt, enable_onnx=True).train(
        1, 8, 2, seed=3, run_dir=run_dir
    )
    path = run_dir / "model" / "model.onnx"
    assert batch_is_symbolic(path)
    assert onnx_max_diff(path, "torch", model, [torch.randn(5, 1, 8, 8)]) < TOLERANCE
    assert model.training  # the caller's model is left in training mode
    # The check's figure reaches the caller and the run's log.
    assert result.onnx_max_diff is not None and 0 <= result.onnx_max_diff < TOLERANCE
    assert onnx_records(run_dir) == [{"path": "model/model.onnx", "max_abs_diff": result.onnx_max_diff}]


def onnx_records(run_dir) -> list[dict]:
    lines = (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()
    found = [json.loads(line) for line in lines if '"onnx"' in line]
    return [{k: v for k, v in r.items() if k not in ("type", "time")} for r in found if r["type"] == "onnx"]


@pytest.mark.processes
def test_fabric_model_warns_when_the_export_fails_and_keeps_the_trained_model(onnx_deps, run_dir):
    from fabric_model import FabricModel

    torch.manual_seed(0)
    data = [(torch.randn(3), i % 2) for i in range(32)]
    model = DataDependent()
    before = model.linear.weight.detach().clone()
    fm = FabricModel(
        model,
        lambda: (data, None),
        torch.nn.functional.cross_entropy,
        torch.optim.SGD(model.parameters(), lr=0.1),
        save_to_onnx=True,
    )
    with pytest.warns(UserWarning, match=r"(?s)ONNX export failed.*DataDependent.*could not trace"):
        result = fm.train(1, 8, 1, seed=3, run_dir=run_dir)
    assert result.onnx_max_diff is None
    assert not (run_dir / "model" / "model.onnx").exists()
    assert (run_dir / "model" / "model.pt").is_file()
    assert not torch.equal(model.linear.weight, before)  # training's result is kept
    [record] = onnx_records(run_dir)
    assert record["path"] is None and "could not trace" in record["error"]


@pytest.mark.processes
def test_fabric_model_writes_a_checked_onnx_file_for_keras(keras_deps, run_dir, caplog):
    from fabric_model import FabricModel

    keras = keras_deps
    caplog.set_level(logging.INFO, logger="fabric_model")
    rng = np.random.default_rng(0)
    images = [(rng.normal(size=(8, 8, 1)).astype("float32"), i % 3) for i in range(48)]
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(4, 3, padding="same", activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
        ]
    )
    FabricModel(model, lambda: (images, None), "sparse_categorical_crossentropy", "adam", save_to_onnx=True).train(
        1, 8, 2, seed=3, run_dir=run_dir
    )
    path = run_dir / "model" / "model.onnx"
    assert batch_is_symbolic(path)
    # The run's last line (on screen; here, with pytest's logging, a record) says it, and how close.
    assert re.fullmatch(rf"onnx: {re.escape(str(path))} \(matches keras within [0-9.e-]+\)", caplog.messages[-1])
    batch = rng.normal(size=(5, 8, 8, 1)).astype("float32")
    assert onnx_max_diff(path, "keras", model, [batch]) < TOLERANCE
