#!/usr/bin/env bash
# The MoE dispatch on the device tool's GPU (one H200, jax 0.11.2, Python 3.12): coarse vs fine-grained
# capacity dispatch and the dropless "tiles" grouped matmul at benchmarks/moe.py --scale size.
# Wheels the machine lacks travel in .whl/ (see device_checks.sh). Results land in $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout ${MOE_TIMEOUT:-170} python3 benchmarks/moe.py --scale --no_hlo --steps 3 --rounds 2 --only ${MOE_ONLY:-1,2,5,4} \
  2>&1 | grep -v "^W1\|Involuntary\|^WARNING" | tee "$OUT/moe_scale.md"
