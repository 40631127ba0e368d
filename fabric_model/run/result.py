"""What ``train()`` returns (the trained weights are in the user's model object itself)."""

from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass
class TrainResult:
    """What ``train()`` returns; the trained weights are in the user's model object itself.

    Attributes:
        run_dir: the run directory (logs, worker logs, metrics).
        history: per epoch, the sample-weighted training averages (``loss`` and metrics).
        test_history: per validation, the test metrics.
        seed: the seed the run used (pass it back as ``seed=`` to repeat the run).
        replica_digests: per worker, a SHA-256 of its final weights and optimizer state.
        onnx_max_diff: with ``save_to_onnx``, the largest absolute difference between
            onnxruntime on ``model/model.onnx`` and the framework's own output on real batches
            (None when no file was written).
    """

    run_dir: Path
    history: list[dict[str, float]]
    test_history: list[dict[str, float]]
    seed: int
    replica_digests: dict[int, str]
    onnx_max_diff: float | None = None
