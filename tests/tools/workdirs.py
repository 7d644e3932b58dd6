"""Hand-written workdirs with known values for the tools' tests (rows shaped like the loop's)."""

import json
import os

# Run "a": a floor, a checkpoint save, a crash after step 4 and a resume from step 3 (step 4 logged
# again, its time with compilation), evaluations at steps 2 and 6, and a torn last line.
A_ROWS = [
    {"step": 1, "loss": 5.0, "tokens_per_sec": 10.0, "mfu": 0.001, "grad_norm": 1.5, "entropy_floor": 2.0},
    {"step": 2, "loss": 4.0, "eval_loss": 4.6, "eval_entropy_floor": 2.5, "tokens_per_sec": 400.0, "mfu": 0.04,
     "grad_norm": 1.25, "entropy_floor": 2.0},
    {"step": 3, "loss": 3.5, "tokens_per_sec": 1000.0, "mfu": 0.10, "grad_norm": 1.0, "entropy_floor": 2.0},
    {"step": 3, "event": "checkpoint_save", "tier": "persistent", "save_blocking_s": 0.5},
    {"step": 4, "loss": 3.2, "tokens_per_sec": 1200.0, "mfu": 0.12, "grad_norm": 0.75, "entropy_floor": 2.0},
    {"step": 3, "event": "checkpoint_restore", "tier": "persistent", "restore_s": 0.25},
    {"step": 4, "loss": 3.3, "tokens_per_sec": 20.0, "mfu": 0.002, "grad_norm": 0.8, "entropy_floor": 2.0},
    {"step": 5, "loss": 3.0, "tokens_per_sec": 1100.0, "mfu": 0.11, "grad_norm": 0.7, "entropy_floor": 2.0},
    {"step": 6, "loss": 2.8, "eval_loss": 3.1, "eval_entropy_floor": 2.5, "tokens_per_sec": 900.0, "mfu": 0.09,
     "grad_norm": 0.6, "entropy_floor": 2.0},
]
A_TORN = '{"step": 7, "loss": 2.'
A_CONFIG = {"model": {"d_model": 32, "n_layers": 2, "scan_layers": True},
            "optim": {"lr": 0.01, "schedule": "cosine"}, "train": {"steps": 6, "seed": 0}, "data": {"path": ""}}

# Run "b": no floor (a text corpus), an eval loss that got worse, a key that a's config lacks.
B_ROWS = [
    {"step": 1, "loss": 6.0, "tokens_per_sec": 5.0, "mfu": 0.0005, "grad_norm": 2.0},
    {"step": 2, "loss": 5.0, "eval_loss": 3.9, "tokens_per_sec": 300.0, "mfu": 0.03, "grad_norm": 1.0},
    {"step": 3, "loss": 4.5, "tokens_per_sec": 800.0, "mfu": 0.08, "grad_norm": 0.5},
    {"step": 4, "loss": 4.0, "eval_loss": 4.2, "tokens_per_sec": 700.0, "mfu": 0.07, "grad_norm": 0.25},
    {"step": 5, "loss": 3.75, "tokens_per_sec": 600.0, "mfu": 0.06, "grad_norm": 0.125},
]
B_CONFIG = {"model": {"d_model": 32, "n_layers": 4, "scan_layers": False, "n_experts": 0},
            "optim": {"lr": 0.003, "schedule": "cosine"}, "train": {"steps": 5, "seed": 0}, "data": {"path": "x"}}


def write_run(root, name: str, rows: list[dict], config: dict | None = None, torn: str = "") -> str:
  """root/name/metrics.jsonl (and config.json when given); returns the workdir."""
  workdir = os.path.join(root, name)
  os.makedirs(workdir)
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    f.write("".join(json.dumps(row) + "\n" for row in rows) + torn)
  if config is not None:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      json.dump(config, f)
  return workdir


def write_a_b(root) -> list[str]:
  return [write_run(root, "a", A_ROWS, A_CONFIG, A_TORN), write_run(root, "b", B_ROWS, B_CONFIG)]
