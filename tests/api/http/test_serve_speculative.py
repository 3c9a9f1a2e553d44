"""The ``speculative`` extension field of /v1/chat/completions: prompt-lookup drafts
change how many passes a reply takes, never its text."""

from __future__ import annotations

import openai
import pytest

QWEN = "tiny-qwen3-vl"
COPY = [{"role": "user", "content": "a b c d e f g a b c d e f g a b c d"}]
SPEC = {"method": "prompt_lookup", "num_draft": 4, "max_ngram": 3}


@pytest.mark.parametrize("stream", [False, True])
def test_speculative_field_gives_the_same_text(client: openai.OpenAI, stream: bool) -> None:
    def ask(extra: dict) -> tuple[str, str | None]:
        kw = dict(model=QWEN, messages=COPY, max_tokens=24, temperature=0, extra_body=extra)
        if not stream:
            r = client.chat.completions.create(**kw)
            return r.choices[0].message.content, r.choices[0].finish_reason
        text, reason = "", None
        for c in client.chat.completions.create(stream=True, **kw):
            for ch in c.choices:
                text += ch.delta.content or ""
                reason = ch.finish_reason or reason
        return text, reason

    plain = ask({})
    assert ask({"speculative": SPEC}) == plain
    assert (
        ask({"speculative": {"num_draft": 8}, "stop": [plain[0][5:8]]})[0]
        == ask({"stop": [plain[0][5:8]]})[0]
    )


def test_seeded_sampled_reply_is_the_same_with_drafts(client: openai.OpenAI) -> None:
    kw = dict(model=QWEN, messages=COPY, max_tokens=16, temperature=1.0, top_p=0.9, seed=5, n=2)
    plain = client.chat.completions.create(**kw)
    drafted = client.chat.completions.create(**kw, extra_body={"speculative": SPEC})
    assert [c.message.content for c in drafted.choices] == [c.message.content for c in plain.choices]


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "medusa"},
        {"num_draft": 0},
        {"num_draft": 99},
        {"min_ngram": 4, "max_ngram": 2},
        {"nope": 1},
    ],
)
def test_bad_speculative_options_are_400(client: openai.OpenAI, spec: dict) -> None:
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=QWEN, messages=COPY, max_tokens=5, extra_body={"speculative": spec}
        )


# -- --speculative-config: drafting for every request ----------------------------------------

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'


@pytest.fixture(scope="module")
def drafting_server(tmp_path_factory):
    from tests.api.http.conftest import start_server, stop_server

    server = start_server(tmp_path_factory.mktemp("spec"), "--speculative-config", NGRAM, models=("tiny",))
    yield server
    stop_server(server)


def _draft_counts(server) -> dict[str, float]:
    """The Qwen model's draft counters from /metrics."""
    import httpx

    out = {}
    for line in httpx.get(f"{server.url}/metrics", timeout=30).text.splitlines():
        if line.startswith("pie_media_draft_tokens_total{") and f'model="{QWEN}"' in line:
            out[line.split('result="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
    return out


def test_server_wide_drafting_keeps_the_text_and_a_request_can_turn_it_off(
    client: openai.OpenAI, drafting_server
) -> None:
    drafting = openai.OpenAI(base_url=drafting_server.v1, api_key="x", max_retries=0, timeout=120)
    kw = dict(model=QWEN, messages=COPY, max_tokens=24, temperature=0)
    plain = client.chat.completions.create(**kw).choices[0].message.content

    before = _draft_counts(drafting_server)
    assert drafting.chat.completions.create(**kw).choices[0].message.content == plain
    during = _draft_counts(drafting_server)
    assert during["proposed"] > before["proposed"] and during["accepted"] > before["accepted"]

    # "speculative": null: this request drafts nothing, and its text is the same
    off = drafting.chat.completions.create(**kw, extra_body={"speculative": None})
    assert off.choices[0].message.content == plain
    assert _draft_counts(drafting_server) == during

    # a request's own options win over the server's
    own = drafting.chat.completions.create(**kw, extra_body={"speculative": {"num_draft": 8}})
    assert own.choices[0].message.content == plain
    assert _draft_counts(drafting_server)["proposed"] > during["proposed"]


def test_in_process_metrics_count_drafts(client: openai.OpenAI, server) -> None:
    before = _draft_counts(server)
    client.chat.completions.create(
        model=QWEN, messages=COPY, max_tokens=16, temperature=0, extra_body={"speculative": SPEC}
    )
    after = _draft_counts(server)
    assert after["proposed"] > before["proposed"] >= 0 and after["accepted"] > before["accepted"], (
        before,
        after,
    )


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("{not json", "not JSON"),
        ("[1]", "JSON object"),
        ('{"method": "eagle"}', "'eagle' is not served"),
        ('{"num_speculative_tokens": 0}', "num_draft"),
        ('{"prompt_lookup_min": 4, "prompt_lookup_max": 2}', "min_ngram"),
        ('{"draft_model": "x"}', "unknown key"),
    ],
)
def test_a_bad_speculative_config_stops_the_start(config: str, message: str, capsys) -> None:
    from api.cli import main

    assert main(["serve", "--speculative-config", config]) == 2
    assert message in capsys.readouterr().err


def test_speculative_config_in_vllm_shape_becomes_a_draft_spec() -> None:
    from api.http.settings import ServeSettings
    from engine import DraftSpec

    s = ServeSettings(speculative_config=NGRAM)
    assert DraftSpec(**s.speculative_config) == DraftSpec("prompt_lookup", 4, 3, 1)
    assert ServeSettings(speculative_config="{}").speculative_config is None
    assert ServeSettings().speculative_config is None
