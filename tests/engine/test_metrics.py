"""``model.metrics()``: counters that follow the work done."""

from __future__ import annotations

from engine import CompletionParams, Model, Turn, complete, run_sync
from engine.metrics import Histogram


def test_metrics_follow_a_completion(tiny_dir) -> None:
    model = Model.load(tiny_dir("tiny-qwen3-vl"), kv_pages=64, device="cpu")
    before = model.metrics()
    assert (before.passes, before.generated_tokens, before.ttft["count"]) == (0, 0, 0)
    results, prompt = run_sync(
        complete(
            model, [Turn("user", ("Hello there",))], CompletionParams(max_tokens=5, n=2, ignore_eos=True)
        )
    )
    m = model.metrics()
    assert m.generated_tokens == 10 and m.ttft["count"] == 2 and m.itl["count"] == 8
    assert m.prompt_tokens == prompt  # the prompt was computed once for both choices
    assert m.passes >= 5 and m.max_steps_in_pass == 2  # the two choices decoded together
    assert m.open_contexts == 0 and m.pages_used == 0
    assert m.mean_steps_per_pass > 1


def test_histogram_quantiles() -> None:
    h = Histogram()
    assert h.quantile(0.5) is None
    for v in (0.001, 0.02, 0.02, 0.3, 100.0):
        h.observe(v)
    assert h.quantile(0.5) == 0.025 and h.quantile(1.0) == float("inf")
    assert h.n == 5 and abs(h.total - 100.341) < 1e-9
