// Caption jobs: POST /v1/jobs/captions, progress from GET /v1/jobs/{id}, results as JSONL.
import { api } from "./api.js";
import { $, dropZone, el, fillSelect, showError } from "./ui.js";

let files = [];
let current = null; // job id
let download = null;

export function setModels(list) {
  fillSelect($("jobs-model"), list.filter((m) => m.kind === "chat" && !m.parent).map((m) => m.id));
}

function picked(list) {
  files = list;
  $("jobs-picked").textContent = files.length ? `${files.length} file(s) chosen` : "no files chosen";
}

function showProgress(job) {
  const finished = job.done + job.failed;
  $("jobs-progress").hidden = false;
  $("jobs-bar").max = job.total;
  $("jobs-bar").value = finished;
  const rate = job.rate ? `${job.rate.toFixed(2)} files/s` : "";
  const eta = job.eta_s != null ? `, about ${Math.ceil(job.eta_s)} s left` : "";
  $("jobs-counts").textContent = `${job.status}: ${finished}/${job.total} (${job.done} captioned, ${job.failed} failed) ${rate}${eta}`;
}

async function showResults(id) {
  const text = await (await api(`/v1/jobs/${id}/results?follow=false`)).text();
  const rows = text.split("\n").filter(Boolean).map((l) => JSON.parse(l));
  rows.sort((a, b) => (a.index ?? 0) - (b.index ?? 0));
  const table = $("jobs-results");
  table.hidden = false;
  table.tBodies[0].replaceChildren(
    ...rows.map((r, i) =>
      el(
        "tr",
        { class: r.error ? "bad" : "" },
        el("td", { text: String(i + 1) }),
        el("td", { text: r.file }),
        el("td", { text: r.error ? `${r.error.code}: ${r.error.message}` : r.caption }),
      ),
    ),
  );
  if (download) URL.revokeObjectURL(download);
  download = URL.createObjectURL(new Blob([text], { type: "application/x-ndjson" }));
  const link = $("jobs-download");
  link.href = download;
  link.download = `captions-${id}.jsonl`;
  link.hidden = false;
}

async function poll(id) {
  while (current === id) {
    const job = await (await api(`/v1/jobs/${id}`)).json();
    showProgress(job);
    if (job.finished_at != null || ["succeeded", "completed", "failed", "cancelled"].includes(job.status)) {
      if (job.error) showError($("jobs-error"), new Error(job.error));
      return job;
    }
    await new Promise((r) => setTimeout(r, 400));
  }
}

async function start(e) {
  e.preventDefault();
  showError($("jobs-error"), null);
  $("jobs-results").hidden = true;
  $("jobs-download").hidden = true;
  const fields = { model: $("jobs-model").value, prompt: $("jobs-prompt").value, max_tokens: $("jobs-max-tokens").value };
  const dir = $("jobs-dir").value.trim();
  let request;
  if (dir) {
    request = { method: "POST", json: { ...fields, max_tokens: Number(fields.max_tokens), directory: dir } };
  } else {
    if (!files.length) {
      showError($("jobs-error"), new Error("Choose some images first (or give a server folder)."));
      return;
    }
    const form = new FormData();
    for (const [k, v] of Object.entries(fields)) form.append(k, v);
    for (const f of files) form.append("file", f, f.name);
    request = { method: "POST", body: form };
  }
  $("jobs-start").disabled = true;
  try {
    const job = await (await api("/v1/jobs/captions", request)).json();
    current = job.id;
    $("jobs-cancel").disabled = false;
    showProgress(job);
    await poll(job.id);
    await showResults(job.id);
  } catch (err) {
    showError($("jobs-error"), err);
  } finally {
    $("jobs-start").disabled = false;
    $("jobs-cancel").disabled = true;
  }
}

export function init() {
  dropZone($("jobs-files").parentElement, $("jobs-files"), picked);
  $("jobs-form").addEventListener("submit", start);
  $("jobs-cancel").addEventListener("click", async () => {
    if (current) await api(`/v1/jobs/${current}/cancel`, { method: "POST" }).catch((e) => showError($("jobs-error"), e));
  });
}
