"""Where a job's workers run: ``train(..., cluster=...)`` (docs/architecture.md, "Processes").

``"local"`` (the default) runs them as processes on this host; ``"ray"`` as actors on the Ray
cluster named by ``RAY_ADDRESS`` (see :mod:`fabric_model.launchers.ray`). This module only
checks the choice: it never imports Ray, so ``import fabric_model`` and local runs stay light.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from ..settings.registry import CLUSTER, CLUSTERS

if TYPE_CHECKING:
    from .ray_cluster import RayCluster


def check_cluster(cluster: str | None) -> str:
    """``cluster`` (or ``$FABRIC_MODEL_CLUSTER`` when None) as ``"local"`` or ``"ray"``.

    Raises:
        ValueError: a value that is not one of :data:`~fabric_model.settings.registry.CLUSTERS`.
        ImportError: ``"ray"`` without Ray installed.
    """
    name, value = "cluster", cluster
    if cluster is None:
        name, value = CLUSTER.name, CLUSTER.get()  # the registry checks the variable's value
    if value is None:
        return "local"
    if not isinstance(value, str) or value.strip().lower() not in CLUSTERS:
        accepted = ", ".join(repr(c) for c in CLUSTERS)
        raise ValueError(f"Expected `{name}` to be None, {accepted}. Received: {name}={value!r}")
    kind = value.strip().lower()
    if kind == "ray" and importlib.util.find_spec("ray") is None:
        raise ImportError(
            f"{name}={value!r} runs the workers on a Ray cluster, but Ray is not installed. "
            "HINT: pip install fabric-model[ray]"
        )
    return kind


def open_cluster(kind: str) -> RayCluster | None:
    """The connected Ray cluster of a ``"ray"`` job; None for local processes (Ray is imported
    only here, so local runs never import it)."""
    if kind != "ray":
        return None
    from .ray_cluster import RayCluster

    return RayCluster()
