"""LoRA adapters served as models (``--lora-modules NAME=PATH[@BASE]``): a request to the
adapter's name equals the engine run under that adapter, token for token, and requests to
the base and to two adapters at once still share the base model's batched passes."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.api.http.conftest import Server, start_server, stop_server

MSGS = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_dir) -> dict[str, Path]:
    from fixtures.tiny_lora import build_adapter

    root = tmp_path_factory.mktemp("adapters")
    return {
        "sea": build_adapter(tiny_dir("tiny-qwen3-vl"), root / "sea", seed=1),
        "sky": build_adapter(tiny_dir("tiny-qwen3-vl"), root / "sky", seed=2),
        "gem": build_adapter(tiny_dir("tiny-gemma4"), root / "gem", seed=3),
    }


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory: pytest.TempPathFactory, adapters) -> Iterator[Server]:
    s = start_server(
        tmp_path_factory.mktemp("serve-lora"),
        "--lora-modules",
        f"sea={adapters['sea']}",
        f"sky={adapters['sky']}@tiny-qwen3-vl",
        f"gem={adapters['gem']}@tiny-gemma4",
    )
    yield s
    stop_server(s)


def _in_process(adapter_dir: Path | None, max_tokens: int) -> str:
    from api.model_ref import load_model
    from engine import CompletionParams, Turn, complete, run_sync

    model = load_model("tiny", device="cpu")
    adapters = ((model.load_adapter(adapter_dir), 1.0),) if adapter_dir else ()
    params = CompletionParams(max_tokens=max_tokens, adapters=adapters)
    results, _ = run_sync(complete(model, [Turn("user", (MSGS[0]["content"],))], params))
    return results[0].text


def test_adapter_models_answer_as_the_engine_under_the_adapter(lora_server: Server, adapters) -> None:
    client = openai.OpenAI(base_url=lora_server.v1, api_key="x", max_retries=0, timeout=120)
    cards = {m.id: m for m in client.models.list()}
    assert cards["sea"].model_extra["parent"] == "tiny-qwen3-vl"
    assert cards["gem"].model_extra["parent"] == "tiny-gemma4"
    assert cards["tiny-qwen3-vl"].model_extra["parent"] is None

    def ask(name: str) -> str:
        r = client.chat.completions.create(model=name, messages=MSGS, max_tokens=12, temperature=0)
        return r.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # base + two adapters at once
        base, sea, sky = pool.map(ask, ["tiny-qwen3-vl", "sea", "sky"])
    assert sea == _in_process(adapters["sea"], 12)
    assert sky == _in_process(adapters["sky"], 12)
    assert base == _in_process(None, 12)
    assert len({base, sea, sky}) == 3  # the adapters change the answer
    assert ask("gem") != ask("tiny-gemma4")


def test_adapter_names_where_only_base_models_run(lora_server: Server) -> None:
    r = httpx.post(f"{lora_server.v1}/embeddings", json={"model": "sea", "input": "hi"})
    assert r.status_code == 400 and "LoRA adapter" in r.json()["error"]["message"]
    r = httpx.post(
        f"{lora_server.v1}/captions",
        data={"model": "sea", "prompt": "x"},
        files=[("file", ("a.png", b"\x89PNG", "image/png"))],
    )
    assert r.status_code == 400 and "LoRA adapter" in r.json()["error"]["message"]


def test_bad_lora_module_refuses_to_start(tmp_path: Path, adapters) -> None:
    with pytest.raises(RuntimeError, match="adapter|NAME=PATH"):
        start_server(tmp_path, "--lora-modules", f"bad={adapters['gem']}@tiny-qwen3-vl")
    (tmp_path / "b").mkdir()
    with pytest.raises(RuntimeError, match="NAME=PATH"):
        start_server(tmp_path / "b", "--lora-modules", "no-equals-sign")
