"""IBM WMLA 4.8's ``pyedt`` package: ``from pyedt.fabric_model import FabricModel``."""
