"""Keras batches: samples stacked into NumPy arrays, and a batch's ``(x, y)``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..base import TARGET_KEYS


# -- batches ------------------------------------------------------------------------------
def collate_numpy(samples: Sequence[Any], _top: bool = True) -> Any:
    """Stack per-sample ``(x, y)`` items (scalars, arrays, dicts and tuples of them) into
    NumPy arrays; float64 becomes float32, the dtype Keras computes in.

    Below the sample's own ``(x, y)`` level, a list or tuple of plain numbers
    (``[0.1, 0.2, 0.3]``) is one array-valued feature; other lists and tuples are structure
    (several model inputs)."""
    first = samples[0]
    if isinstance(first, Mapping):
        return {k: collate_numpy([s[k] for s in samples], False) for k in first}
    if isinstance(first, tuple | list) and (_top or not _is_number_list(first)):
        return tuple(collate_numpy([s[i] for s in samples], False) for i in range(len(first)))
    if hasattr(first, "numpy") and not isinstance(first, np.ndarray):  # tf or torch tensors
        samples = [s.numpy() for s in samples]
    array = np.stack([np.asarray(s) for s in samples])
    return array.astype(np.float32) if array.dtype == np.float64 else array


def _is_number_list(value: Sequence[Any]) -> bool:
    """A non-empty list of numbers (or of such lists)."""
    return len(value) > 0 and all(
        isinstance(v, int | float | np.number) or (isinstance(v, list | tuple) and _is_number_list(v)) for v in value
    )


def split_keras_batch(batch: Any) -> tuple[Any, Any]:
    """``(x, y)`` of a collated batch: a pair, or a dict with a target/label key."""
    if isinstance(batch, tuple | list):
        if len(batch) != 2:
            raise ValueError(
                f"A Keras sample or batch must be an (x, y) pair; received a sequence of {len(batch)} item(s). "
                "HINT: for several inputs make x a dict of arrays keyed by the model's input names."
            )
        return batch[0], batch[1]
    if isinstance(batch, Mapping):
        for key in TARGET_KEYS:
            if key in batch:
                rest = {k: v for k, v in batch.items() if k != key}
                return (next(iter(rest.values())) if len(rest) == 1 else rest), batch[key]
        raise ValueError(f"A dict sample needs a target under one of {TARGET_KEYS}; received keys {sorted(batch)}.")
    raise ValueError(f"A sample must be an (x, y) pair or a dict with a target key; received {type(batch).__name__}.")
