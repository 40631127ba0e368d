"""fabric_model: elastic data-parallel training for PyTorch models.

from fabric_model import FabricModel
FabricModel(model, datasets_function, loss_function, optimizer).train(epochs, batch_size, engines)
"""

from .api import FabricModel, TrainResult
from .callbacks import Callback, EarlyStopping
from .context import WorkerContext, worker_context
from .driver.preemption import Preempted
from .driver.replicas import ReplicaDivergenceError
from .errors import JobError, WorkerError
from .frameworks.keras.quiet import quiet_tensorflow
from .state.best import BestCheckpoints
from .step.plan import epoch_permutation, generator_seed, micro_batch_seed
from .streams.sharded import ShardedDataset, ShardReadError

__all__ = [
    "FabricModel",
    "Callback",
    "EarlyStopping",
    "BestCheckpoints",
    "ShardedDataset",
    "ShardReadError",
    "TrainResult",
    "JobError",
    "Preempted",
    "ReplicaDivergenceError",
    "WorkerError",
    "WorkerContext",
    "worker_context",
    "epoch_permutation",
    "micro_batch_seed",
    "generator_seed",
    "quiet_tensorflow",
]
__version__ = "0.1.0"
