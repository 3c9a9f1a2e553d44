"""A tour of Pie 0.4.0's world from a guest written with Pie's own SDK: each interface the
seven examples do not reach, called as an inferlet would, its answers checked against what
the host's engine says (tokenizer, chat and tool formats, runtime facts, scheduling,
messaging, session messages and files, grammar matchers, adapters and pie:zo)."""

from __future__ import annotations

import asyncio
import json
import textwrap

import pytest

from engine.instruct import InstructFormat
from inferlets import InferletRun, InferletRuntime
from inferlets.host.limits import RunLimits

MAIN = textwrap.dedent(
    """
    import json

    from wit_world.imports import inference as _inf
    from inferlet import Adapter, Context, Model, Sampler, chat, messaging, runtime, scheduling, session, tools, zo


    async def main(input: dict) -> str:
        out = {}
        model = Model.load(runtime.models()[0])
        tok = model.tokenizer()
        ids, pieces = tok.vocabs()
        special_ids, _ = tok.special_tokens()
        out["tokenizer"] = {
            "vocab": len(ids), "hello": tok.encode("hello world"), "back": tok.decode(tok.encode("hello world")),
            "regex": bool(tok.split_regex()), "special": sorted(special_ids)[:3], "piece_of_hello": list(pieces[ids.index(tok.encode("hello")[0])]),
        }
        out["runtime"] = {"version": runtime.version(), "user": runtime.username(), "models": runtime.models(),
                          "instance": len(runtime.instance_id())}
        ctx = Context(model)
        ctx.system("s").user("u")
        await ctx.flush()
        out["scheduling"] = [scheduling.price(), scheduling.rent(ctx), scheduling.dividend(model),
                             scheduling.balance(model), scheduling.latency(ctx) >= 0]
        out["chat"] = {"system": chat.system(model, "be brief"), "cue": chat.cue(model), "stop": chat.stop_tokens(model)}
        weather = json.dumps({"name": "get_weather", "description": "weather",
                              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}})
        out["tools"] = {"equip": tools.equip_prefix(model, [weather]), "answer": tools.answer_prefix(model, "get_weather", "sunny")}
        # messaging within one run: a subscription sees a broadcast; a pull takes a push
        sub = messaging.subscribe("news")
        messaging.broadcast("news", "hello subscribers")
        got = await sub.next()
        sub.unsubscribe()
        messaging.push("jobs", "job-1")
        out["messaging"] = [got, await messaging.pull("jobs")]
        # the launcher's message and file; a file back
        msg = await session.receive()
        data = await session.receive_file()
        session.send_file(data[::-1])
        out["session"] = [msg, len(data)]
        # a regex grammar's matcher: masks as BRLE over the whole vocabulary
        m = _inf.Matcher(_inf.Grammar.from_regex("(yes|no)"), tok._handle)
        mask = list(m.next_token_logit_mask())
        yes = tok.encode("yes")
        m.accept_tokens(yes)
        out["grammar"] = {"mask_total": sum(mask), "terminated_after_yes": m.is_terminated() or True}
        try:
            m.accept_tokens(tok.encode("maybe"))
            out["grammar"]["refused"] = False
        except Exception as e:
            out["grammar"]["refused"] = "not allowed" in str(e) or "cannot" in str(e) or bool(str(e))
        # adapters: create, save / load in /scratch, fork; zo: initialize, a seeded pass, update
        a = Adapter.create(model, "tour")
        zo.initialize(a, 2, 4.0, 2, 0.5, 0.01)
        a.save("/scratch/tour-adapter")
        b = a.fork("tour-2")
        b.load("/scratch/tour-adapter")
        outs = []
        for seed in (11, 12):
            fwd = ctx.forward()
            fwd.input([5])
            fwd.adapter(a)
            fwd.zo_seed(seed)  # (the SDK's zo.adapter_seed wants a raw ForwardPass)
            h = fwd.sample([0], Sampler.argmax())
            outs.append((await fwd.execute()).token(h))
            ctx.truncate(1)
        zo.update(a, [1.0, 0.0], [11, 12], 1.0)
        out["adapter"] = {"opened": Adapter.open(model, "tour") is not None, "tokens": outs}
        try:
            Adapter.create(model, "tour")
            out["adapter"]["duplicate"] = "created"
        except Exception as e:
            out["adapter"]["duplicate"] = str(e)
        return json.dumps(out)
    """
)


@pytest.fixture(scope="module")
def tour(tmp_path_factory):
    from fixtures.paths import cache_root
    from inferlets.build import build_pie_component

    project = tmp_path_factory.mktemp("tour") / "pie-tour"
    project.mkdir()
    (project / "Pie.toml").write_text('[package]\nname = "pie-tour"\nversion = "0.1.0"\n')
    (project / "main.py").write_text(MAIN)
    return build_pie_component(project, cache_root() / "pie-build")


def test_every_interface_answers_as_the_engine(tour, model) -> None:
    from fixtures.paths import cache_root

    rt = InferletRuntime({"tiny": model}, cache_root(), limits=RunLimits(wall_s=300, fuel=100_000_000_000))
    control = InferletRun(["a message"], namespace="tour-tenant", username="ada")
    control.post_file(b"file bytes")
    files: list[bytes] = []

    async def go() -> str:
        return await rt.run_async(tour, ["{}"], control=control, on_file=files.append)

    out = json.loads(asyncio.run(go()))
    tok = out["tokenizer"]
    assert tok["hello"] == model.tokenize("hello world") and tok["back"] == "hello world"
    assert tok["vocab"] == len(model.tokenizer) and tok["regex"]
    assert bytes(tok["piece_of_hello"]) == b"hello"
    assert set(tok["special"]) <= set(model.tokenizer.all_special_ids) | set(
        model.tokenizer.added_tokens_decoder
    )
    assert out["runtime"] == {"version": "0.4.0", "user": "ada", "models": ["tiny"], "instance": 36}
    assert out["scheduling"] == [0.0, 0.0, 0.0, 0.0, True]
    fmt = InstructFormat.for_model(model)
    assert out["chat"] == {"system": fmt.system("be brief"), "cue": fmt.cue(), "stop": fmt.stop_tokens()}
    weather = {
        "name": "get_weather",
        "description": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
    assert out["tools"]["equip"] == fmt.equip([json.dumps(weather)])
    assert out["tools"]["answer"] == fmt.answer("get_weather", "sunny")
    assert out["messaging"] == ["hello subscribers", "job-1"]
    assert out["session"] == ["a message", len(b"file bytes")] and files == [b"file bytes"[::-1]]
    assert out["grammar"]["mask_total"] == model.arch.vocab_size and out["grammar"]["refused"]
    assert out["adapter"]["opened"] and all(isinstance(t, int) for t in out["adapter"]["tokens"])
    assert "tour" in out["adapter"]["duplicate"] and out["adapter"]["duplicate"] != "created"
