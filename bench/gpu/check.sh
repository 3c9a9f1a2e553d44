#!/usr/bin/env bash
# One command on the GPU machine: install the carried wheels, run the CUDA tests, then the
# GPU benchmark; results (JSON + printed table) go to OUT_DIR (default bench/results/).
#   bench/gpu/check.sh [--dry-run] [OUT_DIR]
# --dry-run (runs anywhere): checks the scripts parse, the wheels folder layout, that the
# project imports, and that the CUDA tests collect; then stops where a GPU is needed.
set -euo pipefail
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUT_DIR="${1:-bench/results}"
WHEELS="${GPU_WHEELS:-.cache/gpu-wheels}"
PY="${PY:-$(command -v python3)}"
[ -x .venv/bin/python ] && [ "$DRY" = 1 ] && PY=.venv/bin/python
mkdir -p "$OUT_DIR"
step() { echo "== $*"; }

step "scripts parse"
bash -n bench/gpu/check.sh bench/gpu/fetch_wheels.sh
"$PY" -m py_compile tests/engine/test_cuda.py

step "wheels folder $WHEELS"
if ! ls "$WHEELS"/flashinfer_python-*.whl >/dev/null 2>&1; then
  echo "missing: $WHEELS/flashinfer_python-*.whl (run bench/gpu/fetch_wheels.sh here first)" >&2
  exit 2
fi
for w in "$WHEELS"/*.whl; do "$PY" -m zipfile -l "$w" >/dev/null || { echo "bad wheel $w" >&2; exit 2; }; done
ls "$WHEELS"

if [ "$DRY" = 0 ]; then
  step "install carried wheels (no index)"
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" flashinfer-python
fi

step "project imports (torch, transformers versions as found)"
PYTHONPATH=. "$PY" - <<'PY'
import torch, transformers
import engine, media, encoders  # noqa: F401
print(f"torch {torch.__version__} cuda={torch.cuda.is_available()} transformers {transformers.__version__}")
PY

step "collect the CUDA tests"
PYTHONPATH=. "$PY" -m pytest -q --collect-only -p no:cacheprovider tests/engine/test_cuda.py | tail -3

if [ "$DRY" = 1 ] || ! PYTHONPATH=. "$PY" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "STOP: a CUDA GPU is needed from here on (CUDA tests, JIT compile, GPU benchmark)"
  exit 0
fi

export FLASHINFER_WORKSPACE_BASE="$PWD/.cache/flashinfer-jit"   # JIT kernels cached in the run dir
mkdir -p "$FLASHINFER_WORKSPACE_BASE"
step "flashinfer JIT warm-up"
T0=$(date +%s)
PYTHONPATH=. "$PY" -m pytest -q -p no:cacheprovider tests/engine/test_attention_flashinfer.py -x 2>&1 | tail -5 || true
echo "JIT compile + flashinfer tests took $(( $(date +%s) - T0 )) s"

step "CUDA test suite"
PYTHONPATH=. "$PY" -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py \
  --junitxml "$OUT_DIR/cuda_tests.xml" 2>&1 | tail -20 || true

step "GPU benchmark"
if [ -f bench/gpu/bench.py ]; then
  PYTHONPATH=. "$PY" bench/gpu/bench.py --out "$OUT_DIR/gpu_bench.json"
else
  echo "bench/gpu/bench.py not written yet"
fi
