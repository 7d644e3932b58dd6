"""Communication-efficient training keeps its quality: configs/tiny.py trained as replica=4 x data=2 with
the same seed and batches under each scheme, final eval loss against float32 data parallelism's.

Targets (the comm issue's): int8 within 0.5%; int4 with error feedback within 0.5% and better than int4
without; DiLoCo H=10 within 2%, H=50 within 5%; int8 DiLoCo within 0.5% of float32 DiLoCo. The run is
tiny's full 400 steps: at 250 (schedule scaled) DiLoCo had not converged (H=10 +26%, H=50 +31%). One
target is missed at every length tried and is marked so (strict xfail), not loosened. Seven runs of
101-115 s each on the 2-core CPU when lightly loaded; the whole module took 19 min 26 s (2026-12-01)
while another slow suite shared the cores (experiments/comm_efficiency/README.md)."""

import os

import jax
import pytest

import jaxtrain
from jaxtrain.config_files import load_config_file
from tests.fixtures import ROOT

pytestmark = pytest.mark.slow

STEPS = 400  # configs/tiny.py's length; see the module docstring
SCHEMES = {  # name -> overrides on the f32 data-parallel baseline
    "f32_dp": {},
    "int8": {"comm.format": "int8"},
    "int4": {"comm.format": "int4"},
    "int4_ef": {"comm.format": "int4", "comm.error_feedback": "ef"},
    "diloco_h10": {"diloco.inner_steps": 10},
    "diloco_h10_int8": {"diloco.inner_steps": 10, "diloco.format": "int8"},
    "diloco_h50": {"diloco.inner_steps": 50},
}


def scheme_config(name: str):
  cfg = load_config_file(os.path.join(ROOT, "configs", "tiny.py"))
  cfg.optim.warmup_steps = max(1, round(cfg.optim.warmup_steps * STEPS / cfg.train.steps))
  cfg.train.update(steps=STEPS, eval_every=STEPS)  # one eval, at the end, on tiny's eval batches
  cfg.mesh.update(replica=4, data=2)
  cfg.optim.reduce_axis = "replica"
  for key, value in SCHEMES[name].items():
    section, leaf = key.split(".")
    cfg[section][leaf] = value
  return cfg


@pytest.fixture(scope="module")
def eval_loss(tmp_path_factory):
  """Final eval loss of each scheme, trained lazily once per module."""
  done = {}

  def get(name: str) -> float:
    if name not in done:
      workdir = str(tmp_path_factory.mktemp(name))
      final = jaxtrain.train(scheme_config(name), workdir, devices=jax.devices(), progress=False,
                             sync_every_step=True)
      assert final["step"] == STEPS
      done[name] = final["eval_loss"]
    return done[name]
  return get


def relative(eval_loss, name: str, reference: str = "f32_dp") -> float:
  return eval_loss(name) / eval_loss(reference) - 1


def test_int8_is_within_half_a_percent_of_f32(eval_loss):
  assert relative(eval_loss, "int8") <= 0.005


def test_int4_with_error_feedback_is_within_half_a_percent(eval_loss):
  assert relative(eval_loss, "int4_ef") <= 0.005


@pytest.mark.xfail(strict=True, reason="a known miss, measured 2026-12-01: at 400 steps int4+ef ends at 2.5815, int4 "
                   "at 2.5801 (+0.06%; at 250 steps +0.38%); int4 alone already lands on f32 DP and the gap is within "
                   "the run's noise (experiments/comm_efficiency/README.md). Strict: a pass means the target is met")
def test_int4_with_error_feedback_beats_int4_without(eval_loss):
  assert eval_loss("int4_ef") < eval_loss("int4")


def test_diloco_h10_is_within_2_percent(eval_loss):
  assert relative(eval_loss, "diloco_h10") <= 0.02


def test_diloco_h50_is_within_5_percent(eval_loss):
  assert relative(eval_loss, "diloco_h50") <= 0.05


def test_int8_diloco_is_within_half_a_percent_of_f32_diloco(eval_loss):
  assert relative(eval_loss, "diloco_h10_int8", "diloco_h10") <= 0.005
