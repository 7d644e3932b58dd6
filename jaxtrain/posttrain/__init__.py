"""Post-training on the pre-training loop: each objective is a `train.Task` (supervised fine-tuning,
reward models, preference optimization, RL from rollouts), so runs keep the loop's workdirs, metrics,
checkpoints, resume and preemption."""
