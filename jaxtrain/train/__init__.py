from jaxtrain.train.loop import sample, train
from jaxtrain.train.workdir import load_config
from jaxtrain.train.state import TrainState, create_state
from jaxtrain.train.step import train_step
