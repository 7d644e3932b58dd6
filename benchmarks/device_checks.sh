#!/usr/bin/env bash
# Every GPU check of this stop in one run (the device tool's machine: one H200, jax 0.11.2, Python 3.12).
# Packages that machine lacks travel as wheels in .whl/ (grain, ml_collections, tensorboardX, and this
# repo's pinned flax/optax/orbax). Results land in $OUT; copy the figures into benchmarks/RESULTS.md.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import jax, flax, optax, orbax.checkpoint as o, sys; print(sys.version); print('jax', jax.__version__, jax.devices()); print('flax', flax.__version__, 'optax', optax.__version__, 'orbax', o.__version__)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# 1. train-step MFU against the datasheet bf16 peak
timeout 130 python3 benchmarks/train_step.py --steps 10 --configs gpt2_small --batch_size 16 > "$OUT/train_step.md" 2> "$OUT/train_step.err"
tail -12 "$OUT/train_step.md"
# 2. MoE: dense vs coarse vs fine-grained experts at one active size, on a GPU-sized model
timeout 130 python3 benchmarks/moe.py --steps 3 --rounds 2 --scale --no_hlo > "$OUT/moe.md" 2> "$OUT/moe.err"
tail -12 "$OUT/moe.md"
# 3. checkpoint cost of gpt2_small's state (1.5 GB) against its step and the local disk
timeout 100 python3 benchmarks/checkpoint.py --config gpt2_small --batch_size 16 --saves 3 --steps 3 --dir /tmp > "$OUT/checkpoint.md" 2> "$OUT/checkpoint.err"
tail -6 "$OUT/checkpoint.md"
# 4. the CPU test suite's fast half under jax 0.11.2 (16 cores, 8 virtual devices)
JAX_PLATFORMS=cpu timeout 110 python3 -m pytest -q -p no:cacheprovider -m "not slow" \
  tests/test_moe_train.py tests/test_step.py tests/test_parallel.py tests/test_preemption.py \
  tests/test_checkpoint.py tests/test_train.py > "$OUT/pytest.log" 2>&1
tail -15 "$OUT/pytest.log"
for f in "$OUT"/*.err; do echo "== $f"; grep -v "^W1130\|Involuntary\|^WARNING" "$f" | tail -5; done
