"""8 virtual CPU devices for every test, set before jax is imported; one compilation cache per test
run; XLA's optimizations off but for the tests marked `optimized`."""

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

# Most tests compile small programs and run them for a few steps: XLA:CPU's LLVM optimizations are
# most of their time (the tiny VLM's init: 14.3 s to compile, 3.1 s without them), so they are off,
# here and in the processes tests start. Results are compared within a run, or to references with
# tolerances, never to figures recorded with other flags. Tests whose subject is speed, or that run
# long enough for the slower code to cost more than compiling saves (tiny's convergence: 198 s
# optimized, 342 s not), are marked `optimized`; JAXTRAIN_TEST_OPTIMIZE=1 optimizes every test.
_OPTIMIZE_ALL = os.environ.get("JAXTRAIN_TEST_OPTIMIZE", "") == "1"
if not _OPTIMIZE_ALL:
  os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"

import jax  # noqa: E402
import pytest  # noqa: E402

from tests.fixtures import tiny_config  # noqa: E402


def pytest_sessionfinish(session):
  if _OWN_CACHE and not hasattr(session.config, "workerinput"):  # the run's own process, after its workers
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(autouse=True)
def _xla_optimizations(request, monkeypatch):
  """XLA's optimizations on for a test marked `optimized` (and the processes it starts), off for the
  rest; jax's in-memory caches are dropped only when that changes (the persistent cache's key holds
  it), so that consecutive tests of one kind keep their traces."""
  optimize = _OPTIMIZE_ALL or request.node.get_closest_marker("optimized") is not None
  if optimize and not _OPTIMIZE_ALL:
    monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "0")
  if jax.config.read("jax_disable_most_optimizations") == optimize:
    jax.config.update("jax_disable_most_optimizations", not optimize)
    jax.clear_caches()


@pytest.fixture
def cfg():
  return tiny_config()
