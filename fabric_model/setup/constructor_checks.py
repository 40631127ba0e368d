"""``FabricModel()``'s arguments checked in the caller: each message names the argument, what
was received and what is accepted."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import checks as v

if TYPE_CHECKING:
    from ..api import FabricModel


def check_constructor_arguments(
    self: FabricModel, metrics: Any, user_callback: Any
) -> tuple[list[Any] | None, list[Any]]:
    """Check the constructor's arguments (messages name the argument); return the metrics and callbacks."""
    framework = self._framework
    framework.check_options(
        fn_step_train=self.fn_step_train, fn_test=self.fn_test, keras_custom_objects=self.keras_custom_objects
    )
    v.check_callable(
        "datasets_function",
        self.datasets_function,
        hint=" HINT: pass the function itself, datasets_function=my_fn, not its result my_fn().",
    )
    framework.check_loss(self.loss_function)
    checked_metrics = framework.check_metrics(metrics)
    v.check_logger("worker_logger_callback", self.worker_logger_callback)
    v.check_logger("driver_logger_callback", self.driver_logger_callback)
    v.check_bool("save_to_onnx", self.save_to_onnx)
    v.check_callable("fn_batch_collate", self.fn_batch_collate, allow_none=True)
    v.check_callable(
        "fn_step_train",
        self.fn_step_train,
        allow_none=True,
        hint=" HINT: step(model, data, eva, train_loader, fn_args) -> (metric, loss).",
    )
    v.check_callable(
        "fn_test",
        self.fn_test,
        allow_none=True,
        hint=" HINT: fn_test(model, test_iter, fn_args) -> (metric, loss).",
    )
    callbacks = v.check_user_callbacks(user_callback)
    framework.check_optimizer(self.model, self.optimizer)
    return checked_metrics, list(callbacks)
