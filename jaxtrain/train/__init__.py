from jaxtrain.train.loop import train
from jaxtrain.train.sample import sample
from jaxtrain.train.workdir import load_config
from jaxtrain.train.state import TrainState, create_state
from jaxtrain.train.step import train_step
