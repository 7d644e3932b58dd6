"""The workdir through the CLI: a run is checked against its newest checkpoint's own config (config.json or not),
and one workdir holds one training run at a time (WORKDIR/.lock)."""

import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest

from jaxtrain import metrics
from jaxtrain.__main__ import main
from tests.fixtures import ROOT

CONFIG = """
from tests.fixtures import tiny_config


def get_config(arg=None):
  return tiny_config(train=dict(steps={steps}, eval_every=0), checkpoint=dict(keep=5))
"""


def config_file(tmp_path, steps: int = 2) -> str:
  path = tmp_path / f"tiny_{steps}.py"
  path.write_text(CONFIG.format(steps=steps))
  return str(path)


def train(capsys, config: str, workdir: str, *overrides) -> tuple[int, list[str]]:
  """The CLI's exit status and its stderr lines (after clearing what earlier calls printed)."""
  capsys.readouterr()
  code = main(["train", f"--config={config}", f"--workdir={workdir}", "--no_sample", *overrides])
  return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.slow  # one short training (~20-70 s on 2 shared cores), then two refusals
def test_a_workdir_without_config_json_is_checked_against_its_newest_checkpoint(tmp_path, capsys):
  config, workdir = config_file(tmp_path), str(tmp_path / "run")
  assert train(capsys, config, workdir)[0] == 0
  os.remove(os.path.join(workdir, "config.json"))  # lost, or never copied with the checkpoints

  # Another seed would have resumed the old run silently: refused, one line naming the difference.
  code, err = train(capsys, config, workdir, "--config.train.seed=1")
  assert code == 2 and len(err) == 1, err
  assert err[0] == (f"error: {workdir} holds a run of another config (train.seed: 0 -> 1); rerun with --start_over "
                    "to replace it, or use another --workdir"), err
  # Another d_model: the same one line (not a traceback from the restore), and config.json not rewritten.
  code, err = train(capsys, config, workdir, "--config.model.d_model=64")
  assert code == 2 and len(err) == 1 and "(model.d_model: 32 -> 64)" in err[0], err
  assert not os.path.exists(os.path.join(workdir, "config.json"))
  assert [r["step"] for r in metrics.read_metrics(workdir) if "loss" in r] == [1, 2]  # nothing ran since
