"""The caller's process-wide numerics, carried to its workers (docs/architecture.md, "Devices").

A worker is a fresh interpreter, a fork of a process started before ``train()``, or a process on
another host. The global switches a user set in their own process would not hold there, and
the workers would compute otherwise than the user's own loop. A float32 matmul without TF32 on
an Ampere or later GPU is several times slower. A tensor made in ``forward`` without a dtype
takes another default dtype. The switches carried are TF32 and the float32 matmul precision,
cuDNN's, deterministic algorithms, the default dtype, autocast's default dtypes and the attention
kernels allowed. So the adapter reads them when ``train()`` builds the job (:meth:`Numerics.here`),
and a worker sets those that differ before its model runs a kernel (:meth:`Numerics.apply`).
Deterministic mode then overrides what it must (``frameworks/torch/exact.py``).

torch 2.9 added a second API for float32 precision (``torch.backends.*.fp32_precision``). Once
it has been used, or the legacy calls were mixed in certain orders, the legacy getters raise
("a mix of the legacy and new APIs"). So the precision is set through the legacy calls where
the caller's getters answered, then any value that still differs through the new attributes,
which are what the kernels read: the values are the caller's, and so, in the cases tested
(tests/test_numerics.py), is which getters answer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

#: The legacy precision switches: the float32 matmul precision, cuBLAS's TF32, cuDNN's TF32.
LEGACY = ("float32_matmul_precision", "cuda.matmul.allow_tf32", "cudnn.allow_tf32")
#: The new API's attributes (torch >= 2.9), parents before the operators that inherit from them:
#: what the kernels read, whichever API set it.
NEW = (
    "fp32_precision",
    "cuda.matmul.fp32_precision",
    "cudnn.fp32_precision",
    "cudnn.conv.fp32_precision",
    "cudnn.rnn.fp32_precision",
    "mkldnn.fp32_precision",
    "mkldnn.matmul.fp32_precision",
    "mkldnn.conv.fp32_precision",
    "mkldnn.rnn.fp32_precision",
)
#: cuDNN's switches and cuBLAS's reduced-precision reductions.
SWITCHES = (
    "cudnn.enabled",
    "cudnn.benchmark",
    "cudnn.deterministic",
    "cuda.matmul.allow_fp16_reduced_precision_reduction",
    "cuda.matmul.allow_bf16_reduced_precision_reduction",
)
#: The scaled-dot-product attention kernels allowed: (getter, setter) in ``torch.backends.cuda``.
ATTENTION = (
    ("flash_sdp_enabled", "enable_flash_sdp"),
    ("mem_efficient_sdp_enabled", "enable_mem_efficient_sdp"),
    ("math_sdp_enabled", "enable_math_sdp"),
    ("cudnn_sdp_enabled", "enable_cudnn_sdp"),
)

#: The devices whose default autocast dtype is carried (``torch.set_autocast_dtype``, torch >= 2.4).
AUTOCAST = ("cuda", "cpu")


@dataclasses.dataclass(frozen=True)
class Numerics:
    """The switches' values in one process; a name this torch lacks is left out.

    :meth:`apply` sets only what differs from the process it runs in, so a switch the user never
    touched is never written (a write through either precision API changes which getters answer)."""

    legacy: tuple[tuple[str, Any], ...] | None  # LEGACY's values; None where the getters refuse
    fp32: tuple[tuple[str, str], ...]  # NEW's values (empty before torch 2.9)
    switches: tuple[tuple[str, Any], ...]
    attention: tuple[tuple[str, bool], ...]  # (getter, allowed)
    autocast: tuple[tuple[str, torch.dtype], ...]  # the dtype ``torch.autocast(device)`` takes by default
    algorithms: tuple[bool, bool]  # torch.use_deterministic_algorithms(mode, warn_only=...): its own switch
    default_dtype: torch.dtype

    @classmethod
    def here(cls) -> Numerics:
        """This process's values."""
        try:
            legacy: tuple[tuple[str, Any], ...] | None = tuple((name, _get(name)) for name in LEGACY)
        except RuntimeError:  # the new API was used: the legacy getters refuse a mixed state
            legacy = None
        cuda = torch.backends.cuda
        return cls(
            legacy=legacy,
            fp32=tuple((name, _get(name)) for name in NEW if _has(name)),
            switches=tuple((name, _get(name)) for name in SWITCHES if _has(name)),
            attention=tuple((getter, bool(getattr(cuda, getter)())) for getter, _ in ATTENTION if _has_sdp(getter)),
            autocast=tuple((device, torch.get_autocast_dtype(device)) for device in AUTOCAST if _has_autocast()),
            algorithms=(torch.are_deterministic_algorithms_enabled(), _warn_only()),
            default_dtype=torch.get_default_dtype(),
        )

    def apply(self) -> None:
        """Set this process's switches to these values where they differ (before any kernel runs)."""
        self._apply_precision()
        # A name this process's torch lacks (a hand-started worker's older torch) is skipped.
        for name, value in self.switches:
            if _has(name) and _get(name) != value:
                _set(name, value)
        setters = dict(ATTENTION)
        for getter, allowed in self.attention:
            if _has_sdp(getter) and bool(getattr(torch.backends.cuda, getter)()) != allowed:
                getattr(torch.backends.cuda, setters[getter])(allowed)
        for device, dtype in self.autocast:
            if _has_autocast() and torch.get_autocast_dtype(device) != dtype:
                torch.set_autocast_dtype(device, dtype)
        if (torch.are_deterministic_algorithms_enabled(), _warn_only()) != self.algorithms:
            mode, warn_only = self.algorithms
            torch.use_deterministic_algorithms(mode, warn_only=warn_only)
        if torch.get_default_dtype() != self.default_dtype:
            torch.set_default_dtype(self.default_dtype)

    def _apply_precision(self) -> None:
        """Through the legacy calls where the caller's getters answered, in the order a user makes
        them (TF32 alone, then the matmul precision, which sets TF32 too), then through the new
        attributes whatever still differs (leaving the getters refusing, as the caller's did)."""
        if self.legacy is not None and _legacy_readable():
            wanted = dict(self.legacy)
            for name in (
                "cuda.matmul.allow_tf32",
                "float32_matmul_precision",
                "cuda.matmul.allow_tf32",
                "cudnn.allow_tf32",
            ):
                if _legacy_readable() and _get(name) != wanted[name]:
                    _set(name, wanted[name])
        for name, value in self.fp32:
            if _has(name) and _get(name) != value:
                _set(name, value)


def _legacy_readable() -> bool:
    try:
        torch.get_float32_matmul_precision()
    except RuntimeError:
        return False
    return True


def _has(name: str) -> bool:
    if name == "float32_matmul_precision":
        return True
    owner: Any = torch.backends
    for part in name.split(".")[:-1]:
        owner = getattr(owner, part, None)
        if owner is None:
            return False
    try:
        getattr(owner, name.rsplit(".", 1)[-1])
    except AttributeError:
        return False
    return True


def _get(name: str) -> Any:
    if name == "float32_matmul_precision":
        return torch.get_float32_matmul_precision()
    owner: Any = torch.backends
    for part in name.split("."):
        owner = getattr(owner, part)
    return owner


def _set(name: str, value: Any) -> None:
    if name == "float32_matmul_precision":
        torch.set_float32_matmul_precision(value)
        return
    owner: Any = torch.backends
    *parents, last = name.split(".")
    for part in parents:
        owner = getattr(owner, part)
    setattr(owner, last, value)


def _has_sdp(getter: str) -> bool:
    return callable(getattr(torch.backends.cuda, getter, None))


def _has_autocast() -> bool:
    return callable(getattr(torch, "get_autocast_dtype", None)) and callable(getattr(torch, "set_autocast_dtype", None))


def _warn_only() -> bool:
    check = getattr(torch, "is_deterministic_algorithms_warn_only_enabled", None)
    return bool(check()) if check is not None else False
