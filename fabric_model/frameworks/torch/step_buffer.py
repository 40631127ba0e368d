"""The flat step buffer: every gradient, the buffer deltas, flags, stat sums, count and votes.

Each trainable parameter's ``.grad`` is a view into the buffer, so backward accumulates straight
into what the collective reduces: no copy before or after the allreduce. The step strategies
(``steps/``) bind the part they use: the full buffer, or, for a lone worker whose backward
writes fresh gradients, one without the gradient part, the full one's memory given back, so a
lone worker holds its gradients once, as a plain loop does (docs/architecture.md, "The step").
This module owns the memory; which part a step uses, and when, is the strategy's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...step.layout import StepLayout


class TailViews(NamedTuple):
    """Views of a step buffer past its gradients (made once: slicing is an operation)."""

    buffers: list[torch.Tensor]
    got_grad: torch.Tensor
    after_gradients: torch.Tensor
    tail: torch.Tensor
    stats: torch.Tensor
    sample_count: torch.Tensor
    stats_and_count: torch.Tensor


class StepBuffer:
    """The full buffer (gradients first) and, made on first use, the lone one (no gradients)."""

    def __init__(self, params: list[torch.Tensor], buffers: list[torch.Tensor], n_stats: int, device: torch.device):
        self.params, self.model_buffers, self.device = params, buffers, device
        layout = self.full_layout = StepLayout(
            n_gradients=sum(p.numel() for p in params),
            n_buffers=sum(b.numel() for b in buffers),
            n_flags=len(params),  # 1 where some micro-batch produced a gradient
            n_stats=n_stats,
        )
        self.full = torch.zeros(layout.size, dtype=torch.float32, device=device)
        self.grad_views: list[torch.Tensor] = []
        offset = layout.gradients.start
        for p in params:
            if p.dtype != torch.float32:
                raise TypeError(
                    f"Only float32 parameters are supported; parameter of shape {tuple(p.shape)} is {p.dtype}."
                )
            self.grad_views.append(self.full[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self.full_views = self._tail_views(self.full, layout)
        # The float region (gradients and buffer deltas): deterministic=True's terms. Views are
        # made while the storage is there; they stay valid when it is released and made again.
        self.region = self.full[: layout.n_gradients + layout.n_buffers]
        self._lone: tuple[torch.Tensor, StepLayout, TailViews] | None = None
        self.scratch: torch.Tensor | None = None  # a custom step's own gradient (steps/custom.py)
        # The bound part: what the step's reduction, stats and votes use.
        self.flat, self.layout, self.views = self.full, layout, self.full_views
        #: Whether the full buffer's storage holds its memory (``release`` gives it back): kept
        #: here, so a lone worker's every step does not ask the storage (two calls).
        self.full_held = True
        #: Whether the bound buffer was handed to code outside the step strategy (a vote, a count:
        #: the adapter's ``step_buffer``) since the strategy last zeroed it (steps/lone.py).
        self.lent = False
        self.attach()

    def _tail_views(self, flat: torch.Tensor, layout: StepLayout) -> TailViews:
        offset, buffers = layout.buffers.start, []
        for b in self.model_buffers:
            buffers.append(flat[offset : offset + b.numel()].view(b.shape))
            offset += b.numel()
        return TailViews(
            buffers,
            flat[layout.flags],
            flat[layout.n_gradients :],
            flat[layout.tail],
            flat[layout.stat_sums],
            flat[layout.count],  # a 0-d view: += writes into the buffer
            # The stat sums and the count, adjacent: a micro-batch adds [loss, metrics..., 1] * n in
            # one operation instead of three tiny ones per value (0.1 ms of a 2 ms step on CPU).
            flat[layout.stat_sums.start : layout.count + 1],
        )

    def grad_view_of(self) -> dict[int, torch.Tensor]:
        """Each parameter's gradient view, by the parameter's id."""
        return {id(p): view for p, view in zip(self.params, self.grad_views)}

    # -- which part is bound ----------------------------------------------------------------
    def bind_full(self) -> None:
        if self.flat is not self.full:
            self.flat, self.layout, self.views = self.full, self.full_layout, self.full_views
            self._lone = None  # (made again if the world shrinks to one)

    def bind_lone(self) -> None:
        """The buffer without gradients; the full one's memory given back, ``.grad`` None."""
        self.release()
        if self._lone is None:
            full = self.full_layout
            layout = StepLayout(0, full.n_buffers, full.n_flags, full.n_stats)
            flat = torch.zeros(layout.size, dtype=torch.float32, device=self.device)
            self._lone = (flat, layout, self._tail_views(flat, layout))
        if self.flat is not self._lone[0]:
            self.flat, self.layout, self.views = self._lone

    # -- the gradients' memory --------------------------------------------------------------
    def attach(self) -> None:
        """Each ``.grad`` its view."""
        for p, view in zip(self.params, self.grad_views):
            p.grad = view

    def ensure_grad_views(self) -> None:
        """User code (a custom step, a callback) may have replaced or cleared ``.grad``: put the
        view back, keeping whatever gradient had been accumulated."""
        for p, view in zip(self.params, self.grad_views):
            if p.grad is None:
                p.grad = view
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
                p.grad = view

    def release(self) -> None:
        """Give the full buffer's memory back (its views stay, over an empty storage) and leave
        ``.grad`` None, as ``zero_grad()`` does: a sharded state's member has updated its slices,
        or a lone worker's backward writes fresh gradients."""
        if self.full_held:
            self.full.untyped_storage().resize_(0)
            self.full_held = False
        for p in self.params:
            p.grad = None

    def materialize(self) -> None:
        """The full buffer's memory again, zeroed, with each ``.grad`` its view (after
        :meth:`release`); nothing where the lone buffer is bound."""
        storage = self.full.untyped_storage()
        if self.flat is self.full and storage.nbytes() == 0 and self.layout.size:
            storage.resize_(self.layout.size * self.flat.element_size())
            self.full_held = True
            self.flat.zero_()
            self.attach()

    def make_scratch(self) -> torch.Tensor:
        """A gradient-sized scratch (a custom step's backward writes there), kept for later steps."""
        if self.scratch is None:
            self.scratch = torch.zeros(sum(p.numel() for p in self.params), device=self.device)
        return self.scratch

    def gradient_bytes(self) -> int:
        storage = self.full.untyped_storage()
        held = storage.nbytes() + (self.scratch.nbytes if self.scratch is not None else 0)
        if self._lone is not None:
            held += self._lone[0].nbytes
        # A lone worker's backward writes fresh tensors, outside the step buffer.
        fresh = {
            g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
            for g in (p.grad for p in self.params)
            if g is not None and g.untyped_storage().data_ptr() != storage.data_ptr()
        }
        return held + sum(fresh.values())
