// Server: the models (GET /v1/models) and live charts read from /metrics (Prometheus text).
import { api } from "./api.js";
import { formatValue, timeChart } from "./timechart.js";
import { $, el, showError } from "./ui.js";

const EVERY_MS = 2000;
const SPAN_MS = 5 * 60_000; // the charts show the last 5 minutes, as a Grafana panel's "Last 5 minutes"...
const history = new Map(); // "model|chart" -> [{t, values}]
let firstT = null; // ...or, while the server has run for less, the whole minutes since the
let loadedT = null; // earlier of this page's first sample and the server's start (its models' load time)

/** The charts' window: the whole minutes since the server (or, if earlier, this page) began,
 * from 1 to SPAN_MS: a new server's first minutes fill the width instead of a sliver at the
 * right of an empty box, and a page opened on a server that has run 5 minutes shows them all. */
function spanAt(t) {
  firstT ??= t;
  const since = Math.min(firstT, loadedT ?? firstT);
  return Math.min(SPAN_MS, Math.max(1, Math.ceil((t - since) / 60_000)) * 60_000);
}
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

/** One chart: its title and time span, the axes, and a legend with each series' latest value. */
function chart(model, title, key, series, opts, now, spanMs) {
  const points = history.get(`${model}|${key}`) || [];
  const latest = points.length ? points[points.length - 1].values : {};
  const legendText = (s) => `${s.label} ${s.format ? s.format(latest[s.key]) : formatValue(latest[s.key], opts.unit)}`;
  const legend = el("span", { class: "value" });
  series.forEach((s, i) => {
    if (i) legend.append(" · ");
    legend.append(el("i", { class: `swatch ${s.cls}`, "aria-hidden": "true" }), legendText(s));
  });
  const span = `last ${spanMs / 60_000} min`;
  const label = `${title}, ${span}: ${series.map(legendText).join(", ")}`;
  return el(
    "figure",
    { class: "chart", "data-chart": key, "data-model": model },
    el("figcaption", {}, el("strong", { text: title }), " ", el("span", { class: "span", text: span })),
    timeChart(points, { series, spanMs, now, label, ...opts }),
    legend,
  );
}

function record(model, key, t, values) {
  const id = `${model}|${key}`;
  const points = history.get(id) || [];
  points.push({ t, values });
  while (points.length && points[0].t < t - SPAN_MS) points.shift();
  history.set(id, points);
}

const num = (v) => (v == null ? "–" : String(v)); // a legend's exact count (the axis rounds: 10.9k)

async function refresh() {
  try {
    const text = await (await api("/metrics")).text();
    const now = snapshot(parseMetrics(text));
    const t = Date.now();
    const span = spanAt(t);
    const cards = [];
    for (const [m, s] of Object.entries(now)) {
      const p = last?.[m];
      const dCount = p ? s.ttftCount - p.ttftCount : 0;
      const ttft = dCount > 0 ? (s.ttftSum - p.ttftSum) / dCount : s.ttftCount ? s.ttftSum / s.ttftCount : null;
      const lookups = s.hit + s.miss;
      record(m, "kv", t, { used: s.used, free: s.free });
      record(m, "contexts", t, { contexts: s.contexts, inFlight: s.inFlight });
      record(m, "cache", t, { rate: lookups ? s.hit / lookups : null });
      record(m, "ttft", t, { ttft });
      cards.push(
        el("h3", { text: m }),
        el(
          "div",
          { class: "chart-row" },
          chart(m, "KV pages", "kv", [{ key: "used", label: "used", cls: "a", format: num }, { key: "free", label: "free", cls: "b", format: num }], { unit: "count", yLabel: "pages" }, t, span),
          chart(m, "Open contexts", "contexts", [{ key: "contexts", label: "contexts", cls: "a", format: num }, { key: "inFlight", label: "requests", cls: "b", format: num }], { unit: "count", yLabel: "count" }, t, span),
          chart(m, "Encoder-cache hit rate", "cache", [{ key: "rate", label: "hits", cls: "a" }], { unit: "percent", max: 1, yLabel: "hits / lookups", empty: "no media encoded yet" }, t, span),
          chart(m, "Time to first token", "ttft", [{ key: "ttft", label: "mean", cls: "a" }], { unit: "seconds", emptyMax: 0.1, yLabel: "mean TTFT", empty: "no requests yet" }, t, span),
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
  const created = list.map((m) => m.created).filter((c) => Number.isFinite(c));
  if (created.length) loadedT = Math.min(...created) * 1000; // set again when a restarted server answers
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
