"""Speech on the engine: many requests batched on one model's pages and scheduler.

- 16 requests at once (greedy, different texts and speakers) give each the codes it gives
  alone, and those equal transformers' ``generate`` (test_speech checks solo == generate on
  the fixture; here also on a second CSM shape); seeded sampled requests too.
- the frames of concurrent requests share passes, and their depth-decoder steps one batch;
- a repeated context turn (text + audio) takes the first request's prompt pages from the
  prefix cache, with the same codes;
- a request cancelled mid-stream, or a stream closed early, gives every page back;
- admission: streams and promised pages are bounded; a request over the pool is refused.
Codes are compared exactly (ids); no tolerance is involved.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from speech import InvalidDurationError, SpeechBusyError, SpeechCapacity, SpeechModel

FRAMES = 6
SECONDS = FRAMES / 12.5
TEXTS = [f"Request {i} has its own words." for i in range(16)]


def _reference_codes(path, text: str, speaker: int, frames: int) -> np.ndarray:
    from transformers import AutoProcessor, CsmForConditionalGeneration

    model = CsmForConditionalGeneration.from_pretrained(path).eval()
    processor = AutoProcessor.from_pretrained(path)
    conversation = [{"role": str(speaker), "content": [{"type": "text", "text": text}]}]
    inputs = processor.apply_chat_template(conversation, tokenize=True, return_dict=True)
    non_codec = list(range(model.config.codec_config.codebook_size, model.config.vocab_size))
    out = model.generate(
        **inputs,
        do_sample=False,
        depth_decoder_do_sample=False,
        max_new_tokens=frames,
        suppress_tokens=non_codec,
        depth_decoder_suppress_tokens=non_codec,
        output_audio=False,
        return_dict_in_generate=True,
    )
    return out.sequences[0].numpy()


async def _together(model: SpeechModel, calls: list[dict]) -> list:
    return await asyncio.gather(*(model.speak_async(**c) for c in calls))


def test_sixteen_at_once_equal_alone(csm) -> None:
    greedy = [dict(text=t, speaker=i % 10, max_duration=SECONDS, temperature=0) for i, t in enumerate(TEXTS)]
    sampled = [
        dict(text=t, speaker=0, max_duration=SECONDS, temperature=0.9, seed=i) for i, t in enumerate(TEXTS)
    ]
    alone = [csm.speak(**{**c, "text": c["text"]}) for c in greedy + sampled]
    passes, steps = csm.scheduler.stats.passes, csm.scheduler.stats.steps
    together = asyncio.run(_together(csm, greedy + sampled))
    for a, b in zip(alone, together, strict=True):
        np.testing.assert_array_equal(a.codes, b.codes)
        np.testing.assert_array_equal(a.pcm, b.pcm)
    # 32 requests of 1 prefill + 5 frame steps each; shared passes: far fewer passes than steps
    assert csm.scheduler.stats.steps - steps == 32 * FRAMES
    assert csm.scheduler.stats.passes - passes < (32 * FRAMES) / 4
    assert csm.scheduler.stats.max_steps_in_pass >= 16
    assert csm.pool.stats().in_use == 0 and csm.capacity.streams == 0


def test_a_burst_moves_as_one_cohort(csm) -> None:
    """Eight streams started together are prefilled in one pass and stay in step, so their
    first chunks are decoded in one batch: ``prepare_async`` prepares a text-only request
    inline, and every request reaches the scheduler before its first pass is cut."""
    sizes: list[int] = []
    run = csm.scheduler._run

    def counted(steps):
        sizes.append(len(steps))
        return run(steps)

    async def one(text: str) -> int:
        job = await csm.prepare_async(text, 0, max_duration=SECONDS, temperature=0)
        chunks = [pcm async for pcm in csm.stream_async(job, csm.admit(job, wait=False))]
        return len(chunks)

    async def burst() -> list[int]:
        return await asyncio.gather(*(one(t) for t in TEXTS[:8]))

    csm.scheduler._run = counted  # an instance attribute over the method: counts, then runs it
    try:
        chunks = asyncio.run(burst())
    finally:
        del csm.scheduler._run
    assert sizes == [8] * FRAMES  # one prefill pass, then every frame of all eight together
    assert all(n == FRAMES // 2 for n in chunks)
    assert csm.pool.stats().in_use == 0 and csm.capacity.streams == 0


def test_reference_parity_on_the_batched_path(csm) -> None:
    ours = asyncio.run(
        _together(csm, [dict(text=t, speaker=1, max_duration=SECONDS, temperature=0) for t in TEXTS[:4]])
    )
    for text, clip in zip(TEXTS[:4], ours, strict=True):
        np.testing.assert_array_equal(clip.codes, _reference_codes(csm.path, text, 1, FRAMES))


@pytest.fixture(scope="module")
def wide_csm(tmp_path_factory, tiny_dir):
    from fixtures.tiny_csm import build_variant

    path = build_variant(
        tmp_path_factory.mktemp("csm-wide"),
        tiny_dir("tiny-csm"),
        seed=5,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=16,
        depth={
            "hidden_size": 48,
            "intermediate_size": 96,
            "num_hidden_layers": 3,
            "num_attention_heads": 3,
            "num_key_value_heads": 1,
            "head_dim": 16,
        },
    )
    return SpeechModel.load(path, device="cpu", page_size=8)


def test_second_shape_batched_equals_reference(wide_csm) -> None:
    texts = TEXTS[:5]
    ours = asyncio.run(
        _together(wide_csm, [dict(text=t, speaker=2, max_duration=SECONDS, temperature=0) for t in texts])
    )
    for text, clip in zip(texts, ours, strict=True):
        np.testing.assert_array_equal(clip.codes, _reference_codes(wide_csm.path, text, 2, FRAMES))


def test_repeated_context_turn_hits_the_prefix_cache(csm) -> None:
    from media import Audio

    rng = np.random.default_rng(7)
    earlier = Audio.from_array((0.1 * rng.standard_normal(24000 * 4)).astype(np.float32), 24000)  # 50 frames
    context = [(0, "This is what was said before.", earlier)]
    job = csm.prepare("And now this.", 1, max_duration=SECONDS, temperature=0, context=context)
    assert job.prompt_rows >= 2 * csm.pool.page_size
    reused = csm.stats.reused_rows
    first = csm.speak("And now this.", 1, max_duration=SECONDS, temperature=0, context=context)
    assert csm.stats.reused_rows == reused  # nothing cached yet
    assert csm.pool.stats().cached >= 2  # its full prompt pages stay published
    second = csm.speak("Something else.", 1, max_duration=SECONDS, temperature=0, context=context)
    hit = csm.stats.reused_rows - reused
    assert hit >= csm.pool.page_size and hit % csm.pool.page_size == 0
    np.testing.assert_array_equal(
        csm.speak("And now this.", 1, max_duration=SECONDS, temperature=0, context=context).codes, first.codes
    )
    assert second.codes.shape == first.codes.shape
    # other audio in the same turn shares nothing past the text before it
    other = Audio.from_array((0.1 * rng.standard_normal(24000 * 4)).astype(np.float32), 24000)
    before = csm.stats.reused_rows
    csm.speak("And now this.", 1, max_duration=SECONDS, temperature=0, context=[(0, context[0][1], other)])
    assert csm.stats.reused_rows - before < hit


def test_cancel_and_early_close_give_pages_back(csm) -> None:
    async def cancel_mid_stream() -> None:
        job = csm.prepare("A long one.", 0, max_duration=30, temperature=0)
        ticket = csm.admit(job, wait=False)
        got = []

        async def consume() -> None:
            async for pcm in csm.stream_async(job, ticket):
                got.append(pcm)

        task = asyncio.create_task(consume())
        while len(got) < 2:
            await asyncio.sleep(0.001)
        assert csm.pool.stats().in_use > 0 and csm.capacity.streams == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):  # released once the pass writing them is over
            if csm.pool.stats().in_use == 0:
                break
            await asyncio.sleep(0.01)

    asyncio.run(cancel_mid_stream())
    assert csm.pool.stats().in_use == 0 and csm.capacity.streams == 0
    stream = csm.speak_stream("Another long one.", 0, max_duration=30, temperature=0)
    next(stream)
    assert csm.pool.stats().in_use > 0
    stream.close()
    assert csm.pool.stats().in_use == 0 and csm.capacity.streams == 0


def test_admission_bounds_streams_and_pages() -> None:
    cap = SpeechCapacity(num_pages=10, page_size=4, max_streams=2)
    a = cap.admit(16, wait=False)  # 4 pages
    b = cap.admit(8, wait=False)  # 2 pages
    with pytest.raises(SpeechBusyError) as e:  # third stream
        cap.admit(1, wait=False)
    assert e.value.code == "queue_full" and e.value.retry_after == 1
    b.release()
    with pytest.raises(SpeechBusyError):  # 4 + 8 pages > 10
        cap.admit(32, wait=False)
    with pytest.raises(InvalidDurationError):  # can never fit: a 400, not a wait
        cap.admit(44, wait=True)
    c = cap.admit(24, wait=False)  # 6 pages: 4 + 6 = 10
    assert (cap.streams, cap.pages_promised) == (2, 10)
    a.release()
    a.release()  # idempotent
    c.release()
    assert (cap.streams, cap.pages_promised) == (0, 0)


def test_a_waiting_caller_gets_the_freed_slot() -> None:
    import threading

    cap = SpeechCapacity(num_pages=4, page_size=4, max_streams=1)
    held = cap.admit(4, wait=False)
    got = []
    t = threading.Thread(target=lambda: got.append(cap.admit(4, wait=True, timeout=10)))
    t.start()
    t.join(0.2)
    assert not got
    held.release()
    t.join(10)
    assert got and cap.streams == 1
    got[0].release()
    with pytest.raises(SpeechBusyError):
        held2 = cap.admit(4, wait=False)
        cap.admit(4, wait=True, timeout=0.05)
    held2.release()


def test_only_the_backbone_attends_over_pages(csm) -> None:
    """transformers' setter also reaches Mimi's configs; they must keep their own attention."""
    assert csm.hf.config._attn_implementation == "pie_paged"
    others = [m.config for m in csm.hf.modules() if hasattr(m, "config") and m.config is not csm.hf.config]
    assert others and all(c._attn_implementation != "pie_paged" for c in others)


def test_depth_steps_use_the_cache_keyword_transformers_takes(csm) -> None:
    """transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns every
    call, and goes in 5.40): speaking passes whichever the installed version takes, and so
    raises no deprecation warning."""
    import inspect
    import warnings

    from speech.hf_cache import cache_keyword

    depth = csm.head.hf.depth_decoder
    keyword = cache_keyword(depth)
    assert keyword in inspect.signature(depth.forward).parameters
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        clip = csm.speak(text="No warnings.", speaker=0, max_duration=SECONDS, temperature=0)
    assert len(clip.codes) > 0
