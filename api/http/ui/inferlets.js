// Inferlets: Pie programs (programs.js: list, install, a form from [parameters], launch,
// live events, processes with Stop), and a bare component: upload it (POST /v1/inferlets),
// run it streamed (SSE: run, send..., result|error).
import { api, sse } from "./api.js";
import * as programs from "./programs.js";
import { $, el, fmtBytes, showError } from "./ui.js";

let inferletId = null;
let running = null;

async function upload() {
  const file = $("inferlet-file").files[0];
  if (!file) return;
  showError($("inferlet-error"), null);
  $("inferlet-run").disabled = true;
  $("inferlet-id").textContent = `uploading and compiling ${file.name} (${fmtBytes(file.size)})…`;
  try {
    const r = await api("/v1/inferlets", { method: "POST", body: file, headers: { "Content-Type": "application/wasm" } });
    const obj = await r.json();
    inferletId = obj.id;
    $("inferlet-id").textContent = `${obj.id} (${fmtBytes(obj.bytes)})`;
    $("inferlet-run").disabled = false;
  } catch (e) {
    $("inferlet-id").textContent = "no component chosen";
    showError($("inferlet-error"), e);
  }
}

async function run(e) {
  e.preventDefault();
  if (!inferletId || running) return;
  showError($("inferlet-error"), null);
  const args = $("inferlet-args").value.split("\n").filter((a) => a.length);
  const sends = $("inferlet-sends");
  sends.replaceChildren();
  $("inferlet-result").textContent = "";
  const state = $("inferlet-state");
  state.textContent = "starting…";
  running = new AbortController();
  $("inferlet-run").disabled = true;
  $("inferlet-cancel").disabled = false;
  try {
    const r = await api(`/v1/inferlets/${inferletId}/runs`, {
      method: "POST",
      json: { args, stream: true },
      signal: running.signal,
    });
    for await (const { event, data } of sse(r)) {
      const d = JSON.parse(data);
      if (event === "run") state.textContent = `running ${d.id}`;
      else if (event === "send") sends.append(el("li", { text: d.text }));
      else if (event === "result") {
        $("inferlet-result").textContent = d.result ?? "";
        state.textContent = "succeeded";
      } else if (event === "error") {
        state.textContent = d.status;
        const err = d.error || {};
        showError($("inferlet-error"), new Error(`${err.code}: ${err.message}`));
      }
    }
  } catch (err) {
    if (err.name === "AbortError") state.textContent = "cancelled";
    else {
      state.textContent = "";
      showError($("inferlet-error"), err);
    }
  } finally {
    running = null;
    $("inferlet-run").disabled = false;
    $("inferlet-cancel").disabled = true;
  }
}

/** The key may have changed (app.js hands every panel the models after each /v1/models). */
export function setModels() {
  programs.reload();
}

export function init() {
  programs.init();
  $("inferlet-file").addEventListener("change", upload);
  $("inferlet-form").addEventListener("submit", run);
  $("inferlet-cancel").addEventListener("click", () => running?.abort());
}
