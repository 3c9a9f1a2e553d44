"""Pie 0.4.0's own example inferlets run on pie-media's host, built with stock
componentize-py and Pie's Python SDK (``inferlet`` 0.4.0) from the reference folder, each
to its ``return`` on the tiny models. Where the output is determined (greedy), it equals
what the engine gives for the same tokens. (The examples share one component; see
``pie_examples.py``.)"""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from engine import Context, Sampler, stopping
from engine.instruct import InstructFormat
from inferlets import InferletRuntime
from inferlets.host.errors import InferletFailedError
from inferlets.host.limits import RunLimits
from tests.inferlets.pie_examples import EXAMPLES, NAMES, write_bundle

pytestmark = pytest.mark.skipif(
    not all((EXAMPLES / n / "main.py").is_file() for n in NAMES),
    reason=f"Pie 0.4.0's examples are not at {EXAMPLES} (set PIE_REFERENCE to the reference folder)",
)

LIMITS = RunLimits(wall_s=300, fuel=200_000_000_000)


@pytest.fixture(scope="session")
def bundle(tmp_path_factory):
    from fixtures.paths import cache_root
    from inferlets.build import build_pie_component

    return build_pie_component(
        write_bundle(tmp_path_factory.mktemp("pie") / "pie-examples"), cache_root() / "pie-build"
    )


@pytest.fixture(scope="session")
def pie_rt(model):
    from fixtures.paths import cache_root

    return InferletRuntime({"tiny": model}, cache_root(), limits=LIMITS)


def run(rt, wasm, example: str, **params):
    sends: list[str] = []
    out: list[tuple[str, str]] = []

    async def go():
        return await rt.run_async(
            wasm,
            [json.dumps({"__example__": example, **params})],
            on_send=sends.append,
            on_output=lambda stream, text: out.append((stream, text)),
        )

    result = asyncio.run(go())
    stdout = "".join(t for s, t in out if s == "stdout")
    return result, sends, stdout


def greedy_text(model, prompt: list[int], max_tokens: int) -> str:
    """The engine's greedy continuation of ``prompt`` until a chat stop token, as text."""
    stops = InstructFormat.for_model(model).stop_tokens()

    async def go():
        ctx = Context(model)
        try:
            ctx.fill_tokens(prompt)
            g = await ctx.generate(Sampler.greedy(), stopping.max_tokens(max_tokens) | stopping.eos(stops))
            return [t for t in g.tokens if t not in stops]
        finally:
            ctx.close()

    return model.detokenize(asyncio.run(go()))


def test_python_example_streams_its_answer(pie_rt, bundle) -> None:
    """Top-p generation with chat + reasoning decoders: the returned text is exactly the
    chat deltas the inferlet streamed (then "[done]")."""
    result, sends, _ = run(pie_rt, bundle, "python-example")
    assert sends[-1] == "\n[done]"
    assert result and result == "".join(sends[:-1])


def test_hierarchical_attention_with_an_unmasked_window_equals_engine_greedy(pie_rt, bundle, model) -> None:
    """A window wider than the prompt keeps every row visible: the hand-driven masked
    passes then equal plain greedy decoding of the same tokens."""
    prompt = "Explain how LLM serving systems use KV cache and batching."
    result, _, stdout = run(
        pie_rt,
        bundle,
        "hierarchical-attention-python",
        prompt=prompt,
        max_tokens=10,
        local_window_tokens=100000,
    )
    fmt = InstructFormat.for_model(model)
    tokens = fmt.system(
        "You are a concise assistant. Use the visible hierarchy: global instructions, the chunk "
        "summaries, and the selected local chunk."
    )
    tokens += fmt.user(f"Chunk 0 summary: {' '.join(prompt.split()[:20])}\n")
    tokens += fmt.user(f"Chunk 0 full text:\n{prompt}\n")
    tokens += fmt.user(
        "Answer the original request using the selected local chunk(s) and the global chunk summaries."
    )
    tokens += fmt.cue()
    assert f"total={len(tokens)}" in stdout
    assert result == greedy_text(model, tokens, 10)


def test_hierarchical_attention_masks_rows(pie_rt, bundle) -> None:
    """The default hierarchy hides part of a long prompt from every decode pass."""
    words = " ".join(f"word{i}" for i in range(200))
    result, _, stdout = run(
        pie_rt, bundle, "hierarchical-attention-python", prompt=words, max_tokens=6, chunk_size_words=40
    )
    line = next(ln for ln in stdout.splitlines() if ln.startswith("mask_true_tokens="))
    seen, total = (int(x) for x in line.removeprefix("mask_true_tokens=").split(" / total="))
    assert 0 < seen < total
    assert "generated_tokens=" in stdout and isinstance(result, str)


def test_modular_cache_reuses_saved_prefixes_and_equals_engine_greedy(pie_rt, bundle, model) -> None:
    prompt = "Explain modular KV caching."
    saved_before = set(model.saved_names())
    try:
        first, _, out1 = run(pie_rt, bundle, "modular-cache-python", prompt=prompt, max_tokens=8)
        second, _, out2 = run(pie_rt, bundle, "modular-cache-python", prompt=prompt, max_tokens=8)
    finally:  # the saved prefixes pin pages; other tests count the pool
        for name in set(model.saved_names()) - saved_before:
            model.delete_saved(name)
    assert "cache_miss" in out1 and out1.count("saved=") == 4
    assert "cache_hit_modules=4" in out2 and "saved=" not in out2.replace("save_skipped", "")
    fmt = InstructFormat.for_model(model)
    tokens = fmt.system("You are a concise technical assistant.")
    tokens += fmt.user("Explain simply first, then give implementation details.")
    tokens += fmt.user("Pie inferlets can control forward passes, KV cache snapshots, and generation loops.")
    tokens += fmt.user(prompt) + fmt.cue()
    assert first == second == greedy_text(model, tokens, 8)


def test_two_generations_in_one_inferlet_interleave(pie_rt, bundle) -> None:
    result, sends, _ = run(pie_rt, bundle, "py-concurrency-test")
    assert result == "done"
    assert "[test] verdict: CONCURRENT" in sends
    assert sends.index("[CTX2] START") < sends.index("[CTX1] END")


def test_mcts_searches_to_its_return(pie_rt, bundle) -> None:
    result, _, stdout = run(
        pie_rt, bundle, "mcts-python", max_iterations=6, max_depth=3, rollout_tokens=16, final_tokens=16
    )
    assert "iterations=6" in stdout and "best_score=" in stdout
    assert isinstance(result, str)


def example_schema() -> dict:
    """The constrained example's own PERSON_SCHEMA (the dict literal it passes to json.dumps)."""
    import ast

    tree = ast.parse((EXAMPLES / "python-constrained-decoding" / "main.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "PERSON_SCHEMA":
            return ast.literal_eval(node.value.args[0])
    raise AssertionError("PERSON_SCHEMA not found in the example")


def quote_closing_model(tmp_path):
    """A copy of the tiny model that closes what it opens: an untied LM head that is zero
    but on one hidden unit for a few tokens (a lone quote and a lone comma -1; tokens
    starting with a quote, ']' or '}' +1), and a final norm that keeps only that unit.
    Every other logit is exactly 0, so greedy takes the lowest id the grammar allows
    unless one of those scores above 0: in a string a closing quote always does, after an
    array item either ',' or ']' does (the random model's own favourite string token
    repeats until max_tokens)."""
    import torch
    from safetensors.torch import load_file, save_file

    from api.model_ref import load_model, resolve_model_dir

    dst = tmp_path / "tiny-quotes"
    shutil.copytree(resolve_model_dir("tiny"), dst)
    weights = load_file(str(dst / "model.safetensors"))
    norm = weights["model.language_model.norm.weight"]
    norm.zero_()
    norm[0] = 1.0
    embed = weights["model.language_model.embed_tokens.weight"]
    head = torch.zeros_like(embed)
    model = load_model("tiny")
    for i in range(len(model.tokenizer)):
        text = model.token_text(i)
        if text in ('"', ","):
            head[i, 0] = -1.0
        elif text[:1] in ('"', "]", "}"):
            head[i, 0] = 1.0
    weights["lm_head.weight"] = head
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["tie_word_embeddings"] = False
    config.get("text_config", {})["tie_word_embeddings"] = False
    (dst / "config.json").write_text(json.dumps(config))
    return load_model(dst)


def test_constrained_decoding_returns_schema_json(bundle, tmp_path) -> None:
    """The constrained example on a model that closes strings (``quote_closing_model``):
    the answer is the grammar's doing and equals the engine's constrained greedy
    generation of the same prompt."""
    from engine.grammar import Grammar
    from fixtures.paths import cache_root

    flat = quote_closing_model(tmp_path)
    rt = InferletRuntime({"tiny": flat}, cache_root(), limits=LIMITS)
    result, sends, _ = run(rt, bundle, "python-constrained-decoding", prompt="Alice", max_tokens=400)
    person = json.loads(result)
    assert set(person) == {"name", "age", "email", "skills"} and person["name"] and person["skills"]
    assert sends[-1] == "[done]"

    schema = example_schema()
    fmt = InstructFormat.for_model(flat)
    tokens = fmt.system(
        "You are a helpful assistant that generates structured data. Output ONLY a raw JSON object — no "
        "markdown, no explanation."
    )
    tokens += fmt.user("Alice") + fmt.cue()

    async def go():
        ctx = Context(flat)
        ctx.fill_tokens(tokens)
        g = await ctx.generate(
            Sampler.greedy(),
            stopping.max_tokens(400) | stopping.eos(fmt.stop_tokens()),
            grammar=Grammar.json_schema({**schema, "additionalProperties": False}),
        )
        return g.text

    assert json.loads(asyncio.run(go())) == person


def test_mcp_example_without_a_client_names_the_missing_server(pie_rt, bundle) -> None:
    with pytest.raises(InferletFailedError, match="demo"):
        run(pie_rt, bundle, "mcp-example-py")


def test_a_project_builds_alone(tmp_path, model) -> None:
    """One example exactly as a user builds it (its own folder, Pie.toml and main.py)."""
    from fixtures.paths import cache_root
    from inferlets.build import build_pie_component

    wasm = build_pie_component(EXAMPLES / "py-concurrency-test", cache_root() / "pie-build")
    rt = InferletRuntime({"tiny": model}, cache_root(), limits=LIMITS)

    async def go():
        return await rt.run_async(wasm, ["{}"])

    assert asyncio.run(go()) == "done"


def test_cli_builds_a_pie_project_and_checks_its_input(capsys) -> None:
    """``pie-media inferlet build`` knows Pie's layout; ``run`` checks the input against the
    project's [parameters] before anything runs."""
    from api.cli import main

    assert main(["inferlet", "build", str(EXAMPLES / "py-concurrency-test")]) == 0
    wasm = capsys.readouterr().out.strip()
    assert wasm.endswith(".wasm")
    manifest = EXAMPLES / "python-example" / "Pie.toml"
    code = main(["inferlet", "run", wasm, "--manifest", str(manifest), "--", '{"prompt": 3}'])
    assert code == 2
    assert "parameter 'prompt' must be string" in capsys.readouterr().err


def test_greedy_generation_speculates_and_stays_exact(pie_rt, bundle, model) -> None:
    """Pie's system speculation (default-system-speculation is on for text models): an argmax
    generator feeds the engine's prompt-lookup drafts back as speculative tokens, so the
    tiny model's repetitive greedy text takes fewer passes than tokens, and the text still
    equals plain greedy decoding."""
    prompt = "x y"
    saved_before = set(model.saved_names())
    try:
        before = model.metrics().passes
        out, _, _ = run(
            pie_rt,
            bundle,
            "modular-cache-python",
            prompt=prompt,
            max_tokens=48,
            save_cache=False,
            use_cache=False,
        )
        passes = model.metrics().passes - before
    finally:
        for name in set(model.saved_names()) - saved_before:
            model.delete_saved(name)
    fmt = InstructFormat.for_model(model)
    tokens = fmt.system("You are a concise technical assistant.")
    tokens += fmt.user("Explain simply first, then give implementation details.")
    tokens += fmt.user("Pie inferlets can control forward passes, KV cache snapshots, and generation loops.")
    tokens += fmt.user(prompt) + fmt.cue()
    want = greedy_text(model, tokens, 48)
    assert out == want
    assert len(model.tokenize(want)) >= 40 and passes < 40  # 4 prefill passes + well under one a token
