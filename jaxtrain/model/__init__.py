from jaxtrain.model.decode import generate, init_cache, decode_logits
from jaxtrain.model.transformer import ModelConfig, Transformer, active_mlp_params, param_count
from jaxtrain.model.encoder import Encoder
