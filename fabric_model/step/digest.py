"""Fingerprints of a replica's state, to check that every replica holds the same weights
(docs/architecture.md, "Invariants", 4).

Two kinds, for two uses:

- :func:`state_fingerprint`: one integer per tensor, keyed by its name ("model/fc1.weight",
  "optimizer/state/0/exp_avg"), cheap enough to compute every few steps, so the driver sees
  replicas drift apart within an epoch and can name the tensors that differ;
- :func:`state_digest`: a SHA-256 over every byte, once, at the end of training.

A leaf module: numpy only; torch is used only on tensors it is given.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np

#: Fingerprints are sums modulo this: exact, and the same whatever order the terms are added in.
MODULUS = 1 << 64


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


# -- per-tensor fingerprints ---------------------------------------------------------------------
def tensor_fingerprint(value: Any) -> int:
    """The sum, modulo 2**64, of a tensor's bytes read as little-endian 64-bit words (the last
    bytes as one shorter word); another value's: 64 bits of a hash of its ``repr``.

    Why a sum is enough here. Equal states always give equal sums: integer addition modulo
    2**64 is exact and order-free, so neither thread counts nor devices can raise a false
    alarm. Replicas that diverged hold values whose bits differ by unrelated amounts in many
    places; their sums agree only if every difference cancels exactly, in every tensor, at
    every check, while the drift only grows. A single changed value always changes the sum (a
    word's change is below 2**64). Reading pairs of float32 values as one word weighs the even
    and odd elements apart (by 1 and 2**32), so a change of one ulp up in one element and down
    in its neighbour is seen too. It is no cryptographic hash: swapping two words is not seen;
    the SHA-256 :func:`state_digest` still covers every byte at the end of training.

    Cost: one read of the tensor (numpy on the CPU, no copy; a torch reduction on another
    device), ~6 ms for the 25M float32 values of an 8.4M-parameter model with Adam's moments on
    one core (docs/architecture.md, "Replica checks").
    """
    if hasattr(value, "detach") and hasattr(value, "device"):  # a torch tensor
        return _torch_fingerprint(value)
    if isinstance(value, np.ndarray) and value.dtype != object:
        return _bytes_fingerprint(np.ascontiguousarray(value).reshape(-1).view(np.uint8))
    if isinstance(value, np.generic):
        return _bytes_fingerprint(np.asarray(value).reshape(-1).view(np.uint8))
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _bytes_fingerprint(raw: np.ndarray) -> int:
    whole = raw.size // 8 * 8
    # uint64: numpy's sum wraps modulo 2**64 (defined for unsigned integers).
    total = int(raw[:whole].view(np.uint64).sum(dtype=np.uint64)) if whole else 0
    return (total + int.from_bytes(raw[whole:].tobytes(), "little")) % MODULUS


def _torch_fingerprint(tensor: Any) -> int:
    import torch  # already loaded: the value is one of its tensors

    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if raw.device.type == "cpu":
        return _bytes_fingerprint(raw.numpy())
    return _device_bytes_fingerprint(raw)


def _device_bytes_fingerprint(raw: Any) -> int:
    """:func:`_bytes_fingerprint` of a uint8 torch tensor, summed where it lives: only the sum
    and the last few bytes come back. int64 sums wrap as uint64 ones do, modulo 2**64."""
    import torch

    whole = raw.numel() // 8 * 8
    total = int(raw[:whole].view(torch.int64).sum().item()) if whole else 0
    return (total + int.from_bytes(raw[whole:].cpu().numpy().tobytes(), "little")) % MODULUS


def state_fingerprint(state: Any, prefix: str) -> dict[str, int]:
    """One :func:`tensor_fingerprint` per tensor of ``state`` (nested dicts, lists and tuples),
    keyed by its path under ``prefix``: ``"model/fc1.weight"``, ``"optimizer/state/0/exp_avg"``.
    A list or tuple that holds no tensor (a parameter group's ``params``) is one entry; other
    values (a learning rate, a step count) are entries of their own, so a differing one is named."""
    out: dict[str, int] = {}
    _walk(state, prefix, out)
    return out


def _walk(obj: Any, path: str, out: dict[str, int]) -> None:
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            _walk(value, f"{path}/{key}", out)
    elif isinstance(obj, (list, tuple)) and any(_holds_tensor(item) for item in obj):
        for i, item in enumerate(obj):
            _walk(item, f"{path}/{i}", out)
    else:
        out[path] = tensor_fingerprint(obj)


def _holds_tensor(obj: Any) -> bool:
    if isinstance(obj, Mapping):
        return True  # walked: its keys name what it holds
    if isinstance(obj, (list, tuple)):
        return any(_holds_tensor(item) for item in obj)
    return isinstance(obj, np.ndarray) or (hasattr(obj, "detach") and hasattr(obj, "device"))


def differing(reference: Mapping[str, int], other: Mapping[str, int]) -> list[str]:
    """The names whose fingerprints differ between two replicas (or that only one has), in
    ``reference``'s order, then ``other``'s extra ones."""
    names = [name for name, value in reference.items() if other.get(name) != value]
    return names + [name for name in other if name not in reference]


def check_due(global_step: int, last_of_epoch: bool, every: int) -> bool:
    """Whether the replicas compare fingerprints after ``global_step`` (counted from 0 over the
    run): after every ``every``-th step and each epoch's last (``every`` 0: never)."""
    return every > 0 and (last_of_epoch or (global_step + 1) % every == 0)
