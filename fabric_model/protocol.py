"""The control-plane protocol: every message between the driver and its workers (placeholder)."""

from __future__ import annotations

#: The job's secret (hex), in a worker's environment; never on its command line.
SECRET_ENV = "FABRIC_MODEL_SECRET"
#: Set by the driver's launcher: the worker dies with the driver and leaves Ctrl-C to it.
LAUNCHED_ENV = "FABRIC_MODEL_LAUNCHED"
