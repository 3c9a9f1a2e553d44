#!/usr/bin/env bash
# Download (here, where registries are reachable) exactly the wheels the GPU check needs,
# for CPython 3.12 manylinux x86-64, into an ignored folder carried to the GPU machine.
# That machine has torch 2.11 + CUDA 13, nvcc and ninja, transformers 5.17, no flashinfer.
# - flashinfer-python: the JIT package; its kernels compile there with nvcc (check.sh times it).
#   Its pure-Python deps that the machine may lack are fetched without their own deps
#   (torch/numpy are the machine's own; nvidia-cutlass-dsl is only for the CuTe-DSL kernels
#   we do not use, and is far over the 64 MiB carry limit).
# - transformers is NOT carried: pyproject asks >=5.20, but flashinfer-python 0.7.2.post1 alone
#   is 59 MiB, so transformers (13 MiB) and nvidia-cudnn-frontend (11 MiB) do not fit in the
#   64 MiB carry; check.sh runs against the machine's own transformers 5.17 and reports it.
# av/soundfile/librosa are NOT carried: the CUDA tests use images and text only.
set -euo pipefail
DEST="${1:-.cache/gpu-wheels}"
PIP="${PIP:-.venv/bin/pip}"
mkdir -p "$DEST"
COMMON=(--dest "$DEST" --only-binary=:all: --python-version 3.12 --implementation cp
        --abi cp312 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64
        --platform manylinux_2_17_x86_64 --platform any --no-deps --disable-pip-version-check -q)
"$PIP" download "${COMMON[@]}" flashinfer-python apache-tvm-ffi einops nvidia-ml-py tabulate \

echo "wheels in $DEST:"
ls -l "$DEST"
TOTAL=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
echo "total: $TOTAL bytes ($((TOTAL / 1048576)) MiB); carry limit 64 MiB"
if [ "$TOTAL" -ge $((64 * 1048576)) ]; then echo "over the 64 MiB carry limit" >&2; exit 1; fi
