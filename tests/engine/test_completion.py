"""Completions with n choices (one prefill, n forks), logprobs, stop strings in streams."""

from __future__ import annotations

import math

import pytest
import torch

from engine import (
    Completion,
    CompletionParams,
    Context,
    InvalidRequestError,
    Model,
    Sampler,
    Turn,
    complete,
    max_tokens,
    run_sync,
    stop_strings,
)
from engine.stopping import eos
from media import Image

PAGE = 16


@pytest.fixture(scope="module")
def fresh_qwen(tiny_dir) -> Model:
    """Its own pool, so page counts are not disturbed by other tests' cached prefixes."""
    return Model.load(tiny_dir("tiny-qwen3-vl"), kv_pages=256, page_size=PAGE, device="cpu")


@pytest.fixture(scope="module")
def photo(samples) -> Image:
    return Image.from_path(samples / "images" / "photo_640x480.jpg")


def test_n_choices_share_one_prefill_and_its_pages(fresh_qwen: Model, photo: Image) -> None:
    model = fresh_qwen
    n, k = 3, 5
    turns = [Turn("user", (photo, "Describe this image."))]
    params = CompletionParams(sampler=Sampler.multinomial(1.0), max_tokens=k, n=n, seed=11)
    base = model.pool_stats()
    tower_calls = model.encoder.tower_calls

    async def run() -> tuple[int, int, int, int, list[int]]:
        async with Completion(model, turns, params) as c:
            started = model.pool_stats()
            counts = [0] * n
            async for ev in c:
                counts[ev.index] += 1
            done = model.pool_stats()
            return c.prompt_tokens, started.in_use, started.shared, done.in_use, counts

    prompt, in_use_started, shared_started, in_use_done, counts = run_sync(run())
    prompt_pages = math.ceil(prompt / PAGE)
    # Prefilled once: the prompt's pages are held once and shared by all n choices.
    assert in_use_started - base.in_use == prompt_pages
    assert shared_started - base.shared == prompt_pages
    assert model.encoder.tower_calls - tower_calls == 1  # the image went through the tower once
    # After generating, each choice owns at most its copied tail page plus new pages.
    full = prompt // PAGE
    tail_rows = prompt - full * PAGE
    own = sum(math.ceil((tail_rows + c) / PAGE) for c in counts)
    assert in_use_done - base.in_use == full + own
    assert model.pool_stats().in_use == base.in_use  # closed: everything returned


def test_seeded_choices_are_reproducible_and_differ(fresh_qwen: Model) -> None:
    turns = [Turn("user", ("Tell me a story.",))]
    params = CompletionParams(sampler=Sampler.multinomial(1.0), max_tokens=8, n=2, seed=5)
    a, _ = run_sync(complete(fresh_qwen, turns, params))
    b, _ = run_sync(complete(fresh_qwen, turns, params))
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert a[0].tokens != a[1].tokens
    one, _ = run_sync(
        complete(fresh_qwen, turns, CompletionParams(sampler=Sampler.multinomial(1.0), max_tokens=8, seed=5))
    )
    assert one[0].tokens == a[0].tokens  # choice 0 of n is the n=1 answer with the same seed


def test_greedy_completion_equals_generate(fresh_qwen: Model, photo: Image) -> None:
    (r,), prompt = run_sync(
        complete(fresh_qwen, [Turn("user", (photo, "What is it?"))], CompletionParams(max_tokens=9))
    )

    async def direct() -> tuple[list[int], int]:
        async with Context(fresh_qwen) as ctx:
            ctx.user(photo, "What is it?").cue()
            n = len(ctx)
            g = await ctx.generate(Sampler.greedy(), max_tokens(9) | eos(fresh_qwen.eos_token_ids))
            return g.tokens, n

    tokens, n = run_sync(direct())
    assert r.tokens == tokens and prompt == n


def test_logprobs_are_the_raw_distribution(fresh_qwen: Model) -> None:
    async def run():
        async with Context(fresh_qwen) as ctx:
            ctx.user("Hello").cue()
            logits = (await ctx.next_token_logits()).clone()
            events = [ev async for ev in ctx.stream(Sampler.greedy(), max_tokens(3), logprobs=4)]
            return logits, events

    logits, events = run_sync(run())
    lsm = torch.log_softmax(logits.float(), -1)
    first = events[0]
    assert first.token == int(logits.argmax())
    assert first.logprob == pytest.approx(float(lsm[first.token]), abs=1e-6)
    assert [t for t, _ in first.top_logprobs] == lsm.topk(4).indices.tolist()
    assert first.top_logprobs[0][1] == pytest.approx(first.logprob, abs=1e-6)
    assert all(len(ev.top_logprobs) == 4 for ev in events)


def test_logprobs_off_and_limits(fresh_qwen: Model) -> None:
    async def run(lp):
        async with Context(fresh_qwen) as ctx:
            ctx.user("Hi").cue()
            return [ev async for ev in ctx.stream(Sampler.greedy(), max_tokens(2), logprobs=lp)]

    events = run_sync(run(None))
    assert events[0].logprob is None and events[0].top_logprobs == ()
    with pytest.raises(InvalidRequestError, match="logprobs"):
        run_sync(run(21))


def test_stream_never_shows_text_a_stop_string_takes_back(fresh_qwen: Model) -> None:
    """Whatever the stop string, the streamed pieces join to exactly the final text."""

    async def run(stop):
        async with Context(fresh_qwen) as ctx:
            ctx.user("Go on.").cue()
            events = [ev async for ev in ctx.stream(Sampler.multinomial(1.0), stop, max_tokens=24)]
            return events

    full = "".join(ev.text for ev in run_sync(run(max_tokens(24))))
    assert len(full) > 4
    # Stop strings cut from the text itself (so they certainly fire), at several places.
    for at in (1, len(full) // 2, len(full) - 2):
        target = full[at : at + 3]
        if not target.strip():
            continue
        events = run_sync(run(stop_strings(target)))
        joined = "".join(ev.text for ev in events)
        assert events[-1].done is not None
        assert joined == events[-1].done.text
        assert target not in joined


def test_holdback_rule() -> None:
    cond = stop_strings("END", "</s>") | max_tokens(4)
    assert cond.holdback("hello E") == 1
    assert cond.holdback("hello EN") == 2
    assert cond.holdback("hello </") == 2
    assert cond.holdback("hello") == 0
    assert max_tokens(3).holdback("E") == 0


def test_reseed_and_bad_params(fresh_qwen: Model) -> None:
    ctx = Context(fresh_qwen)
    with pytest.raises(InvalidRequestError):
        ctx.reseed(True)  # type: ignore[arg-type]
    ctx.close()
    with pytest.raises(InvalidRequestError):
        Completion(fresh_qwen, [Turn("robot", ("x",))], CompletionParams())
    with pytest.raises(InvalidRequestError):
        Completion(fresh_qwen, [], CompletionParams())
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        run_sync(_gen_zero(fresh_qwen))


async def _gen_zero(model: Model):
    async with Context(model) as ctx:
        ctx.user("x").cue()
        await ctx.generate(max_tokens=0)


def test_several_media_parts_prepared_together_keep_their_places(fresh_qwen: Model, samples) -> None:
    """The parts of all turns are prepared concurrently; the prompt is still built in
    request order (greedy tokens and prompt length equal the sequential Context)."""
    a = Image.from_path(samples / "images" / "photo_640x480.jpg")
    b = Image.from_path(samples / "images" / "rgba.png")
    c = Image.from_path(samples / "images" / "cmyk.jpg")
    turns = [
        Turn("user", (a, "first", b, "second")),
        Turn("assistant", ("ok",)),
        Turn("user", ("and", c)),
    ]
    (r,), prompt = run_sync(complete(fresh_qwen, turns, CompletionParams(max_tokens=6)))

    async def direct() -> tuple[list[int], int]:
        async with Context(fresh_qwen) as ctx:
            ctx.user(a, "first", b, "second").assistant("ok").user("and", c).cue()
            n = len(ctx)
            g = await ctx.generate(Sampler.greedy(), max_tokens(6) | eos(fresh_qwen.eos_token_ids))
            return g.tokens, n

    tokens, n = run_sync(direct())
    assert r.tokens == tokens and prompt == n


def test_a_bad_part_among_several_is_the_typed_error(fresh_qwen: Model, samples, photo: Image) -> None:
    from media import Audio
    from media.errors import PieMediaError

    audio = Audio.from_path(samples / "audio" / "tone_44k1_stereo.mp3")
    base = fresh_qwen.pool_stats().in_use
    with pytest.raises(PieMediaError) as e:
        run_sync(
            complete(fresh_qwen, [Turn("user", (photo, "x", audio, photo))], CompletionParams(max_tokens=2))
        )
    assert "audio" in str(e.value).lower()
    assert fresh_qwen.pool_stats().in_use == base


def test_batches_group_what_one_pass_produced_and_flag_the_end(fresh_qwen: Model) -> None:
    """``batches()`` hands out the same events as iterating event by event, grouped by what
    was ready together: the n choices' tokens of one pass form one group (from the first
    token on), and ``finished`` turns true exactly on the last group (a server closes its
    stream in that write)."""
    n, k = 3, 12
    turns = [Turn("user", ("Name three colours.",))]
    params = CompletionParams(max_tokens=k, n=n, ignore_eos=True)

    async def grouped() -> tuple[list[list[tuple[int, int]]], list[bool]]:
        groups, finished = [], []
        async with Completion(fresh_qwen, turns, params) as c:
            assert not c.finished
            async for group in c.batches():
                groups.append([(ev.index, ev.token) for ev in group])
                finished.append(c.finished)
        return groups, finished

    async def flat() -> list[tuple[int, int]]:
        async with Completion(fresh_qwen, turns, params) as c:
            return [(ev.index, ev.token) async for ev in c]

    groups, finished = run_sync(grouped())
    assert [e for g in groups for e in g] == run_sync(flat())  # greedy: the same tokens, same order
    # The head ran once on the prompt before forking, so the choices start together and every
    # decode pass serves all three: their tokens come out together, a group per pass.
    assert [len(g) for g in groups] == [n] * k
    assert finished == [False] * (len(groups) - 1) + [True]


def test_batches_hand_out_the_events_before_a_failure_first(fresh_qwen: Model) -> None:
    """A choice that fails mid-pass: the tokens queued before its error (here choice 0's token
    of that pass) still come out, as they do event by event, and then the error."""
    calls = 0

    def fail_on_sixth(ids, probs) -> int:  # two choices per pass: the 6th call is choice 1, pass 3
        nonlocal calls
        calls += 1
        if calls == 6:
            raise RuntimeError("sampler failed")
        return int(ids[0])

    params = CompletionParams(sampler=Sampler.custom(fail_on_sixth), max_tokens=8, n=2, ignore_eos=True)
    turns = [Turn("user", ("Count.",))]

    async def run(grouped: bool) -> tuple[list[int], str]:
        nonlocal calls
        calls = 0
        seen: list[int] = []
        async with Completion(fresh_qwen, turns, params) as c:
            try:
                if grouped:
                    async for group in c.batches():
                        seen.extend(ev.index for ev in group)
                else:
                    async for ev in c:
                        seen.append(ev.index)
            except RuntimeError as e:
                return seen, str(e)
        return seen, ""

    flat, grouped = run_sync(run(False)), run_sync(run(True))
    assert flat == ([0, 1, 0, 1, 0], "sampler failed")
    assert grouped == flat


def test_context_length_is_checked_before_any_row_is_computed(tiny_dir) -> None:
    """A prompt plus max_tokens over ``max_model_len`` is refused (OpenAI's
    context_length_exceeded) before a forward pass; a default max_tokens shrinks to the
    room left instead; the limit cannot exceed the checkpoint's positions."""
    from engine import ContextLengthExceededError

    model = Model.load(tiny_dir("tiny-qwen3-vl"), kv_pages=64, page_size=PAGE, device="cpu", max_model_len=40)
    turns = [Turn("user", ("Say something about the weather today, please.",))]
    passes = model.scheduler.stats.passes

    async def run(params: CompletionParams) -> tuple[int, int, list[int]]:
        async with Completion(model, turns, params) as c:
            tokens = [ev.token async for ev in c]
            return c.prompt_tokens, c.max_tokens, tokens

    with pytest.raises(ContextLengthExceededError) as e:
        run_sync(run(CompletionParams(max_tokens=256)))
    prompt = e.value.details["prompt_tokens"]
    assert e.value.code == "context_length_exceeded" and e.value.details["limit"] == 40
    assert 0 < prompt < 40 and model.scheduler.stats.passes == passes  # nothing was computed
    assert model.pool_stats().in_use == 0
    fitted = CompletionParams(max_tokens=256, max_tokens_is_default=True, ignore_eos=True)
    got_prompt, allowed, tokens = run_sync(run(fitted))
    assert got_prompt == prompt and allowed == 40 - prompt and len(tokens) == allowed
    exact = CompletionParams(max_tokens=40 - prompt, ignore_eos=True)
    assert len(run_sync(run(exact))[2]) == 40 - prompt
    # A context never takes input past the limit, and a refused piece leaves no rows.
    ctx = Context(model)
    ctx.fill("word " * 30)
    held = len(ctx)
    for add in (
        lambda: ctx.fill("word " * 30),
        lambda: ctx.user("word " * 30),
        lambda: ctx.fill_tokens([1] * 30),
    ):
        with pytest.raises(ContextLengthExceededError):
            add()
        assert len(ctx) == held
    ctx.close()
    with pytest.raises(ContextLengthExceededError) as e:  # the prompt alone is over
        run_sync(_long(model))
    assert e.value.details["prompt_tokens"] > 40
    with pytest.raises(InvalidRequestError, match="positions"):
        Model.load(tiny_dir("tiny-qwen3-vl"), kv_pages=4, device="cpu", max_model_len=10**9)
    assert Model.load(tiny_dir("tiny-gemma4"), kv_pages=4, device="cpu").max_model_len > 1000


async def _long(model: Model) -> None:
    text = "word " * 20_000  # over LONG_TEXT_CHARS: tokenized on a worker thread
    async with Completion(model, [Turn("user", (text,))], CompletionParams(max_tokens_is_default=True)) as c:
        async for _ in c:
            pass
