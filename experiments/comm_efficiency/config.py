"""configs/tiny.py on 8 devices as replica=4 x data=2; ARG names the way the replicas communicate.

The model, data and schedule are copied from configs/tiny.py (not imported) so that the study stays
reproducible when tiny changes. Every scheme has the same seed, batches and inner optimizer; only the
reduction over the `replica` axis differs. ARGS are the schemes; run.py trains one run per scheme.
`steps` (run.py --steps) shortens the run with the warm-up scaled in proportion."""

from jaxtrain.config import default_config

# scheme -> dotted overrides on top of the f32 data-parallel baseline (optim.reduce_axis=replica)
SCHEMES = {
    "f32_dp": {},
    "bf16": {"comm.format": "bf16"},
    "fp8": {"comm.format": "fp8"},
    "int8": {"comm.format": "int8"},
    "int4": {"comm.format": "int4"},
    "int4_ef": {"comm.format": "int4", "comm.error_feedback": "ef"},
    "int4_ef21": {"comm.format": "int4", "comm.error_feedback": "ef21"},
    "diloco_h10": {"diloco.inner_steps": 10},
    "diloco_h10_int8": {"diloco.inner_steps": 10, "diloco.format": "int8"},
    "diloco_h50": {"diloco.inner_steps": 50},
    "diloco_h50_int8": {"diloco.inner_steps": 50, "diloco.format": "int8"},
    "streaming_h50_p2_d5_int4": {"diloco.inner_steps": 50, "diloco.fragments": 2, "diloco.delay": 5,
                                 "diloco.format": "int4"},
    # Not a scheme: the same f32 step with GSPMD's implicit reduction, equal up to float reassociation.
    # How far it lands from f32_dp is the run-to-run noise that any perturbation of the updates brings.
    "f32_implicit": {"optim.reduce_axis": ""},
}
ARGS = tuple(SCHEMES)
STEPS, WARMUP = 400, 50  # configs/tiny.py's


def get_config(arg=None, steps: int = STEPS):
  c = default_config()
  c.model.update(vocab_size=256, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=384,
                 max_seq_len=256, scan_layers=False)
  c.data.update(symbols=200, max_symbols=12, stop_prob=0.001)
  c.train.update(steps=steps, batch_size=32, seq_len=128, log_every=10, eval_every=50, eval_batches=4)
  c.optim.update(lr=3e-3, warmup_steps=max(1, round(WARMUP * steps / STEPS)), schedule="cosine")
  c.optim.reduce_axis = "replica"
  c.mesh.update(replica=4, data=2)
  for key, value in SCHEMES[arg or "f32_dp"].items():
    section, name = key.split(".")
    c[section][name] = value
  return c
