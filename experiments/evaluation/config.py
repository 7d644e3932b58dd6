"""configs/text_tiny.py (byte tokenizer, the Python stdlib's top-level *.py) with in-loop tasks; ARG is train.seed.

text_tiny's model, data and optimizer are copied (not imported) so that the study stays reproducible when
text_tiny changes; 400 steps of 32 x 128 bytes instead of 300. model.max_seq_len = 128 = train.seq_len
(text_tiny: 256), so the scorer packs rows of the length the model trained on and the bits-per-byte
windows are 128 long; make_tasks.py keeps BOS + context + choice within 128 bytes, so no request is cut.
The tasks (tasks/, written by make_tasks.py) come from the stdlib's email/ and json/ packages, which
data.path's glob (top-level *.py, not recursive) never matches. ARGS are the seeds; run.py trains one run
per seed."""

import os
import sysconfig

from jaxtrain.config import default_config

HERE = os.path.dirname(os.path.abspath(__file__))
TASKS = ("next_line", "next_indent", "json_bpb")  # in the loop
CONTROLS = ("next_line_control", "next_indent_control")  # at the last step only (run.py)
ARGS = ("0", "1", "2", "3", "4")
STEPS, EVERY = 400, 40


def task_paths() -> str:
  return ",".join(os.path.join(HERE, "tasks", f"{t}.jsonl") for t in TASKS)


def get_config(arg=None):
  c = default_config()
  c.model.update(vocab_size=264, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=384,
                 max_seq_len=128, scan_layers=False)
  c.data.update(kind="text", path=os.path.join(sysconfig.get_paths()["stdlib"], "*.py"), tokenizer="byte",
                eval_fraction=0.02, packing="first_fit")
  c.train.update(steps=STEPS, batch_size=32, seq_len=128, log_every=10, eval_every=100, eval_batches=4,
                 seed=int(arg or "0"))
  c.optim.update(lr=3e-3, warmup_steps=30)
  c.sample.update(prompt="def ", max_new_tokens=64, temperature=0.8, top_k=20)
  c.eval.update(tasks=task_paths(), every_steps=EVERY)
  return c
