// A time-series chart in plain SVG, drawn as a Grafana panel draws a Prometheus series: a y
// axis with a scale in the series' unit from zero, an x axis of wall-clock time over a fixed
// window ending now, gaps where a scrape had no value, and "No data" when nothing is left.
const SVG = "http://www.w3.org/2000/svg"; // a namespace name, never fetched
const W = 260; // viewBox units: about one CSS px each at the desktop's four charts a row
const H = 130;
const PAD = { left: 54, right: 8, top: 8, bottom: 18 };

/** Round steps (1, 2, 2.5, 5 x 10^k) from 0 to at least `max`: {top, step}. */
export function niceScale(max, count = 4, integer = false) {
  // a count of a few (or none): steps of one, 0..2 at least, so a 0 or a 1 reads at a glance
  if (integer && !(max > count)) return { top: Math.max(2, Math.ceil(max || 0)), step: 1 };
  if (!(max > 0)) return niceScale(1, count);
  const raw = max / count;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const norm = raw / mag;
  let step = (norm <= 1 ? 1 : norm <= 2 ? 2 : norm <= 2.5 ? 2.5 : norm <= 5 ? 5 : 10) * mag;
  if (integer) step = Math.max(1, Math.round(step));
  return { top: Math.ceil(max / step - 1e-9) * step, step };
}

const trim = (v, digits) => String(Number(v.toFixed(digits)));

/** Tick and legend text per unit: "count" (10.9k), "percent" (0..1 as 50%), "seconds" (ms
 * below `ref` 1 s, else s: one axis' ticks pass its top, so they share one unit). */
export function formatValue(v, unit, ref = v) {
  if (v == null || !Number.isFinite(v)) return "–";
  if (unit === "percent") return `${trim(v * 100, 1)}%`;
  if (unit === "seconds") return Math.abs(ref) < 1 ? `${trim(v * 1000, 1)} ms` : `${trim(v, 2)} s`;
  const a = Math.abs(v);
  if (a >= 1e6) return `${trim(v / 1e6, 2)}M`;
  if (a >= 1e3) return `${trim(v / 1e3, 1)}k`;
  return trim(v, 2);
}

const two = (n) => String(n).padStart(2, "0");

/** A time tick as a clock shows it: "16:05" on a whole minute, ":15" between. */
export function clockLabel(t) {
  const d = new Date(t);
  return d.getSeconds() ? `:${two(d.getSeconds())}` : `${two(d.getHours())}:${two(d.getMinutes())}`;
}

/** Milliseconds between time ticks: the roundest step that gives four to six across the window. */
export function tickEvery(spanMs) {
  for (const s of [15, 30, 60, 120, 300, 600]) if (spanMs / (s * 1000) <= 6) return s * 1000;
  return 1_800_000;
}

function node(tag, attrs, text) {
  const n = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, String(v));
  if (text != null) n.textContent = text;
  return n;
}

/**
 * An <svg> of `points` ({t: ms since the epoch, values: {key: number|null}}) over the window
 * [now - spanMs, now]. `series`: [{key, cls}]; `unit`: see formatValue; `max`: a fixed top
 * (1 for a rate), else the data's rounded up; `emptyMax`: the top while every value is 0 or
 * missing; `yLabel`: the y axis' title; `empty`: what the chart says when none is left in the window.
 */
export function timeChart(points, { series, unit = "count", spanMs, now = Date.now(), max = null, emptyMax = null, yLabel = "", empty = "No data", label = "" }) {
  const x0 = PAD.left;
  const x1 = W - PAD.right;
  const y0 = H - PAD.bottom; // the zero line
  const y1 = PAD.top;
  const start = now - spanMs;
  const inWindow = points.filter((p) => p.t >= start && p.t <= now);
  const values = inWindow.flatMap((p) => series.map((s) => p.values[s.key])).filter((v) => v != null && Number.isFinite(v));
  const top = max ?? Math.max(0, ...values);
  const scale = niceScale(top > 0 ? top : emptyMax ?? 0, 4, unit === "count");
  const xOf = (t) => x0 + ((t - start) / spanMs) * (x1 - x0);
  const yOf = (v) => y0 - (Math.min(v, scale.top) / scale.top) * (y0 - y1);

  const svg = node("svg", { viewBox: `0 0 ${W} ${H}`, class: "timechart", role: "img", "aria-label": label });
  // y: gridlines and values at each step, from 0 to the top
  for (let i = 0; i * scale.step <= scale.top + 1e-9; i++) {
    const v = i * scale.step;
    const y = yOf(v).toFixed(1);
    svg.append(node("line", { class: i === 0 ? "axis" : "grid", x1: x0, x2: x1, y1: y, y2: y }));
    svg.append(node("text", { class: "ytick", x: x0 - 4, y, "text-anchor": "end", "dominant-baseline": "middle", "data-value": v }, formatValue(v, unit, scale.top)));
  }
  // x: wall-clock ticks at round times (every 15 s, 30 s, 1 min... by the window's length)
  const every = tickEvery(spanMs);
  for (let t = Math.ceil(start / every) * every; t <= now; t += every) {
    const x = xOf(t);
    if (x - x0 < 14 || x1 - x < 14) continue; // no label half off the plot
    svg.append(node("line", { class: "grid", x1: x.toFixed(1), x2: x.toFixed(1), y1: y1, y2: y0 }));
    svg.append(node("line", { class: "axis", x1: x.toFixed(1), x2: x.toFixed(1), y1: y0, y2: y0 + 3 }));
    svg.append(node("text", { class: "xtick", x: x.toFixed(1), y: H - 3, "text-anchor": "middle", "data-t": t }, clockLabel(t)));
  }
  svg.append(node("line", { class: "axis", x1: x0, x2: x0, y1: y1, y2: y0 }));
  if (yLabel) {
    const mid = ((y0 + y1) / 2).toFixed(1);
    svg.append(node("text", { class: "ylabel", x: 11, y: mid, transform: `rotate(-90 11 ${mid})`, "text-anchor": "middle" }, yLabel));
  }
  // each series: one polyline per run of samples without a gap, a dot where a run is one sample
  for (const s of series) {
    const runs = [[]];
    for (const p of inWindow) {
      const v = p.values[s.key];
      if (v == null || !Number.isFinite(v)) runs.push([]);
      else runs[runs.length - 1].push([xOf(p.t), yOf(v)]);
    }
    for (const run of runs.filter((r) => r.length)) {
      if (run.length === 1) {
        svg.append(node("circle", { class: `dot ${s.cls}`, cx: run[0][0].toFixed(1), cy: run[0][1].toFixed(1), r: 2.2, "data-series": s.key }));
      } else {
        const xy = run.map(([x, y]) => `${x.toFixed(1)},${y.toFixed(1)}`).join(" ");
        svg.append(node("polyline", { class: s.cls, points: xy, "data-series": s.key }));
      }
    }
  }
  if (!values.length) {
    svg.append(node("text", { class: "nodata", x: (x0 + x1) / 2, y: (y0 + y1) / 2, "text-anchor": "middle", "dominant-baseline": "middle" }, empty));
  }
  return svg;
}
