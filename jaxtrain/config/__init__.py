"""The config: its schema (every key, its default and the choices it takes) and its checks (what can run, and
what a resumed run may change). Import it as `from jaxtrain import config as config_lib`."""

from jaxtrain.config.checks import (
    FLOAT_RANGES, RESUMABLE_CHANGES, compressing, flat, incompatible, manual_axis, per_replica_state, validate,
    validate_rope)
from jaxtrain.config.schema import (
    ADVANTAGE_SCALES, ATTENTION, AUTO, AUTO_KEYS, BAD_UTF8, COMM_FORMATS, COMM_KERNELS, CROSS_ENTROPY, ConfigError,
    DATA_AXES, DATA_FORMATS, DATA_KINDS, DISPATCH, DTYPES, ERROR_FEEDBACK, FP8, FUSED_NORM, GROUPED_MATMUL,
    MESH_AXES, ModelConfig, ON_DIVERGENCE, OPTIMIZERS, PACKINGS, PREFERENCE_LOSSES, PRESETS, REMAT, RL_AGGREGATES,
    ROPE_SCALINGS, ROUTERS, RULES, SCHEDULES, TASKS, default_config, mesh_shape)

__all__ = [
    "FLOAT_RANGES", "RESUMABLE_CHANGES", "compressing", "flat", "incompatible", "manual_axis", "per_replica_state",
    "validate", "validate_rope", "ADVANTAGE_SCALES", "ATTENTION", "AUTO", "AUTO_KEYS", "BAD_UTF8", "COMM_FORMATS",
    "COMM_KERNELS", "CROSS_ENTROPY", "ConfigError", "DATA_AXES", "DATA_FORMATS", "DATA_KINDS", "DISPATCH", "DTYPES",
    "ERROR_FEEDBACK", "FP8", "FUSED_NORM", "GROUPED_MATMUL", "MESH_AXES", "ModelConfig", "ON_DIVERGENCE",
    "OPTIMIZERS", "PACKINGS", "PREFERENCE_LOSSES", "PRESETS", "REMAT", "RL_AGGREGATES", "ROPE_SCALINGS", "ROUTERS",
    "RULES", "SCHEDULES", "TASKS", "default_config", "mesh_shape"]
