"""The planner's pipeline terms (mesh.stage > 1, jaxtrain/model/pipeline.py).

A stage runs T = M R + S - 1 iterations of Z / (S R) layers on microbatches of 1/M of the tokens.
With remat on it keeps, for the backward pass, each iteration's input and the M-microbatch io
buffer (measured: tests/model/test_pipeline.py::test_gpipe_saves_every_iteration_input), and
recomputes one iteration at a time, whose own saved values and temporaries are the unpipelined
model's terms for its layers and tokens; with remat off it keeps every iteration's. The stage's
gradient is summed over its iterations, one more copy of it, as gradient accumulation does. Every
stage computes in its bubble iterations too: the layers' FLOPs grow by T / (M R)."""

import dataclasses

from jaxtrain.config import ModelConfig
from jaxtrain.model import pipeline as pipeline_lib
from jaxtrain.plan import activations as act


def schedule(cfg, shape: dict) -> tuple[int, int, int]:
  """(stages, repeats, microbatches) of the run; (1, 1, 1) without stages."""
  s = shape["stage"]
  if s == 1:
    return 1, 1, 1
  return s, cfg.model.pipeline_repeats, cfg.train.pipeline_microbatches or s


def backward_bytes(m: ModelConfig, w: act.Widths, tokens: int, act_bytes: int, k: act.Scales,
                   stages: int, repeats: int, microbatches: int) -> dict:
  """{"activations", "attention_temps"} of a stage's backward phase, `tokens` local tokens a
  (gradient-accumulation) microbatch."""
  mb_tokens = -(-tokens // microbatches)
  one = act.backward_bytes(dataclasses.replace(m, n_layers=m.n_layers // (stages * repeats)), w,
                           mb_tokens, act_bytes, k)
  t = pipeline_lib.iterations(stages, repeats, microbatches)
  carried = mb_tokens * m.d_model * act_bytes  # one iteration's input
  if m.remat == "none":  # every iteration keeps what its layers save
    kept = t * one["activations"] + microbatches * carried
  else:
    kept = one["activations"] + (t + microbatches) * carried
  return {"activations": int(kept), "attention_temps": one["attention_temps"]}


def work(stages: int, repeats: int, microbatches: int) -> float:
  """The layers' work a step relative to the unpipelined model's: T / (M R)."""
  if stages == 1:
    return 1.0
  return pipeline_lib.iterations(stages, repeats, microbatches) / (microbatches * repeats)
