"""How torch objects travel to the workers: the job's pickler asks :func:`reduce` about every object
it meets, and this module answers for the torch objects that plain pickling refuses or loses.

- A parametrized module (``torch.nn.utils.parametrize``: ``weight_norm``, ``spectral_norm``,
  ``orthogonal``, a user's ``register_parametrization``) lives in a class torch makes at run time,
  whose ``__getstate__`` raises. It travels as its original class and state (its
  ``parametrizations`` hold the ``original`` tensors, pickled once, so an optimizer pickled with it
  still holds them) and its parametrized class is made again on arrival.
- ``torch.compile(model)`` travels as the module it wraps and the options it was compiled with, and
  is compiled again on arrival: the compiler's own objects (frame hooks, caches) are not data. A
  module compiled in place (``model.compile()``), whose compiled call torch's ``__getstate__`` drops,
  is compiled again the same way.

``torch.Generator`` pickles with its device and state (torch >= 2.1) and needs nothing here.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
from torch.nn.utils import parametrize

#: What :func:`reduce` returns for an object it leaves to the pickler.
NOT_OURS: Any = NotImplemented


def reduce(obj: Any) -> Any:
    """A pickle reduce tuple for the torch objects that need one, else ``NotImplemented``."""
    if not isinstance(obj, torch.nn.Module):
        return NOT_OURS
    compiled_type = _optimized_module_type()
    if compiled_type is not None and isinstance(obj, compiled_type):
        return _compile, (obj._orig_mod, compile_options(getattr(obj, "dynamo_ctx", None)))
    in_place = obj.__dict__.get("_compiled_call_impl")  # model.compile(): torch's __getstate__ drops it
    cls: Any = type(obj)
    names: tuple[str, ...] = ()
    if _is_parametrized(obj):
        _parametrize_helpers()  # fail here, in the caller, rather than in every worker
        cls, names = cls.__bases__[0], tuple(getattr(obj, "parametrizations", ()))
    elif in_place is None:
        return NOT_OURS
    options = None if in_place is None else compile_options(_context_of(in_place))
    state = cls.__getstate__(obj)  # the original class's state: the parametrized class's refuses
    return _new_module, (cls,), state, None, None, functools.partial(_restore, names=names, compile=options)


def _is_parametrized(module: torch.nn.Module) -> bool:
    """Whether torch put ``module`` in a parametrized class of its original one."""
    if not parametrize.is_parametrized(module):
        return False
    cls = type(module)
    return cls.__name__ == f"Parametrized{cls.__bases__[0].__name__}"


def _new_module(cls: Any) -> Any:
    """An empty instance of ``cls``, as pickle makes one before setting its state."""
    return cls.__new__(cls)


def _restore(module: Any, state: Any, names: tuple[str, ...], compile: dict[str, Any] | None) -> None:
    """Set ``module``'s state as pickle would, then parametrize the tensors ``names`` again
    (their parametrizations and ``original`` tensors are in the state) and compile in place."""
    setstate = getattr(module, "__setstate__", None)
    if setstate is not None:
        setstate(state)
    else:
        module.__dict__.update(state)
    if names:
        inject_class, inject_property = _parametrize_helpers()
        inject_class(module)
        for name in names:
            inject_property(module, name)
    if compile is not None:
        module.compile(**compile)


def _parametrize_helpers() -> tuple[Any, Any]:
    """torch's private ``_inject_new_class`` and ``_inject_property``.

    ``register_parametrization`` would call ``right_inverse`` again (changing an orthogonal
    weight's ``original``, initialising a weight norm's ``g``) and makes new ``original``
    tensors, which the optimizer shipped beside the module would not hold. These two make
    only the parametrized class and its properties, the part torch refuses to pickle."""
    helpers = getattr(parametrize, "_inject_new_class", None), getattr(parametrize, "_inject_property", None)
    if not all(callable(helper) for helper in helpers):
        raise RuntimeError(
            f"torch {torch.__version__} has no torch.nn.utils.parametrize._inject_new_class / _inject_property, "
            "which fabric_model uses to send a parametrized module (weight_norm, spectral_norm, orthogonal, "
            "register_parametrization) to the workers. HINT: use the same torch release in the caller and the "
            "workers, one with these helpers (2.1 to 2.13 have them), or apply the parametrization inside the "
            "worker (build the model inside a module's __init__ that parametrizes it)."
        )
    return helpers


def _optimized_module_type() -> type | None:
    """``torch.compile``'s module type, if dynamo is loaded (no compiled module exists otherwise)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(eval_frame, "OptimizedModule", None)


def _compile(module: torch.nn.Module, options: dict[str, Any]) -> Any:
    return torch.compile(module, **options)


def _context_of(compiled_call: Any) -> Any:
    """The dynamo context an in-place compiled call closes over (torch keeps no other reference)."""
    cells = getattr(compiled_call, "__closure__", None) or ()
    names = getattr(getattr(compiled_call, "__code__", None), "co_freevars", ())
    return next((cell.cell_contents for name, cell in zip(names, cells) if name == "self"), None)


def compile_options(context: Any) -> dict[str, Any]:
    """``torch.compile``'s keywords as far as its dynamo context holds them: ``fullgraph``,
    ``dynamic`` and the backend with its ``mode`` or ``options`` (an inductor mode is read back as
    the options it stands for). torch keeps them on private objects, read with guards: what is
    not found is left at torch's default."""
    options: dict[str, Any] = {}
    if isinstance(getattr(context, "fullgraph", None), bool):
        options["fullgraph"] = context.fullgraph
    if isinstance(getattr(context, "_dynamic", None), bool):
        options["dynamic"] = context._dynamic
    backend: Any = getattr(context, "callback", None)
    while hasattr(backend, "_torchdynamo_orig_backend"):  # dynamo's wrappers around the backend
        backend = backend._torchdynamo_orig_backend
    inductor, other = getattr(torch, "_TorchCompileInductorWrapper", ()), getattr(torch, "_TorchCompileWrapper", ())
    if isinstance(backend, inductor) and isinstance(getattr(backend, "config", None), dict) and backend.config:
        options["options"] = dict(backend.config)
    elif isinstance(backend, other) and callable(getattr(backend, "compiler_fn", None)):
        options["backend"] = backend.compiler_fn
        kwargs = getattr(backend, "kwargs", {})
        options.update({k: v for k, v in kwargs.items() if k in ("mode", "options")})
    return options


def unpicklable_hint(obj: Any, owner: Any, attribute: str | None) -> str | None:
    """What works instead, when ``obj`` (``owner.attribute``, if an attribute) keeps a job from pickling."""
    if isinstance(obj, torch.jit.ScriptModule) or isinstance(owner, torch.jit.ScriptModule):
        return (
            "a TorchScript module (torch.jit.script or trace) does not pickle: pass the Python module it was made "
            "from, and script it after training."
        )
    travels = (
        "a torch module travels with its class, parameters, buffers, submodules and attributes (parametrized and "
        "torch.compile'd modules, torch.Generator and gradient checkpointing included)"
    )
    if isinstance(owner, torch.nn.Module) and attribute is not None:
        cls = parametrize.type_before_parametrizations(owner).__name__
        return (
            f"{travels}, and each attribute must pickle: create `{attribute}` when {cls} first needs it (in "
            f"forward), or leave it out in {cls}.__getstate__ and make it again in __setstate__."
        )
    if isinstance(obj, torch.nn.Module):
        return f"{travels}; the error above says which part of it failed."
    return None
