"""A fingerprint of a replica's state, to check that every replica holds the same weights."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np


def state_digest(state: Any) -> str:
    """SHA-256 over every tensor's bytes and every other value's repr, in key order."""
    h = hashlib.sha256()
    _feed(h, state)
    return h.hexdigest()


def _feed(h: Any, obj: Any) -> None:
    # Its own walk, not fabric_model.step.tree's: the hash covers the keys (sorted by repr, so dict order
    # does not matter) and the nesting, not only the leaves.
    if isinstance(obj, dict):
        for key in sorted(obj, key=repr):
            h.update(repr(key).encode())
            _feed(h, obj[key])
    elif isinstance(obj, (list, tuple)):
        h.update(b"[")
        for item in obj:
            _feed(h, item)
        h.update(b"]")
    elif hasattr(obj, "detach") and hasattr(obj, "cpu"):  # a torch tensor
        _feed(h, obj.detach().cpu().numpy())
    elif isinstance(obj, np.ndarray):
        h.update(str((obj.dtype, obj.shape)).encode())
        h.update(np.ascontiguousarray(obj).tobytes())
    else:
        h.update(repr(obj).encode())
