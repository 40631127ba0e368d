"""Hugging Face ``transformers.Trainer`` scripts on fabric_model: change one import.

    from fabric_model.transformers import FabricTrainer as Trainer

docs/transformers.md says what is honoured and what is refused.
"""

from .trainer import FabricTrainer

__all__ = ["FabricTrainer"]
