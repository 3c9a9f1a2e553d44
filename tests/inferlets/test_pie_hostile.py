"""Hostile Pie-world inferlets (issue 41, item 5): each bad input or runaway guest gets a clear
error and the same runtime goes on serving a good inferlet afterwards.

One small Pie project (Pie.toml + ``main.py`` on Pie's SDK ``inferlet`` 0.4.0 and, for the
low-level cases, the raw ``wit_world`` bindings) holds every case, picked by the input's
``case`` key: one stock componentize-py build and one wasmtime compile for the file. The
component importing an interface the host does not know is a hand-written component (WAT).
A path outside the sandbox is ``test_pie_filesystem.py``'s."""

from __future__ import annotations

import asyncio
import json
import textwrap
import threading
import time
import uuid

import pytest

from inferlets import (
    InferletFailedError,
    InferletRun,
    InferletRuntime,
    InferletTimeoutError,
    InferletTrapError,
    InvalidComponentError,
    RunLimits,
)

LIMITS = RunLimits(wall_s=60, fuel=20_000_000_000)

MAIN = textwrap.dedent(
    '''
    """Hostile cases for pie-media's Pie-world host, one per input "case"."""

    import asyncio
    import json
    import time

    from componentize_py_types import Err
    from inferlet import Context, Distribution, Model, Sampler, messaging, session
    from inferlet._async import await_future
    from wit_world.imports import context as _ctx, inference as _inf, poll, runtime


    def attempt(fn):
        """None when ``fn()`` succeeds, else the host's error string (a ``result``'s err)."""
        try:
            fn()
            return None
        except Err as e:
            return str(e.value)


    async def greedy(model, tokens, n, ctx=None):
        """``n`` greedy tokens after ``tokens`` (on ``ctx`` if given, else a fresh context)."""
        ctx = ctx if ctx is not None else Context(model)
        ctx.append(tokens)
        gen = ctx.generate(Sampler.argmax(), max_tokens=n, stop=[], auto_flush=False)
        return await gen.collect_tokens()


    async def continued(model, prompt, extra, ctx):
        """The top-10 next-token distribution after ``extra`` on ``ctx`` (which holds
        ``prompt``) and on a fresh context given ``prompt + extra``, then 5 greedy tokens."""
        out = []
        for c, tokens in ((ctx, extra), (Context(model), prompt + extra)):
            f = c.forward()
            f.input(tokens)
            h = f.probe(len(tokens) - 1, Distribution(1.0, 10))
            ids, probs = (await f.execute()).distribution(h)
            out.append({"ids": list(ids), "probs": list(probs), "greedy": await greedy(model, [ids[0]], 5, c)})
        return out


    async def prefilled(model, text):
        ctx = Context(model)
        ctx.append(model.tokenizer().encode(text))
        await ctx.flush()
        return ctx


    async def good(input):
        model = Model.load("tiny")
        ctx = Context(model)
        ctx.user("Hello")
        return await ctx.generate(Sampler.argmax(), max_tokens=6).collect_text()


    async def masks(input):
        """Masks, BRLEs and sampler indices of the wrong size: execute's error, caught; the
        context then decodes exactly as a fresh one with the same tokens."""
        model = Model.load("tiny")
        prompt = model.tokenizer().encode("The quick brown fox jumps over")
        ctx = Context(model)
        ctx.append(prompt)
        await ctx.flush()
        n = ctx.seq_len
        kv = n + 2  # the context's K/V after a two-row pass

        def bad(masks=None, logit=None, indices=(1,)):
            def go():
                fwd = _inf.ForwardPass(model._handle)
                fwd.context(ctx._handle)
                fwd.input_tokens(prompt[3:5], [n, n + 1])
                if masks is not None:
                    fwd.attention_mask(masks)
                if logit is not None:
                    fwd.logit_mask(logit)
                fwd.sampler(list(indices), Sampler.argmax()._variant)
                fwd.execute()

            return attempt(go)

        errors = {
            "rows": bad(masks=[[0, kv]]),
            "too_many_rows": bad(masks=[[0, kv]] * 3),
            "columns_long": bad(masks=[[0, kv + 1], [0, kv + 1]]),
            "columns_short": bad(masks=[[0, kv - 1], [0, kv - 1]]),
            "brle": bad(masks=[[0, kv - 1, 1], [3, 1, kv]]),  # row 0 right, row 1 not
            "logit": bad(logit=[0, 5]),
            "sampler": bad(indices=(7,)),
        }
        after, fresh = await continued(model, prompt, prompt[:2], ctx)
        return json.dumps({"errors": errors, "after": after, "fresh": fresh})


    async def commit(input):
        """Commit more working pages than are full: the error, caught; the context goes on."""
        model = Model.load("tiny")
        prompt = model.tokenizer().encode("The quick brown fox jumps over")
        ctx = await prefilled(model, "The quick brown fox jumps over")
        h = ctx._handle
        pages = [h.tokens_per_page(), h.committed_page_count(), h.working_page_count(), h.working_page_token_count()]
        errors = {
            "more_than_reserved": attempt(lambda: h.commit_working_pages(pages[2] + 3)),
            "not_full": attempt(lambda: h.commit_working_pages(1)),
        }
        pages_after = [h.committed_page_count(), h.working_page_count(), h.working_page_token_count()]
        after, fresh = await continued(model, prompt, prompt[:2], ctx)
        return json.dumps({"pages": pages, "pages_after": pages_after, "errors": errors, "after": after, "fresh": fresh})


    async def overlapping(input):
        """A second pass on a context executed while its first runs: execute's error; the
        first answers as a lone pass does."""
        model = Model.load("tiny")
        prompt = model.tokenizer().encode("The quick brown fox jumps over")
        ctx = await prefilled(model, "The quick brown fox jumps over")
        n = ctx.seq_len

        def execute(tokens, at):
            fwd = _inf.ForwardPass(model._handle)
            fwd.context(ctx._handle)
            fwd.input_tokens(tokens, list(range(at, at + len(tokens))))
            fwd.sampler([len(tokens) - 1], Sampler.argmax()._variant)
            return fwd.execute()

        long = (prompt * 200)[:1024]  # a pass that outlasts the guest's next few calls
        ctx._handle.reserve_working_pages(1024 // ctx._handle.tokens_per_page() + 1)
        first = execute(long, n)
        second = attempt(lambda: execute(prompt[2:3], n + len(long)))
        out = await await_future(first, "the first pass failed")
        fresh = await greedy(model, prompt + long, 1)
        return json.dumps({"second": second, "first": out.slots[0].value, "fresh": fresh[0]})


    async def pool_full(input):
        """A pass that needs pages the pool has not got (another context holds them all):
        execute's error, caught; once they are given back the same pass runs."""
        model = Model.load("tiny")
        prompt = model.tokenizer().encode("The quick brown fox jumps over")
        ctx = await prefilled(model, "The quick brown fox jumps over")
        n = ctx.seq_len
        hog, k, held = _ctx.Context.create(model._handle), 1 << 20, 0
        while k:  # every page the pool has left
            if attempt(lambda: hog.reserve_working_pages(k)) is None:
                held += k
            else:
                k //= 2
        extra = (prompt * 20)[:96]  # three pages' worth: more than the context holds

        def execute():
            fwd = _inf.ForwardPass(model._handle)
            fwd.context(ctx._handle)
            fwd.input_tokens(extra, list(range(n, n + len(extra))))
            fwd.sampler([len(extra) - 1], Sampler.argmax()._variant)
            return fwd.execute()

        error = attempt(execute)
        hog.destroy()
        out = await await_future(execute(), "the pass failed")
        fresh = await greedy(model, prompt + extra, 1)
        return json.dumps({"held": held, "error": error, "first": out.slots[0].value, "fresh": fresh[0]})


    async def destroyed(input):
        """A context used after ``destroy``: every call with a ``result`` fails with the
        host's error, the run's other contexts work on."""
        model = Model.load("tiny")
        ctx = await prefilled(model, "Hello there")
        h = ctx._handle
        h.destroy()

        def execute():
            fwd = _inf.ForwardPass(model._handle)
            fwd.context(h)
            fwd.input_tokens([1], [0])
            fwd.sampler([0], Sampler.argmax()._variant)
            fwd.execute()

        errors = {
            "commit": attempt(lambda: h.commit_working_pages(0)),
            "reserve": attempt(lambda: h.reserve_working_pages(1)),
            "fork": attempt(h.fork),
            "save": attempt(lambda: h.save("after-destroy")),
            "execute": attempt(execute),
        }
        ok = await greedy(model, model.tokenizer().encode("Hello there"), 3)
        return json.dumps({"errors": errors, "fresh_ok": len(ok)})


    async def failing_call(input):
        """A host call without a ``result`` to carry its error fails: the run ends (a trap)."""
        model = Model.load("tiny")
        ctx = await prefilled(model, "Hello there")
        if input["call"] == "tokens-per-page":
            ctx._handle.destroy()
            ctx._handle.tokens_per_page()
        elif input["call"] == "truncate":
            ctx._handle.truncate_working_page_tokens(1000)
        elif input["call"] == "poll":
            poll.poll([])
        return "not reached"


    async def forged(input):
        """A handle the guest made up, or one of another resource type: the component
        model's own checks end the run."""
        model = Model.load("tiny")
        ctx = Context(model)
        h = ctx._handle
        h.handle = model._handle.handle if input["how"] == "foreign" else 4242
        return str(h.tokens_per_page())


    async def handles(input):
        """Contexts in a loop: the resource cap refuses one, caught; the rest still work."""
        model = Model.load("tiny")
        held = []
        while len(held) < 100000:
            try:
                held.append(_ctx.Context.create(model._handle))
            except Err as e:
                return json.dumps({"made": len(held), "error": str(e.value)})
        return json.dumps({"made": len(held), "error": None})


    async def launch(input):
        """Children in a loop: the cap ends the loop with launch's error."""
        children, error = [], None
        while len(children) < 1000:
            try:
                children.append(runtime.launch("child@0.1.0", json.dumps({"i": len(children)})))
            except Err as e:
                error = str(e.value)
                break
        first = await await_future(children[0], "child failed") if children else None
        return json.dumps(
            {"launched": len(children), "error": error, "first": getattr(first, "value", first),
             "pid": children[0].pid() if children else None}
        )


    async def pull(input):
        session.send("pulling")
        return await messaging.pull(input["topic"])


    async def push(input):
        messaging.push(input["topic"], input["message"])
        return "pushed"


    async def receive(input):
        session.send("waiting")
        return await session.receive()


    async def spin(input):
        x = 0
        while True:
            x += 1


    async def sleep(input):
        """asyncio.sleep (the entry loop's timers) then time.sleep (WASI's clocks): how long
        each took by the guest's own clock."""
        t0 = time.monotonic()
        await asyncio.sleep(input["s"])
        t1 = time.monotonic()
        time.sleep(input["s"])
        return json.dumps([round((t1 - t0) * 1000), round((time.monotonic() - t1) * 1000)])


    async def memory(input):
        big = bytearray(1 << 30)
        return str(len(big))


    CASES = {f.__name__: f for f in (good, masks, commit, overlapping, pool_full, destroyed, failing_call, forged, handles, launch, pull, push, receive, spin, sleep, memory)}


    async def main(input: dict) -> str:
        return await CASES[input["case"]](input)
    '''
)

# A component of Pie's world that also imports an interface no host of Pie's world serves.
UNKNOWN_IMPORT_WAT = """(component
  (import "pie:core/runtime@0.4.0" (instance (export "version" (func (result string)))))
  (import "acme:x/y@0.1.0" (instance (export "hello" (func (result string)))))
)"""


@pytest.fixture(scope="module")
def wasm(tmp_path_factory):
    from fixtures.paths import cache_root
    from inferlets.build import build_pie_component

    project = tmp_path_factory.mktemp("pie-hostile") / "hostile"
    project.mkdir()
    (project / "Pie.toml").write_text('[package]\nname = "hostile"\nversion = "0.1.0"\n')
    (project / "main.py").write_text(MAIN)
    return build_pie_component(project, cache_root() / "pie-build")


@pytest.fixture(scope="module")
def rt(model):
    from fixtures.paths import cache_root

    return InferletRuntime({"tiny": model}, cache_root(), limits=LIMITS)


@pytest.fixture(scope="module")
def good_answer(rt, wasm):
    return asyncio.run(rt.run_async(wasm, [json.dumps({"case": "good"})]))


def same_continuation(after: dict, fresh: dict) -> None:
    """The same next-token distribution (to float noise: a pass of 2 rows vs. one of 8) and
    the same greedy tokens."""
    assert after["ids"] == fresh["ids"]
    assert after["probs"] == pytest.approx(fresh["probs"], rel=1e-4)
    assert after["greedy"] == fresh["greedy"] and len(after["greedy"]) == 5


def run(rt, wasm, case: str, *, limits=None, control=None, on_send=None, **params) -> str:
    async def go():
        return await rt.run_async(
            wasm, [json.dumps({"case": case, **params})], limits=limits, control=control, on_send=on_send
        )

    return asyncio.run(go())


@pytest.fixture
def serving(rt, wasm, model, good_answer):
    """After the test: the runtime still runs a good inferlet to the same answer, and every
    context and KV page of the bad run is back."""
    in_use, open_before = model.pool.stats().in_use, model.open_contexts  # saved contexts of other tests stay
    yield
    assert model.open_contexts == open_before
    assert model.pool.stats().in_use == in_use
    assert run(rt, wasm, "good") == good_answer


def test_wrong_size_masks_and_sampler_rows_are_executes_error(rt, wasm, serving) -> None:
    out = json.loads(run(rt, wasm, "masks"))
    e = out["errors"]
    assert "1 attention masks for 2 input rows" in e["rows"]
    assert "3 attention masks for 2 input rows" in e["too_many_rows"]
    for case in ("columns_long", "columns_short"):
        assert "attention mask of row 0" in e[case] and "must cover exactly" in e[case], e[case]
    assert "attention mask of row 1's runs add up to" in e["brle"] and "must cover exactly" in e["brle"]
    assert "add up to 5" in e["logit"] and "logit mask" in e["logit"]
    assert "sampler reads row 7" in e["sampler"] and "2 rows" in e["sampler"]
    # nothing of a refused pass reached the context: it goes on as a fresh one
    same_continuation(out["after"], out["fresh"])


def test_committing_more_working_pages_than_are_full_is_refused(rt, wasm, serving) -> None:
    out = json.loads(run(rt, wasm, "commit"))
    page_size, _, working, working_tokens = out["pages"]
    assert working_tokens < page_size  # the prompt fills no page: none may be committed
    assert f"cannot commit {working + 3} working pages: 0 are full" in out["errors"]["more_than_reserved"]
    assert "cannot commit 1 working pages: 0 are full" in out["errors"]["not_full"]
    assert out["pages_after"] == out["pages"][1:]
    same_continuation(out["after"], out["fresh"])


def test_a_pass_executed_while_another_of_its_context_runs_is_refused(rt, wasm, serving) -> None:
    """The first pass (in pages reserved for it, on a quiet context) is handed to the loop
    without waiting for it; the second, on the same context while the first runs, must
    still be execute's error."""
    out = json.loads(run(rt, wasm, "overlapping"))
    assert "await it first" in out["second"], out["second"]
    assert out["first"] == out["fresh"]


def test_a_pass_the_pool_has_no_pages_for_is_executes_error(rt, wasm, serving) -> None:
    """Pages are taken when the pass joins the batch, on the loop: a pass that needs fresh
    ones is not handed over unchecked, so an exhausted pool is still ``execute``'s error
    (the guest catches it), not a trap later."""
    out = json.loads(run(rt, wasm, "pool_full"))
    assert out["held"] > 0
    assert out["error"] is not None and "KV pool exhausted" in out["error"], out["error"]
    assert out["first"] == out["fresh"]


def test_a_destroyed_context_used_again(rt, wasm, serving) -> None:
    out = json.loads(run(rt, wasm, "destroyed"))
    for call, err in out["errors"].items():
        assert err is not None and "context was destroyed" in err, (call, err)
    assert out["fresh_ok"] == 3  # the run's other contexts work on


@pytest.mark.parametrize(
    ("call", "error", "reason"),
    [
        ("tokens-per-page", "invalid_request", r"this context was destroyed"),
        ("truncate", "invalid_working_pages", r"cannot truncate 1000 working rows"),
        ("poll", "inferlet_trap", r"wasi:io/poll\.poll: poll: the list of pollables is empty"),
    ],
    ids=["after-destroy", "truncate-too-many", "poll-nothing"],
)
def test_a_failing_call_without_a_result_ends_the_run(rt, wasm, serving, call, error, reason) -> None:
    """The WIT gives these calls no ``result`` to carry an error: the run ends there, with
    the host's own typed error when it has one (its code kept), else the trap error naming
    the call and why (never the host's exception, untyped)."""
    from media.errors import PieMediaError

    with pytest.raises(PieMediaError, match=reason) as e:
        run(rt, wasm, "failing_call", call=call)
    assert e.value.code == error


@pytest.mark.parametrize(
    ("how", "reason"),
    [("forged", "unknown handle index 4242"), ("foreign", r"handle index \d+ used with the wrong type")],
)
def test_forged_or_foreign_handle_traps(rt, wasm, serving, how, reason) -> None:
    """A made-up handle, or a model's handle passed as a context: the component model's
    own handle checks refuse it before the host sees it, and the run ends saying so."""
    with pytest.raises(InferletTrapError, match=f"inferlet trapped: {reason}"):
        run(rt, wasm, "forged", how=how)


def test_live_resource_cap(rt, wasm, serving) -> None:
    out = json.loads(run(rt, wasm, "handles", limits=RunLimits(max_handles=2)))
    assert out["error"] is not None and "live resources" in out["error"]
    assert 0 < out["made"] < 2 * 64


def test_launch_loop_stops_at_max_children(rt, wasm, serving, monkeypatch) -> None:
    import concurrent.futures

    calls = []

    def launcher(program, input, parent_state):
        calls.append((program, json.loads(input)["i"], parent_state.control.namespace))
        fut = concurrent.futures.Future()
        fut.set_result(f"child {len(calls)} done")
        return f"pid-{len(calls)}", fut, lambda: None

    monkeypatch.setattr(rt, "launch_child", launcher, raising=False)
    out = json.loads(
        run(rt, wasm, "launch", limits=RunLimits(max_children=5), control=InferletRun(namespace="tenant-x"))
    )
    assert out["launched"] == 5 and len(calls) == 5
    assert "at most 5 children" in out["error"]
    assert out["first"] == "child 1 done" and out["pid"] == "pid-1"
    # each child is launched for the parent's tenant
    assert calls == [("child@0.1.0", i, "tenant-x") for i in range(5)]


def test_pull_never_returns_another_tenants_message(rt, wasm, serving) -> None:
    topic = f"jobs-{uuid.uuid4().hex[:8]}"

    async def go():
        loop = asyncio.get_running_loop()
        pulling = asyncio.Event()
        a = asyncio.ensure_future(
            rt.run_async(
                wasm,
                [json.dumps({"case": "pull", "topic": topic})],
                control=InferletRun(namespace="tenant-a"),
                on_send=lambda m: loop.call_soon_threadsafe(pulling.set),
            )
        )
        await asyncio.wait_for(pulling.wait(), 30)
        push = {"case": "push", "topic": topic}
        b = InferletRun(namespace="tenant-b")
        assert await rt.run_async(wasm, [json.dumps({**push, "message": "from b"})], control=b) == "pushed"
        await asyncio.sleep(0.5)
        assert not a.done()  # tenant b's message is not tenant a's
        a2 = InferletRun(namespace="tenant-a")
        assert await rt.run_async(wasm, [json.dumps({**push, "message": "from a"})], control=a2) == "pushed"
        got_a = await asyncio.wait_for(a, 30)
        # tenant b's message waited in tenant b's queue
        b2 = InferletRun(namespace="tenant-b")
        got_b = await rt.run_async(wasm, [json.dumps({"case": "pull", "topic": topic})], control=b2)
        return got_a, got_b

    assert asyncio.run(go()) == ("from a", "from b")


@pytest.mark.parametrize("case", ["receive", "pull"])
def test_a_wait_that_never_ends_times_out_without_spinning(rt, wasm, serving, case) -> None:
    """A guest awaiting a future nobody completes (a receive with no client message, a pull
    only another tenant answers) sleeps in ``poll`` until the deadline, then ends with the
    timeout error: process CPU time over the wait is a small part of its wall time."""
    topic = f"never-{uuid.uuid4().hex[:8]}"
    marks: dict[str, tuple[float, float]] = {}
    wall_s = 3.0

    def on_send(_msg: str) -> None:
        if case == "pull":  # another tenant pushes onto the topic first: not this guest's

            def other_tenant() -> None:
                rt.run(
                    wasm,
                    [json.dumps({"case": "push", "topic": topic, "message": "not yours"})],
                    loop=loop,
                    control=InferletRun(namespace="tenant-other"),
                )

            pusher = threading.Thread(target=other_tenant, daemon=True)
            pusher.start()
            pusher.join(30)  # its run's CPU is not the wait's
        marks["wait"] = (time.monotonic(), time.process_time())

    async def go():
        nonlocal loop
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        with pytest.raises(InferletTimeoutError) as e:
            await rt.run_async(
                wasm,
                [json.dumps({"case": case, "topic": topic})],
                limits=RunLimits(wall_s=wall_s),
                control=InferletRun(namespace="tenant-waits"),
                on_send=on_send,
            )
        return t0, e.value

    loop = None
    t0, err = asyncio.run(go())
    t1, c1 = time.monotonic(), time.process_time()
    assert err.code == "inferlet_timeout" and "deadline" in str(err)
    assert t1 - t0 < wall_s + 2  # ends at the deadline, not later
    w0, c0 = marks["wait"]
    waited, cpu = t1 - w0, c1 - c0
    assert waited > wall_s / 2
    assert cpu < 0.25 * waited, f"{cpu:.3f} s CPU over a {waited:.3f} s wait"


def test_a_guest_sleeps_as_long_as_it_asks_without_spinning(rt, wasm, serving) -> None:
    """asyncio.sleep (the entry loop's timers) and time.sleep (WASI's clocks) each wait the
    time asked, by the guest's clock and by the host's, in poll: little CPU for the wall
    time. (The guest's clock was wasmtime's, counted from the run's start, while its
    pollables were the host's: every sleep ended at once, and the loop spun.)"""
    t0, c0 = time.monotonic(), time.process_time()
    slept = json.loads(run(rt, wasm, "sleep", s=0.4))
    wall, cpu = time.monotonic() - t0, time.process_time() - c0
    assert all(400 <= ms < 2000 for ms in slept), slept
    assert wall >= 0.8
    assert cpu < 0.5 * wall, (cpu, wall)


def test_fuel_exhaustion_traps(rt, wasm, serving) -> None:
    with pytest.raises(InferletTrapError, match="fuel"):
        run(rt, wasm, "spin", limits=RunLimits(fuel=1_000_000_000))


def test_a_guest_allocating_a_gib_hits_the_memory_cap(rt, wasm, serving) -> None:
    with pytest.raises((InferletTrapError, InferletFailedError), match="MemoryError|memory") as e:
        run(rt, wasm, "memory", limits=RunLimits(memory_bytes=256 << 20))
    assert e.value.code in ("inferlet_trap", "inferlet_failed")


def test_unknown_interface_is_refused_by_name(rt, wasm, serving) -> None:
    import wasmtime

    comp = bytes(wasmtime.wat2wasm(UNKNOWN_IMPORT_WAT))
    with pytest.raises(InvalidComponentError, match="acme:x/y") as e:
        rt.check_component(comp)
    assert e.value.details["interface"] == "acme:x/y@0.1.0"
    with pytest.raises(InvalidComponentError, match="acme:x/y"):
        asyncio.run(rt.run_async(comp, ["{}"]))
