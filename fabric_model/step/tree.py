"""Nested inputs and states as trees: tuples, lists and dicts of leaves (tensors, arrays, numbers).

A leaf module: it imports nothing from the package and no framework. Dicts are walked in insertion
order, as torch's pytree flattens them (Keras' ``keras.tree`` sorts dict keys instead: code that must
match Keras uses ``keras.tree`` itself).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def map_tree(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree`` with ``fn`` applied to every leaf; dicts come back as plain dicts, lists as lists,
    tuples as tuples of the same type (a namedtuple stays one)."""
    if isinstance(tree, dict):
        return {key: map_tree(fn, value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [map_tree(fn, value) for value in tree]
    if isinstance(tree, tuple):
        items = [map_tree(fn, value) for value in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
    return fn(tree)


def leaves(tree: Any) -> list[Any]:
    """The leaves of ``tree``, depth first, dicts in insertion order."""
    if isinstance(tree, dict):
        return [leaf for value in tree.values() for leaf in leaves(value)]
    if isinstance(tree, list | tuple):
        return [leaf for value in tree for leaf in leaves(value)]
    return [tree]
