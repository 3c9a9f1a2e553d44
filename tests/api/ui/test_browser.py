"""The page at ``/ui`` in a real headless Chromium against the real server (tiny models):
what a person sees equals what the API answers, and the page's controls do what they say
(the stop button frees the request's KV pages, a job reports its bad file, an inferlet's
sends arrive in order, a wrong key shows the server's 401 message). Each panel is
photographed at desktop and phone width."""

from __future__ import annotations

import base64
import itertools
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import av
import httpx
import pytest

from tests.api.http.conftest import Server, start_server, stop_server
from tests.api.ui.conftest import KEY, PHONE, UPLOAD_LIMIT, UiServer, open_page

QWEN = "tiny-qwen3-vl"
EXAMPLES = Path(__file__).resolve().parents[3] / "inferlets" / "examples"


def metric(ui: UiServer, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{ui.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text  # the admin's
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise AssertionError(f"no {name} {labels} in /metrics")


def until(page, expression: str, timeout: float = 60) -> None:
    """Poll a JS expression (page.wait_for_function evaluates strings, which the page's CSP forbids)."""
    deadline = time.monotonic() + timeout
    while not page.evaluate(expression):
        assert time.monotonic() < deadline, f"still false after {timeout} s: {expression}"
        time.sleep(0.05)


def drop_file(page, selector: str, path: Path, mime: str) -> None:
    """Drop a file on a drop zone as a person dragging it from their desktop would."""
    data = page.evaluate_handle(
        """([name, b64, mime]) => {
            const dt = new DataTransfer();
            const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
            dt.items.add(new File([bytes], name, { type: mime }));
            return dt;
        }""",
        [path.name, base64.b64encode(path.read_bytes()).decode(), mime],
    )
    page.dispatch_event(selector, "drop", {"dataTransfer": data})


def sampling(page, **values: object) -> None:
    if not page.is_visible("#chat-max-tokens"):
        page.click(".sampling summary")
    for name, value in values.items():
        if name == "ignore_eos":
            page.set_checked("#chat-ignore-eos", bool(value))
        else:
            page.fill(f"#chat-{name.replace('_', '-')}", str(value))


def ask(page, text: str, *, wait: str = "done") -> str:
    n = page.locator(".msg.assistant").count()
    page.fill("#chat-input", text)
    page.click("#chat-send")
    answer = page.locator(".msg.assistant").nth(n)
    if wait:
        answer.and_(page.locator(f"[data-done='{wait}']")).wait_for()
    return answer.locator(".text").inner_text()


FIRST_LINE_GAP = """(node) => {
    // px between the bubble's role label and the top of its first visible character
    const who = node.querySelector(".who").getBoundingClientRect();
    const walker = document.createTreeWalker(node.querySelector(":scope > .text"), NodeFilter.SHOW_TEXT);
    for (let t = walker.nextNode(); t; t = walker.nextNode()) {
        const i = t.data.search(/\\S/);
        if (i < 0) continue;
        const r = document.createRange();
        r.setStart(t, i);
        r.setEnd(t, i + 1);
        return r.getBoundingClientRect().top - who.bottom;
    }
    return null;
}"""


def first_line_gap(bubble) -> float:
    """How far below its role label a bubble's text begins (a blank band shows as tens of px)."""
    gap = bubble.evaluate(FIRST_LINE_GAP)
    assert gap is not None, "the bubble shows no text"
    return gap


def shown_image(img) -> tuple[int, int]:
    """An <img>'s decoded size, after checking it loaded and takes room on the page."""
    img.scroll_into_view_if_needed()
    deadline = time.monotonic() + 10
    while not img.evaluate("(i) => i.complete"):
        assert time.monotonic() < deadline, "the image never finished loading"
        time.sleep(0.05)
    info = img.evaluate(
        "(i) => ({done: i.complete, w: i.naturalWidth, h: i.naturalHeight, box: i.getBoundingClientRect().width, src: i.src})"
    )
    assert info["done"] and info["box"] > 0 and info["src"].startswith("blob:"), info
    return info["w"], info["h"]


def player(page, selector: str, timeout: float = 20) -> float:
    """The duration an <audio>/<video> in the chat found in the local file (its metadata loaded)."""
    until(
        page,
        f"(() => {{ const m = document.querySelector({selector!r}); return !!m && m.readyState >= 1 && isFinite(m.duration); }})()",
        timeout,
    )
    return page.evaluate(f"document.querySelector({selector!r}).duration")


def api_chat(ui: UiServer, messages: list[dict], max_tokens: int) -> str:
    r = httpx.post(
        f"{ui.url}/v1/chat/completions",
        headers=ui.headers,
        json={"model": QWEN, "messages": messages, "temperature": 0, "top_p": 1, "max_tokens": max_tokens},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_wrong_key_shows_the_servers_401_message(browser, ui_server: UiServer, shot) -> None:
    page = open_page(browser, ui_server, None)
    try:
        page.wait_for_selector("#status.bad:has-text('401')")
        assert "Missing API key" in page.inner_text("#status")
        page.fill("#key-input", "sk-wrong")
        page.click("#key-save")
        page.wait_for_selector("#status.bad:has-text('Incorrect API key provided')")
        assert "401" in page.inner_text("#status")
        assert page.evaluate("sessionStorage.getItem('pie-media-api-key')") == "sk-wrong"
        shot(page, "wrong-key")
        page.fill("#key-input", ui_server.key)
        page.press("#key-input", "Enter")
        page.wait_for_selector(f"#status:not(.bad):has-text('{QWEN}')")
        assert page.errors == []
    finally:
        page.context.close()


def test_dropped_png_answer_equals_the_api_and_turns_continue(page, ui_server: UiServer, samples: Path, shot):
    png = samples / "images" / "rgba.png"
    drop_file(page, "#chat-drop", png, "image/png")
    page.wait_for_selector(f"#chat-attachments li:has-text('tokens for {QWEN}')")
    facts = page.inner_text("#chat-attachments")
    assert "image" in facts and "96×48" in facts
    sampling(page, temperature=0, top_p=1, max_tokens=16)
    first = ask(page, "What is in this picture?")

    uploaded = httpx.post(
        f"{ui_server.url}/v1/media", headers=ui_server.headers, files=[("file", (png.name, png.read_bytes()))]
    ).json()["data"][0]["media"]
    turn1 = {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": f"pie-media://{uploaded['id']}"}},
            {"type": "text", "text": "What is in this picture?"},
        ],
    }
    raw = api_chat(ui_server, [turn1], 16)
    # the bubble shows the API's answer without the newlines it opens with (the tiny model's
    # answer starts with "\n\n\n"), so its first line sits right under the role label
    assert raw != raw.lstrip() and first == raw.strip()
    assert first  # the tiny model says something
    bubble = page.locator(".msg.assistant").first
    assert 0 <= first_line_gap(bubble) < 8
    thumbnail = page.locator(".msg.user").first.locator("figure.attached img")
    assert shown_image(thumbnail) == (96, 48)  # the photo itself, decoded, on screen
    assert thumbnail.get_attribute("alt") == png.name
    second = ask(page, "And the colours?")
    history = [turn1, {"role": "assistant", "content": raw}]  # the page sends the text as it came
    raw2 = api_chat(
        ui_server, [*history, {"role": "user", "content": [{"type": "text", "text": "And the colours?"}]}], 16
    )
    assert second == raw2.strip()
    assert 0 <= first_line_gap(page.locator(".msg.assistant").nth(1)) < 8
    assert page.locator(".msg.user img").count() == 1  # the later turn carries no media
    assert shown_image(thumbnail) == (96, 48)  # and the first turn's thumbnail is still there

    # a file the server refuses shows the server's own typed message
    big = samples / "images" / "photo_4032x3024.jpg"
    assert big.stat().st_size > UPLOAD_LIMIT
    page.set_input_files("#chat-files", str(big))
    bad = page.wait_for_selector("#chat-attachments li.bad")
    assert "413" in bad.inner_text() and str(UPLOAD_LIMIT) in bad.inner_text()
    shot(page, "chat")
    page.click("#chat-attachments li.bad button")


def test_each_drop_zone_has_one_file_control(page, samples: Path) -> None:
    """One clear control per drop zone (not a "choose files" link beside a native "Choose
    Files" button): the native input is visually hidden, the zone's one button-like label
    opens the browser's file chooser, and what is picked there is attached."""
    zones = {
        "chat": "#chat-drop",
        "jobs": "label[for='jobs-files']",
        "inferlets": "label[for='inferlet-file']",
    }
    for panel, zone in zones.items():
        page.click(f"#tab-{panel}")
        text = page.inner_text(zone).lower()
        assert text.count("choose") == 1, text
        controls = page.locator(f"{zone} .pick")
        assert controls.count() == 1 and controls.is_visible()
        box = page.locator(f"{zone} input[type=file]").bounding_box()
        assert box is not None and box["width"] <= 1 and box["height"] <= 1  # no native button drawn
    page.click("#tab-chat")
    with page.expect_file_chooser() as chooser:
        page.click("#chat-drop .pick")
    assert chooser.value.is_multiple()
    chooser.value.set_files(str(samples / "images" / "rgba.png"))
    item = page.locator("#chat-attachments li", has_text="rgba.png")
    item.locator(f"text=tokens for {QWEN}").wait_for()
    assert item.locator("img.thumb").evaluate("(i) => i.complete && i.naturalWidth") == 96
    item.locator("button").click()
    assert page.locator("#chat-attachments li").count() == 0


def test_stop_cancels_the_request_and_its_pages_come_back(page, ui_server: UiServer) -> None:
    before = metric(ui_server, "pie_media_kv_pages", model=QWEN, state="used")
    sampling(page, temperature=0, max_tokens=1500, ignore_eos=True)
    ask(page, "Count to a thousand.", wait="")
    until(
        page,
        "document.querySelectorAll('.msg.assistant .text')[document.querySelectorAll('.msg.assistant').length - 1].textContent.length > 0",
    )
    assert metric(ui_server, "pie_media_kv_pages", model=QWEN, state="used") > before
    page.click("#chat-stop")
    page.wait_for_selector(".msg.assistant[data-done='stopped']")
    deadline = time.monotonic() + 15
    while metric(ui_server, "pie_media_kv_pages", model=QWEN, state="used") != before:
        assert time.monotonic() < deadline, "the stopped request's pages did not come back"
        time.sleep(0.1)
    assert metric(ui_server, "pie_media_requests_in_flight", model=QWEN) == 0
    sampling(page, max_tokens=16, ignore_eos=False)


def test_clips_show_players_in_the_history(page, samples: Path, shot) -> None:
    """A video and an audio clip sent in the chat stay in their bubbles as players of the
    local file; a turn the model refuses (this model takes no audio) stays on screen but out
    of the history, so the next turn is answered."""
    page.click("#tab-chat")
    page.click("#chat-clear")
    clip = samples / "video" / "vp9_320x240_25fps_2s.webm"
    page.set_input_files("#chat-files", str(clip))
    page.wait_for_selector(f"#chat-attachments li:has-text('tokens for {QWEN}')")
    ask(page, "What happens in this clip?")
    video = ".msg.user figure.attached video"
    assert page.locator(video).count() == 1
    assert player(page, video) == pytest.approx(2.0, abs=0.1)
    assert page.get_attribute(video, "src").startswith("blob:")

    tone = samples / "audio" / "tone_16k_mono.wav"
    page.set_input_files("#chat-files", str(tone))
    page.wait_for_selector(f"#chat-attachments li:has-text('{QWEN} cannot take audio')")
    ask(page, "What is this sound?", wait="failed")
    err = page.inner_text("#chat-error")
    assert "400" in err and "audio" in err, err
    audio = ".msg.user figure.attached audio"
    assert player(page, audio) == pytest.approx(2.0, abs=0.05)  # 64,000 bytes of 16 kHz 16-bit mono

    assert ask(page, "Say something.")  # answered: the refused audio turn is not resent
    assert page.is_hidden("#chat-error")
    assert player(page, video) == pytest.approx(2.0, abs=0.1)  # the players are still there
    assert page.locator(".msg.user figure.attached").count() == 2
    shot(page, "chat-clips")


def test_spoken_clip_plays_and_errors_are_the_servers(page, ui_server: UiServer, shot) -> None:
    page.click("#tab-speak")
    page.fill("#speak-text", "")
    page.click("#speak-go")
    err = page.wait_for_selector("#speak-error:not([hidden])")
    assert "400" in err.inner_text() and "input" in err.inner_text()
    page.fill("#speak-text", "Good morning.")
    page.fill("#speak-max", "1")
    page.select_option("#speak-format", "wav")
    page.click("#speak-go")
    until(
        page,
        "(() => { const a = document.getElementById('speak-audio'); return !a.hidden && isFinite(a.duration) && a.duration > 0; })()",
    )
    assert page.is_hidden("#speak-error")
    assert page.get_attribute("#speak-download", "download") == "speech.wav"
    duration = page.evaluate("document.getElementById('speak-audio').duration")
    assert 0 < duration <= 1.2
    shot(page, "speak")


AUDIO = "document.getElementById('speak-audio')"


def speech_times(page) -> dict[str, int]:
    """speak.js's timings of the last request (ms since it started) and its state."""
    data = page.evaluate(f"({{...{AUDIO}.dataset}})")
    return {k: (v if k == "state" else int(v)) for k, v in data.items()}


def test_mp3_plays_while_it_streams(page, ui_server: UiServer, shot) -> None:
    page.click("#tab-speak")
    page.fill("#speak-text", "Good morning, and welcome to the page.")
    page.fill("#speak-max", "5")
    page.select_option("#speak-format", "mp3")
    assert page.evaluate("window.MediaSource && MediaSource.isTypeSupported('audio/mpeg')")
    page.click("#speak-go")
    until(page, f"{AUDIO}.dataset.state === 'done'")
    times = speech_times(page)
    assert times["state"] == "done" and page.is_hidden("#speak-error")
    # the element started playing before the last byte arrived: it played the stream
    assert "playing" in times, times
    assert times["firstAudio"] <= times["playing"] < times["done"], times
    until(page, f"isFinite({AUDIO}.duration) && {AUDIO}.duration > 0 && {AUDIO}.currentTime > 0")
    duration = page.evaluate(f"{AUDIO}.duration")
    assert 0 < duration <= 5.3
    assert "first audio after" in page.inner_text("#speak-ttfa") and "ms" in page.inner_text("#speak-ttfa")
    assert "(streamed)" in page.inner_text("#speak-progress")
    link = page.locator("#speak-download")
    assert link.get_attribute("download") == "speech.mp3"
    with page.expect_download() as download:
        link.click()
    clip = Path(download.value.path())
    assert f"({clip.stat().st_size / 1024:.1f} KiB)" in link.inner_text()  # every chunk, once
    with av.open(str(clip)) as f:  # the saved file is the clip that played: same length
        frames = list(f.decode(audio=0))
    assert sum(fr.samples for fr in frames) / frames[0].sample_rate == pytest.approx(duration, abs=0.1)
    shot(page, "speak-streaming")


def test_speech_stop_aborts_and_its_pages_come_back(page, ui_server: UiServer) -> None:
    csm = "tiny-csm"
    before = metric(ui_server, "pie_media_kv_pages", model=csm, state="used")
    page.click("#tab-speak")
    page.fill("#speak-max", "60")
    page.select_option("#speak-format", "mp3")
    page.click("#speak-go")
    until(page, f"'firstAudio' in {AUDIO}.dataset")
    assert metric(ui_server, "pie_media_requests_in_flight", model=csm) == 1
    page.click("#speak-stop")
    until(page, f"{AUDIO}.dataset.state === 'stopped'")
    assert "stopped after" in page.inner_text("#speak-progress")
    assert page.get_attribute("#speak-download", "download") == "speech-partial.mp3"
    assert page.is_disabled("#speak-stop") and page.is_enabled("#speak-go")
    deadline = time.monotonic() + 15
    while (
        metric(ui_server, "pie_media_kv_pages", model=csm, state="used") != before
        or metric(ui_server, "pie_media_requests_in_flight", model=csm) != 0
    ):
        assert time.monotonic() < deadline, "the stopped speech request's pages did not come back"
        time.sleep(0.1)
    page.fill("#speak-max", "5")


def test_caption_job_of_twelve_reports_the_bad_file(page, samples: Path, shot) -> None:
    images = sorted(
        p
        for p in (samples / "images").iterdir()
        if p.suffix in (".png", ".jpg") and p.stat().st_size < UPLOAD_LIMIT
    )
    files = [*images[:11], samples / "hostile" / "image_truncated.jpg"]
    assert len(files) == 12
    page.click("#tab-jobs")
    page.fill("#jobs-max-tokens", "4")
    page.set_input_files("#jobs-files", [str(f) for f in files])
    assert page.inner_text("#jobs-picked") == "12 file(s) chosen"
    page.click("#jobs-start")
    page.wait_for_selector("#jobs-download:not([hidden])")
    assert "12/12 (11 captioned, 1 failed)" in page.inner_text("#jobs-counts")
    assert page.get_attribute("#jobs-bar", "value") == "12"
    rows = page.locator("#jobs-results tbody tr")
    assert rows.count() == 12
    bad = page.locator("#jobs-results tbody tr.bad")
    assert bad.count() == 1 and "image_truncated.jpg" in bad.inner_text()
    shot(page, "jobs")


@pytest.fixture(scope="module")
def wasm() -> Path:
    from fixtures.paths import cache_root
    from inferlets import build_component

    return build_component(EXAMPLES, cache_root() / "inferlets-build")


def test_inferlet_sends_appear_in_order(page, ui_server: UiServer, wasm: Path, shot) -> None:
    args = ["best-of", QWEN, "Name a fruit.", "6", "3", "0.8", "5"]
    page.click("#tab-inferlets")
    page.set_input_files("#inferlet-file", str(wasm))
    page.wait_for_selector("#inferlet-run:not([disabled])", timeout=180_000)
    inferlet_id = page.inner_text("#inferlet-id").split()[0]
    page.fill("#inferlet-args", "\n".join(args))
    page.click("#inferlet-run")
    page.wait_for_selector("#inferlet-state:text('succeeded')")
    sends = page.locator("#inferlet-sends li").all_inner_texts()
    run = httpx.post(
        f"{ui_server.url}/v1/inferlets/{inferlet_id}/runs",
        headers=ui_server.headers,
        json={"args": args},
        timeout=120,
    ).json()
    assert len(sends) == 3 and sends == run["sends"]
    assert page.inner_text("#inferlet-result") == run["result"]
    page.fill("#inferlet-args", "no-such-example")
    page.click("#inferlet-run")
    err = page.wait_for_selector("#inferlet-error:not([hidden])")
    assert "first argument" in err.inner_text()
    shot(page, "inferlets")


CHART_AXES = """(fig) => {
    const svg = fig.querySelector("svg.timechart");
    const texts = (cls) => [...svg.querySelectorAll("text." + cls)];
    return {
        yticks: texts("ytick").map((t) => ({ text: t.textContent, value: Number(t.dataset.value), y: Number(t.getAttribute("y")) })),
        xticks: texts("xtick").map((t) => ({ text: t.textContent, t: Number(t.dataset.t), x: Number(t.getAttribute("x")) })),
        ylabel: texts("ylabel").map((t) => t.textContent).join(""),
        nodata: texts("nodata").map((t) => t.textContent).join(""),
        span: fig.querySelector("figcaption .span").textContent,
        lines: Object.fromEntries([...svg.querySelectorAll("[data-series]")].map((n) => [n.dataset.series,
            n.tagName === "circle" ? [[Number(n.getAttribute("cx")), Number(n.getAttribute("cy"))]]
                : n.getAttribute("points").split(" ").map((p) => p.split(",").map(Number))])),
        width: svg.getBoundingClientRect().width,
    };
}"""


def chart_axes(page, model: str, chart: str) -> dict:
    return page.locator(f".chart[data-chart='{chart}'][data-model='{model}']").evaluate(CHART_AXES)


def laid_out_axes(page, model: str, chart: str, timeout: float = 10) -> dict:
    """``chart_axes`` once the chart has a layout: read while a refresh redraws it, its SVG
    can measure 0 wide for a moment (a clean clone's CI read it so once)."""
    deadline = time.monotonic() + timeout
    while True:
        axes = chart_axes(page, model, chart)
        if axes["width"] > 0 or time.monotonic() > deadline:
            return axes
        time.sleep(0.05)


def value_at(axes: dict, y: float) -> float:
    """The value a point at height y stands for, read off the chart's own y ticks."""
    lo, hi = axes["yticks"][0], axes["yticks"][-1]
    return lo["value"] + (y - lo["y"]) / (hi["y"] - lo["y"]) * (hi["value"] - lo["value"])


def test_server_panel_draws_live_charts(page, ui_server: UiServer, shot) -> None:
    """Each chart reads as a Grafana panel of the same series would: a y scale from 0 in the
    series' unit, clock time along x over the last minutes (up to 5; fewer while the page is
    new), the line where the scale says its value is, and "no data" words (not a bare line)
    for a series with none."""
    api_chat(ui_server, [{"role": "user", "content": "Hi"}], 1)  # a time to first token, run alone too
    page.click("#tab-server")
    for name in (QWEN, "tiny-csm"):
        page.wait_for_selector(f"#server-models td:text('{name}')")
    kv = f".chart[data-chart='kv'][data-model='{QWEN}']"
    page.wait_for_selector(f"{kv} polyline[data-series='free']", state="attached")  # two scrapes or more
    used = int(metric(ui_server, "pie_media_kv_pages", model=QWEN, state="used"))  # the server is idle now
    free = int(metric(ui_server, "pie_media_kv_pages", model=QWEN, state="free"))
    until(
        page,
        f"document.querySelector(\"{kv} .value\").textContent === 'used {used} · free {free}'",
        timeout=10,
    )

    for model in (QWEN, "tiny-csm"):
        for chart in ("kv", "contexts", "cache", "ttft"):
            axes = laid_out_axes(page, model, chart)
            minutes = int(axes["span"].removeprefix("last ").removesuffix(" min"))
            assert axes["span"] == f"last {minutes} min" and 1 <= minutes <= 5 and axes["ylabel"], axes
            ys = axes["yticks"]
            assert len(ys) >= 3 and ys[0]["value"] == 0, ys
            assert all(a["value"] < b["value"] and a["y"] > b["y"] for a, b in itertools.pairwise(ys)), ys
            xs = axes["xticks"]  # round clock times across the window, as the browser's clock shows them
            assert len(xs) >= 3, xs
            step = xs[1]["t"] - xs[0]["t"]
            assert step in (15_000, 30_000, 60_000), xs
            assert all(b["t"] - a["t"] == step and a["x"] < b["x"] for a, b in itertools.pairwise(xs)), xs
            for x in xs:
                clock = time.localtime(x["t"] / 1000)
                expect = time.strftime("%H:%M", clock) if clock.tm_sec == 0 else f":{clock.tm_sec:02d}"
                assert x["text"] == expect, x
            assert time.time() * 1000 - minutes * 60_000 <= xs[0]["t"] and xs[-1]["t"] <= time.time() * 1000
            assert axes["width"] > 150
    cache = chart_axes(page, QWEN, "cache")
    assert [t["text"] for t in cache["yticks"]] == ["0%", "25%", "50%", "75%", "100%"]
    assert all(t["text"].endswith((" ms", " s")) for t in chart_axes(page, QWEN, "ttft")["yticks"])
    ttft = f".chart[data-chart='ttft'][data-model='{QWEN}']"
    until(
        page, f'document.querySelector("{ttft} .value").textContent.match(/^mean [0-9.]+ m?s$/)', timeout=10
    )

    # the lines sit where the scale says: free pages near their count, used pages on the zero line
    axes = chart_axes(page, QWEN, "kv")
    top = axes["yticks"][-1]["value"]
    assert top >= free
    newest_free = axes["lines"]["free"][-1]
    assert value_at(axes, newest_free[1]) == pytest.approx(free, abs=top * 0.01)
    assert value_at(axes, axes["lines"]["used"][-1][1]) == pytest.approx(used, abs=top * 0.01)
    assert newest_free[0] > axes["xticks"][-1]["x"]  # the newest sample is at "now", right of the last minute
    assert len(axes["lines"]["free"]) >= 2  # a line over time, not one number

    # a series with no sample says so instead of drawing a line
    speech_cache = chart_axes(page, "tiny-csm", "cache")
    assert speech_cache["nodata"] == "no media encoded yet" and speech_cache["lines"] == {}
    shot(page, "server")


@pytest.fixture(scope="session", autouse=True)
def spare_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Future[Server]]:
    """The throwaway server that test_a_stopped_server_shows_unreachable stops, started in a
    thread as the module begins: its ~10 s of start-up overlap the main server's instead of
    adding to the module's time. (Session scope, autouse: set up before ``ui_server``.)"""
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(start_server, tmp_path_factory.mktemp("spare"), models=("tiny",))
        yield future
        if future.exception() is None:
            stop_server(future.result())


def test_a_stopped_server_shows_unreachable(browser, spare_server: Future[Server], shot) -> None:
    """A throwaway server (no key: loopback) stops under the open page: the status line says
    the server is unreachable (not a blank or a stale "connected") and a panel's action
    shows the same message."""
    server = spare_server.result()
    page = open_page(browser, UiServer(server, ""), None)
    try:
        page.wait_for_selector(f"#status:not(.bad):has-text('connected: {QWEN}')")
        stop_server(server)
        # nothing clicked: the Server panel's live refresh notices within its 2 s period
        page.wait_for_selector("#status.bad:has-text('Server unreachable')", timeout=10_000)
        assert server.url in page.inner_text("#status") and "Retrying" in page.inner_text("#status")
        assert page.get_attribute("body", "data-server") == "down"
        page.fill("#chat-input", "Anyone there?")
        page.click("#chat-send")
        err = page.wait_for_selector("#chat-error:not([hidden])")
        assert "Server unreachable" in err.inner_text()
        page.click("#tab-server")
        page.wait_for_selector("#server-error:has-text('Server unreachable')")
        shot(page, "server-down")
        assert page.errors == []
    finally:
        page.context.close()
        stop_server(server)


def test_the_page_reconnects_when_the_server_answers_again(page) -> None:
    """The network between page and server drops, then returns (Chromium's offline mode:
    a second server start would cost ~10 s): unreachable, then connected again unprompted."""
    page.click("#tab-chat")
    page.context.set_offline(True)
    try:
        page.wait_for_selector("#status.bad:has-text('Server unreachable')", timeout=10_000)
    finally:
        page.context.set_offline(False)
    page.wait_for_selector(f"#status:not(.bad):has-text('connected: {QWEN}')", timeout=10_000)
    assert page.get_attribute("body", "data-server") == "up"
    page.wait_for_selector("#server-error", state="hidden")


def test_every_panel_fits_a_phone_and_tabs_take_the_keyboard(page) -> None:
    page.set_viewport_size(PHONE)
    try:
        page.focus("#tab-chat")
        for name in ("speak", "jobs", "inferlets", "server", "chat"):
            page.keyboard.press("ArrowRight")
            assert page.evaluate("document.activeElement.id") == f"tab-{name}"
            assert page.is_visible(f"#panel-{name}")
            assert page.locator(".panel:visible").count() == 1  # one panel at a time
            width = page.evaluate("document.documentElement.scrollWidth")
            assert width <= PHONE["width"], (name, width)
    finally:
        page.set_viewport_size({"width": 1280, "height": 860})
