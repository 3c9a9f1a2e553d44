"""What keys that isolate cost a request, on the server's own code: identifying the key
(a sha256 and a constant-time compare against every key), the per-key limits (token
buckets, a stream slot) and the tenant-scoped store look-ups, against the decode step of
the tiny model that every generated token pays. Printed per request, in microseconds, for
1, 100 and 1000 keys; saved to bench/results/key_limits_cpu.json.

    .venv/bin/python bench/key_limits.py
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from api.http.security.key_limits import KeyLimiter
from api.http.security.keys import ApiKeys, parse_key_file
from api.http.security.tenancy import Caller
from api.http.stores.files import FileStore


def _per_call_us(fn, n: int = 2000, repeat: int = 7) -> float:
    best = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(best)


def main() -> None:
    out: dict = {"machine": f"{platform.processor() or platform.machine()}, 2 shared cores", "keys": {}}
    for count in (1, 100, 1000):
        text = "".join(
            f'[[keys]]\nname = "k{i}"\nkey = "sk-bench-{i:06d}"\nrequests_per_minute = 1000000\n'
            f"max_concurrent_streams = 1000\n\n"
            for i in range(count)
        )
        named, _ = parse_key_file(text)
        keys = ApiKeys(named=named)
        header = f"Bearer sk-bench-{count - 1:06d}"
        caller = keys.identify(header)
        limiter = KeyLimiter()

        def admit(c: Caller = caller, lim: KeyLimiter = limiter) -> None:
            lim.admit(c, generation=True)
            lim.release(c)

        out["keys"][count] = {
            "identify_us": round(_per_call_us(lambda h=header, k=keys: k.identify(h)), 2),
            "limits_us": round(_per_call_us(admit), 2),
        }
    with tempfile.TemporaryDirectory() as tmp:
        files = FileStore(Path(tmp))
        for i in range(200):
            files.add(b"x", filename=f"{i}", purpose="batch", tenant=f"t{i % 10}")
        some = files.list(1)[0][0].id
        out["store_get_us"] = {
            "admin": round(_per_call_us(lambda: files.get(some), n=500), 2),
            "tenant": round(_per_call_us(lambda: files.get(some, scope="t3"), n=500), 2),
        }
        files.close()
    from api.model_ref import load_model
    from engine import Sampler, SyncContext, max_tokens

    model = load_model("tiny", device="cpu")
    ctx = SyncContext(model)
    ctx.user("Count to ten.").cue()
    ctx.generate(Sampler.greedy(), max_tokens(4))
    t0 = time.perf_counter()
    n = ctx.generate(Sampler.greedy(), max_tokens(32)).tokens
    step_us = (time.perf_counter() - t0) / max(1, len(n)) * 1e6
    out["tiny_decode_step_us"] = round(step_us, 1)
    per_request = (
        out["keys"][100]["identify_us"] + out["keys"][100]["limits_us"] + out["store_get_us"]["tenant"]
    )
    out["keyed_request_over_one_decode_step"] = round(per_request / step_us, 4)
    for count, row in out["keys"].items():
        print(f"{count:>5} keys: identify {row['identify_us']:8.2f} us   limits {row['limits_us']:6.2f} us")
    print(
        f"store get by id: admin {out['store_get_us']['admin']} us, tenant-scoped {out['store_get_us']['tenant']} us"
    )
    print(
        f"tiny model decode step: {step_us:.0f} us; a keyed request's extra work (100 keys) = "
        f"{100 * out['keyed_request_over_one_decode_step']:.2f}% of one step"
    )
    dest = ROOT / "bench" / "results" / "key_limits_cpu.json"
    dest.write_text(json.dumps(out, indent=2) + "\n")
    print(f"saved {dest.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
