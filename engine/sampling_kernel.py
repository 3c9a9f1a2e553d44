"""Sampling on the CPU without sorting the vocabulary: one compiled call for every sampled
row of a pass, with per-row temperature, top-k, top-p, min-p and uniform.

Why: a top-p row sorted all of its 151,936 logits (16 ms a row here, 0.5 s for a pass of
32 contexts), and a model with random weights, whose rows are nearly flat, keeps ~130k of
them in its nucleus, so taking the top 1024 candidates first would not help it either.
This kernel reads each row a few times, in order, and sorts only a few dozen tokens:

1. the row's max and min (one vectorised pass over its bits as ordered integers, which
   also finds NaNs); ``t = logits / T`` as torch divides (float32);
2. ``e = exp(t - max)`` and each token's bin, ``floor((max - t) / w)`` of 4096 equal-width
   bins (``w`` = the row's range / 4095, at most 1/64; what falls past the last bin
   shares it), vectorised: ``exp(-d) = 2^-k * e^r`` with ``k = round(d log2 e)`` and a
   degree-6 polynomial for ``|r| <= ln2 / 2`` (within 1.2 ulp, float32, as torch's own exp
   is; no table, so no gather: the same speed on AVX2 CPUs that load a gather's lanes one
   by one); the few tokens with ``d`` past 64 get a true exp);
3. a histogram of the bins' masses (and counts, for top-k);
4. each filter is a cut in the tokens' order (value descending, then id descending):
   top-k walks the bins' counts, top-p their masses (over what top-k keeps), min-p the
   bins around ``-log(min_p)``; only the tokens of the bin where a cut falls are
   gathered (a vectorised test per block of 64 bin indices, then the blocks that hold
   one token by token) and sorted,
   and the strictest cut wins (every filter keeps an upper set of that order); the cut
   bin's dropped tokens are then moved one bin on, so that "kept" is ``bin <= cut bin``;
5. the draw: the first token, in vocabulary order, whose kept cumulative mass exceeds
   ``u`` times the kept mass (block sums first, then one block token by token): the same
   inverse-CDF draw as ``engine.sampling``'s torch code, so a seeded row draws the same
   token unless ``u`` falls within float rounding of a step of the CDF. The block sums
   add in a fixed order, the one this kernel's earlier, auto-vectorised loop used here,
   so seeded draws are the same as before it (and no longer depend on the machine's
   vector width).

What is kept is what ``engine.sampling.probs`` keeps (transformers' warper chain), up to
float rounding at a top-p or min-p boundary, and one rule where transformers has none:
tokens with equal logits that straddle a top-p boundary are kept highest id first
(transformers' unstable sort keeps whichever it meets). Without numba, ``available()``
is False and ``engine.sampling`` uses its torch code.

Speed (``bench/sampling_kernel.py``, results in ``bench/results/sampling_kernel_cpu.json``):
a flat 151,936-token top-p row costs ~0.17-0.2 ms of one core here (was ~0.3); a call of
two or more rows samples half of them on a second thread (``SPLIT_ROWS``), ~0.1 ms a row
of wall time at 32 rows. What is left is mostly step 2 (the exp) and step 3 (a
scatter-add per token, ~1 cycle each): every pass is exact, so neither can be skipped.

``RowSoftmax`` gives a forward pass's scoring slots (``engine.slots``: logprob(s),
entropy, dist) each row's softmax statistics with the same exp: numpy's max, then
one compiled read of the row for log-sum-exp and entropy (~45 us for 151,936 tokens
here), and for a dist only the 64-token blocks whose max can hold its top k.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

BINS = 4096
WIDEST = 1 / 64
"""The widest bin, in units of logit / T: rows spanning more than 64 units put what lies
past 64 (probabilities under e^-64 of the top one's) into the last bin."""
SPLIT_ROWS = 2
"""From this many rows a call samples half of them on a second thread (the kernel holds no
GIL), where the process may use two or more cores: the calls come after a pass's forward,
when its cores are free (here, 2 shared cores: 32 flat top-p rows ~0.22 -> ~0.11 ms a row
of wall time; a handoff costs ~0.03 ms, so 2 rows gain already)."""
_lock = threading.Lock()
_kernels = None
_failed = False
_warm_thread: threading.Thread | None = None
_helper: tuple[int, ThreadPoolExecutor] | None = None  # (pid, executor): not a forked parent's


def available() -> bool:
    """Whether the compiled kernel is usable here (numba imports and compiles)."""
    return _get() is not None


def warm_in_background() -> None:
    """Compile (or load from numba's on-disk cache) both kernels on a daemon thread, once
    per process, so the first sampled request does not wait for it (a model's runner
    calls this when it is made). Here (2 shared cores): 7-15 s with an empty cache, the
    first time the kernels' source (``engine/sampling_kernel_jit.py``) is run; ~0.5 s
    from the cache at every later start. :func:`wait_warm` waits for it."""
    global _warm_thread
    with _lock:
        if _warm_thread is not None:
            return
        _warm_thread = threading.Thread(target=_warm, name="pie-sampling-kernel-warm", daemon=True)
        _warm_thread.start()  # under the lock: wait_warm never sees it unstarted


def wait_warm(timeout: float | None = None) -> bool:
    """Wait (at most ``timeout`` seconds) for :func:`warm_in_background`'s thread; True
    when it is done or was never started (the kernels then compile on their first call)."""
    thread = _warm_thread
    if thread is None or thread is threading.current_thread():
        return True
    thread.join(timeout)
    return not thread.is_alive()


def _warm() -> None:
    """Every kernel called once, with the argument types a pass gives it (the sampler's,
    and ``RowSoftmax``'s at temperature 1 and another)."""
    if available():
        x = torch.zeros(1, 8)
        one = np.ones(1)
        sample_rows(x, one, one.astype(np.int64), one * 0.5, one * 0.1, one * 0.5)
        kept_masks(x, one, one.astype(np.int64), one * 0.5, one * 0.1)
        rows = x.numpy()
        RowSoftmax(rows, [(1.0, 1)]).top(0, 1.0, 1)
        RowSoftmax(rows, [(0.5, 1)]).top(0, 0.5, 1)


def sample_rows(
    logits: torch.Tensor,
    temperature: np.ndarray,
    top_k: np.ndarray,
    top_p: np.ndarray,
    min_p: np.ndarray,
    u: np.ndarray,
) -> np.ndarray:
    """One token per row of ``logits`` ((B, V) CPU): temperature (> 0), top_k (0: none),
    top_p (1: none), min_p (0: none), u (one U[0, 1) draw per row). Returns (B,) int64;
    -1 marks a row that cannot be sampled (NaN, +inf, or no finite logit)."""
    kernels = _get()
    assert kernels is not None, "sample_rows needs numba (check available())"
    x = _rows(logits)
    n = x.shape[0]
    out = np.empty(n, dtype=np.int64)
    args = (x, x.view(np.int32), *_params(temperature, top_k, top_p, min_p), np.asarray(u, np.float64), out)
    helper = _second_thread() if n >= SPLIT_ROWS else None
    if helper is None:
        if n:
            kernels["batch"](*args)
        return out
    half = n // 2
    first = helper.submit(kernels["batch"], *(a[:half] for a in args))
    kernels["batch"](*(a[half:] for a in args))
    first.result()
    return out


def kept_masks(
    logits: torch.Tensor, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray
) -> np.ndarray:
    """(B, V) bool: the tokens ``sample_rows`` may draw (nonzero probability after the
    filters), for rows with a finite max (what the tests compare with the definitions)."""
    kernels = _get()
    assert kernels is not None, "kept_masks needs numba (check available())"
    x = _rows(logits)
    out = np.zeros(x.shape, dtype=np.bool_)
    kernels["masks"](x, x.view(np.int32), *_params(temperature, top_k, top_p, min_p), out)
    return out


class RowSoftmax:
    """The softmax statistics of rows of logits: each row's max (numpy's), log sum exp(x -
    max), the entropy of softmax(x), and for a row with a dist that dist's normaliser at
    its temperature and its block maxima (``sampling_kernel_jit.row_stats``: one read of
    the row after the max, with the exp of ``sample_rows`` and float32 sums per
    block of 512 tokens, float64 across). ``x``: (R, V) float32, C-contiguous;
    ``dists[r]``: the (temperature > 0, k) of a dist on row r, or None. A row whose max is
    not finite (NaN, +inf, all -inf) has ``ok[r]`` False: the caller answers it another
    way."""

    def __init__(self, x: np.ndarray, dists: list[tuple[float, int] | None]):
        kernels = _get()
        assert kernels is not None, "RowSoftmax needs numba (check available())"
        rows, vocab = x.shape
        self._x = x
        self._temps = np.ones(rows, dtype=np.float32)
        self._ks = np.zeros(rows, dtype=np.int64)
        for r, d in enumerate(dists):
            if d is not None and d[0] > 0 and d[1] > 0:
                self._temps[r], self._ks[r] = d
        mx = x.max(axis=1) if vocab else np.full(rows, np.nan, dtype=np.float32)  # NaN where one is
        out = np.full((rows, 3), np.nan)
        self._block_keys = np.empty((rows, -(-vocab // 64)), dtype=np.int32)
        if vocab:
            kernels["row_stats"](x, x.view(np.int32), mx, self._temps, self._ks, out, self._block_keys)
        self._mx = mx
        self._out = out
        self.ok: list[bool] = np.isfinite(out[:, 0]).tolist()
        self.mx: list[float] = mx.tolist()
        self.log_s: list[float] = out[:, 0].tolist()
        self.entropy: list[float] = out[:, 1].tolist()

    def top(self, r: int, temperature: float, k: int) -> tuple[list[int], list[float]]:
        """softmax(row r / temperature)'s ``k`` most probable tokens (0 < k <= vocabulary,
        temperature > 0, ``ok[r]``), most probable first (by logit, equal logits by lower
        id), float32 probabilities, zeros left out."""
        temp = np.float32(temperature)
        if not (self._ks[r] > 0 and self._temps[r] == temp):  # not the one summed with the row
            return RowSoftmax(self._x[r : r + 1], [(temperature, k)]).top(0, temperature, k)
        kernels = _get()
        assert kernels is not None
        row = self._x[r]
        ids = np.empty(k, dtype=np.int64)
        probs = np.empty(k, dtype=np.float32)
        mx_t = np.float32(self._mx[r] / temp)
        n = kernels["top_dist"](row, temp, k, mx_t, self._out[r, 2], self._block_keys[r], ids, probs)
        return ids[:n].tolist(), probs[:n].tolist()


def _second_thread() -> ThreadPoolExecutor | None:
    """The thread that samples half of a large call's rows (made once), or None where this
    process may run on one core only."""
    global _helper
    pid = os.getpid()
    if (_helper is None or _helper[0] != pid) and len(os.sched_getaffinity(0)) > 1:
        with _lock:
            if _helper is None or _helper[0] != pid:
                _helper = (pid, ThreadPoolExecutor(max_workers=1, thread_name_prefix="pie-sampling-kernel"))
    return _helper[1] if _helper is not None and _helper[0] == pid else None


def _rows(logits: torch.Tensor) -> np.ndarray:
    """The rows as float32 numpy (contiguous)."""
    return logits.detach().to(torch.float32).contiguous().numpy()


def _params(temperature, top_k, top_p, min_p) -> tuple[np.ndarray, ...]:
    return (
        np.asarray(temperature, dtype=np.float32),
        np.asarray(top_k, dtype=np.int64),
        np.asarray(top_p, dtype=np.float64),
        np.asarray(min_p, dtype=np.float64),
    )


def _get():
    global _kernels, _failed
    if _kernels is not None or _failed:
        return _kernels
    with _lock:
        if _kernels is None and not _failed:
            try:
                _kernels = _compile()
            except Exception:  # numba missing or unable to compile here: the torch path
                _failed = True
    return _kernels


def _compile():
    """The kernels by name (:mod:`engine.sampling_kernel_jit`; each compiled, or loaded
    from numba's on-disk cache, on its first call). Raises ImportError without numba."""
    import numba

    from engine import sampling_kernel_jit as k

    return {name: fn for name, fn in vars(k).items() if isinstance(fn, numba.core.registry.CPUDispatcher)}
