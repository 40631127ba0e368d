"""Reading a torch micro-batch in one gather instead of one ``__getitem__`` per sample.

A ``TensorDataset`` collated by torch's ``default_collate`` gives, for indices ``idx``, the
list ``[t[idx] for t in tensors]``: the same values (``torch.stack`` of the rows ``t[i]``),
read with one gather per tensor instead of 64 ``__getitem__`` calls and a collate (about
0.3 ms a micro-batch of 64 on CPU, against tens of microseconds). A CPU tensor is gathered by
numpy (``take`` on the tensor's own memory), others by ``t[index]``.

A plain list (or tuple) of samples under the default collate is read the same way once its
samples are stacked, field by field, into tensors of their own (:func:`stacked_reader`): each
sample a tensor, or a tuple, list or dict of tensors, Python numbers or NumPy arrays, every
field of one type, shape and dtype. The stacked copy is made once per worker (the adapter keeps
the reader) and holds the values the samples had then; where it would take more than
:data:`STACK_BYTES`, or the samples are of any other form, the list is read item by item and
collated, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from ...step.data import Reader

#: The most bytes a list of samples' stacked copy may take (:func:`stacked_reader`): beyond it,
#: the copy's memory would cost more than the collate it saves (~30 us a micro-batch of 16).
STACK_BYTES = 256 << 20


def tensor_reader(dataset: Any, collate_fn: Callable[..., Any] | None) -> Reader | None:
    """A one-gather reader for a plain ``TensorDataset`` or list of samples under the default
    collate, else None.

    Subclasses may override ``__getitem__`` and a user's collate may do anything, so both
    keep the item-by-item read."""
    if collate_fn is not None:
        return None
    if type(dataset) is TensorDataset:
        return _list_gather(dataset.tensors)
    if type(dataset) in (list, tuple):
        return stacked_reader(dataset)
    return None


def stacked_reader(samples: list[Any] | tuple[Any, ...]) -> Reader | None:
    """A one-gather reader of a list of samples, or None where it is read item by item.

    What it reads is what ``default_collate`` gives for the same samples: a tensor, a list of
    tensors (for tuple and list samples), or a dict of tensors in the first sample's key order."""
    fielded = _fields(samples)
    if fielded is None:
        return None
    build, fields = fielded
    row = 0
    for field in fields:
        size = _row_bytes(field[0])
        if size is None:
            return None
        row += size
    if row * len(samples) > STACK_BYTES:
        return None
    stacked: list[torch.Tensor] = []
    for field in fields:
        whole = _stack(field)
        if whole is None:
            return None
        stacked.append(whole)
    return _gather(stacked, build)


def _row_bytes(value: Any) -> int | None:
    """The bytes one sample's value takes in a stacked field; None: a value not stacked."""
    if type(value) is torch.Tensor:
        return value.numel() * value.element_size() if _stackable(value) else None
    if type(value) in (int, float, bool):
        return 8
    if type(value) is np.ndarray:
        return int(value.nbytes)
    return None


def _stack(field: list[Any]) -> torch.Tensor | None:
    """A field's values stacked as ``default_collate`` puts a micro-batch of them together: CPU
    tensors of one dtype (``torch.stack``), Python ints, floats or bools (``torch.tensor``; floats
    as float64), numeric NumPy arrays of one dtype (``torch.as_tensor``, then stacked). None
    where the micro-batches' own results could differ: mixed types or dtypes (each micro-batch's
    stack promotes as its own samples say), shapes that differ, a value needing a gradient."""
    first = field[0]
    kind = type(first)
    if any(type(v) is not kind for v in field):
        return None
    try:
        if kind is torch.Tensor:
            if any(t.dtype != first.dtype for t in field):
                return None
            whole = torch.stack(field)
        elif kind in (int, float, bool):
            whole = torch.tensor(field, dtype=torch.float64 if kind is float else None)
        elif first.dtype.kind in "biufc" and all(a.dtype == first.dtype for a in field):
            whole = torch.as_tensor(np.stack(field))
        else:
            return None
    except (RuntimeError, TypeError, ValueError, OverflowError):  # shapes or devices differ, an int past int64
        return None
    return None if whole.requires_grad else whole


def _fields(samples: list[Any] | tuple[Any, ...]) -> tuple[Callable[[list[Any]], Any] | None, list[list[Any]]] | None:
    """How a micro-batch's stacked fields are put together (None: a tensor sample, the field
    itself), and each field's values over the samples; None for any other form."""
    if not samples:
        return None
    first = samples[0]
    kind = type(first)
    if kind is torch.Tensor:
        return None, [list(samples)]
    if kind in (tuple, list) and first:
        width = len(first)
        if any(type(s) is not kind or len(s) != width for s in samples):
            return None
        return list, [list(field) for field in zip(*samples)]
    if kind is dict and first:
        keys = list(first)
        names = first.keys()
        if any(type(s) is not dict or s.keys() != names for s in samples):
            return None

        def as_dict(values: list[Any]) -> dict[Any, Any]:
            return dict(zip(keys, values))

        return as_dict, [[s[k] for s in samples] for k in keys]
    return None


def _stackable(t: Any) -> bool:
    return type(t) is torch.Tensor and t.device.type == "cpu" and t.layout == torch.strided and not t.requires_grad


def _gather(tensors: Sequence[torch.Tensor], build: Callable[[list[Any]], Any] | None) -> Reader:
    """Reads rows ``indices`` of each of ``tensors`` (put together by ``build``; None: the one tensor)."""
    if build is None:
        (whole,) = tensors
        array = _numpy_view(whole)
        if array is not None:
            return lambda indices: torch.from_numpy(array.take(indices, axis=0))
        return lambda indices: whole[torch.from_numpy(np.ascontiguousarray(indices, dtype=np.int64))]
    if build is list:
        return _list_gather(tensors)
    pieces = _list_gather(tensors)
    return lambda indices: build(pieces(indices))


def _list_gather(tensors: Sequence[torch.Tensor]) -> Reader:
    """Reads rows ``indices`` of each of ``tensors``, as a list."""
    arrays = [_numpy_view(t) for t in tensors]
    if all(a is not None for a in arrays):
        # numpy's gather: the same rows, without torch's indexing dispatch (it read a micro-batch
        # of 64 x 256 floats in ~50 us where t[index] took ~85 us inside a 2 ms step).
        if len(arrays) == 2:  # (inputs, targets): the usual dataset, read without a comprehension's frame
            x, y = arrays
            assert x is not None and y is not None

            def read_pair(indices: np.ndarray) -> list[torch.Tensor]:
                return [torch.from_numpy(x.take(indices, axis=0)), torch.from_numpy(y.take(indices, axis=0))]

            return read_pair

        def read_arrays(indices: np.ndarray) -> list[torch.Tensor]:
            return [torch.from_numpy(a.take(indices, axis=0)) for a in arrays]  # type: ignore[union-attr]

        return read_arrays

    def read(indices: np.ndarray) -> list[torch.Tensor]:
        index = torch.from_numpy(np.ascontiguousarray(indices, dtype=np.int64))
        return [t[index] for t in tensors]

    return read


def _numpy_view(t: torch.Tensor) -> np.ndarray | None:
    """The CPU tensor's memory as an array (no copy), or None where numpy has no such dtype."""
    if t.device.type != "cpu" or t.requires_grad or t.is_conj() or t.is_neg() or t.dtype == torch.bfloat16:
        return None
    try:
        return t.numpy()
    except (TypeError, RuntimeError):  # a dtype numpy lacks (float8, quantized), a sparse tensor
        return None
