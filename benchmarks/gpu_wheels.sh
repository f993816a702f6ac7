#!/usr/bin/env bash
# Download the Python wheels the GPU machine lacks (cp312, manylinux x86-64) into the
# git-ignored .whl/ folder, for `run(..., carry=[".whl"])` (docs/gpu.md). Run from the repo root
# on a machine with network access: `bash benchmarks/gpu_wheels.sh` (or `make gpu-wheels`).
#
# The versions are the ones this repo is developed against (the generated stubs in
# proto/pdserve/v1 need protobuf >= 7.35.1 and grpcio >= 1.85.1, so both travel too: the GPU
# machine's own may be older). One version of each package: two stop the install there.
# No ray: the kit launches plain processes (--no-ray). redis is small and travels so that no
# import path can miss it; the kit's clusters use the in-memory prefix index.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=(
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
  grpcio==1.85.3
  grpcio-health-checking==1.85.1
  grpcio-reflection==1.85.1
  protobuf==7.36.2
  cryptography==50.0.2
  cffi==2.1.1
  pycparser==3.12
  redis==8.1.0
)
mkdir -p .whl
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
  manylinux1_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64; do
  PLATFORMS+=(--platform "$p")
done
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${PLATFORMS[@]}" -d .whl "${WHEELS[@]}"
# Keep exactly the listed versions (an older download of another version would stop the
# install on the device).
for f in .whl/*.whl; do
  base=$(basename "$f" | tr '[:upper:]' '[:lower:]')
  ok=0
  while read -r k; do
    n=${k%_*}; v=${k##*_}
    [[ $base == "${n//-/_}-${v}-"* ]] && ok=1
  done <<<"$(printf '%s\n' "${WHEELS[@]}" | tr '[:upper:]' '[:lower:]' | sed 's/==/_/')"
  if [[ $ok == 0 ]]; then echo "removing $f (not in the list)"; rm -f "$f"; fi
done
ls -1 .whl
du -sh .whl
