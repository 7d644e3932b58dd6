"""sample (train/sampling.py): reads only params and `extra` of the newest checkpoint, on one device, with no
mesh, no optimizer and no warning; bad sampling arguments are one line (exit 2 from the CLI)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtrain
from jaxtrain import __main__ as cli, data, optim, parallel
from jaxtrain.checkpoint import pretrained
from jaxtrain.model import Transformer, generate
from jaxtrain.train import workdir as workdir_lib
from tests.fixtures import tiny_config

PROMPT = "< 1 2 3 |"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A tiny MoE run of 3 steps (odd: two sign updates of the expert biases can cancel) on a data=2 x fsdp=4
  mesh: its checkpoint has state (opt_state, extra = the expert biases), data and meta."""
  workdir = str(tmp_path_factory.mktemp("run"))
  cfg = tiny_config(train={"steps": 3}, mesh={"data": 2, "fsdp": -1},
                    model={"n_experts": 4, "top_k": 2, "bias_update_rate": 0.1})
  jaxtrain.train(cfg, workdir, progress=False, sync_every_step=True)
  return workdir


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
  """A one-step dense run on one device (vocab 64, max_seq_len 32, as `trained`): what the argument checks
  read, a few seconds where the MoE run on 8 devices takes ~40."""
  workdir = str(tmp_path_factory.mktemp("dense"))
  jaxtrain.train(tiny_config(train={"steps": 1}, mesh={"data": 1}), workdir, devices=jax.devices()[:1],
                 progress=False, sync_every_step=True)
  return workdir


def reference(workdir, max_new_tokens):
  """Greedy continuation of PROMPT by the saved params and expert biases, with generate called directly."""
  cfg = workdir_lib.load_config(workdir)
  model_cfg, params = pretrained.load_params(workdir)
  extra = pretrained.load_extra(workdir)
  assert np.any(jax.tree.leaves(extra)[0] != 0)  # the biases moved: they change which experts run
  tokenizer = data.make_tokenizer(cfg, workdir)
  prompt_BP = jnp.asarray(np.concatenate([[tokenizer.bos], tokenizer.encode(PROMPT)]), jnp.int32)[None]
  out = np.asarray(generate(Transformer(model_cfg), params, prompt_BP, jax.random.key(0), max_new_tokens, 0.0, 0,
                            extra))[0]
  if tokenizer.eos in out:
    out = out[: list(out).index(tokenizer.eos) + 1]
  return tokenizer.decode(out)


@pytest.mark.slow  # > 10 s: the default suite stays under 10 minutes
def test_sample_reads_params_alone_on_one_device_without_a_word(trained, capfd, monkeypatch):
  """No optimizer is built (its state's shapes are not needed), no mesh either, the config is not
  changed, and nothing is printed (Orbax's read-only warning was printed on every sample)."""
  def refuse(*args, **kwargs):
    raise AssertionError("sample must not build this")

  monkeypatch.setattr(optim, "build", refuse)
  monkeypatch.setattr(parallel, "make_mesh", refuse)
  configs, read_config = [], pretrained.read_config

  def spy(*args):
    cfg = read_config(*args)
    configs.append((cfg, cfg.to_json()))
    return cfg

  monkeypatch.setattr(pretrained, "read_config", spy)
  capfd.readouterr()
  text = jaxtrain.sample(trained, PROMPT, max_new_tokens=6, temperature=0.0, top_k=0)
  out, err = capfd.readouterr()
  assert (out, err) == ("", "")
  assert configs and all(cfg.to_json() == saved for cfg, saved in configs)
  monkeypatch.undo()
  assert text == reference(trained, 6)
  assert jaxtrain.sample(trained, PROMPT, 6, 0.0, 0, devices=jax.devices()[3:4]) == text


@pytest.mark.parametrize("flags, named", [
    (["--top_k", "65"], "top_k=65"),  # vocab_size is 64
    (["--top_k", "-1"], "top_k=-1"),
    (["--temperature", "nan"], "temperature=nan"),
    (["--temperature", "inf"], "temperature=inf"),
    (["--temperature", "-0.5"], "temperature=-0.5"),
    (["--max_new_tokens", "0"], "max_new_tokens=0"),
    (["--max_new_tokens", "27"], "max_seq_len=32"),  # the prompt is 6 tokens
])
def test_bad_sampling_arguments_are_one_line_exit_2(dense, capsys, flags, named):
  rc = cli.main(["sample", "--workdir", dense, "--prompt", PROMPT, "--max_new_tokens", "4", *flags])
  out, err = capsys.readouterr()
  assert rc == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: ") and named in err, err


def test_top_k_equal_to_vocab_and_longest_continuation_are_fine(dense, capsys):
  rc = cli.main(["sample", "--workdir", dense, "--prompt", PROMPT, "--max_new_tokens", "26", "--top_k", "64",
                 "--temperature", "1.0"])
  assert rc == 0 and capsys.readouterr().err == ""
