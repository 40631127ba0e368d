"""The PyTorch side of the ONNX export: the call training makes, traced by torch.onnx, and its outputs.

The file is traced on the call training makes (:class:`~fabric_model.frameworks.torch.calling.ModelCall`):
a dict of inputs the forward takes by name as keyword arguments, a tuple spread over the positional
arguments it takes, else one argument. The file's inputs are the call's tensors, named after their dict
keys (else ``input``, ``input_0``...); its other values (None, flags, numbers) stay fixed in the graph as
the batch had them. Its outputs are the tensors of whatever the model returns, in torch's pytree order (a
tuple in order, a dict or ``ModelOutput`` by its keys, a dataclass by its fields), named after their keys;
what is no tensor (None, a number, a cache object) is no output. The reference outputs of the check are
flattened by the same function, so onnxruntime's outputs are compared with their own counterparts.

Framework-neutral steps (staging, the fixed-batch check, onnxruntime's comparison) are in
:mod:`fabric_model.frameworks.export`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from ...step.tree import map_tree
from ..export import _EXTERNAL_DATA_BYTES, _INSTALL_HINT, _batch_size, _error, _require, _to_numpy

_PACKED_HINT = (
    "torch.export cannot trace packed sequences (torch.nn.utils.rnn.pack_padded_sequence: the packed "
    "length depends on the lengths' values). To export, run the RNN on the padded batch and mask it, or "
    "export a model without the packing"
)
_TRACE_HINT = (
    "the forward must be traceable by torch.export: no Python branches on tensor values, no conversions to "
    "numpy or Python numbers (see the exportdb in the torch docs)"
)


@contextlib.contextmanager
def torch_inference(model: Any) -> Iterator[None]:
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


def original_module(model: Any) -> Any:
    """The module a ``torch.compile``d model wraps (``_orig_mod``), else ``model``: torch.export traces the
    Python forward itself, and the compiled wrapper's ``forward(*args, **kwargs)`` hides its signature (the
    export's dynamic shapes would not match it). Same parameters: the trained weights are there."""
    import torch

    while isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
        model = model._orig_mod
    return model


# -- the call -----------------------------------------------------------------------------------------
def call_arguments(model: Any, inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` of the call training makes with ``inputs`` (``ModelCall.args_and_kwargs``), on the
    model's device; with ``use_cache=False`` added where the forward takes ``use_cache`` and the batch does
    not set it. Why: a Hugging Face decoder's cache is state for a next call, which a one-call graph cannot
    be given, and torch.export cannot trace every cache class; the logits do not depend on it."""
    import torch

    from .calling import ModelCall

    args, kwargs = ModelCall.of(model, target_required=False).args_and_kwargs(inputs)
    try:
        device = next(model.parameters()).device
    except StopIteration:
        device = None

    def place(x: Any) -> Any:
        if isinstance(x, np.ndarray):
            x = torch.as_tensor(x)
        return x.to(device) if device is not None and isinstance(x, torch.Tensor) else x

    args, kwargs = map_tree(place, args), map_tree(place, kwargs)
    if "use_cache" not in kwargs and _takes_by_name(model, "use_cache", len(args)):
        kwargs["use_cache"] = False
    return args, kwargs


def _takes_by_name(model: Any, name: str, n_args: int) -> bool:
    """Whether the forward (a wrapper's: the module it exposes) has a parameter ``name`` that ``n_args``
    positional arguments do not fill."""
    from .calling import signature_source

    try:
        parameters = list(inspect.signature(signature_source(model).forward).parameters.values())
    except (TypeError, ValueError):
        return False
    for position, parameter in enumerate(parameters):
        if parameter.name == name:
            if parameter.kind is inspect.Parameter.KEYWORD_ONLY:
                return True
            return parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and position >= n_args
    return False


def call_model(model: Any, inputs: Any) -> Any:
    """The model (a compiled one: its original module) called on ``inputs`` as training calls it, in
    inference mode: what the file is traced on and compared with."""
    model = original_module(model)
    args, kwargs = call_arguments(model, inputs)
    with torch_inference(model):
        return model(*args, **kwargs)


# -- inputs and outputs, flattened ---------------------------------------------------------------------
def _is_array(x: Any) -> bool:
    import torch

    return isinstance(x, torch.Tensor | np.ndarray)


def _unique(names: list[str], fallback: str, taken: frozenset[str] = frozenset()) -> list[str]:
    """``names``, or ``fallback_0``, ``fallback_1``... where they repeat or collide with ``taken``."""
    if len(set(names)) == len(names) and not set(names) & taken and all(names):
        return names
    return [f"{fallback}_{i}" for i in range(len(names))]


def named_inputs(inputs: Any) -> list[tuple[str, Any]]:
    """The arrays of ``inputs`` with a name each, in the order the call's tensors are flattened (torch's
    pytree order): its dict key (``input_ids``), its path in nested inputs (``images_0``), ``input`` for one
    tensor, ``input_0``... for a tuple. The file's inputs bear these names."""
    found: list[tuple[str, Any]] = []

    def walk(x: Any, path: tuple[str, ...], keyed: bool) -> None:
        if _is_array(x):
            found.append(("_".join(path) if keyed else "_".join(("input", *path)), x))
        elif isinstance(x, Mapping):
            for key, value in x.items():
                walk(value, (*path, str(key)), keyed or not path)
        elif isinstance(x, tuple | list):
            for i, value in enumerate(x):
                walk(value, (*path, str(i)), keyed)

    walk(inputs, (), False)
    names = _unique([name for name, _ in found], "input")
    return [(name, x) for name, (_, x) in zip(names, found)]


def output_tensors(output: Any) -> list[tuple[tuple[str, ...], Any]]:
    """The tensors of a model's output with their paths, in torch's pytree order: a tuple or list in order
    (a namedtuple by its fields), a dict or ``ModelOutput`` by its keys (a ``ModelOutput`` holds its set
    fields only, as its pytree node does), a dataclass by its fields, another pytree node by its children.
    Other leaves (None, numbers, objects torch cannot flatten) are not outputs of the graph."""
    import torch
    from torch.utils import _pytree as pytree

    found: list[tuple[tuple[str, ...], Any]] = []

    def walk(x: Any, path: tuple[str, ...]) -> None:
        if isinstance(x, torch.Tensor):
            found.append((path, x))
        elif isinstance(x, Mapping):
            for key, value in x.items():
                walk(value, (*path, str(key)))
        elif isinstance(x, tuple) and hasattr(x, "_fields"):
            for field, value in zip(x._fields, x):
                walk(value, (*path, field))
        elif isinstance(x, tuple | list):
            for i, value in enumerate(x):
                walk(value, (*path, str(i)))
        elif type(x) in pytree.SUPPORTED_NODES:
            children, _context = pytree.SUPPORTED_NODES[type(x)].flatten_fn(x)
            for i, value in enumerate(children):
                walk(value, (*path, str(i)))
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            for field in dataclasses.fields(x):
                walk(getattr(x, field.name), (*path, field.name))

    walk(output, ())
    return found


def output_names(paths: list[tuple[str, ...]], taken: frozenset[str]) -> list[str]:
    """``logits`` for a dict's or ModelOutput's field, ``output`` for one tensor, ``output_0``... by position."""
    names = ["_".join(path) if path and not path[0].isdigit() else "_".join(("output", *path)) for path in paths]
    return _unique(names, "output", taken)


def torch_outputs(model: Any, sample: Any) -> list[np.ndarray]:
    """The model's tensor outputs on ``sample`` in inference mode, called as training calls it, flattened as
    the exported file's outputs are."""
    return [_to_numpy(x) for _, x in output_tensors(call_model(model, sample))]


# -- the export ------------------------------------------------------------------------------------------
def _traced_call(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, tuple[Any, ...]]:
    """A module whose ``forward(*tensors)`` is ``model(*args, **kwargs)`` with ``tensors`` in the place of
    the call's tensors, returning the output's tensors as a flat tuple; and those tensors. The exporter then
    sees exactly the file's inputs and outputs: the call's other values are constants, and the structure of
    args, kwargs and output (which torch.export would have to match with dynamic shapes, and could not
    flatten for an unregistered dataclass) stays in Python."""
    import torch
    from torch.utils import _pytree as pytree

    flat, spec = pytree.tree_flatten((args, kwargs))
    slots = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    fixed = [None if isinstance(x, torch.Tensor) else x for x in flat]

    class TracedCall(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
            values = list(fixed)
            for slot, tensor in zip(slots, tensors):
                values[slot] = tensor
            call_args, call_kwargs = pytree.tree_unflatten(values, spec)
            return tuple(x for _, x in output_tensors(self.model(*call_args, **call_kwargs)))

    traced = TracedCall()
    traced.training = False  # the exporter warns about a module in training mode; the model's flags are set
    return traced, tuple(flat[i] for i in slots)


def export_torch(model: Any, sample: Any, path: str) -> None:
    """Write ``model`` to ``path`` with torch.onnx's torch.export-based exporter, traced on the call training
    makes with ``sample`` (module docstring), batch dimension dynamic."""
    torch = _require("torch", "torch", model)
    if not isinstance(model, torch.nn.Module):
        raise _error("torch", model, "the model is not a torch.nn.Module")
    _require("onnx", "torch", model)
    _require("onnxscript", "torch", model)
    user_model, model = model, original_module(model)
    if _batch_size(sample) == 1:
        # torch.export specializes a dimension of size 1 (it cannot tell it from broadcasting), so a
        # one-sample batch would give a fixed batch of 1: export with the sample repeated instead.
        sample = grow_torch_batch(sample)
    args, kwargs = call_arguments(model, sample)
    names = [name for name, _ in named_inputs(sample)]
    with torch_inference(model), _packed_watch(model) as packed:
        try:
            reference = model(*args, **kwargs)
        except Exception as exc:
            raise _error("torch", user_model, "the model fails on the export's batch", exc) from exc
    paths = [p for p, _ in output_tensors(reference)]
    if not paths:
        raise _error("torch", user_model, f"the model's output ({type(reference).__name__}) holds no tensor")
    traced, tensors = _traced_call(model, args, kwargs)
    if not tensors:
        raise _error("torch", user_model, "the model's inputs hold no tensor")
    if len(names) != len(tensors):  # inputs of a kind named_inputs does not walk: positional names
        names = [f"input_{i}" for i in range(len(tensors))]
    # The torch.export-based exporter (dynamo=True): it is the default since torch 2.9, while the TorchScript
    # exporter warns that it is deprecated. It needs onnxscript. One Dim shared by every input says they
    # share the batch size. Note it silently falls back to a static dimension when the model fixes the batch
    # size (e.g. x.view(4, -1)): export_onnx checks the file's input shape for that.
    batch = torch.export.Dim("batch")
    dynamic_shapes = (tuple({0: batch} if t.dim() > 0 else None for t in tensors),)  # forward(*tensors)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with torch_inference(model), warnings.catch_warnings():
        # Every input after the first shares the one batch Dim, which the exporter reports input by input.
        warnings.filterwarnings("ignore", message=r".*shares the same shape constraints", category=UserWarning)
        try:
            torch.onnx.export(
                traced,
                tensors,
                path,
                dynamo=True,
                input_names=names,
                output_names=output_names(paths, frozenset(names)),
                dynamic_shapes=dynamic_shapes,
                # One self-contained file unless it cannot be (the exporter's default is an extra .data file).
                external_data=weight_bytes > _EXTERNAL_DATA_BYTES,
                verbose=False,
            )
        except ImportError as exc:
            hint = _INSTALL_HINT["onnxscript"]
            raise _error("torch", user_model, "a module the exporter needs is missing", exc, hint) from exc
        except Exception as exc:
            if packed:
                what = "torch.onnx.export could not trace the model: it runs an RNN on packed sequences"
                raise _error("torch", user_model, what, exc, _PACKED_HINT) from exc
            raise _error("torch", user_model, "torch.onnx.export could not trace the model", exc, _TRACE_HINT) from exc


@contextlib.contextmanager
def _packed_watch(model: Any) -> Iterator[list[bool]]:
    """For the block, a list that becomes ``[True]`` when an RNN of ``model`` is given a PackedSequence:
    how a trace failure is told to come from packed sequences (torch.export's own message names no cause)."""
    import torch

    seen: list[bool] = []

    def hook(module: Any, args: tuple[Any, ...]) -> None:
        if args and isinstance(args[0], torch.nn.utils.rnn.PackedSequence) and not seen:
            seen.append(True)

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, torch.nn.RNNBase)]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def grow_torch_batch(sample: Any) -> Any:
    """``sample`` with its first row repeated at the end (tensors and NumPy arrays; other values as they are)."""
    import torch

    def grow(x: Any) -> Any:
        if isinstance(x, np.ndarray) and x.ndim > 0:
            return np.concatenate([x, x[:1]])
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return torch.cat([x, x[:1]])
        return x

    return map_tree(grow, sample)
