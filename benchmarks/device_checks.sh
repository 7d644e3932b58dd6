#!/usr/bin/env bash
# Every GPU check in one run of under 10 minutes on the device tool's machine (one H200, jax 0.11.2,
# Python 3.12, 16 cores, no network). Packages its image lacks travel as wheels in .whl/ (grain,
# array_record, portpicker, ml_collections, tensorboardX, nvidia-ml-py, and this repo's pinned
# flax/optax/orbax): fill it here with `bash tools/device_wheels.sh`, then run
#   run(command="bash benchmarks/device_checks.sh", carry=[".whl"], timeout_s=600)
# Results land in $OUT (6 files: summary.txt, kernel_checks.txt, train_step.md, attention.md,
# fp8_loss.md, stderr.log; the tool brings back at most 8); the summary prints last. Copy the figures
# into benchmarks/RESULTS.md. Exit status 1 when any step failed or ran out of its time.
#
# Budget: each step runs under its own timeout (a hang costs that step, not the run), capped by
# what is left of BUDGET_S = 570 s; the steps run in order of value (the kernels' numerics first, the
# fp8 comparison last), so a late step gets what the earlier ones left. Limits, from the H200 run of
# 2026-12-04 (what each used then in brackets; the kernel checks ran out of 60 s limits and took
# 118 s + 148 s on their own, ~50 Triton and XLA compiles a config):
#   install wheels                                             30 s  (1 s)
#   environment (nvidia-smi, versions, one NVML read)          20 s  (5 s)
#   kernel numerics, gpt2_small and llama_1b shapes           270 s  (266 s as two processes)
#   train step gpt2_small, batch 16 x 1024, 20 steps, energy,  60 s  (31 s)
#     attention xla and pallas side by side, one process
#   train step llama_1b shortened: 4 of its 16 layers,         70 s  (40 s)
#     batch 8 x 2048, 10 steps, energy, xla and pallas
#   attention op, llama_1b heads (32/8 of 64, bf16),           50 s  (39 s)
#     fwd+bwd at 1024/2048/4096 tokens x 4 rows
#   fp8 vs bf16: gpt2_small, 2 runs of 20 steps, 8 x 1024     70 s  (50 s)
#   summary                                                    ~1 s
# Run it with timeout_s=600. Keep $OUT to the files below: the tool brings back 8 at most.
# DRY=1 runs the same steps with tiny settings on whatever backend is there, without installing
# wheels; LIMIT_SCALE multiplies every limit and the budget (a check of this script on 2 CPU cores:
# JAX_PLATFORMS=cpu PYTHON=.venv/bin/python DRY=1 LIMIT_SCALE=4 OUT=/tmp/dry bash benchmarks/device_checks.sh).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
PYTHON=${PYTHON:-python3}
DRY=${DRY:-0}
LIMIT_SCALE=${LIMIT_SCALE:-1}
BUDGET_S=$((570 * LIMIT_SCALE))
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
STATUS=/tmp/device_checks_status.txt
: > "$SUMMARY"; : > "$STATUS"; : > "$OUT/stderr.log"
rm -f /tmp/device_checks_*.err
export PYTHONUNBUFFERED=1
FAILED=0

step() {  # step NAME SECONDS OUTFILE COMMAND...: COMMAND under its own timeout, stdout to OUTFILE
  local name=$1 limit=$(($2 * LIMIT_SCALE)) out=$3 t0=$SECONDS left rc
  shift 3
  left=$((BUDGET_S - SECONDS))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 10 ]; then
    printf '%-26s skipped: %d s of the budget left\n' "$name" "$left" | tee -a "$STATUS"
    FAILED=1
    return 1
  fi
  echo "=== $name: $*" >> "$OUT/stderr.log"
  timeout -k 5 "$limit" "$@" >> "$out" 2> "/tmp/device_checks_$name.err"
  rc=$?
  grep -v "^W[0-9]\{4\}\|Involuntary\|^WARNING: All log messages" "/tmp/device_checks_$name.err" >> "$OUT/stderr.log"
  [ "$rc" -ne 0 ] && FAILED=1
  printf '%-26s rc %3d%s  %3d s of %3d s\n' "$name" "$rc" "$([ "$rc" -eq 124 ] && echo ' (timed out)')" \
    $((SECONDS - t0)) "$limit" | tee -a "$STATUS"
  return $rc
}

# ---- install and environment ----
if [ "$DRY" = 1 ]; then
  export PYTHONPATH=$PWD
  GPT2=(--configs tiny --batch_size 2 --steps 2 --set train.seq_len=32 --vary model.attention=xla,pallas)
  LLAMA=(--configs tiny --batch_size 2 --steps 2 --set model.n_layers=1 --set train.seq_len=32
         --vary model.attention=xla,pallas)
  ATTN=(--config tiny --lengths 64,128 --batch_size 1 --steps 2)
  FP8=(--config tiny --steps 4 --batch_size 2 --seq_len 32)
else
  ls .whl/*.whl > /dev/null 2>&1 || { echo "no wheels in .whl/: run tools/device_wheels.sh here first" | tee -a "$SUMMARY"; exit 1; }
  step install 30 /dev/stdout "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl || { tail -5 /tmp/device_checks_install.err; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
  GPT2=(--configs gpt2_small --batch_size 16 --steps 20 --vary model.attention=xla,pallas)
  LLAMA=(--configs llama_1b --batch_size 8 --steps 10 --set model.n_layers=4 --vary model.attention=xla,pallas)
  ATTN=(--config llama_1b --lengths 1024,2048,4096 --batch_size 4 --steps 10)
  FP8=(--config gpt2_small --steps 20 --batch_size 8 --seq_len 1024)
fi
{
  echo "# device checks $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  { nvidia-smi --query-gpu=name,memory.total,driver_version,power.limit --format=csv,noheader; } 2>&1 | head -2
} >> "$SUMMARY"
step environment 20 "$SUMMARY" "$PYTHON" -c "
import sys, jax, flax, optax, orbax.checkpoint as o
print('python', sys.version.split()[0], '| jax', jax.__version__, jax.devices(), '| flax', flax.__version__,
      '| optax', optax.__version__, '| orbax', o.__version__)
try:
  import pynvml; pynvml.nvmlInit()
  print('NVML: board power now', pynvml.nvmlDeviceGetPowerUsage(pynvml.nvmlDeviceGetHandleByIndex(0)) / 1e3, 'W')
except Exception as e:
  print('NVML: not available:', type(e).__name__, e)"

# ---- 1. kernel and attention numerics against their references ----
if [ "$DRY" = 1 ]; then
  step kernels 70 "$OUT/kernel_checks.txt" "$PYTHON" benchmarks/kernel_checks.py --small
else
  step kernels 270 "$OUT/kernel_checks.txt" "$PYTHON" benchmarks/kernel_checks.py --configs gpt2_small,llama_1b
fi

# ---- 2. train-step MFU (datasheet bf16 peak) and NVML energy of the timed steps ----
step train_step_gpt2 60 "$OUT/train_step.md" "$PYTHON" benchmarks/train_step.py "${GPT2[@]}" --energy
step train_step_llama 70 "$OUT/train_step.md" "$PYTHON" benchmarks/train_step.py "${LLAMA[@]}" --energy

# ---- 3. the attention implementations against each other (the op, forward + backward) ----
step attention 50 "$OUT/attention.md" "$PYTHON" benchmarks/attention_impls.py --op \
  --impls xla,blockwise,cudnn,pallas "${ATTN[@]}"

# ---- 4. fp8 vs bf16: loss per step and step time, and the loop's own energy row ----
rm -rf /tmp/fp8
step fp8 70 "$OUT/fp8_loss.md" "$PYTHON" benchmarks/fp8_loss.py "${FP8[@]}" --workdir /tmp/fp8

# ---- summary ----
{
  echo; echo "## steps (rc, seconds used of the limit; budget ${BUDGET_S} s, ${SECONDS} s used)"
  cat "$STATUS"
  echo; echo "## kernel numerics (FAIL lines, then the counts; all lines in kernel_checks.txt)"
  grep "^FAIL" "$OUT/kernel_checks.txt" 2>/dev/null | cut -c1-220
  grep -E "^[0-9]+ passed, [0-9]+ failed" "$OUT/kernel_checks.txt" 2>/dev/null
  echo; echo "## train step (MFU against the datasheet's bf16 peak)"
  grep -E "datasheet|^\| (gpt2_small|llama_1b|tiny) " "$OUT/train_step.md" 2>/dev/null
  echo; echo "## attention op (fwd+bwd)"
  grep -E "^\| [0-9]+ \|" "$OUT/attention.md" 2>/dev/null
  echo; echo "## fp8 vs bf16"
  grep -E "^\| (off|current)|^per-step" "$OUT/fp8_loss.md" 2>/dev/null
  echo; echo "## the loop's own NVML energy (fp8_loss's bf16 run, its goodput row: compile and save included)"
  "$PYTHON" -c "
import json, sys
rows = [json.loads(l) for l in open('/tmp/fp8/fp8_off/metrics.jsonl') if l.strip()]
last = [r for r in rows if 'goodput_wall_s' in r][-1]
print({k: round(last[k], 4) for k in ('energy_j', 'power_w', 'joules_per_token', 'goodput_wall_s') if k in last}
      if 'energy_j' in last else 'no energy columns: the loop found no NVML')" 2>&1 | tail -1
  for f in /tmp/device_checks_*.err; do
    name=$(basename "$f" .err); name=${name#device_checks_}
    grep -q "^$name .* rc   0 " "$STATUS" && continue
    echo; echo "## stderr of $name (last lines)"
    grep -v "^W[0-9]\{4\}\|Involuntary\|^WARNING" "$f" | tail -4 | cut -c1-300
  done
} >> "$SUMMARY"
cat "$SUMMARY"
exit $FAILED
