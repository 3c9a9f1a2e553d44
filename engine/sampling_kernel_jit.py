"""The numba kernels of :mod:`engine.sampling_kernel` (the algorithm is described there).

Imported on first use by ``sampling_kernel._compile`` (an ``ImportError`` here means no
numba: ``engine.sampling`` uses its torch code). The functions are module-level on
purpose: numba's on-disk cache keys a function by its bytecode and the pickled contents
of its closure, and a closure holding another jitted function pickles that dispatcher
with a fresh uuid in every process. Defined inside a function (as they were), the
kernels missed the cache at every start, compiled again (~7-15 s here, on the
background thread ``warm_in_background`` starts) and added 11 more files to the cache
directory each time. Globals are not part of the key; numba freezes their values into the
code when it compiles, so the constants below must stay in this file (numba's cache is
stamped with it) and keep the values they had as closure variables.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba.extending import intrinsic

__all__ = ["BINS", "WIDEST", "batch", "masks", "row_stats", "top_dist"]

BINS = 4096  # = sampling_kernel.BINS (tests/engine/test_sampling_kernel.py checks)
WIDEST = 1 / 64  # = sampling_kernel.WIDEST

njit = numba.njit(nogil=True, cache=True)
fast = numba.njit(nogil=True, cache=True, fastmath={"reassoc", "contract", "nsz"})
nbins, widest = BINS, WIDEST
one, half = np.float32(1.0), np.float32(0.5)
# exp(-d) without a table, so without a gather (a table's lookup was one gather a vector;
# AVX2 CPUs whose LLVM model prefers no gathers, Zen 1-3, load its 8 lanes one by one:
# 2.5x slower there, bench/results/*_avx2_class.json): d = k ln2 - r with k = round(d log2 e)
# (Cody-Waite: ln2 in two parts, k ln2_hi exact), e^r by the standard degree-6 minimax
# polynomial of float32 expf (cephes' coefficients), 2^-k written into the exponent bits.
log2e = np.float32(1.4426950408889634)
ln2_hi, ln2_lo = np.float32(0.693359375), np.float32(-2.12194440e-4)
p0, p1, p2, p3, p4, p5 = (
    np.float32(v)
    for v in (
        1.9875691500e-4,
        1.3981999507e-3,
        8.3334519073e-3,
        4.1665795894e-2,
        1.6666665459e-1,
        5.0000001201e-1,
    )
)


@intrinsic
def f32_bits(typingctx, bits):
    """The float32 whose bits are the int32 ``bits`` (a bitcast: free in a vector)."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return numba.types.float32(numba.types.int32), codegen


@fast
def neg_exp(d):
    """exp(-d) for 0 <= d < 64, float32 (within 1.2 ulp of the float64 value; the same bits
    on AVX2 and AVX-512 builds), vectorisable without a gather."""
    k = np.floor(d * log2e + half)
    r = (k * ln2_hi - d) + k * ln2_lo  # -d + k ln2, |r| <= ln2 / 2
    z = r * r
    y = (((((p0 * r + p1) * r + p2) * r + p3) * r + p4) * r + p5) * z + r + one
    return y * f32_bits(np.int32((np.int32(127) - np.int32(k)) << 23))


@njit
def kept(b, t, j, cut_b, cut_t, cut_id):
    return b < cut_b or (b == cut_b and (t > cut_t or (t == cut_t and j >= cut_id)))


@fast
def exps(x, temp, mx, inv_w, e, bins):
    """e = exp(x / temp - mx) and each token's bin (see the module's doc); tokens 64 or
    more below the max need ``far_exps`` after."""
    cap_e = np.float32(63.99)
    cap_b = np.float32(nbins - 0.5) / inv_w
    for j in range(x.shape[0]):
        d = mx - x[j] / temp
        de = d if d < cap_e else cap_e  # a select, not min(): min's NaN rule stops vectorising
        e[j] = neg_exp(de)
        bins[j] = np.uint16(np.int32((d if d < cap_b else cap_b) * inv_w))


@njit
def far_exps(x, temp, mx, e, bins, hits):
    """The true exp of the tokens 64 or more below the max (0 for -inf): all in the last bin, so
    only the blocks of 64 that hold one are read."""
    cap_e = np.float32(63.99)
    vocab = x.shape[0]
    block_hits(bins, nbins - 1, nbins - 1, hits)
    for c in range((vocab + 63) // 64):
        if c < vocab // 64 and hits[c] == 0:
            continue
        for j in range(c * 64, min(vocab, c * 64 + 64)):
            if bins[j] != nbins - 1:
                continue
            t = x[j] / temp
            if mx - t > cap_e:
                e[j] = np.float32(math.exp(np.float32(t - mx))) if t != -np.inf else np.float32(0.0)


@njit
def finite_min(bits):
    """The smallest value of a row other than -inf (its bits as in ``extremes``; -inf
    if there is none): the keys shifted so that -inf's, the least, wraps to the top
    of the unsigned order."""
    shift = np.uint32(2139095040)  # -(key(-inf) + 1)
    lo = np.uint32(0xFFFFFFFF)
    for j in range(bits.shape[0]):
        i = bits[j]
        k = np.int32(i ^ np.int32(np.int32(i >> 31) & np.int32(0x7FFFFFFF)))
        u = np.uint32(np.uint32(k) + shift)
        lo = np.uint32(u if u < lo else lo)
    keys = np.empty(1, dtype=np.int32)
    key = np.int32(np.uint32(lo - shift))
    keys[0] = key ^ ((key >> 31) & 0x7FFFFFFF)
    return keys.view(np.float32)[0]


@njit
def extremes(bits):
    """A row's (max, min, has NaN), from its float32 bits in one vectorised pass: an
    int32 key (the bits, the magnitude's flipped where negative) orders like the
    floats, and integer max/min vectorise where float ones (NaN rules) do not."""
    hi, lo, nan = np.int32(-2147483648), np.int32(2147483647), np.int32(0)
    for j in range(bits.shape[0]):
        i = bits[j]
        k = np.int32(i ^ np.int32(np.int32(i >> 31) & np.int32(0x7FFFFFFF)))
        hi = np.int32(k if k > hi else hi)
        lo = np.int32(k if k < lo else lo)
        nan = np.int32(nan | np.int32(np.int32(i & 0x7FFFFFFF) > np.int32(0x7F800000)))
    keys = np.empty(2, dtype=np.int32)
    keys[0] = hi ^ ((hi >> 31) & 0x7FFFFFFF)
    keys[1] = lo ^ ((lo >> 31) & 0x7FFFFFFF)
    values = keys.view(np.float32)
    return values[0], values[1], nan != 0


@njit
def histogram(e, bins, hm, hc, counts):
    """Each bin's mass (and count, with ``counts``, in the same pass)."""
    hm[:] = 0.0
    if counts:
        hc[:] = 0
        for j in range(e.shape[0]):
            b = bins[j]
            hm[b] += e[j]
            hc[b] += 1
    else:
        for j in range(e.shape[0]):
            hm[bins[j]] += e[j]


@njit
def block_hits(bins, lo_b, hi_b, hits):
    """Per block of 64 tokens, whether one has a bin in lo_b..hi_b (vectorised in 16-bit
    lanes: a fixed trip count from a provably non-negative index, so no gather)."""
    span = np.uint16(hi_b - lo_b)
    lo16 = np.uint16(lo_b)
    for c in range(bins.shape[0] // 64):
        base = c * 64
        h = np.uint16(0)
        for k in range(64):
            h = np.uint16(h | np.uint16(np.uint16(bins[base + k] - lo16) <= span))
        hits[c] = h


@njit
def members(x, temp, bins, lo_b, hi_b, idx, hits):
    """The tokens of bins lo_b..hi_b by value descending, then id descending:
    (ids, values). Only the blocks of 64 that hold one are read token by token."""
    n = 0
    vocab = x.shape[0]
    full = vocab // 64
    block_hits(bins, lo_b, hi_b, hits)
    for j in range(vocab - 1, full * 64 - 1, -1):
        b = bins[j]
        if b >= lo_b and b <= hi_b:
            idx[n] = j
            n += 1
    for c in range(full - 1, -1, -1):
        if hits[c] == 0:
            continue
        for j in range(c * 64 + 63, c * 64 - 1, -1):
            b = bins[j]
            if b >= lo_b and b <= hi_b:
                idx[n] = j
                n += 1
    ids = idx[:n].copy()
    vals = np.empty(n, dtype=np.float32)
    tied = True
    for i in range(n):
        vals[i] = x[ids[i]] / temp
        tied = tied and vals[i] == vals[0]
    if tied:  # one value (a flat row): ids descending is the order already
        return ids, vals
    order = np.argsort(-vals, kind="mergesort")  # stable: ids stay descending among ties
    return ids[order], vals[order]


@njit
def cut(x, temp, k, p, m, inv_w, e, bins, hm, hc, idx, hits):
    """The strictest filter's cut (bin, value, id): token j is kept iff
    ``kept(bins[j], x[j] / temp, j, *cut)``; and the tokens (ids, values) of a
    bin range that holds the cut's bin, if one was gathered (else empty)."""
    vocab = x.shape[0]
    near_ids, near_vals, near_lo, near_hi = idx[:0], np.empty(0, dtype=np.float32), -1, -1
    z = 0.0
    for b in range(nbins):
        z += hm[b]
    cut_b, cut_t, cut_id = nbins, -np.inf, 0
    # top-k: keep every token whose value is >= the k-th largest (ties all kept).
    zk = z
    bk = nbins
    kmass = 0.0  # mass of bin bk's kept tokens
    if 0 < k < vocab:
        count = 0
        bk = 0
        while bk < nbins - 1 and count + hc[bk] < k:
            count += hc[bk]
            bk += 1
        ids, vals = members(x, temp, bins, bk, bk, idx, hits)
        near_ids, near_vals, near_lo, near_hi = ids, vals, bk, bk
        kth = vals[k - count - 1]
        cut_b, cut_t, cut_id = bk, kth, 0
        zk = 0.0
        for b in range(bk):
            zk += hm[b]
        for i in range(vals.shape[0]):
            if vals[i] >= kth:
                kmass += e[ids[i]]
        zk += kmass
    # top-p over what top-k keeps: a token is kept iff the mass before it (in the
    # order) is < p * (top-k's mass).
    if p < 1.0:
        target_p = p * zk
        before = 0.0
        bp = -1
        for b in range(min(bk, nbins - 1) + 1):
            mb = hm[b] if b < bk else kmass
            if before + mb >= target_p:
                bp = b
                break
            before += mb
        if bp >= 0:
            ids, vals = members(x, temp, bins, bp, bp, idx, hits)
            last_t, last_id = vals[0], ids[0]
            for i in range(vals.shape[0]):
                if (bp == bk and vals[i] < cut_t) or before >= target_p:
                    break  # past top-k's cut in its own bin, or past the nucleus
                last_t, last_id = vals[i], ids[i]
                before += e[ids[i]]
            if bp < cut_b or (bp == cut_b and (last_t > cut_t or (last_t == cut_t and last_id > cut_id))):
                cut_b, cut_t, cut_id = bp, last_t, last_id
                near_ids, near_vals, near_lo, near_hi = ids, vals, bp, bp
    # min-p: keep e >= min_p (the top token's e is 1). Bins before the band around
    # -log(min_p) are all kept, bins after it all dropped; the band's tokens are
    # checked one by one.
    if m > 0.0:
        thr = -math.log(m)
        lo_b = min(max(int((thr - 1e-4) * inv_w) - 1, 0), nbins - 1)
        hi_b = min(int((thr + 1e-4) * inv_w) + 1, nbins - 1)
        mb, mt = lo_b, np.inf  # nothing in the band kept: the bins before it only
        ids, vals = members(x, temp, bins, lo_b, hi_b, idx, hits)
        for i in range(ids.shape[0]):
            if e[ids[i]] >= m and (mt == np.inf or vals[i] < mt):
                mb, mt = bins[ids[i]], vals[i]
        if mb < cut_b or (mb == cut_b and mt > cut_t):
            cut_b, cut_t, cut_id = mb, mt, 0
            near_ids, near_vals, near_lo, near_hi = ids, vals, lo_b, hi_b
    if not near_lo <= cut_b <= near_hi:
        near_ids, near_vals = idx[:0], np.empty(0, dtype=np.float32)
    return cut_b, cut_t, cut_id, near_ids, near_vals


@njit
def mark(x, temp, bins, cut_b, cut_t, cut_id, ids, vals, idx, hits):
    """Moves the cut bin's dropped tokens one bin on (to ``cut_b + 1``, a bin nothing
    reads after this), so that token j is kept iff ``bins[j] <= cut_b``. ``ids``,
    ``vals``: tokens of bins around the cut's that ``cut`` gathered (else empty)."""
    if cut_b >= nbins:
        return
    if ids.shape[0] == 0:
        ids, vals = members(x, temp, bins, cut_b, cut_b, idx, hits)
    for i in range(ids.shape[0]):
        if bins[ids[i]] == cut_b and not kept(cut_b, vals[i], ids[i], cut_b, cut_t, cut_id):
            bins[ids[i]] = cut_b + 1


@njit
def kept_block_sums(x, temp, e, bins, cut_b, cut_t, cut_id, sums):
    """Per block of 256 tokens (vocabulary order), the mass of the kept ones (``mark``
    first: token j is kept iff ``bins[j] <= cut_b``), in float32, summed in the order
    the vectorised loop of the kernel before this one summed them (on this AVX-512
    machine: 32 lanes of 8 steps each, lanes j, j + 8, j + 16, j + 24 paired, then
    halved), written out so that seeded draws stay what they were, on every machine.
    Elementwise over the lanes, so LLVM still vectorises it without reassociating."""
    vocab = e.shape[0]
    full = vocab // 256
    acc = np.empty(32, dtype=np.float32)
    v = np.empty(8, dtype=np.float32)
    cb = np.int32(cut_b)  # 32-bit lanes
    zero = np.float32(0.0)
    for i in range(full):
        base = i * 256
        for lane in range(32):  # the step loop unrolls, the lane loop vectorises
            a = e[base + lane] if np.int32(bins[base + lane]) <= cb else zero
            for step in range(1, 8):
                j = base + step * 32 + lane
                a += e[j] if np.int32(bins[j]) <= cb else zero
            acc[lane] = a
        for lane in range(8):
            v[lane] = (acc[lane] + acc[lane + 8]) + (acc[lane + 16] + acc[lane + 24])
        w0, w1, w2, w3 = v[0] + v[4], v[1] + v[5], v[2] + v[6], v[3] + v[7]
        sums[i] = (w0 + w2) + (w1 + w3)
    if full < sums.shape[0]:  # the partial block: the old loop itself, it is short
        start = full * 256
        tail = np.zeros(1)
        partial_block_sum(x[start:], temp, e[start:], bins[start:], cut_b, cut_t, cut_id - start, tail)
        sums[full] = tail[0]


@fast
def partial_block_sum(x, temp, e, bins, cut_b, cut_t, cut_id, sums):
    """The kept mass of fewer than 256 tokens, as the kernel before this one summed a
    row's partial last block (the same code, so LLVM sums in the same order)."""
    vocab = e.shape[0]
    full = vocab // 256
    for i in range(full):
        s = np.float32(0.0)
        base = i * 256
        for k in range(256):
            j = base + k
            b = np.int32(bins[j])
            t = x[j] / temp
            keep = (b < cut_b) | ((b == cut_b) & ((t > cut_t) | ((t == cut_t) & (j >= cut_id))))
            s += e[j] * np.float32(keep)
        sums[i] = s
    if full < sums.shape[0]:
        s = np.float32(0.0)
        for j in range(full * 256, vocab):
            if kept(bins[j], x[j] / temp, j, cut_b, cut_t, cut_id):
                s += e[j]
        sums[full] = s


@njit
def draw(x, temp, e, bins, cut_b, cut_t, cut_id, u, mass):
    """The first token whose kept cumulative mass, in vocabulary order, exceeds u times
    the kept mass (blocks of 256 summed first); never a zero-probability token."""
    vocab = e.shape[0]
    kept_block_sums(x, temp, e, bins, cut_b, cut_t, cut_id, mass)
    total = 0.0
    for i in range(mass.shape[0]):
        total += mass[i]
    target = u * total
    if target >= total:
        target = np.nextafter(total, 0.0)
    c = 0.0
    last_block = -1
    for i in range(mass.shape[0]):
        if mass[i] <= 0:
            continue
        last_block = i
        if c + mass[i] <= target:
            c += mass[i]
            continue
        for j in range(i * 256, min(vocab, i * 256 + 256)):
            if e[j] > 0 and bins[j] <= cut_b:
                c += e[j]
                if c > target:
                    return j
        break  # float rounding between the block's sum and its tokens': its last token
    if last_block < 0:
        return -1
    for j in range(min(vocab, last_block * 256 + 256) - 1, last_block * 256 - 1, -1):
        if e[j] > 0 and bins[j] <= cut_b:
            return j
    return -1


@njit
def prepare(x, bits, mx_raw, mn_raw, temp, e, bins, hm, hc, hits, filtered, counts):
    """Steps 2 and 3 for one row with a finite max; returns 1 / w."""
    mx = mx_raw / temp
    mn = mn_raw / temp
    masked = mn == -np.inf
    if masked:  # -inf (masked) tokens: the bins span the finite ones, their e is 0
        mn = finite_min(bits) / temp  # the same as the smallest finite t (monotone)
        if mn == -np.inf:  # ... unless it overflows: then t by t
            mn = mx
            for j in range(x.shape[0]):
                t = x[j] / temp
                if t < mn and t != -np.inf:
                    mn = t
    far = masked or mx - mn > np.float32(63.99)
    if mx - mn > np.float32(63.99):
        mn = mx - 64  # the bins span what the table covers; the rest share the last
    w = min(widest, (np.float64(mx) - np.float64(mn)) / (nbins - 1))
    if not w > 1e-30:
        w = widest
    inv_w = np.float32(1.0 / w)
    exps(x, temp, mx, inv_w, e, bins)
    if far:
        far_exps(x, temp, mx, e, bins, hits)
    if filtered:
        histogram(e, bins, hm, hc, counts)
    return np.float64(inv_w)


@njit
def batch(x, bits, temps, ks, ps, ms, us, out):
    vocab = x.shape[1]
    e = np.empty(vocab, dtype=np.float32)
    bins = np.empty(vocab, dtype=np.uint16)
    idx = np.empty(vocab, dtype=np.int64)
    hits = np.empty(vocab // 64 + 1, dtype=np.uint16)
    hm = np.empty(nbins)
    hc = np.empty(nbins, dtype=np.int64)
    mass = np.empty((vocab + 255) // 256)
    for r in range(x.shape[0]):
        mx_raw, mn_raw, nan = extremes(bits[r])
        if nan or mx_raw == np.inf or mx_raw == -np.inf:  # NaN, +inf, none finite
            out[r] = -1
            continue
        row, temp, k, p, m = x[r], temps[r], ks[r], ps[r], ms[r]
        filtered = (0 < k < vocab) or p < 1.0 or m > 0.0
        inv_w = prepare(row, bits[r], mx_raw, mn_raw, temp, e, bins, hm, hc, hits, filtered, 0 < k < vocab)
        cut_b, cut_t, cut_id = nbins, -np.inf, 0
        if filtered:
            cut_b, cut_t, cut_id, ids, vals = cut(row, temp, k, p, m, inv_w, e, bins, hm, hc, idx, hits)
            mark(row, temp, bins, cut_b, cut_t, cut_id, ids, vals, idx, hits)
        out[r] = draw(row, temp, e, bins, cut_b, cut_t, cut_id, us[r], mass)


@njit
def masks(x, bits, temps, ks, ps, ms, out):
    vocab = x.shape[1]
    e = np.empty(vocab, dtype=np.float32)
    bins = np.empty(vocab, dtype=np.uint16)
    idx = np.empty(vocab, dtype=np.int64)
    hits = np.empty(vocab // 64 + 1, dtype=np.uint16)
    hm = np.empty(nbins)
    hc = np.empty(nbins, dtype=np.int64)
    for r in range(x.shape[0]):
        row, temp = x[r], temps[r]
        mx_raw, mn_raw, _ = extremes(bits[r])
        inv_w = prepare(row, bits[r], mx_raw, mn_raw, temp, e, bins, hm, hc, hits, True, 0 < ks[r] < vocab)
        cb, ct, ci, ids, vals = cut(row, temp, ks[r], ps[r], ms[r], inv_w, e, bins, hm, hc, idx, hits)
        mark(row, temp, bins, cb, ct, ci, ids, vals, idx, hits)
        for j in range(vocab):
            out[r, j] = e[j] > 0 and bins[j] <= cb


# -- softmax statistics of a row, for a forward pass's scoring slots (engine.slots) --------
SUM_BLOCK = 512  # tokens summed in float32 lanes (vectorised) before a float64 add
MAX_BLOCK = 64  # tokens per block whose max a dist keeps (its candidates)


@fast
def exp_sums(x, temp, mx):
    """(sum e, sum e * d) over a row, e = exp(-d), d = mx - x / temp (mx: the max of
    x / temp). Tokens past 63.99 below the max (under e^-64 of the top one's; -inf
    included) add 0. Float32 sums per block of ``SUM_BLOCK`` tokens, float64 across."""
    cap = np.float32(63.99)
    zero = np.float32(0.0)
    s_all = 0.0
    w_all = 0.0
    n = x.shape[0]
    full = n // SUM_BLOCK
    for c in range(full + 1):
        base = c * SUM_BLOCK
        count = SUM_BLOCK if c < full else n - base
        s = zero
        w = zero
        if temp == one:  # no division (the raw logits' statistics)
            for i in range(count):
                d = mx - x[base + i]
                de = d if d < cap else cap
                e = neg_exp(de)
                e = e if d < cap else zero
                s += e
                w += e * de
        else:
            for i in range(count):
                d = mx - x[base + i] / temp
                de = d if d < cap else cap
                e = neg_exp(de)
                e = e if d < cap else zero
                s += e
                w += e * de
        s_all += s
        w_all += w
    return s_all, w_all


@fast
def exp_sums_keys(x, bits, mx, keys):
    """``exp_sums`` at temperature 1 that also keeps, per block of ``MAX_BLOCK`` tokens,
    the order key (as ``extremes``; ``bits``: the row as int32) of the block's max in
    keys[c] (a dist's candidates), read from each summed block while it is in the cache:
    an integer max vectorises where a float one (NaN rules) does not, even with numba's
    fastmath. (Measured here: 53 us a 151,936-token row, against 66 for the sums and a
    read of their own for the maxima.)"""
    cap = np.float32(63.99)
    zero = np.float32(0.0)
    per = SUM_BLOCK // MAX_BLOCK
    s_all = 0.0
    w_all = 0.0
    n = x.shape[0]
    full = n // SUM_BLOCK
    for c in range(full + 1):
        base = c * SUM_BLOCK
        count = SUM_BLOCK if c < full else n - base
        s = zero
        w = zero
        for i in range(count):
            d = mx - x[base + i]
            de = d if d < cap else cap
            e = neg_exp(de)
            e = e if d < cap else zero
            s += e
            w += e * de
        s_all += s
        w_all += w
        for sub in range(per):
            lo = base + sub * MAX_BLOCK
            if lo >= n:
                break
            part = MAX_BLOCK if lo + MAX_BLOCK <= n else n - lo
            hi = np.int32(-2147483648)
            for i in range(part):
                b = bits[lo + i]
                k = np.int32(b ^ np.int32(np.int32(b >> 31) & np.int32(0x7FFFFFFF)))
                hi = np.int32(k if k > hi else hi)
            keys[c * per + sub] = hi
    return s_all, w_all


@njit
def row_stats(x, bits, mxs, temps, ks, out, keys):
    """Per row r of ``x`` (``bits``: its int32 view; ``mxs[r]``: its max, NaN if it holds
    one): out[r] = (log sum exp(x - max), the entropy of softmax(x) (log s + sum e * d /
    s), and for a dist on the row (ks[r] > 0, at temps[r]) log sum exp(x / temp - max /
    temp)); keys[r]: for such a row, each block's max as an order key (``exp_sums_keys``,
    the dist's candidates). A row whose max is not finite (NaN, +inf, no finite token)
    keeps NaN in out[r]. One read of the row after the max (two for a dist at another
    temperature than 1)."""
    for r in range(x.shape[0]):
        mx = mxs[r]
        if not (-np.inf < mx < np.inf):
            continue
        row = x[r]
        if ks[r] > 0:
            s, w = exp_sums_keys(row, bits[r], mx, keys[r])
        else:
            s, w = exp_sums(row, one, mx)
        out[r, 0] = math.log(s)
        out[r, 1] = math.log(s) + w / s
        temp = temps[r]
        if ks[r] > 0:
            if temp == one:
                out[r, 2] = out[r, 0]
            else:
                out[r, 2] = math.log(exp_sums(row, temp, np.float32(mx / temp))[0])


@njit
def take_top(x, temp, k, cand, n, best_t, best_id):
    """The ``k`` largest x / temp of the tokens ``cand[:n]`` (ids ascending) into
    ``best_t`` / ``best_id``, largest first, equal values by lower id (-inf / -1 pad)."""
    best_t[:] = -np.inf
    best_id[:] = -1
    for i in range(n):  # ids ascending: a later token enters only with a larger value
        t = x[cand[i]] / temp
        if t > best_t[k - 1]:
            at = k - 1
            while at > 0 and best_t[at - 1] < t:
                best_t[at] = best_t[at - 1]
                best_id[at] = best_id[at - 1]
                at -= 1
            best_t[at] = t
            best_id[at] = cand[i]


@njit
def top_dist(x, temp, k, mx_t, log_s, keys, ids_out, probs_out):
    """softmax(x / temp)'s ``k`` most probable tokens into ``ids_out`` / ``probs_out``
    (float32 probabilities; by x / temp descending, equal values by lower id; zeros left
    out); returns how many. ``mx_t``: the max of x / temp, ``log_s``: log sum exp(x / temp
    - mx_t); ``keys``: the row's block maxima as order keys (``row_stats``). The k
    largest block maxima are k tokens, so the row's k-th largest value is at least the
    k-th of them: only the blocks whose max reaches it are read (k of them, more on
    ties). Where the temperature's rounding could make a token below that tie the k-th
    value, the row is read again."""
    nb = keys.shape[0]
    block_bits = np.empty(nb, dtype=np.int32)
    for c in range(nb):
        block_bits[c] = keys[c] ^ ((keys[c] >> 31) & 0x7FFFFFFF)
    block_max = block_bits.view(np.float32)
    top = np.full(k, -np.inf, dtype=np.float32)  # the k largest block maxima, ascending
    for c in range(nb):
        v = block_max[c]
        if v > top[0]:
            i = 0
            while i + 1 < k and top[i + 1] < v:
                top[i] = top[i + 1]
                i += 1
            top[i] = v
    thr = top[0]
    if temp != one:  # a few steps lower: x just below may divide to the same value
        for _ in range(int(temp) + 2):
            thr = np.nextafter(thr, np.float32(-np.inf))
    vocab = x.shape[0]
    hit = 0
    for c in range(nb):
        hit += block_max[c] >= thr
    cand = np.empty(hit * MAX_BLOCK, dtype=np.int64)
    n = 0
    for c in range(nb):
        if block_max[c] >= thr:
            for j in range(c * MAX_BLOCK, min(vocab, c * MAX_BLOCK + MAX_BLOCK)):
                if x[j] >= thr:
                    cand[n] = j
                    n += 1
    best_t = np.empty(k, dtype=np.float32)
    best_id = np.empty(k, dtype=np.int64)
    take_top(x, temp, k, cand, n, best_t, best_id)
    below = np.nextafter(thr, np.float32(-np.inf)) / temp  # the most a token left out can have
    if n < k or not below < best_t[k - 1]:  # read every token that could tie the k-th
        kth = best_t[k - 1]
        cand = np.empty(vocab, dtype=np.int64)
        n = 0
        for j in range(vocab):
            if x[j] / temp >= kth:
                cand[n] = j
                n += 1
        take_top(x, temp, k, cand, n, best_t, best_id)
    norm = np.float64(mx_t) + log_s
    m = 0
    for i in range(k):
        if best_id[i] >= 0:
            p = np.float32(math.exp(np.float64(best_t[i]) - norm))
            if p > 0:
                ids_out[m] = best_id[i]
                probs_out[m] = p
                m += 1
    return m
