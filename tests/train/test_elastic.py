"""Elastic restore: a checkpoint from 8 devices (2 data x 4 fsdp) continues on 4 and on 2 devices."""

import os
import shutil

import jax
import numpy as np
import pytest

import jaxtrain
from jaxtrain import metrics
from tests.fixtures import tiny_config


def config(**mesh):
  return tiny_config(train=dict(steps=3, eval_every=0), checkpoint=dict(every_steps=2),
                     mesh=dict(rules="fsdp", **{"data": 1, "fsdp": 1, **mesh}))


@pytest.mark.slow  # keeps the default suite under 10 minutes on 2 cores; CI runs the slow set too
def test_restore_on_another_mesh_and_device_count_continues_the_same_run(tmp_path):
  original = str(tmp_path / "original")
  jaxtrain.train(config(data=2, fsdp=4), original, progress=False, sync_every_step=True)
  step3 = [r for r in metrics.read_metrics(original) if "loss" in r][-1]
  assert step3["step"] == 3

  for name, mesh, n in [("fsdp4", dict(fsdp=4), 4), ("data2", dict(data=2), 2)]:
    run = str(tmp_path / name)
    shutil.copytree(original, run)
    shutil.rmtree(os.path.join(run, "checkpoints", "3"))  # as if stopped after step 2
    os.remove(os.path.join(run, "metrics.jsonl"))
    jaxtrain.train(config(**mesh), run, devices=jax.devices()[:n], progress=False, sync_every_step=True)
    rows = [r for r in metrics.read_metrics(run) if "loss" in r]
    assert [r["step"] for r in rows] == [3], name
    np.testing.assert_allclose(rows[0]["loss"], step3["loss"], rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(rows[0]["grad_norm"], step3["grad_norm"], rtol=1e-4, err_msg=name)
