// Pie programs in the Inferlets panel: the caller's programs (GET /v1/pie/programs), an
// install from a component and its Pie.toml (POST /v1/pie/programs), a launch form built
// from the program's [parameters] (POST /v1/pie/programs/{ref}/launch), the shown
// process's events as they come (SSE: GET /v1/pie/runs/{id}/events), and the processes
// of both doors (GET /v1/inferlets/runs) with Stop (POST .../runs/{id}/cancel).
import { api, sse } from "./api.js";
import { $, dropZone, el, fmtBytes, showError } from "./ui.js";

let programs = [];
let chosen = null; // the program whose form is shown
let watching = null; // {id, abort}: the process whose events are shown
let picked = { wasm: null, toml: null };
let poll = null;
const launchedAs = new Map(); // run id -> the program ref this page launched it as
const downloads = [];

const INT = new Set(["int", "integer"]);
const FLOAT = new Set(["float", "number"]);
const BOOL = new Set(["bool", "boolean"]);
const TEXT = new Set(["string", "str"]);

function error(e) {
  showError($("pie-error"), e);
}

// -- the programs ------------------------------------------------------------------------
export async function reload() {
  const state = $("pie-programs-state");
  try {
    const r = await api("/v1/pie/programs");
    programs = (await r.json()).data;
    state.textContent = `${programs.length} program(s)`;
  } catch (e) {
    programs = [];
    state.textContent = "";
    if (e.code !== "unreachable" && e.status !== 401) error(e);
  }
  renderPrograms();
  if (chosen) {
    const again = programs.find((p) => p.id === chosen.id);
    if (again) choose(again.id);
    else {
      chosen = null;
      $("pie-launch-form").hidden = true;
    }
  }
  await refreshRuns();
}

function renderPrograms() {
  $("pie-programs-empty").hidden = programs.length > 0;
  $("pie-programs").replaceChildren(
    ...programs.map((p) => {
      const open = el("button", { type: "button", class: "link", "aria-label": `open ${p.id}` }, p.id);
      open.addEventListener("click", () => choose(p.id));
      const facts = p.parameters.length
        ? `${p.parameters.length} parameter(s): ${p.parameters.map((q) => q.name).join(", ")}`
        : "no parameters";
      return el(
        "li",
        { "data-ref": p.id, class: chosen && chosen.id === p.id ? "on" : "" },
        open,
        el("span", { class: "desc", text: p.description || "(no description)" }),
        el("span", { class: "facts", text: facts }),
      );
    }),
  );
}

function field(p) {
  const id = `pie-param-${p.name}`;
  let input;
  if (BOOL.has(p.type)) {
    if (p.optional) {
      input = el("select", { id, name: p.name });
      input.append(el("option", { value: "", text: "(not set)" }), el("option", { value: "true", text: "true" }));
      input.append(el("option", { value: "false", text: "false" }));
    } else input = el("input", { id, name: p.name, type: "checkbox" });
  } else if (INT.has(p.type)) input = el("input", { id, name: p.name, type: "number", step: "1" });
  else if (FLOAT.has(p.type)) input = el("input", { id, name: p.name, type: "number", step: "any" });
  else if (TEXT.has(p.type)) input = el("input", { id, name: p.name, type: "text" });
  else input = el("textarea", { id, name: p.name, rows: "2", placeholder: `JSON ${p.type}` });
  if (!p.optional) input.setAttribute("aria-required", "true");
  const kind = `${p.type}${p.optional ? ", optional" : ", required"}`;
  return el(
    "div",
    { class: "param", "data-param": p.name, "data-type": p.type, "data-optional": String(p.optional) },
    el("label", { for: id }, el("span", { class: "name", text: p.name }), " ", el("span", { class: "facts type", text: kind })),
    input,
    p.description ? el("span", { class: "facts", text: p.description }) : "",
  );
}

function choose(ref) {
  const p = programs.find((x) => x.id === ref);
  if (!p) return;
  const changed = !chosen || chosen.id !== ref || chosen.manifest_hash !== p.manifest_hash;
  chosen = p;
  for (const li of $("pie-programs").children) li.classList.toggle("on", li.dataset.ref === ref);
  $("pie-launch-form").hidden = false;
  $("pie-launch-form").dataset.ref = ref;
  $("pie-launch-title").textContent = p.id;
  $("pie-launch-desc").textContent = p.manifest_error
    ? `${p.description} (its Pie.toml could not be read: ${p.manifest_error})`
    : p.description;
  if (!changed) return;
  const params = $("pie-params");
  if (p.parameters.length) params.replaceChildren(...p.parameters.map(field));
  else
    params.replaceChildren(
      el(
        "div",
        { class: "param", "data-param": "", "data-type": "json" },
        el("label", { for: "pie-input-json", text: "Input (JSON): the program declares no [parameters]" }),
        el("textarea", { id: "pie-input-json", rows: "3" }, "{}"),
      ),
    );
}

/** The launch input from the form: typed values; optional fields left empty are left out. */
function input() {
  if (!chosen.parameters.length) return $("pie-input-json").value;
  const out = {};
  for (const p of chosen.parameters) {
    const node = $(`pie-param-${p.name}`);
    if (node.type === "checkbox") {
      out[p.name] = node.checked;
      continue;
    }
    const raw = node.value;
    if (raw === "") continue; // left out: the server says when it is required
    if (BOOL.has(p.type)) out[p.name] = raw === "true";
    else if (INT.has(p.type) || FLOAT.has(p.type)) out[p.name] = Number(raw);
    else if (TEXT.has(p.type)) out[p.name] = raw;
    else {
      try {
        out[p.name] = JSON.parse(raw);
      } catch {
        out[p.name] = raw; // the server names the field and its type
      }
    }
  }
  return out;
}

async function launch(e) {
  e.preventDefault();
  if (!chosen) return;
  error(null);
  const button = $("pie-launch");
  button.disabled = true;
  $("pie-run-state").textContent = `launching ${chosen.id}…`;
  try {
    const r = await api(`/v1/pie/programs/${encodeURIComponent(chosen.id)}/launch`, {
      method: "POST",
      json: { input: input() },
    });
    const run = await r.json();
    launchedAs.set(run.id, chosen.id);
    watch(run.id);
    await refreshRuns();
  } catch (err) {
    $("pie-run-state").textContent = "not launched";
    error(err);
  } finally {
    button.disabled = false;
  }
}

// -- a process's events ------------------------------------------------------------------
function programOf(run) {
  if (launchedAs.has(run.id)) return launchedAs.get(run.id);
  const refs = programs.filter((p) => p.inferlet_id === run.inferlet_id).map((p) => p.id);
  return refs.length ? refs.join(" / ") : run.inferlet_id;
}

function fileLink(runId, n, d) {
  const bytes = Uint8Array.from(atob(d.data), (c) => c.charCodeAt(0));
  const url = URL.createObjectURL(new Blob([bytes], { type: "application/octet-stream" }));
  downloads.push(url);
  const name = `${runId}-file-${n}.bin`;
  return el("a", { href: url, download: name, class: "file" }, `${name} (${fmtBytes(d.bytes)})`);
}

function event(runId, kind, d, n) {
  const li = el("li", { class: `ev ${kind}`, "data-kind": kind }, el("span", { class: "kind", text: kind }));
  if (kind === "file") li.append(fileLink(runId, n, d));
  else if (kind === "return") li.append(el("span", { class: "text", text: d.result ?? "" }));
  else if (kind === "error") li.append(el("span", { class: "text", text: d.status === "cancelled" ? "stopped (Signal)" : d.message }));
  else li.append(el("span", { class: "text", text: d.text ?? "" }));
  return li;
}

async function watch(runId) {
  if (watching) watching.abort.abort(); // detaches: that process goes on
  while (downloads.length) URL.revokeObjectURL(downloads.pop());
  const abort = new AbortController();
  watching = { id: runId, abort };
  const list = $("pie-events");
  list.replaceChildren();
  list.dataset.run = runId;
  list.dataset.state = "running";
  const state = $("pie-run-state");
  state.textContent = `${runId}: running`;
  let files = 0;
  try {
    const r = await api(`/v1/pie/runs/${runId}/events`, { signal: abort.signal });
    for await (const { event: kind, data } of sse(r)) {
      const d = JSON.parse(data);
      if (kind === "run") continue;
      if (kind === "file") files += 1;
      list.append(event(runId, kind, d, files));
      list.lastChild.scrollIntoView?.({ block: "nearest" });
      if (kind === "return" || kind === "error") {
        list.dataset.state = d.status || kind;
        state.textContent = `${runId}: ${d.status || kind}`;
      }
    }
  } catch (err) {
    if (err.name === "AbortError") return; // another process is shown now
    state.textContent = `${runId}: not followed`;
    error(err);
  } finally {
    if (watching && watching.id === runId && watching.abort === abort) watching = null;
  }
  refreshRuns();
}

// -- the processes -----------------------------------------------------------------------
async function stop(run, button) {
  button.disabled = true;
  try {
    await api(`/v1/inferlets/${run.inferlet_id}/runs/${run.id}/cancel`, { method: "POST" });
  } catch (err) {
    error(err);
  }
  await refreshRuns();
}

export async function refreshRuns() {
  let runs;
  try {
    runs = (await (await api("/v1/inferlets/runs")).json()).data;
  } catch {
    return; // the status line says why (unreachable, no key)
  }
  runs.reverse(); // newest first
  const table = $("pie-runs");
  table.hidden = runs.length === 0;
  $("pie-runs-empty").hidden = runs.length > 0;
  table.tBodies[0].replaceChildren(
    ...runs.map((run) => {
      const show = el("button", { type: "button", class: "link", "aria-label": `show ${run.id}` }, run.id);
      show.addEventListener("click", () => watch(run.id));
      const actions = el("td", { class: "actions" });
      if (run.status === "running") {
        const b = el("button", { type: "button", class: "stop", "aria-label": `stop ${run.id}` }, "Stop");
        b.addEventListener("click", () => stop(run, b));
        actions.append(b);
      }
      const started = new Date(run.created_at * 1000).toLocaleTimeString();
      return el(
        "tr",
        { "data-run": run.id, "data-status": run.status, class: run.status === "failed" ? "bad" : "" },
        el("td", {}, show, el("span", { class: "facts", text: ` ${run.origin === "pie" ? "pie" : "http"}` })),
        el("td", { text: programOf(run) }),
        el("td", { class: "status", text: run.status }),
        el("td", { text: started }),
        actions,
      );
    }),
  );
  const running = runs.some((r) => r.status === "running");
  if (running && poll === null) poll = setInterval(refreshRuns, 2000);
  else if (!running && poll !== null) {
    clearInterval(poll);
    poll = null;
  }
}

// -- install -----------------------------------------------------------------------------
function take(files) {
  for (const f of files) {
    if (f.name.toLowerCase().endsWith(".toml")) picked.toml = f;
    else picked.wasm = f;
  }
  const parts = [];
  if (picked.wasm) parts.push(`${picked.wasm.name} (${fmtBytes(picked.wasm.size)})`);
  if (picked.toml) parts.push(picked.toml.name);
  $("pie-install-picked").textContent = parts.length ? parts.join(" + ") : "no files chosen";
  $("pie-install-go").disabled = !(picked.wasm && picked.toml);
}

async function install(e) {
  e.preventDefault();
  if (!picked.wasm || !picked.toml) return;
  error(null);
  const state = $("pie-install-state");
  const go = $("pie-install-go");
  go.disabled = true;
  state.textContent = `installing ${picked.wasm.name} (compiling it the first time)…`;
  try {
    const form = new FormData();
    form.append("file", picked.wasm, picked.wasm.name);
    form.append("manifest", await picked.toml.text());
    if ($("pie-install-force").checked) form.append("force_overwrite", "true");
    const p = await (await api("/v1/pie/programs", { method: "POST", body: form })).json();
    state.textContent = p.installed ? `installed ${p.id}` : `${p.id}: ${p.message}`;
    await reload();
    choose(p.id);
  } catch (err) {
    state.textContent = "not installed";
    error(err);
  } finally {
    go.disabled = !(picked.wasm && picked.toml);
  }
}

export function init() {
  dropZone($("pie-install-wasm").closest(".drop"), $("pie-install-wasm"), take);
  dropZone($("pie-install-toml").closest(".drop"), $("pie-install-toml"), take);
  $("pie-install-form").addEventListener("submit", install);
  $("pie-launch-form").addEventListener("submit", launch);
  $("pie-refresh").addEventListener("click", reload);
  $("tab-inferlets").addEventListener("click", refreshRuns);
}
