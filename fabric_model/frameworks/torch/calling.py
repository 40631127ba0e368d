"""How a batch becomes a call of the user's model, and what the loss of its output is.

A model is called as its ``forward`` takes its inputs, as one would call it by hand
(docs/training.md, "Inputs and outputs"):

- a dict whose keys the forward takes by name is passed as keyword arguments,
  ``model(**inputs)`` (a Hugging Face model and its ``input_ids``, ``attention_mask``,
  ``labels``); the target stays among them when the forward takes a parameter of its name,
  or takes ``**kwargs`` and either names no parameter of its own (a pure wrapper) or must
  compute the loss itself (``loss_function=None``);
- a wrapper whose forward is ``forward(*args, **kwargs)`` and which exposes the module it
  forwards to (peft's ``get_base_model()``, ``.module`` of DDP and accelerate, ``.model``) is
  called as that module's signature says (:func:`signature_source`);
- a tuple or list of inputs is unpacked when the forward takes that many positional
  arguments, else passed as one;
- anything else is the one argument.

``loss_function=None`` means the model computes its loss (:func:`model_loss`), and whatever the
model returns (a tensor, a tuple, a dict, a ``ModelOutput``, a dataclass) reaches the loss and
the metrics unchanged.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

import torch

from ..base import TARGET_KEYS

#: How wrappers expose the module their ``forward(*args, **kwargs)`` forwards to, in the order tried.
WRAPPED_BY = ("get_base_model", "module", "model")


def _parameters(forward: Any) -> list[inspect.Parameter] | None:
    try:
        return list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):  # a builtin or C forward
        return None


def _names_nothing(parameters: list[inspect.Parameter]) -> bool:
    """``forward(*args, **kwargs)``: no parameter of its own, so its signature says nothing."""
    return bool(parameters) and all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters)


def _wrapped(model: Any) -> Any:
    """The module ``model`` says it forwards to (:data:`WRAPPED_BY`), or None."""
    for name in WRAPPED_BY:
        try:
            inner = getattr(model, name, None)
            if name == "get_base_model" and callable(inner):
                inner = inner()
        except Exception:  # a property or method that needs more than it has: not a wrapper's
            continue
        if isinstance(inner, torch.nn.Module) and inner is not model:
            return inner
    return None


def signature_source(model: Any) -> Any:
    """The module whose ``forward`` says what the call takes: ``model`` (a compiled model: its
    original module), or, while its forward names no parameter (``forward(*args, **kwargs)``) and
    it exposes the module it forwards to, that module, followed down through nested wrappers."""
    current, seen = getattr(model, "_orig_mod", model), set()
    while id(current) not in seen:
        seen.add(id(current))
        parameters = _parameters(getattr(current, "forward", current))
        inner = _wrapped(current) if parameters is not None and _names_nothing(parameters) else None
        if inner is None:
            return current
        current = getattr(inner, "_orig_mod", inner)
    return current


@dataclasses.dataclass(frozen=True)
class ModelCall:
    """What the model's ``forward`` accepts, read once from its signature (picklable: no model inside)."""

    names: frozenset[str] = frozenset()  # parameters that may be passed by name
    required: frozenset[str] = frozenset()  # those of them without a default
    var_keyword: bool = False  # forward(..., **kwargs)
    wraps_all: bool = False  # forward(*args, **kwargs), the module it forwards to unknown: every key goes in
    positional: int = 1  # the most positional arguments it takes (a large number for *args)
    target_required: bool = True  # False when the model computes its own loss

    @classmethod
    def of(cls, model: Any, *, target_required: bool = True) -> ModelCall:
        """The call of ``model``, read from the forward of :func:`signature_source`."""
        source = signature_source(model)
        parameters = _parameters(getattr(source, "forward", source))
        if parameters is None:  # a builtin or C forward: one positional argument
            return cls(target_required=target_required)
        kinds = inspect.Parameter
        named = {p.name for p in parameters if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)}
        required = {p.name for p in parameters if p.name in named and p.default is kinds.empty}
        by_position = [p for p in parameters if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
        var_positional = any(p.kind is kinds.VAR_POSITIONAL for p in parameters)
        return cls(
            names=frozenset(named),
            required=frozenset(required),
            var_keyword=any(p.kind is kinds.VAR_KEYWORD for p in parameters),
            positional=1 << 30 if var_positional else len(by_position),
            target_required=target_required,
            wraps_all=_names_nothing(parameters),
        )

    def takes_target(self, key: str) -> bool:
        """Whether the target under ``key`` is passed to the forward with the other inputs: the forward
        names it; or it takes ``**kwargs`` and either names nothing (a wrapper that passes every key
        on) or must compute the loss itself (``loss_function=None``). A forward that names its inputs
        and takes ``**kwargs`` besides does not get the target a loss function reads."""
        return key in self.names or (self.var_keyword and (self.wraps_all or not self.target_required))

    # -- a batch's inputs and target --------------------------------------------------------
    def split(self, batch: Any) -> tuple[Any, Any]:
        """``(inputs, target)`` of a collated batch.

        A pair ``(x, y)``; a longer tuple ``(x1, ..., xn, y)``, the inputs being ``(x1, ..., xn)``;
        a dict with a target under one of :data:`TARGET_KEYS`: the target, and the other entries
        as the inputs (the target too when the forward takes it by name). A dict without a target
        key is all inputs, with the target None, when the model computes its own loss.
        """
        if isinstance(batch, (tuple, list)):
            if len(batch) < 2:
                raise ValueError(f"A batch must be (inputs, target); received a sequence of {len(batch)} item(s).")
            return (tuple(batch[:-1]) if len(batch) > 2 else batch[0]), batch[-1]
        if isinstance(batch, Mapping):
            key = next((k for k in TARGET_KEYS if k in batch), None)
            if key is None:
                if self.target_required:
                    raise ValueError(
                        f"A dict sample needs a target under one of the keys {TARGET_KEYS} (or loss_function=None "
                        f"for a model that computes its own loss); received keys {sorted(batch)}."
                    )
                return dict(batch), None
            if self.takes_target(key) and self.takes_keywords(batch):
                return dict(batch), batch[key]  # the forward takes the target too (HF models' labels)
            rest = {k: v for k, v in batch.items() if k != key}
            if len(rest) == 1 and self.positional:  # {"x": ..., "label": ...}: model(x), as before
                return next(iter(rest.values())), batch[key]
            return rest, batch[key]
        raise ValueError(
            f"A sample must be an (input, target) tuple or a dict with a target key; received {type(batch).__name__}."
        )

    # -- calling the model --------------------------------------------------------------------
    def takes_keywords(self, inputs: Mapping[Any, Any]) -> bool:
        """Whether a dict of inputs is passed as keyword arguments: the forward takes every key by
        name (or takes ``**kwargs``) and every parameter it requires is among them; otherwise the
        dict is its one argument (``forward(self, batch)``)."""
        keys = set(inputs)
        if not all(isinstance(k, str) for k in keys):
            return False
        return (keys <= self.names or self.var_keyword) and self.required <= keys

    def unpacks(self, inputs: Any) -> bool:
        """Whether a tuple or list of inputs is spread over the forward's positional arguments."""
        return isinstance(inputs, (tuple, list)) and 1 < len(inputs) <= self.positional

    def __call__(self, model: Any, inputs: Any) -> Any:
        if isinstance(inputs, torch.Tensor):  # the common case first: nothing to decide
            return model(inputs)
        if isinstance(inputs, Mapping) and self.takes_keywords(inputs):
            return model(**inputs)
        if self.unpacks(inputs):
            return model(*inputs)
        return model(inputs)

    def args_and_kwargs(self, inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The positional and keyword arguments of the call (what the ONNX export traces)."""
        if isinstance(inputs, Mapping) and self.takes_keywords(inputs):
            return (), dict(inputs)
        if self.unpacks(inputs):
            return tuple(inputs), {}
        return (inputs,), {}


# -- outputs ----------------------------------------------------------------------------------
def _field(output: Any, name: str) -> Any:
    """``output.name`` or ``output[name]`` where the output has it, else None."""
    if isinstance(output, Mapping):
        return output.get(name)
    return getattr(output, name, None)


def _scalar(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() == 0


def _item(x: Any) -> str:
    if _scalar(x):
        return "a scalar tensor"
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return f"a {type(x).__name__}"


def structure(output: Any) -> str:
    """A tuple or list output item by item: ``a tuple of 3: [0] a scalar tensor, [1] a tensor of shape
    (8, 10), [2] a scalar tensor``; anything else as :func:`_item` says it."""
    if isinstance(output, (tuple, list)):
        items = ", ".join(f"[{i}] {_item(x)}" for i, x in enumerate(output))
        return f"a {type(output).__name__} of {len(output)}: {items}"
    return _item(output)


def model_loss(output: Any) -> torch.Tensor:
    """The loss a model computed itself (``loss_function=None``): ``output.loss``, ``output["loss"]``,
    or the one scalar tensor of a tuple (Hugging Face's ``(loss, logits, ...)``, nanoGPT's
    ``(logits, loss)``); a scalar tensor output is the loss. A tuple of several scalar tensors and no
    ``loss`` field is refused: which one is the loss would be a guess (an auxiliary loss, a
    temperature and the loss all look alike). The caller's first-batch check
    (:mod:`fabric_model.frameworks.torch.first_batch`) calls this, so the refusal comes before any worker."""
    loss = _field(output, "loss")
    if loss is None and isinstance(output, (tuple, list)):
        scalars = [i for i, x in enumerate(output) if _scalar(x)]
        if len(scalars) > 1:
            raise ValueError(
                "Expected `loss_function` to be given when the model's output holds several scalar tensors and no "
                f"`loss` field (loss_function=None reads the loss the model computed). Received: loss_function=None "
                f"and an output that is {structure(output)}; which of "
                f"{', '.join(f'[{i}]' for i in scalars)} is the loss would be a guess. Accepted: an output with a "
                "`loss` field (a dict or ModelOutput with `loss`, a dataclass or namedtuple with .loss), a tuple or "
                "list with exactly one scalar tensor, or a scalar tensor. HINT: return the loss under a `loss` field, "
                "e.g. return {'loss': loss, 'logits': logits}, or pass a `loss_function(output, target)` that picks "
                f"it, e.g. loss_function=lambda output, target: output[{scalars[0]}]."
            )
        loss = output[scalars[0]] if scalars else None
    if loss is None and _scalar(output):
        loss = output
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            f"loss_function=None: the model must compute its loss, but its output ({describe(output)}) holds none "
            "(no `loss` field, no scalar tensor). HINT: put the target in the batch under a name the model's forward "
            "takes (Hugging Face models: `labels`), or pass loss_function(output, target)."
        )
    return loss


def primary_output(output: Any) -> Any:
    """The tensor a default metric reads: the output itself, its ``logits``, or its first tensor."""
    if isinstance(output, torch.Tensor):
        return output
    logits = _field(output, "logits")
    if isinstance(logits, torch.Tensor):
        return logits
    values = output.values() if isinstance(output, Mapping) else output if isinstance(output, (tuple, list)) else ()
    return next((x for x in values if isinstance(x, torch.Tensor) and x.dim() > 0), output)


def detached(output: Any) -> Any:
    """A tensor output detached (the metrics record nothing); a structure as it is (see its use)."""
    return output.detach() if isinstance(output, torch.Tensor) else output


def describe(x: Any) -> str:
    """A short description of a value's structure: shapes and dtypes of its tensors."""
    if isinstance(x, torch.Tensor):
        return f"tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    if isinstance(x, (tuple, list)):
        return f"{type(x).__name__} of [{', '.join(describe(i) for i in x)}]"
    if isinstance(x, Mapping):
        inner = ", ".join(f"{k}: {describe(v)}" for k, v in x.items())
        return f"{type(x).__name__} of {{{inner}}}"
    return type(x).__name__
