from jaxtrain.optim.build import build, decay_mask
from jaxtrain.optim.schedules import make_schedule
