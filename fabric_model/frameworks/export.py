"""ONNX export of a trained model, checked against the framework with onnxruntime.

``export_onnx`` writes the file with a dynamic batch dimension, then runs it on real batches of two sizes
and returns (and logs) the largest absolute difference from the framework's own inference output.
What is framework-neutral lives here (staging, the fixed-batch check, onnxruntime's comparison); the
exporter itself and the model's own outputs come from the :class:`~fabric_model.frameworks.base.Framework`.
onnx, onnxruntime, onnxscript (torch) and tf2onnx (Keras) are imported only when an export is asked for,
so the package works without them.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from ..step.tree import leaves

if TYPE_CHECKING:
    from ..run.rundir import RunDirectory
    from .base import Framework

logger = logging.getLogger(__name__)

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


def _framework(framework: str | Framework) -> Framework:
    """The Framework object; a name ("torch", "keras") is looked up (a ValueError for others)."""
    from . import resolve_framework  # lazily: importing this module imports no framework

    return resolve_framework(framework)


# ----------------------------------------------------------------------------------------------- batches


def _batch_size(sample: Any) -> int:
    """The first axis of the sample's first array (other leaves, such as a None mask, are skipped)."""
    found = [x for x in leaves(sample) if hasattr(x, "shape") and len(x.shape) > 0]
    if not found:
        raise ValueError("sample_input must be a batch: an array or tensor (or a tuple/dict of them) with a batch axis")
    return int(found[0].shape[0])


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor, possibly on a GPU or requiring grad
        return x.detach().cpu().numpy()
    return np.asarray(x)


# -------------------------------------------------------------------------------------------------- check


def _ort_session(path: str, framework: str, model: Any) -> Any:
    ort = _require("onnxruntime", framework, model)
    try:
        # The CPU provider explicitly: GPU builds of onnxruntime refuse a session without a provider list.
        return ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise _error(framework, model, "onnxruntime cannot load the exported file", exc) from exc


def _feeds(session: Any, framework: Framework, model: Any, batch: Any) -> dict[str, np.ndarray]:
    inputs = session.get_inputs()
    arrays = [_to_numpy(x) for x in framework.trained.onnx_inputs(batch, [i.name for i in inputs])]
    if len(arrays) != len(inputs):
        raise _error(framework.name, model, f"the file has {len(inputs)} inputs, the sample {len(arrays)}")
    return {i.name: a.astype(_ORT_DTYPES.get(i.type, a.dtype), copy=False) for i, a in zip(inputs, arrays)}


def onnx_max_diff(path: str | os.PathLike[str], framework: str | Framework, model: Any, inputs: Sequence[Any]) -> float:
    """Largest absolute difference between onnxruntime on ``path`` and the model in inference mode.

    ``framework`` is "torch" or "keras" (or a Framework object); ``inputs`` is a list of batches, each as the
    framework takes it (see ``export_onnx``).
    """
    return _compare(path, _framework(framework), model, inputs)[0]


def _compare(
    path: str | os.PathLike[str], framework: Framework, model: Any, inputs: Sequence[Any]
) -> tuple[float, float]:
    """(largest absolute difference, largest absolute model output) over the batches."""
    name = framework.name
    session = _ort_session(os.fspath(path), name, model)
    output_names = [o.name for o in session.get_outputs()]
    worst = scale = 0.0
    for batch in inputs:
        feeds = _feeds(session, framework, model, batch)
        try:
            got = session.run(None, feeds)
        except Exception as exc:
            shapes = {key: a.shape for key, a in feeds.items()}
            raise _error(name, model, f"onnxruntime failed on inputs of shapes {shapes}", exc) from exc
        expected, names = framework.trained.inference_outputs(model, batch)
        if names is not None and set(names) <= set(output_names):  # the file's outputs carry the names
            got = [got[output_names.index(key)] for key in names]
        if len(got) != len(expected):
            raise _error(name, model, f"the file has {len(got)} outputs, the model {len(expected)}")
        for ours, theirs in zip(got, expected):
            if np.shape(ours) != np.shape(theirs):
                raise _error(name, model, f"output shape {np.shape(ours)} differs from the model's {theirs.shape}")
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


def export_onnx(framework: str | Framework, model: Any, sample_input: Any, path: str | os.PathLike[str]) -> float:
    """Write ``model`` to the ONNX file ``path`` with a dynamic batch dimension; return its max abs error.

    ``framework`` is "torch" or "keras" (or a Framework object); ``sample_input`` is a batch as the model takes
    it: a tensor or a tuple of tensors (torch), an array or a dict of arrays (Keras). The file is written aside
    and renamed into place, after onnxruntime has run it on the sample and on a batch of another size; the
    largest absolute difference from the framework's inference output is logged and returned. Raises
    ExportError on any failure.
    """
    fw = _framework(framework)
    _batch_size(sample_input)
    _require("onnxruntime", fw.name, model)  # before the export's work, not after it
    target = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(target)
    os.makedirs(directory, exist_ok=True)
    # A private directory beside the target: the file keeps its final name inside it, so an external data
    # file it refers to keeps a valid relative name after the move; rename() stays within one filesystem.
    staging = tempfile.mkdtemp(prefix=".onnx-export-", dir=directory)
    try:
        staged = os.path.join(staging, os.path.basename(target))
        diff, scale = _export_and_check(fw, model, sample_input, staged)
        # The model file last: whoever sees it at `path` also finds its external data, if any.
        for name in os.listdir(staging):
            if name != os.path.basename(target):
                os.replace(os.path.join(staging, name), os.path.join(directory, name))
        os.replace(staged, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("%s model %s exported to %s, max abs difference %.3g", fw.name, _model_name(model), target, diff)
    if not diff <= _WARN_TOLERANCE * max(1.0, scale):  # also catches NaN
        logger.warning("the ONNX file %s differs from the %s model by up to %.3g", target, fw.name, diff)
    return diff


def _export_and_check(framework: Framework, model: Any, sample_input: Any, staged: str) -> tuple[float, float]:
    """Export to ``staged``, check its batch dimension is dynamic, compare it on two batch sizes."""
    framework.trained.write_onnx(model, sample_input, staged)
    if not os.path.exists(staged):
        raise _error(framework.name, model, "the exporter wrote no file")
    if not _batch_is_dynamic(staged, framework.name, model):
        raise _error(
            framework.name,
            model,
            "the exported batch dimension is fixed",
            hint="the model's code fixes the batch size (a reshape to a constant batch?); use -1 or x.shape[0]",
        )
    return _compare(staged, framework, model, [sample_input, framework.trained.grow_batch(sample_input)])


# -- after train(): the run's model/model.onnx ----------------------------------------------------------
def check_onnx_available(framework: Framework, model: Any) -> None:
    """Fail before training, not after it, when ``save_to_onnx=True`` lacks a package."""
    try:
        for module in framework.trained.onnx_requirements():
            _require(module, framework.name, model)
    except ExportError as exc:
        raise ImportError(f"save_to_onnx=True needs the ONNX packages: {exc}") from None


def export_final_model(
    framework: Framework, model: Any, adapter: Any, train_set: Any, run: RunDirectory
) -> float | None:
    """``model/model.onnx`` from the trained model, traced on the first training batch; returns
    onnxruntime's max abs difference from the framework, also logged and written to
    ``logs/metrics.jsonl`` as a ``type: "onnx"`` line. A failure is a warning (and such a line
    with the error), not an exception: the trained model is already in ``model`` and ``model/``."""
    from ..run.metrics_log import MetricsLog

    try:
        inputs = framework.trained.export_inputs(adapter, train_set)
        diff = export_onnx(framework, model, inputs, run.model / "model.onnx")
    except ExportError as exc:
        with MetricsLog(run.metrics, append=True) as metrics:
            metrics.onnx(path=None, error=str(exc))
        # Say where the trained model is, so a failed export does not read as a lost training run.
        files = run.model.iterdir() if run.model.is_dir() else ()
        saved = sorted(f"model/{p.name}" for p in files if p.suffix != ".onnx" and not p.name.startswith("."))
        kept = f" The trained model is saved: {', '.join(saved)}." if saved else ""
        warnings.warn(
            f"save_to_onnx=True, but the ONNX export failed; no model.onnx was written.{kept} {exc}", stacklevel=4
        )
        return None
    with MetricsLog(run.metrics, append=True) as metrics:
        metrics.onnx(path="model/model.onnx", max_abs_diff=diff)
    logger.info(
        "model/model.onnx written; onnxruntime vs %s on real batches: max abs difference %.3g", framework.name, diff
    )
    return diff
