"""Every shipped config's train step compiled by its intended target's own compiler
(`jaxtrain.compile_for`), not lowered: memory against the chip's HBM, matmul FLOPs against the
model's, collectives on the mesh axes the config shards over. Compiled, not executed. On TPU the
planner's prediction is checked against the same compile, out of sample: its TPU scales were fitted
on tests/targets/planner_grid.FIT, none of which is a case here.

Skipped with the reason when libtpu / the CUDA plugin is missing (`make test-targets` installs
them). Each compile takes 10 s to a few minutes on two cores."""

import pytest

from jaxtrain.aot import compile_for
from tests.targets import planner_grid

GIB = 1024**3
PLANNER_TOLERANCE = 0.15  # predicted per-device memory within 15% of the compiler's
# Per-device totals a config must stay under, for regressions the fit check would not see:
# long_32k's blockwise attention took 2.49 GiB while XLA:TPU precomputed every key block's mask
# (the whole L x S mask, 2 GiB), 0.48 GiB since its scan reads each block through an optimization
# barrier
AT_MOST_GIB = {"long_32k": 1.0}

# config, target, overrides (the config's own mesh unless said), the mesh axes its collectives use
CASES = [
    ("gpt2_small", "tpu-v5p:2x2x1", {}, {"data"}),
    # fsdp 16 (on 4 chips: 172 GiB of temporaries); 115 s: `long` (llama_1b compiles for GPU below)
    pytest.param("llama_1b", "tpu-v5p:2x2x4", {}, {"fsdp"}, marks=pytest.mark.long),
    pytest.param("llama_8b", "tpu-v5p:4x4x4", {}, {"fsdp"},  # fsdp 64, batch 256 x 8192
                 marks=pytest.mark.long),
    ("llama_70b", "tpu-v5p:2x2x4", {}, {"fsdp"}),  # fsdp 16, 49.3 GiB of state a chip
    # the MoE configs compile for 331 s and 543 s on 2 EPYC cores (2026-12-07): `long`, out of
    # CI, as llama_8b (196 s) is (`make test-targets TARGETS_MARK=` runs them)
    pytest.param("mixtral_8x7b", "tpu-v5p:4x4x4", {}, {"fsdp", "expert"},  # fsdp 8 x expert 8
                 marks=pytest.mark.long),
    # fsdp 64 x expert 8, 2 microbatches: on 256 chips with expert 256 and fsdp 1 (its first layout)
    # XLA:TPU refused 1.46 TB of temporaries a chip: every dense weight replicated, and dropless
    # dispatch sizing each shard's expert rows for every token of all 256 shards
    pytest.param("deepseek_v3_like", "tpu-v5p:8x8x8", {}, {"fsdp", "expert"},
                 marks=pytest.mark.long),
    ("long_16k", "tpu-v5p:2x2x2", {}, {"context"}),  # context 8
    # context 4, never built beyond eval_shape before; on a v5e 2x2 (16 GiB) XLA:TPU needs 24.67 GiB
    ("long_32k", "tpu-v5p:2x2x1", {}, {"context"}),
]
# On GPU packed batches take the Pallas flash kernel (checked on an H200, 2026-12-04). llama_1b's
# batch of 256 x 2048 (32 rows a device) still needs 110.76 GiB a device on 8 H100s (its f32
# [rows, L, 128256] logits and their gradient); 32 rows with remat full is what this case holds.
GPU_CASES = [
    ("gpt2_small", "h100:8", {"train.batch_size": 16}, {"data"}),
    ("llama_1b", "h100:8", {"train.batch_size": 32, "model.remat": "full"}, {"fsdp"}),
    # float32: no cuDNN attention (bf16/fp16 only); permuted indices at 16K: blockwise
    ("long_16k", "h100:8", {}, {"context"}),
]


def _attention_share(cfg) -> float:
  """The share of the model's FLOPs in attention's score and value matmuls."""
  from jaxtrain import metrics
  from jaxtrain.model import ModelConfig, active_mlp_params
  m = ModelConfig.from_config(cfg.model)
  args = (m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff, m.vocab_size)
  full = metrics.train_flops_per_token(*args, cfg.train.seq_len, active_mlp_params(m))
  without = metrics.train_flops_per_token(*args, 0, active_mlp_params(m))
  return (full - without) / full


def _check(cfg, report, axes):
  assert not report.refusal, report.refusal
  m = report.memory
  assert m["total"] == m["argument"] + m["output"] + m["temp"] - m["alias"]
  assert 0 < m["total"] <= report.usable_bytes, report.table()
  # the donated state is the step's output too: it aliases, so it counts once
  assert m["alias"] > 0.9 * m["output"], report.table()
  # the traced step's matmuls are the model's, plus remat's recomputed forward (at most 1/3 more);
  # an attention kernel's FLOPs (the model's attention term) are not among them
  low = 1 - _attention_share(cfg) if report.kernels else 1.0
  if not report.ragged_flops:  # dropless experts' FLOPs are known only as a bound
    assert report.model_flops * low * 0.98 <= report.flops, report.table()
  assert report.flops <= report.model_flops * 1.45, report.table()
  used = {a for key in report.collectives for a in key.split()[0].split(",")}
  assert axes <= used, (axes, report.collectives)


@pytest.mark.parametrize("name, target, overrides, axes", CASES,
                         ids=[(c.values if hasattr(c, "values") else c)[0] for c in CASES])
def test_config_compiles_for_tpu(target_devices, name, target, overrides, axes):
  target_devices(target)  # skips without libtpu
  cfg = planner_grid.config(name, overrides)
  report = compile_for(cfg, target, name)
  print(report.table())
  _check(cfg, report, axes)
  assert report.memory["total"] <= AT_MOST_GIB.get(name, float("inf")) * GIB, report.table()
  row = planner_grid.row(name, name, target, overrides, report)
  print(f"planner, out of sample: predicted / compiled = {row['ratio']:.3f} "
        f"({row['predicted']['total'] / GIB:.2f} / {report.memory['total'] / GIB:.2f} GiB)")
  # MoE under remat none is not modelled (planner_grid.MOE_FIT: 0.70); context parallelism is
  # over-predicted: long_16k 1.065, long_32k 1.237 (2026-12-04; 2.1x and 2.5x while the planner
  # counted saved scores for blockwise attention, which keeps only its output and log-sum-exp, and
  # took splash for it). long_32k's peak lies in the first layer's attention backward, where the
  # second layer's saved values are gone, and the planner counts both layers'. Printed, and `plan`
  # says so in its table
  if (cfg.model.n_experts and cfg.model.remat != "full") or cfg.mesh.context > 1:
    return
  assert abs(row["ratio"] - 1) <= PLANNER_TOLERANCE, row


# Pipelined (mesh.stage): llama_8b as 4 stages x fsdp 2 with 8 microbatches of 2 rows, and
# pipeline_tiny GPipe and circular. Splash does not run inside a stage: blockwise/xla attention.
PIPELINE_CASES = [
    pytest.param("llama_8b", "tpu-v5p:2x2x2", {"mesh.stage": 4, "mesh.fsdp": 2,  # 151 s: `long`
                                               "train.batch_size": 16,
                                               "train.pipeline_microbatches": 8},
                 marks=pytest.mark.long),
    ("pipeline_tiny", "tpu-v5p:2x2x2", {}),
    ("pipeline_tiny", "tpu-v5p:2x2x1", {"mesh.stage": 2, "model.pipeline_repeats": 2,
                                        "train.pipeline_microbatches": 4}),
]


@pytest.mark.parametrize("name, target, overrides", PIPELINE_CASES,
                         ids=["llama_8b", "pipeline_tiny", "pipeline_tiny:circular"])
def test_pipelined_config_compiles_for_tpu(target_devices, name, target, overrides):
  """Fits; activations cross `stage`; the traced step's matmuls are the model's times the
  schedule's T / (M R) (every stage computes in its bubble iterations too), with remat's recompute
  and blockwise attention's full score blocks (the model counts causal half) on top. The
  planner's pipeline terms (plan/pipeline.py) are printed, not held: 1.078, 0.899 and 0.840 of
  the compiled totals (2026-12-04)."""
  from jaxtrain.model import pipeline
  target_devices(target)
  cfg = planner_grid.config(name, overrides)
  report = compile_for(cfg, target, name)
  print(report.table())
  assert not report.refusal and report.fits, report.table()
  used = {a for key in report.collectives for a in key.split()[0].split(",")}
  assert "stage" in used, report.collectives
  s, r = cfg.mesh.stage, cfg.model.pipeline_repeats
  m = cfg.train.pipeline_microbatches or s
  schedule = pipeline.iterations(s, r, m) / (m * r)
  assert report.model_flops * 0.98 <= report.flops, report.table()
  bound = 1.45 * schedule * (1 + _attention_share(cfg))
  assert report.flops <= report.model_flops * bound, (report.flops / report.model_flops, bound)
  row = planner_grid.row(name, name, target, overrides, report)
  print(f"planner (pipelined): predicted / compiled = {row['ratio']:.3f}")


def test_llama_70b_does_not_fit_16_chips_as_stages_yet(target_devices):
  """As 4 stages x fsdp 4 XLA:TPU refuses llama_70b on 16 v5p chips (109.48 GiB of temporaries;
  fsdp 16 fits in 89.63): about three f32 copies of each stage's 17.9 GiB gradient, summed over the
  pipeline's iterations. The planner says it does not fit either (its 99.79 GiB is short of what
  the compiler asks). When the pipeline's gradient copies shrink, this fails: make it a fit."""
  target_devices("tpu-v5p:2x2x4")
  overrides = {"mesh.stage": 4, "mesh.fsdp": 4}
  report = compile_for(planner_grid.config("llama_70b", overrides), "tpu-v5p:2x2x4", "llama_70b")
  print(report.table())
  assert "RESOURCE_EXHAUSTED" in report.refusal and not report.fits
  row = planner_grid.row("llama_70b", "llama_70b", "tpu-v5p:2x2x4", overrides, report)
  assert row["predicted"]["total"] > 95 * GIB, row


@pytest.mark.long  # two llama_70b compiles, 194 s on 2 EPYC cores (2026-12-07): out of CI
def test_llama_70b_fits_twice_the_batch_only_with_activations_offloaded(target_devices):
  """Issue 23's claim, by the compiler's own figure: llama_70b with 32 rows of 8192 tokens (two a
  chip) on 16 v5p chips as fsdp 16 is refused by XLA:TPU (99.44 GiB, 2026-12-04: remat full keeps
  80 layer inputs of 128 MiB a row), and with `train.offload=activations` those inputs wait in host
  memory (80 x 2 x 128 MiB = 20 GiB, written in the forward pass and read back in the backward) and
  the step fits (87.02 of 95 GiB). The planner is on the same side of the line both times."""
  target = "tpu-v5p:2x2x4"
  target_devices(target)
  reports = {}
  for mode in ("none", "activations"):
    overrides = {"train.batch_size": 32, "train.offload": mode}
    reports[mode] = compile_for(planner_grid.config("llama_70b", overrides), target, "llama_70b")
    print(reports[mode].table())
    plan = planner_grid.row("llama_70b", "llama_70b", target, overrides, reports[mode])
    print(f"planner, offload={mode}: {plan['predicted']['total'] / GIB:.2f} GiB predicted")
    assert (plan["predicted"]["total"] <= 95 * GIB) == (mode == "activations"), plan
  assert "RESOURCE_EXHAUSTED" in reports["none"].refusal and not reports["none"].fits
  offloaded = reports["activations"]
  assert offloaded.fits and not offloaded.refusal, offloaded.table()
  inputs = 80 * 2 * 8192 * 8192 * 2  # layers x rows a chip x tokens x d_model x bf16
  assert offloaded.host["temp"] == inputs, offloaded.host
  assert offloaded.host["to_host"] == offloaded.host["to_device"] == inputs, offloaded.host


@pytest.mark.parametrize("name, target, overrides, axes", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_config_compiles_for_gpu(target_devices, name, target, overrides, axes):
  target_devices(target)  # skips without the CUDA plugin
  cfg = planner_grid.config(name, overrides)
  report = compile_for(cfg, target, name)
  print(report.table())
  _check(cfg, report, axes)


def test_gpu_compile_matches_the_h200_run(target_devices):
  """gpt2_small's batch of 64 x 1024 with xla attention on one H200 ran out of memory asking for
  113.41 GiB (benchmarks/RESULTS.md, 2026-11-30 and again 2026-12-04): the deviceless compile
  assigns the same temporaries and says it does not fit. With `auto` (the Pallas flash kernel for
  packed rows) the same batch ran there, 228 ms a step (2026-12-04): the compile says it fits."""
  target_devices("h200:1")
  cfg = planner_grid.config("gpt2_small", {"model.attention": "xla"})
  report = compile_for(cfg, "h200:1", "gpt2_small")
  print(report.table())
  assert 110 * GIB < report.memory["temp"] < 116 * GIB, report.table()
  assert not report.fits
  fused = compile_for(planner_grid.config("gpt2_small", {}), "h200:1", "gpt2_small")
  print(fused.table())
  assert fused.fits and "flash_attention_forward" in fused.kernels, fused.table()


def test_refused_program_is_reported_not_raised(target_devices):
  """Two layers of gpt2_small with 64 rows of 1024 tokens a chip on a v5e slice (16 GiB each):
  XLA:TPU refuses the program (19.79 GiB of temporaries, 2026-12-03); compile_for reports the
  refusal in the compiler's words instead of raising, and `compile` exits 1."""
  target_devices("tpu-v5e:2x2")
  cfg = planner_grid.config("gpt2_small", {"model.n_layers": 2, "train.batch_size": 256})
  report = compile_for(cfg, "tpu-v5e:2x2", "gpt2_small")
  print(report.table())
  assert not report.fits and "RESOURCE_EXHAUSTED" in report.refusal
  assert "does not fit: the compiler refused the program" in report.table()
