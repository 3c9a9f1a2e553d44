// Speak: POST /v1/audio/speech; the clip arrives in chunks, then plays and can be saved.
import { api } from "./api.js";
import { $, fillSelect, fmtBytes, showError } from "./ui.js";

let url = null;
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
  const progress = $("speak-progress");
  go.disabled = true;
  progress.textContent = "generating…";
  try {
    const r = await api("/v1/audio/speech", { method: "POST", json: body });
    const reader = r.body.getReader();
    const chunks = [];
    let size = 0;
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      chunks.push(value);
      size += value.length;
      progress.textContent = `received ${fmtBytes(size)}…`;
    }
    const blob = new Blob(chunks, { type: r.headers.get("content-type") || "audio/wav" });
    if (url) URL.revokeObjectURL(url);
    url = URL.createObjectURL(blob);
    const audio = $("speak-audio");
    audio.hidden = false;
    audio.src = url;
    const link = $("speak-download");
    link.href = url;
    link.download = `speech.${format}`;
    link.textContent = `Download speech.${format} (${fmtBytes(size)})`;
    link.hidden = false;
    progress.textContent = `${fmtBytes(size)} of ${format}`;
    audio.play().catch(() => {}); // autoplay may be refused; the controls still work
  } catch (err) {
    progress.textContent = "";
    showError($("speak-error"), err);
  } finally {
    go.disabled = false;
  }
}

export function init() {
  $("speak-form").addEventListener("submit", speak);
}
