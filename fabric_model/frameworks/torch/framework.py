"""The PyTorch framework's driver half: a ``torch.nn.Module`` with a ``torch.optim.Optimizer``."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, ClassVar

from ...setup import checks as v
from ..base import Framework, FrameworkAdapter, TrainedModel, UserObjects


class TorchFramework(Framework):
    """PyTorch: loss and metrics are callables ``f(output, target)``; a custom step and test may replace ours."""

    name: ClassVar[str] = "torch"

    def check_loss(self, loss_function: Any, *, model: Any = None, fn_step_train: Any = None) -> None:
        """A callable ``loss(output, target)``, not a loss class; None: the model computes its loss."""
        from .first_batch import check_loss_object

        if loss_function is None:  # checked on the first batch: the output must hold a loss (calling.model_loss)
            return

        check_loss_object(loss_function)
        v.check_callable(
            "loss_function",
            loss_function,
            hint=" HINT: pass e.g. torch.nn.functional.cross_entropy or torch.nn.CrossEntropyLoss().",
        )

    def check_metrics(self, metrics: Any) -> list[Any] | None:
        """Metrics are callables ``metric(output, target)``; None keeps IBM's default accuracy, [] shows none."""
        return None if metrics is None else v.check_metrics(metrics)

    def check_reader_processes(self, processes: int) -> None:
        return None  # frameworks/torch/reader_processes.py

    def check_shardable(self, optimizer: Any) -> None:
        from .sharded import check_shardable

        check_shardable(optimizer)

    def check_optimizer(self, model: Any, optimizer: Any) -> None:
        """A ``torch.optim.Optimizer`` over the model's own parameters."""
        import torch

        if not isinstance(optimizer, torch.optim.Optimizer):
            hint = (
                " HINT: pass an instance, e.g. torch.optim.SGD(model.parameters(), lr=0.1)."
                if isinstance(optimizer, type)
                else ""
            )
            raise TypeError(
                f"Expected `optimizer` to be a torch.optim.Optimizer over the model's parameters. "
                f"Received: optimizer={optimizer!r}.{hint}"
            )
        if isinstance(optimizer, torch.optim.SparseAdam):
            sparse = [n for n, m in model.named_modules() if getattr(m, "sparse", False) is True]
            raise TypeError(
                "Expected `optimizer` to accept dense gradients: workers sum every gradient as a dense tensor, "
                f"so {', '.join(sparse) or 'a sparse module'}'s gradient reaches the optimizer dense. Received: "
                "optimizer=SparseAdam, which refuses dense gradients. HINT: use torch.optim.Adam (same update); "
                "keep or drop sparse=True on the embedding, as you like."
            )
        model_params = {id(p) for p in model.parameters()}
        held = [p for group in optimizer.param_groups for p in group["params"]]
        foreign = [p for p in held if id(p) not in model_params]
        if not held or foreign:
            raise ValueError(
                f"Expected `optimizer` to hold the parameters of `model`. Received: an optimizer over {len(held)} "
                f"tensor(s), {len(foreign)} of which are not parameters of the model. "
                "HINT: build the optimizer from this model, optimizer=SGD(model.parameters(), ...), "
                "after any model.to(device) or re-creation."
            )

    def prepare_for_shipping(self, adapter: FrameworkAdapter, first_batch: Any) -> FrameworkAdapter:
        """Check the model, loss and metrics on the first batch (see :mod:`.first_batch`), and keep
        the default accuracy only if the model's output is a classifier's."""
        import torch

        from .adapter import TorchAdapter
        from .batches import to_device
        from .first_batch import check_loss_and_metrics, check_parameter_dtypes, forward_first_batch
        from .flops import counted
        from .ibm import accuracy_applies

        model = adapter.model
        check_parameter_dtypes(model, adapter.grad_step.options.precision)  # type: ignore[attr-defined]
        if getattr(adapter, "step_fn", None) is not None:  # a custom step uses the loss its own way
            return adapter
        device = next(model.parameters(), torch.zeros(0)).device
        assert isinstance(adapter, TorchAdapter)
        inputs, target = adapter.call.split(to_device(first_batch, device))
        with adapter.grad_step.autocast(device):
            # A compiled model's original module: the same function, without a compile in the caller.
            # Counted: the step's size in FLOPs decides the run's intra-op threads (flops.py).
            output, adapter.first_forward_flops = counted(
                lambda: forward_first_batch(getattr(model, "_orig_mod", model), adapter.call, inputs)
            )
        if adapter.default_accuracy and not accuracy_applies(output, target):
            adapter.drop_default_accuracy()
        check_loss_and_metrics(adapter.compute_loss, adapter.loss_function is None, adapter.metrics, output, target)
        return adapter

    def make_adapter(self, user: UserObjects) -> FrameworkAdapter:
        """A :class:`~.torch_adapter.TorchAdapter` (``custom_objects`` is Keras' only)."""
        from .adapter import TorchAdapter

        return TorchAdapter(
            user.model,
            user.optimizer,
            user.loss_function,
            user.metrics,
            user.collate,
            user.fn_step_train,
            user.fn_test,
            user.fn_args,
            user.step_options,
        )

    def split_batch(self, batch: Any) -> tuple[Any, Any]:
        """A pair, a longer tuple (several inputs, then the target) or a dict (its target key, if any:
        whether it needs one depends on the loss, checked on the first batch by the model's own call)."""
        from .calling import ModelCall

        return ModelCall(target_required=False).split(batch)

    def draw_seed(self) -> int:
        """From torch's global generator, which ``torch.manual_seed`` seeds."""
        import torch

        return int(torch.randint(0, 2**31 - 1, (1,)).item())

    def save_model(self, model_dir: Path, model: Any, model_state: dict[str, Any]) -> Path:
        """``model.pt``: the state_dict in torch's own format (load with ``torch.load(path, weights_only=True)``)."""
        import torch

        model_dir.mkdir(exist_ok=True)
        tmp, path = model_dir / ".model.pt.tmp", model_dir / "model.pt"
        torch.save(model_state, tmp)
        os.replace(tmp, path)
        return path

    def deterministic(self, adapter: FrameworkAdapter, max_micro_batches: int) -> FrameworkAdapter:
        """Up to ``MAX_TERMS`` micro-batches a step and no custom step: every term gathered and
        added in micro-batch order; otherwise the fixed-point sum. float16's loss scale could
        overflow the exact sum: refused (bf16-mixed needs no scale)."""
        from .adapter import TorchAdapter
        from .exact import ExactTorchAdapter
        from .ordered import MAX_TERMS, OrderedTorchAdapter

        assert isinstance(adapter, TorchAdapter)
        if adapter.grad_step.options.scales_loss:
            raise ValueError(
                "Expected `precision` to be '32' or 'bf16-mixed' with deterministic=True. Received: "
                "precision='16-mixed'. HINT: float16's loss scale can overflow the exact fixed-point sum; "
                "bf16-mixed needs no scale."
            )
        if adapter.step_fn is None and max_micro_batches <= MAX_TERMS:  # the run's configuration, never its size
            return OrderedTorchAdapter.from_adapter(adapter, max_micro_batches)
        return ExactTorchAdapter.from_adapter(adapter, max_micro_batches)

    @functools.cached_property
    def trained(self) -> TrainedModel:
        from .trained import TorchTrainedModel

        return TorchTrainedModel(self)
