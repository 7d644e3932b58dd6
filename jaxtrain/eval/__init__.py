"""Evaluation: log-likelihood scoring of continuations packed like training (score), task files
scored as lm-evaluation-harness scores them (tasks), `evaluate`, the evaluator the training loop
runs for eval.tasks (loop), and lm-evaluation-harness's model "jaxtrain" (adapter; the eval
extra). Importing this package loads no jax (the CLI's parser imports eval.cli); `evaluate` loads it
on first call."""


def evaluate(params_or_workdir, tasks, **kwargs) -> dict:
  """{task name: {metric: value}}: `tasks` (JSONL paths) scored by the newest checkpoint of a
  workdir, a Hugging Face directory, or params with config= and tokenizer=
  (jaxtrain.eval.harness.evaluate: num_fewshot, seed, limit, rows, seq_len, mesh)."""
  from jaxtrain.eval import harness
  return harness.evaluate(params_or_workdir, tasks, **kwargs)


__all__ = ["evaluate"]
