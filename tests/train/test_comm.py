"""The comm report of a compiled train step: the float32 explicit reduction over replica sends
2 (R-1)/R x 4 bytes per parameter; the baseline resets compressed-reduction keys; the projection's model;
and `python -m jaxtrain comm`."""

import os
import subprocess
import sys

import jax
import pytest

from jaxtrain import config as config_lib, config_files
from jaxtrain.config import ConfigError
from jaxtrain.config import ModelConfig
from jaxtrain.model.transformer import param_count
from jaxtrain import builder
from jaxtrain.core import state as state_lib
from jaxtrain.train import comm
from tests.fixtures import ROOT, tiny_config


@pytest.mark.slow  # ~20 s on 2 cores: the default suite stays under 10 minutes
def test_f32_reduction_over_replica_is_ring_all_reduce_of_every_parameter():
  cfg = tiny_config(mesh=dict(replica=4, data=2), optim=dict(reduce_axis="replica"), train=dict(batch_size=16))
  _, task, tx, _ = builder.build(cfg, "")
  n = sum(x.size for x in jax.tree.leaves(state_lib.abstract_state(task, tx).params))
  rep = comm.report(cfg)
  want = 2 * (4 - 1) / 4 * 4 * n
  # the rest over replica: the loss's sums (a few scalars)
  assert rep["config"]["params"] == n and rep["config"]["reduced"] == pytest.approx(want, rel=1e-3)
  assert rep["config"]["by_axis"][("replica", "f32")] == pytest.approx(want, rel=1e-3)
  assert rep["ratio"] == 1.0 and rep["baseline"] == rep["config"]  # the config is its own baseline
  text = comm.format_report(rep)
  assert "over replica: baseline / config = 1.00x" in text
  assert any(line.split()[:2] == ["replica", "f32"] for line in text.splitlines())


def test_baseline_resets_compressed_reduction_and_diloco_keys():
  cfg = tiny_config(comm=dict(format="int8", error_feedback="ef21", block=64), diloco=dict(delay=3))
  base = comm.baseline(cfg)
  assert (base.comm.format, base.comm.error_feedback, base.comm.block, base.diloco.delay,
          base.optim.reduce_axis) == ("f32", "none", 256, 0, "replica")
  assert cfg.comm.format == "int8"  # the config itself is left alone
  cfg = tiny_config(comm=dict(axis="data", format="bf16"))
  assert comm.baseline(cfg).optim.reduce_axis == "data" and comm.baseline(cfg).comm.axis == "data"


def test_projection_follows_its_stated_model():
  n = param_count(ModelConfig.from_config(config_files.load_config_file("configs/gpt2_small.py").model))
  rows = comm.project({"dp": 6.0, "streaming": 6.0}, ("gpt2_small",), (1, 100), overlap_steps={"streaming": 4})
  t = 6 * n * 64 * 1024 / (989e12 * 0.4)
  by = {(r["scheme"], r["gbit"]): r for r in rows}
  comm_1g = 6.0 * n * 8 / 1e9
  assert by["dp", 1]["compute_s"] == pytest.approx(t) and by["dp", 1]["comm_s"] == pytest.approx(comm_1g)
  assert by["dp", 1]["utilization"] == pytest.approx(t / (t + comm_1g))
  assert by["streaming", 1]["utilization"] == pytest.approx(t / (t + comm_1g - 4 * t))
  assert by["streaming", 100]["utilization"] == 1.0  # all of it hidden behind 4 steps of compute
  measured = comm.project({"dp": 6.0}, ("gpt2_small",), (10,), step_time_s={"gpt2_small": 2.0})
  assert measured[0]["utilization"] == pytest.approx(2.0 / (2.0 + 6.0 * n * 8 / 10e9))
  table = comm.format_projection(rows)
  assert "a model, not a measurement" in table and "| dp | " in table
  assert f"| streaming | {by['streaming', 1]['utilization']:.1%} | 100.0% |" in table


def cli(*argv):
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  return subprocess.run([sys.executable, "-m", "jaxtrain", "comm", f"--config={ROOT}/configs/tiny.py", *argv],
                        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


@pytest.mark.slow  # ~27 s on 2 cores: the default suite stays under 10 minutes
def test_cli_prints_the_table_and_the_projection():
  p = cli("--config.mesh.replica=4", "--config.optim.reduce_axis=replica", "--project")
  assert p.returncode == 0, p.stderr[-3000:]
  replica = [line.split() for line in p.stdout.splitlines() if line.startswith("replica ")]
  n = param_count(ModelConfig.from_config(config_files.load_config_file("configs/tiny.py").model))
  assert replica[0][:2] == ["replica", "f32"], p.stdout
  assert float(replica[0][2].replace(",", "")) == pytest.approx(2 * 3 / 4 * 4 * n, rel=1e-3)
  assert "over replica: baseline / config = 1.00x" in p.stdout
  assert "over replica, measured: f32 data-parallel 6, this config 6\n" in p.stdout  # 2 (4-1)/4 x 4 bytes
  assert "| f32 data-parallel |" in p.stdout and "| this config |" in p.stdout


def test_cli_bad_key_is_one_line_exit_2():
  p = cli("--config.optim.nope=1")
  assert p.returncode == 2 and p.stderr.splitlines() == ["error: --config.optim.nope: unknown config key"]


def test_pallas_quantize_kernel_is_refused_on_cpu_in_one_line():
  cfg = tiny_config(mesh=dict(replica=4, data=2), comm=dict(format="int8", kernel="pallas"), train=dict(batch_size=16))
  with pytest.raises(ConfigError, match=r"comm.kernel=pallas runs on GPU and TPU only.*comm.kernel=xla on CPU"):
    builder.build(cfg, "")
  cfg.comm.kernel = "triton"
  with pytest.raises(ConfigError, match="comm.kernel"):
    config_lib.validate(cfg, 8)
