from jaxtrain.train.loop import load_config, sample, train
from jaxtrain.train.state import TrainState, create_state
from jaxtrain.train.step import train_step
