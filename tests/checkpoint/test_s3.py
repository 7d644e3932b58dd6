"""The persistent tier on S3 (`checkpoint.dir=s3://bucket/run`), against a real S3 server: moto's, started
by this module as its own process on a local port. The fast tier stays on local disk."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import jaxtrain
from jaxtrain import checkpoint, metrics
from jaxtrain.config import ConfigError
from jaxtrain.train import workdir as workdir_lib
from tests.checkpoint.test_manager import final_params, losses
from tests.fixtures import ROOT, tiny_config

pytest.importorskip("moto.server", reason="moto[s3] (the test extra) runs the local S3 server")
boto3 = pytest.importorskip("boto3")

BUCKET = "jaxtrain-test"
KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3():
  """A moto S3 server on 127.0.0.1 holding BUCKET, and the AWS credentials it takes in the environment; yields
  (endpoint URL, boto3 client). No request leaves this machine."""
  port = free_port()
  server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  url = f"http://127.0.0.1:{port}"
  with pytest.MonkeyPatch.context() as env:
    for key, value in KEYS.items():
      env.setenv(key, value)
    for key in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
      env.delenv(key, raising=False)
    client = boto3.client("s3", endpoint_url=url)
    deadline = time.time() + 60
    while True:
      try:
        client.create_bucket(Bucket=BUCKET)
        break
      except Exception:  # not listening yet
        if time.time() > deadline or server.poll() is not None:
          server.kill()
          raise
        time.sleep(0.2)
    try:
      yield url, client
    finally:
      server.send_signal(signal.SIGTERM)
      server.wait(timeout=30)


def keys(client, prefix: str) -> list[str]:
  pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
  return sorted(o["Key"][len(prefix):] for page in pages for o in page.get("Contents", []))


def steps(client, prefix: str) -> dict[int, bool]:
  """{step: committed} of the step directories under s3://BUCKET/prefix/."""
  found = {}
  for key in keys(client, prefix + "/"):
    head, _, rest = key.partition("/")
    if head.isdigit():
      found[int(head)] = found.get(int(head), False) or rest == "commit_success.txt"
  return found


def uploading(client, prefix: str, after: int, arrays: bool) -> int | None:
  """An odd step newer than `after` whose upload is in flight (no commit_success.txt yet), with `arrays` one
  whose state item has begun."""
  found = {}
  for key in keys(client, prefix + "/"):
    head, _, rest = key.partition("/")
    if head.isdigit() and int(head) > after and int(head) % 2:
      found.setdefault(int(head), set()).add(rest)
  return next((s for s, rest in sorted(found.items()) if "commit_success.txt" not in rest
               and (not arrays or any(r.startswith("state/") for r in rest))), None)


def copy_prefix(client, src: str, dst: str, skip_step: int | None = None):
  for key in keys(client, src + "/"):
    if skip_step is None or not key.startswith(f"{skip_step}/"):
      client.copy_object(Bucket=BUCKET, Key=f"{dst}/{key}", CopySource={"Bucket": BUCKET, "Key": f"{src}/{key}"})


def config(url, prefix, fast_dir, **mesh):
  return tiny_config(train=dict(steps=3, eval_every=0),
                     checkpoint=dict(dir=f"s3://{BUCKET}/{prefix}", s3_endpoint=url, every_steps=2,
                                     fast_dir=fast_dir, fast_every_steps=1),
                     mesh=dict(rules="fsdp", **{"data": 1, "fsdp": 1, **mesh}))


def test_checkpoints_round_trip_through_s3_onto_another_mesh(s3, tmp_path):
  """Saved from 8 devices, the fast tier on local disk; the S3 tier keeps its newest 2 steps, commits each with
  commit_success.txt, and restores bitwise onto a 2 x 2 mesh of 4 devices."""
  url, client = s3
  k = tiny_config(checkpoint=dict(dir=f"s3://{BUCKET}/unit", s3_endpoint=url, keep=2, fast_dir=str(tmp_path / "fast"),
                                  fast_every_steps=1)).checkpoint
  ckpts = checkpoint.Checkpoints(k, str(tmp_path / "run"))
  mesh8 = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "fsdp"))
  spec = jax.sharding.PartitionSpec("fsdp", "data")
  def tree(step):
    return {"w": np.arange(64.0, dtype=np.float32).reshape(8, 8) * step, "step": np.int32(step)}
  for step in (1, 2, 3):
    state = {"w": jax.device_put(tree(step)["w"], jax.sharding.NamedSharding(mesh8, spec)), "step": tree(step)["step"]}
    ckpts.save(step, state, {"position": step}, {"config": {}}, tiers=ckpts.persistent())
    ckpts.wait()
  assert [(r.step, r.tier, r.error) for r in ckpts.finished_saves()] == [(s, "persistent", None) for s in (1, 2, 3)]
  ckpts.close()
  assert steps(client, "unit") == {2: True, 3: True}
  assert {"3/commit_success.txt", "3/state/commit_success.txt", "3/state/manifest.ocdbt",
          "3/data/process_0.json"} <= set(keys(client, "unit/"))

  ckpts = checkpoint.Checkpoints(k, str(tmp_path / "run"), read_only=True)
  assert ckpts.latest()[0] == 3 and ckpts.latest()[1].name == "persistent"
  mesh4 = jax.sharding.Mesh(np.array(jax.devices()[4:]).reshape(2, 2), ("a", "b"))
  shardings = {"w": jax.sharding.NamedSharding(mesh4, jax.sharding.PartitionSpec("b", "a")),
               "step": jax.sharding.NamedSharding(mesh4, jax.sharding.PartitionSpec())}
  abstract = {"w": jax.ShapeDtypeStruct((8, 8), np.float32), "step": jax.ShapeDtypeStruct((), np.int32)}
  state, data, _, row = ckpts.restore(abstract, shardings)
  ckpts.close()
  assert state["w"].sharding == shardings["w"] and data == {"position": 3} and row["tier"] == "persistent"
  np.testing.assert_array_equal(np.asarray(state["w"]), tree(3)["w"])
  assert int(state["step"]) == 3


@pytest.mark.slow  # two trainings, 19-78 s on 2 shared cores
def test_s3_round_trip_resumes_on_another_device_count(s3, tmp_path):
  """Saved on 8 devices (2 data x 4 fsdp), the fast tier on local disk lost: the S3 tier's step 2 continues on
  4 devices to the loss of the uninterrupted run's step 3."""
  url, client = s3
  original = str(tmp_path / "original")
  jaxtrain.train(config(url, "original", str(tmp_path / "fast"), data=2, fsdp=4), original, progress=False,
                 sync_every_step=True)
  assert steps(client, "original") == {2: True, 3: True}  # the end is a forced persistent save
  assert "2/state/manifest.ocdbt" in keys(client, "original/")  # arrays through TensorStore's s3 driver
  saves = [(r["step"], r["tier"]) for r in metrics.read_metrics(original) if r.get("event") == "checkpoint_save"]
  assert saves == [(1, "fast"), (2, "fast"), (2, "persistent"), (3, "persistent")]
  step3 = [r for r in metrics.read_metrics(original) if "loss" in r][-1]

  # Another machine: the workdir without its metrics, no fast tier, the S3 tier as if stopped after step 2.
  run = str(tmp_path / "fsdp4")
  os.makedirs(run)
  copy_prefix(client, "original", "fsdp4", skip_step=3)
  jaxtrain.train(config(url, "fsdp4", str(tmp_path / "fast4"), fsdp=4), run, devices=jax.devices()[:4],
                 progress=False, sync_every_step=True)
  rows = metrics.read_metrics(run)
  assert [(r["step"], r["tier"]) for r in rows if r.get("event") == "checkpoint_restore"] == [(2, "persistent")]
  trained = [r for r in rows if "loss" in r]
  assert [r["step"] for r in trained] == [3]
  np.testing.assert_allclose(trained[0]["loss"], step3["loss"], rtol=1e-5)
  np.testing.assert_allclose(trained[0]["grad_norm"], step3["grad_norm"], rtol=1e-4)
  assert steps(client, "fsdp4") == {2: True, 3: True}


def test_the_start_refuses_an_unusable_s3_tier_with_one_line(s3, tmp_path, monkeypatch):
  url, client = s3
  def check(**k):
    cfg = tiny_config(checkpoint={"dir": f"s3://{BUCKET}/probe", "s3_endpoint": url, **k})
    workdir_lib.check_workdir(cfg, str(tmp_path / "run"), start_over=False)

  check()  # reachable, found, writable: and nothing is left behind
  assert keys(client, "probe") == []
  with pytest.raises(ConfigError, match=rf"^checkpoint tier persistent at s3://{BUCKET}/probe: cannot reach the "
                                        r"S3 endpoint http://127.0.0.1:1 \(.*\)$"):
    check(s3_endpoint="http://127.0.0.1:1")
  with pytest.raises(ConfigError, match=r"^checkpoint tier persistent at s3://no-such-bucket/run: bucket "
                                        rf"'no-such-bucket' does not exist at {url}$"):
    workdir_lib.check_workdir(tiny_config(checkpoint=dict(dir="s3://no-such-bucket/run", s3_endpoint=url)),
                              str(tmp_path / "run"), start_over=False)
  for key in KEYS:
    monkeypatch.delenv(key)
  monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
  monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
  monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to ask for
  for key in ("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
    monkeypatch.delenv(key, raising=False)
  with pytest.raises(ConfigError, match=r"^checkpoint tier persistent at s3://.*: no AWS credentials found \("):
    check()


def test_cli_exits_2_before_training_when_the_bucket_is_missing(s3, tmp_path):
  url, _ = s3
  env = {**os.environ, "PYTHONPATH": ROOT, "AWS_ENDPOINT_URL": url}
  env.pop("XLA_FLAGS", None)
  workdir = str(tmp_path / "run")
  done = subprocess.run([sys.executable, "-m", "jaxtrain", "train", f"--config={ROOT}/configs/tiny.py",
                         f"--workdir={workdir}", "--config.checkpoint.dir=s3://no-such-bucket/run", "--no_sample"],
                        env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 2, done.stderr[-3000:]
  assert done.stderr.strip() == (f"error: checkpoint tier persistent at s3://no-such-bucket/run: bucket "
                                 f"'no-such-bucket' does not exist at {url}")
  assert not os.path.exists(os.path.join(workdir, "metrics.jsonl"))  # nothing trained


# ---- kill -9 while a step is being uploaded ----

def command(workdir, prefix, steps=30):
  return [sys.executable, "-m", "jaxtrain", "train", f"--config={ROOT}/configs/tiny.py", f"--workdir={workdir}",
          f"--config.train.steps={steps}", "--config.train.log_every=1", "--config.train.eval_every=0",
          "--config.train.batch_size=8", "--config.train.seq_len=32", "--config.model.d_model=32",
          "--config.model.d_ff=64", "--config.optim.warmup_steps=1", f"--config.checkpoint.dir=s3://{BUCKET}/{prefix}",
          f"--config.checkpoint.fast_dir={workdir}/fast", "--config.checkpoint.fast_every_steps=2",
          "--config.checkpoint.every_steps=3", "--no_sample"]


@pytest.mark.slow  # four starts of a training process, ~1-2 min on 2 cores
def test_kill_9_mid_upload_leaves_the_newest_complete_step_and_the_rest_is_cleaned(s3, tmp_path, monkeypatch):
  url, client = s3
  monkeypatch.setenv("AWS_ENDPOINT_URL", url)  # the endpoint from the environment, here and in the runs
  env = {**os.environ, "PYTHONPATH": ROOT}
  env.pop("XLA_FLAGS", None)
  workdir, prefix = str(tmp_path / "killed"), "killed"
  cut = []  # the uncommitted step each kill left
  for attempt in range(3):
    proc = subprocess.Popen(command(workdir, prefix), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    give_up, partial = time.time() + 240, None
    while proc.poll() is None and time.time() < give_up and partial is None:
      # A newer step each time, one the fast tier does not hold (its row is logged when it is trained again); the
      # first kill as soon as the step appears, the others once its arrays are being written.
      partial = uploading(client, prefix, max(cut, default=0), arrays=attempt > 0)
      time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if partial is not None and not steps(client, prefix).get(partial, True):
      cut.append(partial)
      # A reader now lists only committed steps: the newest complete one, never the half-uploaded one.
      ckpts = checkpoint.Checkpoints(tiny_config(checkpoint=dict(dir=f"s3://{BUCKET}/{prefix}")).checkpoint,
                                     workdir, read_only=True)
      persistent = ckpts.persistent()[0].manager.all_steps()
      ckpts.close()
      assert partial not in persistent
      assert sorted(persistent) == sorted(s for s, committed in steps(client, prefix).items() if committed)
  assert cut == [3, 9, 15], cut  # every kill hit an upload in flight
  done = subprocess.run(command(workdir, prefix), env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  assert not re.search(r"^(\w+:(absl|orbax)|[IWEF]\d{4} )", done.stderr, re.M), done.stderr[-3000:]  # no AWS logs
  assert all(steps(client, prefix).values())  # the half-uploaded steps were removed or written again in full
  got = losses(workdir)
  assert sorted(got) == list(range(1, 31))
  for step, values in got.items():  # a step trained again after a restart logs the same loss
    assert len(set(values)) == 1, (step, values)
  step, params = final_params(workdir)  # the newest step, read back from S3
  assert step == 30
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))
