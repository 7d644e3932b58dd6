"""Target names and what `compile` says before compiling anything: a bad target or a missing extra
is one line and exit status 2. (The compiles themselves: tests/targets, with the extras.)"""

import pytest

from jaxtrain import __main__ as cli
from jaxtrain.aot import targets
from jaxtrain.config import ConfigError


@pytest.mark.parametrize("name, kind, shape, n", [
    ("tpu-v5p:4x4x4", "tpu-v5p", (4, 4, 4), 64), ("tpu-v5e:16x16", "tpu-v5e", (16, 16), 256),
    ("tpu-v6e:8x8", "tpu-v6e", (8, 8), 64), ("h100:8", "h100", (8,), 8),
    ("h200:16", "h200", (16,), 16),
])
def test_parse(name, kind, shape, n):
  target = targets.parse(name)
  assert (target.kind, target.shape, target.n_devices) == (kind, shape, n)


@pytest.mark.parametrize("name, message", [
    ("tpu-v9:2x2", "KIND one of"), ("h100", "KIND one of"), ("tpu-v5p:4xq", "positive integers"),
    ("h100:12", "multiple"), ("tpu-v5e:16", "AxB"), ("h100:2x2", "GPU count"),
])
def test_bad_target_is_a_config_error(name, message):
  with pytest.raises(ConfigError, match=message):
    targets.parse(name)


def test_gpu_may_allocate_what_jax_preallocates(monkeypatch):
  chip = targets.CHIPS["h200"]
  assert chip.usable_bytes == int(chip.hbm_bytes * 0.75)
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
  assert chip.usable_bytes == int(chip.hbm_bytes * 0.9)
  assert targets.CHIPS["tpu-v5p"].usable_bytes == targets.CHIPS["tpu-v5p"].hbm_bytes


def test_cli_bad_target_is_one_line_exit_2(capsys):
  assert cli.main(["compile", "--config=configs/tiny.py", "--target=tpu-v9:2x2"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: --target='tpu-v9:2x2'"), err


@pytest.mark.skipif(targets.available("tpu") is None, reason="libtpu is installed here")
def test_cli_without_the_extra_says_which_to_install(capsys):
  assert cli.main(["compile", "--config=configs/tiny.py", "--target=tpu-v5e:2x2"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == ["error: compiling for TPU needs libtpu: pip install -e '.[tpu]' "
                 "(make test-targets installs it)"], err
