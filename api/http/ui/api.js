// Every call the page makes goes through the public API with the key typed by the user
// (kept in sessionStorage: this tab only, gone when it closes).
const KEY = "pie-media-api-key";

export function getKey() {
  return sessionStorage.getItem(KEY) || "";
}

export function setKey(key) {
  if (key) sessionStorage.setItem(KEY, key);
  else sessionStorage.removeItem(KEY);
}

export class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

/** The server's own message from an error body (OpenAI's shape, or FastAPI's detail). */
export function messageOf(body) {
  const e = body && (body.error || (body.detail && (body.detail.error || body.detail)));
  if (!e) return null;
  if (typeof e === "string") return { message: e, code: null };
  return { message: e.message || JSON.stringify(e), code: e.code || null };
}

export async function errorOf(response) {
  const text = await response.text();
  let found = null;
  try {
    found = messageOf(JSON.parse(text));
  } catch {
    /* not JSON: the text itself */
  }
  const message = found ? found.message : text || response.statusText;
  return new ApiError(response.status, `${response.status}: ${message}`, found && found.code);
}

export const UNREACHABLE = `Server unreachable: nothing answers at ${location.origin} (is pie-media serve still running?)`;

/** Tell the page whether the server answered (app.js shows it on the status line). */
function reached(ok) {
  window.dispatchEvent(new CustomEvent("pie-media:reached", { detail: ok }));
}

/** fetch() with the key, a JSON body when `json` is given, and errors as ApiError. */
export async function api(path, { method = "GET", json, body, headers = {}, signal } = {}) {
  const h = { ...headers };
  const key = getKey();
  if (key) h.Authorization = `Bearer ${key}`;
  if (json !== undefined) {
    h["Content-Type"] = "application/json";
    body = JSON.stringify(json);
  }
  let response;
  try {
    response = await fetch(path, { method, headers: h, body, signal });
  } catch (e) {
    if (e.name === "AbortError") throw e;
    reached(false);
    throw new ApiError(0, UNREACHABLE, "unreachable");
  }
  reached(true);
  if (!response.ok) throw await errorOf(response);
  return response;
}

/** Server-sent events of a fetch response: yields {event, data} (data as text). */
export async function* sse(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value.replace(/\r\n/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) yield { event, data: data.join("\n") };
    }
  }
}
