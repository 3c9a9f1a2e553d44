// Server: the models (GET /v1/models) and live charts read from /metrics (Prometheus text).
import { api } from "./api.js";
import { $, el, showError } from "./ui.js";

const EVERY_MS = 2000;
const KEEP = 60;
const SVG = "http://www.w3.org/2000/svg"; // a namespace name, never fetched
const history = new Map(); // "model|chart" -> [{t, values}]
let last = null; // previous scrape, for per-interval TTFT

/** Prometheus text exposition -> [{name, labels, value}] (comments skipped). */
export function parseMetrics(text) {
  const out = [];
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = /^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/.exec(line);
    if (!m) continue;
    const labels = {};
    for (const [, k, v] of (m[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[k] = v;
    out.push({ name: m[1], labels, value: Number(m[3]) });
  }
  return out;
}

function pick(samples, name, model, extra = {}) {
  const s = samples.find(
    (x) => x.name === name && x.labels.model === model && Object.entries(extra).every(([k, v]) => x.labels[k] === v),
  );
  return s ? s.value : null;
}

function snapshot(samples) {
  const models = [...new Set(samples.filter((s) => s.name === "pie_media_kv_pages").map((s) => s.labels.model))];
  const now = {};
  for (const m of models) {
    const hit = pick(samples, "pie_media_encoder_cache_total", m, { result: "hit" }) ?? 0;
    const miss = pick(samples, "pie_media_encoder_cache_total", m, { result: "miss" }) ?? 0;
    now[m] = {
      used: pick(samples, "pie_media_kv_pages", m, { state: "used" }),
      free: pick(samples, "pie_media_kv_pages", m, { state: "free" }),
      contexts: pick(samples, "pie_media_running_contexts", m),
      inFlight: pick(samples, "pie_media_requests_in_flight", m),
      hit,
      miss,
      ttftSum: pick(samples, "pie_media_time_to_first_token_seconds_sum", m) ?? 0,
      ttftCount: pick(samples, "pie_media_time_to_first_token_seconds_count", m) ?? 0,
    };
  }
  return now;
}

function sparkline(points, series) {
  const w = 240;
  const h = 48;
  const all = points.flatMap((p) => series.map((s) => p.values[s.key])).filter((v) => v != null);
  const max = Math.max(1e-9, ...all);
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  svg.setAttribute("class", "spark");
  svg.setAttribute("preserveAspectRatio", "none"); // the newest sample at the right edge
  svg.setAttribute("role", "img");
  for (const s of series) {
    const xy = points
      .map((p, i) => [p.values[s.key], i])
      .filter(([v]) => v != null)
      .map(([v, i]) => `${(((KEEP - points.length + i) / (KEEP - 1)) * w).toFixed(1)},${(h - 2 - (v / max) * (h - 4)).toFixed(1)}`);
    const line = document.createElementNS(SVG, "polyline");
    line.setAttribute("points", xy.join(" "));
    line.setAttribute("class", s.cls);
    svg.append(line);
  }
  return svg;
}

function chart(model, title, key, series, format) {
  const id = `${model}|${key}`;
  const points = history.get(id) || [];
  const latest = points.length ? points[points.length - 1].values : {};
  const legend = series.map((s) => `${s.label} ${format(latest[s.key])}`).join(" · ");
  return el(
    "figure",
    { class: "chart", "data-chart": key, "data-model": model },
    sparkline(points, series),
    el("figcaption", {}, el("strong", { text: title }), el("br"), el("span", { class: "value", text: legend })),
  );
}

function record(model, key, values) {
  const id = `${model}|${key}`;
  const points = history.get(id) || [];
  points.push({ values });
  if (points.length > KEEP) points.shift();
  history.set(id, points);
}

const num = (v) => (v == null ? "–" : String(v));
const pct = (v) => (v == null ? "–" : `${(v * 100).toFixed(0)}%`);
const ms = (v) => (v == null ? "–" : `${(v * 1000).toFixed(0)} ms`);

async function refresh() {
  try {
    const text = await (await api("/metrics")).text();
    const now = snapshot(parseMetrics(text));
    const cards = [];
    for (const [m, s] of Object.entries(now)) {
      const p = last?.[m];
      const dCount = p ? s.ttftCount - p.ttftCount : 0;
      const ttft = dCount > 0 ? (s.ttftSum - p.ttftSum) / dCount : s.ttftCount ? s.ttftSum / s.ttftCount : null;
      const lookups = s.hit + s.miss;
      record(m, "kv", { used: s.used, free: s.free });
      record(m, "contexts", { contexts: s.contexts, inFlight: s.inFlight });
      record(m, "cache", { rate: lookups ? s.hit / lookups : null });
      record(m, "ttft", { ttft });
      cards.push(
        el("h3", { text: m }),
        el(
          "div",
          { class: "chart-row" },
          chart(m, "KV pages", "kv", [{ key: "used", label: "used", cls: "a" }, { key: "free", label: "free", cls: "b" }], num),
          chart(m, "Open contexts", "contexts", [{ key: "contexts", label: "contexts", cls: "a" }, { key: "inFlight", label: "requests", cls: "b" }], num),
          chart(m, "Encoder-cache hit rate", "cache", [{ key: "rate", label: "hits", cls: "a" }], pct),
          chart(m, "Time to first token", "ttft", [{ key: "ttft", label: "mean", cls: "a" }], ms),
        ),
      );
    }
    last = now;
    $("server-charts").replaceChildren(...(cards.length ? cards : [el("p", { class: "empty", text: "No chat model is served, so there is no engine to chart." })]));
    showError($("server-error"), null);
  } catch (e) {
    showError($("server-error"), e);
  }
}

export function setModels(list) {
  $("server-models").tBodies[0].replaceChildren(
    ...(list.length
      ? list.map((m) =>
          el("tr", {}, el("td", { text: m.id }), el("td", { text: m.kind }), el("td", { text: m.architecture || "" }), el("td", { text: (m.media_kinds || []).join(", ") })),
        )
      : [el("tr", {}, el("td", { colspan: "4", class: "empty", text: "No models (or the key is missing)." }))]),
  );
}

export function init() {
  refresh();
  setInterval(refresh, EVERY_MS);
}
