"""8 virtual CPU devices for every test, set before jax is imported; one compilation cache per test run."""

import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Many test files compile the same small programs (the tiny model's step on the same meshes): a persistent
# compilation cache, made here in the process that starts the run and inherited by its xdist workers and
# the subprocesses tests start, compiles each once per run. Fresh for every run (deleted at its end), so
# a run's time never depends on an earlier one. A cache hit is the same executable: results are unchanged.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxtrain-test-jax-cache-")
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import pytest  # noqa: E402

from tests.fixtures import tiny_config  # noqa: E402


def pytest_sessionfinish(session):
  if _OWN_CACHE and not hasattr(session.config, "workerinput"):  # the run's own process, after its workers
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.fixture
def cfg():
  return tiny_config()
