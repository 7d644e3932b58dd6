#!/usr/bin/env bash
# Fills .whl/ with the wheels benchmarks/device_checks.sh (and device_moe.sh) install on the device
# tool's GPU machine: one H200, Python 3.12, jax 0.11.2 and most of our dependencies in its image,
# no network. It lacks grain and what grain imports (array_record, portpicker), ml_collections and
# tensorboardX; flax, optax and orbax-checkpoint travel at this repo's pins rather than the image's;
# nvidia-ml-py is the `gpu` extra (NVML board power for jaxtrain/train/goodput.py). Every other
# dependency of these is in the image (checked against the wheels' Requires-Dist, 2026-12).
# Versions: constraints.txt's pins; nvidia-ml-py, which constraints.txt does not pin, is pinned
# here.
#
#   bash tools/device_wheels.sh          # here, where pip reaches PyPI (~7 MiB)
#
# .whl/ is gitignored: a device run takes it only when it names it, run(..., carry=[".whl"]).
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES="grain array_record portpicker ml_collections tensorboardX flax optax orbax-checkpoint"
NVML_PIN="nvidia-ml-py==13.615.71"
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

pin() {  # pin NAME: its NAME==VERSION line of constraints.txt (- and _ alike, any case)
  grep -i -m1 -E "^$(echo "$1" | sed 's/[-_]/[-_]/g')==" constraints.txt
}

specs=()
for p in $PACKAGES; do
  specs+=("$(pin "$p" || { echo "constraints.txt pins no $p" >&2; exit 1; })")
done
specs+=("$(pin nvidia-ml-py || echo "$NVML_PIN")")
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")  # pip matches each manylinux tag exactly: name them all
done

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "downloading: ${specs[*]}"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d "$tmp" "${specs[@]}"
mkdir -p .whl
rm -f .whl/*.whl  # one version of each: two of one package stop the whole install there
mv "$tmp"/*.whl .whl/
ls -1 .whl
du -sh .whl
git check-ignore -q .whl/x.whl || echo "warning: .whl/ is not gitignored: add /.whl/ to it" >&2
