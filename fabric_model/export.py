"""ONNX export of a trained model, checked against the framework with onnxruntime.

``export_onnx`` writes the file with a dynamic batch dimension, then runs it on real batches of two sizes
and returns (and logs) the largest absolute difference from the framework's own inference output.
onnx, onnxruntime, onnxscript (torch) and tf2onnx (Keras) are imported only when an export is asked for,
so the package works without them.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

FRAMEWORKS = ("torch", "keras")

# A difference above this, relative to the outputs' scale, means the file does not compute what the model does.
_WARN_TOLERANCE = 1e-3

# Weights above this go to an external data file: a single protobuf cannot exceed 2 GiB.
_EXTERNAL_DATA_BYTES = 1 << 30

_INSTALL_HINT = {
    "onnx": "pip install 'fabric-model[onnx]'",
    "onnxruntime": "pip install 'fabric-model[onnx]'",
    "onnxscript": "pip install onnxscript (torch.onnx.export's exporter needs it)",
    "tf2onnx": "pip install tf2onnx (Keras' ONNX export needs it)",
    "tensorflow": "pip install 'fabric-model[tensorflow]'",
    "keras": "pip install 'fabric-model[tensorflow]'",
}

_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # torch.onnx colours its messages
_ERROR_LINE = re.compile(r"\s*[\w.]*(Error|Exception)\b")

_ORT_DTYPES = {
    "tensor(float)": np.float32,
    "tensor(double)": np.float64,
    "tensor(float16)": np.float16,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
}


class ExportError(RuntimeError):
    """The model could not be exported to ONNX, or the exported file could not be checked."""


def _model_name(model: Any) -> str:
    return type(model).__qualname__


def _error(framework: str, model: Any, what: str, exc: BaseException | None = None, hint: str = "") -> ExportError:
    message = f"ONNX export of {framework} model {_model_name(model)} failed: {what}"
    if exc is not None:
        # Some lines only (the whole exception is the __cause__): torch.export's messages run to pages of graph
        # dumps, and TensorFlow's end with the actual error after the user-code traceback.
        lines = _ANSI.sub("", str(exc)).strip().splitlines()
        if len(lines) > 12:
            # ...and the exception lines further down, with the line after each (Keras puts the message there).
            starts = [i for i in range(8, len(lines)) if _ERROR_LINE.match(lines[i])][:2]
            errors = [line for i in starts for line in lines[i : i + 2] if line.strip()]
            lines = [*lines[:8], "    ...", *errors]
        detail = "\n".join(lines)
        message += f"\n  caused by {type(exc).__name__}: {detail}"
    if hint:
        message += f"\n  hint: {hint}"
    return ExportError(message)


def _require(module: str, framework: str, model: Any) -> ModuleType:
    """Import an optional dependency; its absence becomes an ExportError with the install command."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        package = module.split(".")[0]
        hint = _INSTALL_HINT.get(package, "pip install 'fabric-model[onnx]'")
        raise _error(framework, model, f"{package} is not installed", exc, hint) from exc


def _check_framework(framework: str) -> None:
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {FRAMEWORKS}, got {framework!r}")


# ----------------------------------------------------------------------------------------------- batches


def _batch_size(sample: Any) -> int:
    leaves = _leaves(sample)
    if not leaves or not hasattr(leaves[0], "shape") or len(leaves[0].shape) == 0:
        raise ValueError("sample_input must be a batch: an array or tensor (or a tuple/dict of them) with a batch axis")
    return int(leaves[0].shape[0])


def _leaves(tree: Any) -> list[Any]:
    """Arrays/tensors of a nested tuple/list/dict, dicts in insertion order (as torch's pytree flattens them)."""
    if isinstance(tree, dict):
        return [leaf for value in tree.values() for leaf in _leaves(value)]
    if isinstance(tree, list | tuple):
        return [leaf for value in tree for leaf in _leaves(value)]
    return [tree]


def _map(fn: Any, tree: Any) -> Any:
    if isinstance(tree, dict):
        return {key: _map(fn, value) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_map(fn, value) for value in tree)
    return fn(tree)


def _other_batch(sample: Any) -> Any:
    """The sample with its first row repeated at the end: a batch size the export did not see."""

    def grow(x: Any) -> Any:
        if isinstance(x, np.ndarray):
            return np.concatenate([x, x[:1]])
        import torch

        if isinstance(x, torch.Tensor):
            return torch.cat([x, x[:1]])
        tf = importlib.import_module("tensorflow")
        return tf.concat([x, x[:1]], axis=0)

    return _map(grow, sample)


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor, possibly on a GPU or requiring grad
        return x.detach().cpu().numpy()
    return np.asarray(x)


# ------------------------------------------------------------------------------------------------- torch


@contextlib.contextmanager
def _torch_inference(model: Any) -> Iterator[None]:
    """Eval mode and no autograd for the block; every submodule's own training flag is restored after.

    The caller's model is switched in place rather than deep-copied: a copy doubles the (GPU) memory and some
    models do not copy; restoring each submodule's flag also keeps a submodule the user froze in eval mode.
    """
    import torch

    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, training in modes:
            module.training = training


def _torch_args(model: Any, sample: Any) -> tuple[Any, ...]:
    """The model's positional inputs, on the model's device."""
    import torch

    args = sample if isinstance(sample, tuple | list) else (sample,)
    try:
        device = next(model.parameters()).device
    except StopIteration:
        return tuple(args)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def _export_torch(model: Any, sample: Any, path: str) -> None:
    torch = _require("torch", "torch", model)
    if not isinstance(model, torch.nn.Module):
        raise _error("torch", model, "the model is not a torch.nn.Module")
    _require("onnx", "torch", model)
    _require("onnxscript", "torch", model)
    args = _torch_args(model, sample)
    if _batch_size(args) == 1:
        # torch.export specializes a dimension of size 1 (it cannot tell it from broadcasting), so a
        # one-sample batch would give a fixed batch of 1: export with the sample repeated instead.
        args = tuple(torch.cat([a, a]) if isinstance(a, torch.Tensor) else a for a in args)
    # The torch.export-based exporter (dynamo=True): it is the default since torch 2.9, while the TorchScript
    # exporter warns that it is deprecated. It needs onnxscript. One Dim shared by every input says they
    # share the batch size. Note it silently falls back to a static dimension when the model fixes the batch
    # size (e.g. x.view(4, -1)): export_onnx checks the file's input shape for that.
    batch = torch.export.Dim("batch")
    dynamic_shapes = tuple({0: batch} if isinstance(a, torch.Tensor) and a.dim() > 0 else None for a in args)
    names = ["input"] if len(args) == 1 else [f"input_{i}" for i in range(len(args))]
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with _torch_inference(model):
        try:
            torch.onnx.export(
                model,
                args,
                path,
                dynamo=True,
                input_names=names,
                dynamic_shapes=dynamic_shapes,
                # One self-contained file unless it cannot be (the exporter's default is an extra .data file).
                external_data=weight_bytes > _EXTERNAL_DATA_BYTES,
                verbose=False,
            )
        except ImportError as exc:
            hint = _INSTALL_HINT["onnxscript"]
            raise _error("torch", model, "a module the exporter needs is missing", exc, hint) from exc
        except Exception as exc:
            raise _error(
                "torch",
                model,
                "torch.onnx.export could not trace the model",
                exc,
                "the forward must be traceable by torch.export: no Python branches on tensor values, no "
                "conversions to numpy or Python numbers (see the exportdb in the torch docs)",
            ) from exc


def _torch_outputs(model: Any, sample: Any) -> list[np.ndarray]:
    with _torch_inference(model):
        out = model(*_torch_args(model, sample))
    return [_to_numpy(x) for x in _leaves(out)]


# ------------------------------------------------------------------------------------------------- keras


def _keras_signature(model: Any, sample: Any) -> list[Any]:
    """Positional input signature for model.export: the sample's structure, every batch dimension None.

    Shapes and dtypes come from the model's declared inputs where it has them (Sequential with an Input,
    functional; they may also leave other dimensions open), else from the sample (subclassed models).
    """
    tf = importlib.import_module("tensorflow")
    try:
        declared = list(model.inputs or [])
    except (AttributeError, ValueError):  # subclassed or never-built models have no symbolic inputs
        declared = []
    by_name = {getattr(t, "name", None): t for t in declared}

    def spec(x: Any, name: str | None, declared_input: Any = None) -> Any:
        if declared_input is not None and len(declared_input.shape) == len(x.shape):
            shape = (None, *declared_input.shape[1:])
            dtype = declared_input.dtype
        else:
            shape = (None, *x.shape[1:])
            dtype = x.dtype
        return tf.TensorSpec(shape, tf.as_dtype(dtype), name=name)

    if isinstance(sample, dict):
        return [{key: spec(value, key, by_name.get(key)) for key, value in sample.items()}]
    if isinstance(sample, list | tuple):
        pairs = zip(sample, declared) if len(declared) == len(sample) else ((x, None) for x in sample)
        return [[spec(x, f"input_{i}", d) for i, (x, d) in enumerate(pairs)]]
    single = declared[0] if len(declared) == 1 else None
    return [spec(sample, getattr(single, "name", None) or "input", single)]


def _keras_has_onnx_export() -> bool:
    # model.export(format="onnx") arrived in Keras 3.x; fabric-model[tensorflow] allows older Keras 3.
    return importlib.util.find_spec("keras.src.export.onnx") is not None


@contextlib.contextmanager
def _environ_kept() -> Iterator[None]:
    """Undo os.environ changes made in the block.

    tf2onnx.convert sets TF_CPP_MIN_LOG_LEVEL=3 when imported (and TensorFlow sets TF2_BEHAVIOR, KMP_*...):
    an export must not change the environment of the training process and of the workers it starts later.
    """
    before = dict(os.environ)
    try:
        yield
    finally:
        for key in set(os.environ) - set(before):
            del os.environ[key]
        for key, value in before.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


def _export_keras(model: Any, sample: Any, path: str) -> None:
    keras = _require("keras", "keras", model)
    tf = _require("tensorflow", "keras", model)
    if not isinstance(model, keras.Model):
        raise _error("keras", model, "the model is not a keras.Model (a bare layer or function cannot be exported)")
    _require("onnx", "keras", model)
    # Both paths convert a tf.function with tf2onnx; import it here so its absence gets the install hint.
    tf2onnx = _require("tf2onnx.convert", "keras", model)
    if not model.built:
        # A subclassed model has no weights (and model.export refuses it) until it is called once.
        try:
            model(sample, training=False)
        except Exception as exc:
            raise _error("keras", model, "the model fails on sample_input", exc) from exc
    signature = _keras_signature(model, sample)
    try:
        if _keras_has_onnx_export():
            # Keras' own exporter traces call(training=False) over the signature and patches tf2onnx for
            # numpy 2; it wants an explicit signature for models that were never called.
            model.export(path, format="onnx", verbose=False, input_signature=signature)
        else:
            # tf2onnx.convert.from_keras fails on Keras 3 models (KeyError on 'keras_tensor_N'); a
            # tf.function over the same signature converts.
            function = tf.function(lambda *args: model(*args, training=False), input_signature=signature)
            tf2onnx.from_function(function, input_signature=signature, output_path=path)
    except Exception as exc:
        raise _error(
            "keras",
            model,
            "the model could not be traced and converted",
            exc,
            "call() must run inside a tf.function: TensorFlow/Keras ops only, no .numpy() or Python branches on "
            "tensor values; the dtype policy must be float32",
        ) from exc


def _keras_outputs(model: Any, sample: Any) -> tuple[list[np.ndarray], list[str] | None]:
    keras = importlib.import_module("keras")
    out = model(sample, training=False)
    names = sorted(out) if isinstance(out, dict) else None  # keras.tree flattens dicts in sorted key order
    return [_to_numpy(x) for x in keras.tree.flatten(out)], names


# -------------------------------------------------------------------------------------------------- check


def _ort_session(path: str, framework: str, model: Any) -> Any:
    ort = _require("onnxruntime", framework, model)
    try:
        # The CPU provider explicitly: GPU builds of onnxruntime refuse a session without a provider list.
        return ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise _error(framework, model, "onnxruntime cannot load the exported file", exc) from exc


def _feeds(session: Any, framework: str, model: Any, batch: Any) -> dict[str, np.ndarray]:
    inputs = session.get_inputs()
    if framework == "keras" and isinstance(batch, dict) and all(i.name in batch for i in inputs):
        arrays = [_to_numpy(batch[i.name]) for i in inputs]
    else:
        keras_tree = importlib.import_module("keras").tree if framework == "keras" else None
        leaves = keras_tree.flatten(batch) if keras_tree else _leaves(batch)
        arrays = [_to_numpy(x) for x in leaves]
    if len(arrays) != len(inputs):
        raise _error(framework, model, f"the file has {len(inputs)} inputs, the sample {len(arrays)}")
    return {i.name: a.astype(_ORT_DTYPES.get(i.type, a.dtype), copy=False) for i, a in zip(inputs, arrays)}


def onnx_max_diff(path: str | os.PathLike[str], framework: str, model: Any, inputs: Sequence[Any]) -> float:
    """Largest absolute difference between onnxruntime on ``path`` and the model in inference mode.

    ``inputs`` is a list of batches, each as the framework takes it (see ``export_onnx``).
    """
    return _compare(path, framework, model, inputs)[0]


def _compare(path: str | os.PathLike[str], framework: str, model: Any, inputs: Sequence[Any]) -> tuple[float, float]:
    """(largest absolute difference, largest absolute model output) over the batches."""
    _check_framework(framework)
    session = _ort_session(os.fspath(path), framework, model)
    output_names = [o.name for o in session.get_outputs()]
    worst = scale = 0.0
    for batch in inputs:
        feeds = _feeds(session, framework, model, batch)
        try:
            got = session.run(None, feeds)
        except Exception as exc:
            shapes = {name: a.shape for name, a in feeds.items()}
            raise _error(framework, model, f"onnxruntime failed on inputs of shapes {shapes}", exc) from exc
        if framework == "torch":
            expected = _torch_outputs(model, batch)
        else:
            expected, names = _keras_outputs(model, batch)
            if names is not None and set(names) <= set(output_names):
                got = [got[output_names.index(name)] for name in names]
        if len(got) != len(expected):
            raise _error(framework, model, f"the file has {len(got)} outputs, the model {len(expected)}")
        for ours, theirs in zip(got, expected):
            if np.shape(ours) != np.shape(theirs):
                raise _error(framework, model, f"output shape {np.shape(ours)} differs from the model's {theirs.shape}")
            if ours.size:
                scale = max(scale, float(np.nanmax(np.abs(np.asarray(theirs, np.float64)), initial=0.0)))
                diff = np.abs(np.asarray(ours, np.float64) - np.asarray(theirs, np.float64))
                worst = max(worst, float(np.max(diff)), 0.0 if np.all(np.isfinite(diff)) else float("inf"))
    return worst, scale


def _batch_is_dynamic(path: str, framework: str, model: Any) -> bool:
    onnx = _require("onnx", framework, model)
    graph = onnx.load(path, load_external_data=False).graph
    for graph_input in graph.input:
        dims = graph_input.type.tensor_type.shape.dim
        if dims and not dims[0].dim_param and dims[0].HasField("dim_value"):
            return False
    return True


def export_onnx(framework: str, model: Any, sample_input: Any, path: str | os.PathLike[str]) -> float:
    """Write ``model`` to the ONNX file ``path`` with a dynamic batch dimension; return its max abs error.

    ``framework`` is "torch" or "keras"; ``sample_input`` is a batch as the model takes it: a tensor or a tuple
    of tensors (torch), an array or a dict of arrays (Keras). The file is written aside and renamed into place,
    after onnxruntime has run it on the sample and on a batch of another size; the largest absolute difference
    from the framework's inference output is logged and returned. Raises ExportError on any failure.
    """
    _check_framework(framework)
    _batch_size(sample_input)
    _require("onnxruntime", framework, model)  # before the export's work, not after it
    target = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(target)
    os.makedirs(directory, exist_ok=True)
    # A private directory beside the target: the file keeps its final name inside it, so an external data
    # file it refers to keeps a valid relative name after the move; rename() stays within one filesystem.
    staging = tempfile.mkdtemp(prefix=".onnx-export-", dir=directory)
    try:
        staged = os.path.join(staging, os.path.basename(target))
        if framework == "torch":
            _export_torch(model, sample_input, staged)
        else:
            with _environ_kept():
                _export_keras(model, sample_input, staged)
        if not os.path.exists(staged):
            raise _error(framework, model, "the exporter wrote no file")
        if not _batch_is_dynamic(staged, framework, model):
            raise _error(
                framework,
                model,
                "the exported batch dimension is fixed",
                hint="the model's code fixes the batch size (a reshape to a constant batch?); use -1 or x.shape[0]",
            )
        diff, scale = _compare(staged, framework, model, [sample_input, _other_batch(sample_input)])
        # The model file last: whoever sees it at `path` also finds its external data, if any.
        for name in os.listdir(staging):
            if name != os.path.basename(target):
                os.replace(os.path.join(staging, name), os.path.join(directory, name))
        os.replace(staged, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("%s model %s exported to %s, max abs difference %.3g", framework, _model_name(model), target, diff)
    if not diff <= _WARN_TOLERANCE * max(1.0, scale):  # also catches NaN
        logger.warning("the ONNX file %s differs from the %s model by up to %.3g", target, framework, diff)
    return diff
