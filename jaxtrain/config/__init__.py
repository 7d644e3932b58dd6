"""The config: one module per section (model, data, train, posttrain, optim, comm and diloco, mesh,
checkpoint, sample, eval), each with its defaults, the choices its keys take and its checks;
`schema` assembles the defaults, `checks` runs the checks. Import it as `from jaxtrain import
config as config_lib`. No jax import here."""

from jaxtrain.config.checks import RESUMABLE_CHANGES, incompatible, validate
from jaxtrain.config.comm import (
    COMM_KERNELS, ERROR_FEEDBACK, compressing, manual_axis, per_replica_state)
from jaxtrain.config.data import BAD_UTF8, DATA_FORMATS, DATA_KINDS, PACKINGS
from jaxtrain.config.errors import ConfigError, flat
from jaxtrain.config.mesh import DATA_AXES, MESH_AXES, PRESETS, RULES, mesh_shape
from jaxtrain.config.model import (
    ATTENTION, DISPATCH, DTYPES, FP8, FUSED_NORM, GROUPED_MATMUL, REMAT, ROPE_SCALINGS, ROUTERS,
    ModelConfig, VisionConfig, image_token, validate_rope)
from jaxtrain.config.optim import ON_DIVERGENCE, OPTIMIZERS, SCHEDULES
from jaxtrain.config.posttrain import ADVANTAGE_SCALES, PREFERENCE_LOSSES, RL_AGGREGATES
from jaxtrain.config.schema import FLOAT_RANGES, default_config
from jaxtrain.config.train import AUTO, AUTO_KEYS, CROSS_ENTROPY, nan_steps

__all__ = [
    "FLOAT_RANGES", "RESUMABLE_CHANGES", "compressing", "flat", "incompatible", "manual_axis",
    "per_replica_state", "validate", "validate_rope", "ADVANTAGE_SCALES", "ATTENTION", "AUTO",
    "AUTO_KEYS", "BAD_UTF8", "COMM_KERNELS", "CROSS_ENTROPY", "ConfigError",
    "DATA_AXES", "DATA_FORMATS", "DATA_KINDS", "DISPATCH", "DTYPES", "ERROR_FEEDBACK", "FP8",
    "FUSED_NORM", "GROUPED_MATMUL", "MESH_AXES", "ModelConfig", "ON_DIVERGENCE", "OPTIMIZERS",
    "VisionConfig", "image_token", "PACKINGS", "PREFERENCE_LOSSES", "PRESETS", "REMAT",
    "RL_AGGREGATES", "ROPE_SCALINGS",
    "ROUTERS", "RULES", "SCHEDULES", "default_config", "mesh_shape", "nan_steps"]
