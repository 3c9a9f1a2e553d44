#!/usr/bin/env bash
# Run a command as if on an AVX2-class x86 CPU (AMD Zen 3: AVX2 + FMA, no AVX-512), on a
# machine that has AVX-512 (e.g. this Zen 5 class EPYC):
#
#     bench/avx2_class.sh .venv/bin/python bench/host_overhead.py --overlap off ...
#
# What it emulates: the instruction set every library picks at run time.
#   torch (ATen)  ATEN_CPU_CAPABILITY=avx2: its AVX2 kernels (check:
#                 torch.backends.cpu.get_cpu_capability() == "AVX2");
#   MKL, oneDNN   their AVX2 code paths (MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA);
#   numba         code generated for znver3 (tuning model and features: AVX2, no AVX-512,
#                 no GFNI / AVX-VNNI); its on-disk cache keys entries by CPU name and
#                 features, and lives in a directory of its own here besides, so an
#                 AVX-512 build is never loaded (check: no "zmm" in fn.inspect_asm(sig));
#                 (LLVM's znver3 model also prefers no gathers: table look-ups become
#                 scalar loads and inserts, as a real Zen 3 build's do);
#   numpy         its AVX-512 dispatch targets off (X86_V4, AVX512_ICL, AVX512_SPR:
#                 numpy.show_runtime() lists found: X86_V3 only); its OpenBLAS on Haswell
#                 kernels (what it picks for Zen anyway);
#   glibc         memcpy/memset/str* and libm ifuncs without their AVX-512 (EVEX) variants
#                 (ld.so --list-diagnostics: the x86-64-v4 hwcaps subdir inactive).
# What it cannot: everything that is the silicon, not the instruction set. The caches
# (here 48 KiB L1d / 1 MiB L2 per core, 32 MiB L3; Zen 3: 32 KiB / 512 KiB), the clock,
# the memory, branch prediction and what each AVX2 instruction costs stay this machine's:
# a real Zen 3 runs the same code (numba's znver3 build is what numba makes there) with
# its own, mostly lower, throughput, and with half the L2 for a 151,936-token row's working
# set (row, exps, bins: ~1.5 MB, past either L2). So figures made with this wrapper show what the
# AVX2 code paths cost on Zen 5 silicon: most likely a lower bound for a real Zen 3. Code
# compiled once for a fixed baseline (CPython, the tokenizers' Rust) runs the same either way.
set -euo pipefail

export ATEN_CPU_CAPABILITY=avx2
export MKL_ENABLE_INSTRUCTIONS=AVX2
export ONEDNN_MAX_CPU_ISA=AVX2
export DNNL_MAX_CPU_ISA=AVX2
export NUMBA_CPU_NAME=znver3
# Zen 3's features as LLVM names them: this machine's (llvmlite's host features) with
# AVX-512, AVX-VNNI and GFNI off. Without an explicit list numba would pair znver3 with
# the host's features, AVX-512 included.
NUMBA_CPU_FEATURES="+64bit,+adx,+aes,+avx,+avx2,+bmi,+bmi2,+clflushopt,+clwb,+clzero"
NUMBA_CPU_FEATURES+=",+cmov,+crc32,+cx16,+cx8,+f16c,+fma,+fsgsbase,+fxsr,+invpcid,+lzcnt"
NUMBA_CPU_FEATURES+=",+mmx,+movbe,+pclmul,+popcnt,+prfchw,+rdpid,+rdrnd,+rdseed,+sahf,+sha"
NUMBA_CPU_FEATURES+=",+shstk,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+sse4a,+ssse3,+vaes"
NUMBA_CPU_FEATURES+=",+vpclmulqdq,+xsave,+xsavec,+xsaveopt,+xsaves"
NUMBA_CPU_FEATURES+=",-avx512f,-avx512bw,-avx512cd,-avx512dq,-avx512vl,-avx512bf16"
NUMBA_CPU_FEATURES+=",-avx512bitalg,-avx512ifma,-avx512vbmi,-avx512vbmi2,-avx512vnni"
NUMBA_CPU_FEATURES+=",-avx512vp2intersect,-avx512vpopcntdq,-avx512fp16,-avxvnni,-gfni"
export NUMBA_CPU_FEATURES
# A cache of its own (AVX2_CLASS_NUMBA_CACHE to choose it): never the AVX-512 build's files.
export NUMBA_CACHE_DIR="${AVX2_CLASS_NUMBA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/numba-avx2-class}"
export NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL AVX512_SPR"
export OPENBLAS_CORETYPE=Haswell
export GLIBC_TUNABLES="glibc.cpu.hwcaps=-AVX512F,-AVX512CD,-AVX512BW,-AVX512DQ,-AVX512VL,-AVX_VNNI"

exec "$@"
