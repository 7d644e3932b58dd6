"""Checkpoints: tiered asynchronous Orbax managers (manager.py), save policies (policy.py), HF
interop (hf.py, safetensors_io.py, convert.py) and loading pretrained weights (pretrained.py);
tiers on S3-compatible object storage (object_store.py)."""

from jaxtrain.checkpoint import object_store

from jaxtrain.checkpoint.manager import (Checkpoints, DataRestore, DataSave, DataStateHandler,
                                         SaveRecord, Tier, remove_tiers, tier_dirs)

__all__ = ["object_store", "Checkpoints", "DataRestore", "DataSave", "DataStateHandler", "SaveRecord", "Tier",
           "remove_tiers", "tier_dirs"]
