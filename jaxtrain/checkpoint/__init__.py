"""Checkpoints: tiered asynchronous Orbax managers (manager.py), save policies (policy.py), HF
interop (hf.py, safetensors_io.py, convert.py) and loading pretrained weights (pretrained.py)."""

from jaxtrain.checkpoint.manager import (Checkpoints, DataRestore, DataSave, DataStateHandler,
                                         SaveRecord, Tier, remove_tiers, tier_dirs)

__all__ = ["Checkpoints", "DataRestore", "DataSave", "DataStateHandler", "SaveRecord", "Tier",
           "remove_tiers", "tier_dirs"]
