"""``from pyedt.fabric_model import FabricModel``, as in IBM WMLA 4.8."""

from fabric_model import Callback, FabricModel

__all__ = ["Callback", "FabricModel"]
