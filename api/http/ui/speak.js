// Speak: POST /v1/audio/speech. MP3 (and ADTS AAC where the browser takes it) plays while it
// streams: each chunk the server sends (whole codec frames) is appended to a Media Source
// Extensions SourceBuffer behind the <audio> element. wav/flac (sent whole by the server),
// pcm/opus and browsers without MSE take the whole clip, then play it. Either way the clip
// can be downloaded once complete, and Stop aborts the request (the server frees its pages).
//
// Timings land on the <audio> element as data attributes (ms since the request started):
// data-first-audio (first bytes), data-playing (the element started playing), data-done
// (the stream ended), and data-state: streaming | done | stopped | error.
import { api } from "./api.js";
import { $, fillSelect, fmtBytes, showError } from "./ui.js";

const MSE_TYPES = { mp3: "audio/mpeg", aac: "audio/aac" };
let urls = []; // object URLs of the last clip, revoked when the next one starts
let controller = null;
let started = 0; // performance.now() when the current request started
let voicesLoaded = false;

export async function setModels(list) {
  fillSelect($("speak-model"), list.filter((m) => m.kind === "speech").map((m) => m.id));
  if (voicesLoaded || !list.length) return;
  try {
    const voices = (await (await api("/v1/audio/voices")).json()).data.map((v) => v.id);
    fillSelect($("speak-voice"), voices);
    voicesLoaded = true;
  } catch (e) {
    showError($("speak-error"), e);
  }
}

/** The MSE type for a streamed format, or null when this browser must take the whole clip. */
export function streamType(format) {
  const type = MSE_TYPES[format];
  return type && window.MediaSource && MediaSource.isTypeSupported(type) ? type : null;
}

const since = () => Math.round(performance.now() - started);
const once = (target, name) => new Promise((resolve) => target.addEventListener(name, resolve, { once: true }));

/** Append one chunk and wait until the SourceBuffer took it (appends must not overlap). */
async function append(buffer, chunk) {
  const ended = Promise.race([once(buffer, "updateend"), once(buffer, "error").then(() => Promise.reject(new Error("the browser could not decode the audio stream")))]);
  buffer.appendBuffer(chunk);
  await ended;
}

function objectUrl(thing) {
  const u = URL.createObjectURL(thing);
  urls.push(u);
  return u;
}

/** A player fed chunk by chunk through MSE: playback starts with the first frames. */
async function streamingPlayer(audio, type) {
  const source = new MediaSource();
  audio.src = objectUrl(source);
  await once(source, "sourceopen");
  const buffer = source.addSourceBuffer(type);
  audio.play().catch(() => {}); // starts as soon as enough frames are buffered
  return {
    push: (chunk) => append(buffer, chunk),
    end: () => {
      if (source.readyState === "open" && !buffer.updating) source.endOfStream(); // duration becomes finite
    },
  };
}

/** A player that takes the whole clip at the end (formats MSE cannot stream). */
function wholePlayer(audio, type) {
  const chunks = [];
  return {
    push: async (chunk) => {
      chunks.push(chunk);
    },
    end: () => {
      if (!chunks.length) return;
      audio.src = objectUrl(new Blob(chunks, { type }));
      audio.play().catch(() => {}); // autoplay may be refused; the controls still work
    },
  };
}

function offerDownload(chunks, type, format, size, partial) {
  const link = $("speak-download");
  link.href = objectUrl(new Blob(chunks, { type }));
  const name = partial ? `speech-partial.${format}` : `speech.${format}`;
  link.download = name;
  link.textContent = `Download ${name} (${fmtBytes(size)})`;
  link.hidden = false;
}

async function speak(e) {
  e.preventDefault();
  showError($("speak-error"), null);
  const format = $("speak-format").value;
  const body = {
    model: $("speak-model").value,
    input: $("speak-text").value,
    voice: $("speak-voice").value || "alloy",
    response_format: format,
    max_duration: Number($("speak-max").value),
  };
  const go = $("speak-go");
  const stop = $("speak-stop");
  const progress = $("speak-progress");
  const ttfa = $("speak-ttfa");
  const audio = $("speak-audio");
  const link = $("speak-download");
  for (const u of urls) URL.revokeObjectURL(u);
  urls = [];
  audio.pause();
  audio.removeAttribute("src");
  audio.hidden = true;
  for (const k of ["firstAudio", "playing", "done"]) delete audio.dataset[k];
  audio.dataset.state = "streaming";
  link.hidden = true;
  ttfa.textContent = "";
  go.disabled = true;
  stop.disabled = false;
  progress.textContent = "generating…";
  controller = new AbortController();
  started = performance.now();
  const chunks = [];
  let size = 0;
  let type = "audio/wav";
  let player = null;
  try {
    // A 4xx (bad input, unknown voice, wrong key, busy) arrives as JSON before any audio.
    const r = await api("/v1/audio/speech", { method: "POST", json: body, signal: controller.signal });
    type = (r.headers.get("content-type") || "audio/wav").split(";")[0];
    const mse = streamType(format);
    audio.hidden = false;
    player = mse ? await streamingPlayer(audio, mse) : wholePlayer(audio, type);
    const reader = r.body.getReader();
    for (;;) {
      let step;
      try {
        step = await reader.read();
      } catch (err) {
        if (err.name === "AbortError") throw err;
        throw new Error(`the audio stream broke off after ${fmtBytes(size)}: the server ended it (see its log)`);
      }
      if (step.done) break;
      if (!chunks.length) {
        audio.dataset.firstAudio = String(since());
        ttfa.textContent = `first audio after ${since()} ms`;
      }
      chunks.push(step.value);
      size += step.value.length;
      progress.textContent = `${mse ? "playing while it streams" : "receiving"}: ${fmtBytes(size)}…`;
      await player.push(step.value);
    }
    audio.dataset.done = String(since());
    player.end();
    audio.dataset.state = "done";
    progress.textContent = `${fmtBytes(size)} of ${format} in ${since()} ms${mse ? " (streamed)" : ""}`;
    if (chunks.length) offerDownload(chunks, type, format, size, false);
  } catch (err) {
    audio.dataset.done = String(since());
    player?.end(); // what arrived stays playable
    if (err.name === "AbortError") {
      audio.dataset.state = "stopped";
      progress.textContent = `stopped after ${fmtBytes(size)}`;
      if (chunks.length) offerDownload(chunks, type, format, size, true);
    } else {
      audio.dataset.state = "error";
      progress.textContent = "";
      showError($("speak-error"), err);
    }
  } finally {
    controller = null;
    go.disabled = false;
    stop.disabled = true;
  }
}

export function init() {
  $("speak-form").addEventListener("submit", speak);
  $("speak-stop").addEventListener("click", () => controller?.abort());
  const audio = $("speak-audio");
  audio.addEventListener("playing", () => {
    if (!("playing" in audio.dataset)) audio.dataset.playing = String(since());
  });
}
