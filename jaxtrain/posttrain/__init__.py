"""Post-training on the pre-training loop: each objective is a `train.Task` (supervised fine-tuning,
reward models, preference optimization, RL from rollouts), so runs keep the loop's workdirs, metrics,
checkpoints, resume and preemption.

TASKS maps train.task to its task; importing this package puts them into train.task.TASKS, where the loop
(which may not import this layer) finds them."""

from jaxtrain.posttrain.dpo import Dpo
from jaxtrain.posttrain.grpo import Grpo
from jaxtrain.posttrain.ppo import Ppo
from jaxtrain.posttrain.reward import RewardModel, load_reward_model
from jaxtrain.posttrain.sft import Sft
from jaxtrain.train import task as _task

TASKS = {"sft": Sft, "rm": RewardModel, "dpo": Dpo, "grpo": Grpo, "ppo": Ppo}
_task.TASKS.update(TASKS)

__all__ = ["Dpo", "Grpo", "Ppo", "RewardModel", "Sft", "TASKS", "load_reward_model"]
