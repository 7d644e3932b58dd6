"""Post-training on the pre-training loop: each objective is a `core.task.Task` (supervised
fine-tuning, reward models, preference optimization, RL from rollouts), so runs keep the loop's
workdirs, metrics, checkpoints, resume and preemption. `builder.TASKS` names them for train.task."""

from jaxtrain.posttrain.dpo import Dpo
from jaxtrain.posttrain.grpo import Grpo
from jaxtrain.posttrain.ppo import Ppo
from jaxtrain.posttrain.reward import RewardModel, load_reward_model
from jaxtrain.posttrain.sft import Sft

__all__ = ["Dpo", "Grpo", "Ppo", "RewardModel", "Sft", "load_reward_model"]
