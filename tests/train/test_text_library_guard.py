"""A script without `if __name__ == "__main__":` that calls jaxtrain.train on a text corpus with
prepare workers: it must run once, start a bounded number of processes, and finish.

With multiprocessing's spawn, every tokenizer worker re-imported the script as __mp_main__, which ran its
jaxtrain.train call again, failed to start workers while bootstrapping, and the pool respawned it forever.
"""

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.fixtures import ROOT

SCRIPT = '''\
import json, os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
with open({runs!r}, "a") as f:  # every execution of this top level, in any process
  f.write(f"{{os.getpid()}}\\n")
starts = []
sys.addaudithook(lambda event, args: starts.append(str(list(args[1] or [""])[-1]))  # the last argument
                 if event == "subprocess.Popen" else None)
import jaxtrain
cfg = jaxtrain.get_config({config!r})
cfg.model.update(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64, max_seq_len=32)
cfg.data.update(path={corpus!r}, prepare_workers=2)
cfg.train.update(steps=2, batch_size=4, seq_len=16, log_every=1, eval_every=2, eval_batches=1)
cfg.optim.update(warmup_steps=1)
final = jaxtrain.train(cfg, {workdir!r}, progress=False)
print(json.dumps({{"loss": final["loss"], "eval_loss": final["eval_loss"], "starts": starts}}))
'''


@pytest.mark.slow  # ~26 s on 2 cores: the default suite stays under 10 minutes
def test_unguarded_script_trains_text_with_prepare_workers(tmp_path):
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for i in range(24):  # 2.4 MB: 3 shards of >= 1 MiB, so 2 workers start
    (corpus / f"{i:02d}.txt").write_text(f"file {i}: " + "the quick brown fox jumps over the lazy dog. " * 2200)
  runs = tmp_path / "runs.txt"
  script = tmp_path / "unguarded.py"
  script.write_text(SCRIPT.format(runs=str(runs), config=os.path.join(ROOT, "configs", "text_tiny.py"),
                                  corpus=str(corpus), workdir=str(tmp_path / "run")))
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env={**env, "PYTHONPATH": ROOT},
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
  try:
    out, err = proc.communicate(timeout=300)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)  # the script and every process it started
    out, err = proc.communicate()
  executions = runs.read_text().split()
  assert proc.returncode == 0 and len(executions) == 1, (proc.returncode, len(executions), err[-3000:])
  result = json.loads(out.strip().splitlines()[-1])
  assert result["starts"] == ["jaxtrain.data.workers"] * 2, result  # two tokenizer workers, nothing else
  report = json.load(open(tmp_path / "run" / "data_cache" / "report.json"))
  assert (report["files"], report["kept"], report["sources"][0]["shards"]) == (24, 24, 3)
  assert result["loss"] > 0 and result["eval_loss"] > 0
