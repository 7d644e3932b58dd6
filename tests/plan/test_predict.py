"""The planner without compiling: the state's per-device bytes against the shardings the loop gives it on
real (virtual) devices, how memory moves with batch, remat and mesh, suggestions that re-predict as fitting,
FLOPs, the CLI's table and its one-line errors, and train.batch_size=auto accepted by the schema."""

import dataclasses
import math

import jax
import numpy as np
import pytest

from jaxtrain import config as config_lib, config_files, metrics
from jaxtrain.__main__ import main
from jaxtrain.plan import auto, estimate, predict
from jaxtrain.plan.state_bytes import state_bytes
from jaxtrain import builder
from jaxtrain.core import state as state_lib
from tests.fixtures import tiny_config

GIB = 2**30


def sharded_bytes(tree, shardings) -> int:
  """Bytes of each leaf's shard on device 0 as the loop lays it out (the independent reference)."""
  return sum(math.prod(sh.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
             for x, sh in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))


@pytest.mark.parametrize("mesh, comm", [
    ({"data": 2, "fsdp": 2, "tensor": -1, "rules": "fsdp_tp"}, {}),
    ({"data": 1, "replica": 2, "fsdp": -1}, {"format": "int8", "error_feedback": "ef"}),  # per-shard residuals
], ids=["fsdp_tp", "fsdp-compressed-ef"])
def test_state_bytes_equal_the_loops_shards(mesh, comm):
  cfg = tiny_config(mesh=mesh, comm=comm)
  cfg.mesh.update(data=mesh.get("data", 1))
  shape = config_lib.validate(cfg, 8)
  mesh_, task, tx, _ = builder.build(cfg, "", jax.devices())
  abstract = state_lib.abstract_state(task, tx)
  shardings = state_lib.state_shardings(task, tx, mesh_, cfg.mesh.rules)
  got = state_bytes(cfg, shape)
  assert got["params"] == sharded_bytes(abstract.params, shardings.params)
  assert got["opt_state"] == sharded_bytes(abstract.opt_state, shardings.opt_state)


def memory(cfg, n: int = 8) -> dict:
  return estimate.memory_bytes(cfg, config_lib.validate(cfg, n), "cpu")[0]


def test_memory_moves_the_right_way():
  base = memory(tiny_config())
  double = memory(tiny_config(train={"batch_size": 16}))
  assert double["activations"] > base["activations"] and double["params"] == base["params"]
  assert memory(tiny_config(model={"remat": "full"}))["activations"] < base["activations"]
  assert memory(tiny_config(mesh={"data": 1, "fsdp": 8}))["opt_state"] < base["opt_state"] / 4
  assert memory(tiny_config(train={"cross_entropy": "chunked", "ce_token_chunk": 8}))["loss_temps"] < \
      base["loss_temps"]


def test_moe_dispatch_rows_follow_the_expert_shards():
  """Dropless over X expert shards holds the worst case, X x min(k, E / X) expert rows a token
  (every token of every shard to one shard's experts); capacity holds capacity_factor x k slots
  whatever X."""
  from jaxtrain.config import ModelConfig
  from jaxtrain.plan import activations
  m = ModelConfig(n_experts=8, top_k=2, dispatch="dropless")
  assert activations.expert_rows(m, 1) == (2, 1)
  assert activations.expert_rows(m, 8) == (8, 8)  # one expert a shard: min(k, 1) row per copy
  assert activations.expert_rows(m, 2) == (4, 2)
  capacity = ModelConfig(n_experts=8, top_k=2, dispatch="capacity", capacity_factor=1.5)
  assert activations.expert_rows(capacity, 8) == (3.0, 0)
  moe = dict(n_experts=8, top_k=2, d_ff_expert=64, dispatch="dropless")
  mesh = lambda expert: {"data": 1, "fsdp": -1, "expert": expert, "rules": "fsdp_ep"}
  one = memory(tiny_config(model=moe, mesh=mesh(1)))
  eight = memory(tiny_config(model=moe, mesh=mesh(8)))
  assert eight["activations"] > 2 * one["activations"]


def test_blockwise_attention_holds_one_block_of_scores_not_the_layers():
  """Under context parallelism a TPU runs blockwise attention (the load-balanced order is no causal
  order by position: no splash, no cuDNN; a GPU runs the Pallas flash kernel), and blockwise saves
  its output and log-sum-exp only: the attention temporaries are BLOCK_COPIES of one key block's
  float32 scores for the local tokens, whatever the layers (were 2 L + 3 copies: long_16k 2.1x its
  compile)."""
  from jaxtrain.config import ModelConfig
  from jaxtrain.plan import activations
  m = ModelConfig(n_layers=2, n_heads=4, head_dim=32, d_model=128, attention_block=512,
                  compute_dtype="bfloat16")
  assert estimate._attention_impl(m, 16384, "tpu-v5p") == "splash"
  assert estimate._attention_impl(m, 16384, "tpu-v5p", context=8) == "blockwise"
  assert estimate._attention_impl(m, 1024, "tpu-v5p", context=8) == "xla"
  assert estimate._attention_impl(m, 16384, "h100", context=8) == "pallas"  # a fused kernel too
  assert estimate._attention_impl(m, 16384, "tpu-v5p", stages=4) == "blockwise"
  tokens = 2048
  for layers in (2, 8):
    one = dataclasses.replace(m, n_layers=layers)
    w = activations.widths(one, 16384, 1, "blockwise")
    got = activations.backward_bytes(one, w, tokens, 2, activations.XLA_TPU)["attention_temps"]
    assert got == activations.BLOCK_COPIES * tokens * 4 * 4 * 512
  xla = activations.widths(m, 2048, 1, "xla")
  held = activations.backward_bytes(m, xla, tokens, 2, activations.XLA_TPU)["attention_temps"]
  assert held == tokens * 4 * 4 * 2048 * (2 * 2 + 3)  # xla saves scores and probs a layer


def test_flops_count_tokens_remat_and_time():
  cfg = tiny_config(train={"batch_size": 64})
  m, t = cfg.model, cfg.train
  per_token = metrics.train_flops_per_token(m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff,
                                            m.vocab_size, t.seq_len)
  plan = predict(cfg, 64, "h100")
  assert plan.flops_per_step == per_token * t.batch_size * t.seq_len
  assert plan.compute_time_s == pytest.approx(plan.flops_per_step / 64 / (989e12 if m.compute_dtype == "bfloat16"
                                                                         else 67e12) / 0.4)
  assert predict(tiny_config(model={"remat": "full"}, train={"batch_size": 64}), 64, "h100").flops_per_step \
      > plan.flops_per_step


def test_what_does_not_fit_says_which_change_would():
  cfg = tiny_config(train={"batch_size": 64, "seq_len": 32})
  need = predict(cfg, 8, "h100").memory["total"]
  plan = predict(cfg, 8, "h100", device_memory_bytes=0.8 * need)
  assert not plan.fits and plan.suggestions
  for line in plan.suggestions:  # each one re-predicted with the change, and fitting
    what = line.split(":")[0]
    changed = config_files.apply_overrides(tiny_config(train={"batch_size": 64, "seq_len": 32}),
                                           dict(kv.split("=") for kv in what.split()))
    assert predict(changed, 8, "h100").memory["total"] <= 0.8 * need, line


def test_auto_picks_the_largest_predicted_batch():
  cfg = auto.with_train(tiny_config(), batch_size=config_lib.AUTO)
  limit = 64 * 2**20
  choice = auto.choose(cfg, 8, "h100", limit)
  assert choice["step"] == 8 and choice["batch_size"] % 8 == 0
  at = lambda b: predict(auto.with_train(cfg, batch_size=b), 8, "h100").memory["total"] <= (1 - auto.MARGIN) * limit
  assert at(choice["batch_size"]) and not at(choice["batch_size"] + 8)


def test_auto_in_the_schema_and_overrides():
  cfg = config_files.apply_overrides(tiny_config(), {"train.batch_size": "auto", "train.microbatches": "auto"})
  assert cfg.train.batch_size == "auto"
  config_lib.validate(cfg, 8)  # accepted before the planner resolves it
  with pytest.raises(config_lib.ConfigError, match="expected int"):
    config_files.apply_overrides(tiny_config(), {"train.steps": "auto"})
  bad = auto.with_train(tiny_config(), batch_size="many")
  with pytest.raises(config_lib.ConfigError, match=r"^train.batch_size must be positive or auto, got 'many'$"):
    config_lib.validate(bad, 8)


def test_cli_prints_the_table(capsys):
  assert main(["plan", "--config=configs/tiny.py", "--devices=8", "--device_kind=h100",
               "--config.mesh.fsdp=4"]) == 0
  out = capsys.readouterr().out
  assert "8 x h100 (data=2 fsdp=4)" in out and "memory.total" in out and "step time" in out


@pytest.mark.parametrize("argv, message", [
    (["--device_kind=v100"], "invalid choice"),
    (["--devices=6"], "does not divide"),  # tiny's batch over 6 devices
    (["--devices=0"], "devices must be >= 1"),
    (["--device_memory_gib=0"], "--device_memory_gib must be positive"),
    (["--config.model.remat=some"], "model.remat: unknown value"),
])
def test_cli_bad_input_is_one_line(argv, message, capsys):
  assert main(["plan", "--config=configs/tiny.py", "--device_kind=h100", *argv]) == 2
  err = capsys.readouterr().err
  assert message in err and err.count("\n") == 1


def test_cli_resolves_auto_by_prediction(capsys):
  assert main(["plan", "--config=configs/tiny.py", "--devices=8", "--device_kind=h100", "--device_memory_gib=0.05",
               "--config.train.batch_size=auto"]) == 0
  out = capsys.readouterr().out
  batch = int(out.split("train.batch_size=")[1].split()[0])
  assert batch % 8 == 0 and any(line.split() == ["fits", "yes"] for line in out.splitlines())


def test_stages_are_suggested_when_nothing_else_fits():
  """A deep narrow model at 32K tokens, one row a device: its remat'd layer inputs (64 of them a
  row) are what does not fit; no single other change helps (remat full, chunked loss, blockwise
  attention already; the batch does not split into microbatches). Two stages keep T + M = 5
  microbatch inputs a stage instead: the planner suggests them, with the bubble's step time."""
  c = tiny_config(model=dict(n_layers=64, d_model=1024, n_heads=8, n_kv_heads=8, head_dim=128,
                             d_ff=2048, max_seq_len=32768, remat="full", attention="blockwise",
                             scan_layers=True, compute_dtype="bfloat16"),
                  train=dict(batch_size=8, seq_len=32768, cross_entropy="chunked"),
                  mesh=dict(data=1, fsdp=-1))
  plain = predict(c, 8, "tpu-v5e")
  staged = predict(estimate.with_values(c, mesh__stage=2), 8, "tpu-v5e")
  assert staged.memory["activations"] < plain.memory["activations"]
  assert staged.step_time_s > plain.step_time_s  # (S - 1) of M R + S - 1 iterations idle
  limit = (plain.memory["total"] + staged.memory["total"]) / 2
  plan = predict(c, 8, "tpu-v5e", device_memory_bytes=limit)
  assert not plan.fits
  assert len(plan.suggestions) == 1 and plan.suggestions[0].startswith("mesh.stage=2:")
