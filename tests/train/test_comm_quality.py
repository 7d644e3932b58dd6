"""Communication-efficient training keeps its quality: configs/tiny.py trained as replica=4 x data=2 with
the same seed and batches under each scheme, final eval loss against float32 data parallelism's.

Targets (the comm issue's): int8 within 0.5%; int4 with error feedback within 0.5% and better than int4
without; DiLoCo H=10 within 2%, H=50 within 5%; int8 DiLoCo within 0.5% of float32 DiLoCo. The run is
tiny's full 400 steps: at 250 (schedule scaled) DiLoCo had not converged (H=10 +26%, H=50 +31%). "int4
with error feedback better than without" is checked at step 100, in the copy-learning transition, where the
schemes differ far beyond float noise; at the end both sit on tiny's plateau within 0.06% of each other, an
order that flips with the CPU's rounding (int4+ef behind on a Xeon, ahead on an AMD EPYC). Seven runs of
101-115 s each on the 2-core CPU when lightly loaded; the whole module took 19 min 26 s (2026-12-01)
while another slow suite shared the cores (experiments/comm_efficiency/README.md)."""

import os

import jax
import pytest

import jaxtrain
from jaxtrain.config_files import load_config_file
from tests.fixtures import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.long]  # 19-23 min as a module: `make test-long`

STEPS = 400  # configs/tiny.py's length; see the module docstring
MID = 100  # within the copy-learning transition (experiments/comm_efficiency/README.md)
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
  cfg.train.update(steps=STEPS, eval_every=MID)  # on tiny's eval batches at MID's multiples and the end
  cfg.mesh.update(replica=4, data=2)
  cfg.optim.reduce_axis = "replica"
  for key, value in SCHEMES[name].items():
    section, leaf = key.split(".")
    cfg[section][leaf] = value
  return cfg


@pytest.fixture(scope="module")
def eval_losses(tmp_path_factory):
  """{step: eval loss} of each scheme's run, trained lazily once per module."""
  done = {}

  def get(name: str) -> dict:
    if name not in done:
      workdir = str(tmp_path_factory.mktemp(name))
      final = jaxtrain.train(scheme_config(name), workdir, devices=jax.devices(), progress=False,
                             sync_every_step=True)
      assert final["step"] == STEPS
      done[name] = {r["step"]: r["eval_loss"] for r in jaxtrain.read_metrics(workdir, as_frame=False)
                    if "eval_loss" in r}
      assert done[name][STEPS] == final["eval_loss"]
    return done[name]
  return get


@pytest.fixture(scope="module")
def eval_loss(eval_losses):
  """Final eval loss of each scheme."""
  return lambda name: eval_losses(name)[STEPS]


def relative(eval_loss, name: str, reference: str = "f32_dp") -> float:
  return eval_loss(name) / eval_loss(reference) - 1


def test_int8_is_within_half_a_percent_of_f32(eval_loss):
  assert relative(eval_loss, "int8") <= 0.005


def test_int4_with_error_feedback_is_within_half_a_percent(eval_loss):
  assert relative(eval_loss, "int4_ef") <= 0.005


def test_int4_with_error_feedback_beats_int4_without(eval_losses):
  # at MID (measured on a Xeon: int4 4.734, int4+ef 4.440, float32 DP 3.827, its float-reassociation twin 3.885)
  assert eval_losses("int4_ef")[MID] < eval_losses("int4")[MID]


def test_diloco_h10_is_within_2_percent(eval_loss):
  assert relative(eval_loss, "diloco_h10") <= 0.02


def test_diloco_h50_is_within_5_percent(eval_loss):
  assert relative(eval_loss, "diloco_h50") <= 0.05


def test_int8_diloco_is_within_half_a_percent_of_f32_diloco(eval_loss):
  assert relative(eval_loss, "diloco_h10_int8", "diloco_h10") <= 0.005
