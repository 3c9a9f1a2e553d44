// Chat: media uploaded through POST /v1/media, answers streamed from /v1/chat/completions.
import { ApiError, api, messageOf, sse } from "./api.js";
import { $, dropZone, el, fillSelect, fmtBytes, showError } from "./ui.js";

let history = []; // OpenAI messages of this conversation
let attachments = []; // {file, url, media?, error?, data?, ready?: a promise while it uploads}
let uploads = Promise.resolve(); // uploads go one at a time, in the order chosen
let shownUrls = []; // object URLs of the media in this conversation's bubbles
let running = null; // AbortController of the streaming answer
let waiting = null; // AbortController of a Send that waits for its uploads to finish
let models = [];

export function setModels(list) {
  models = list.filter((m) => m.kind === "chat");
  fillSelect($("chat-model"), models.map((m) => m.id));
  renderAttachments();
}

function facts(a) {
  const m = a.media;
  const meta = m.metadata || {};
  const parts = [m.kind, fmtBytes(m.bytes)];
  if (meta.width && meta.height) parts.push(`${meta.width}×${meta.height}`);
  const duration = meta.duration_s ?? meta.duration;
  if (duration != null) parts.push(`${Number(duration).toFixed(2)} s`);
  const frames = meta.num_frames ?? meta.frames ?? meta.frame_count;
  if (frames != null) parts.push(`${frames} frames`);
  if (meta.sample_rate) parts.push(`${meta.sample_rate} Hz`);
  const model = $("chat-model").value;
  const tokens = (m.token_counts || {})[model];
  if (model in (m.token_counts || {})) {
    parts.push(tokens == null ? `${model} cannot take ${m.kind}` : `${tokens} tokens for ${model}`);
  }
  return parts.join(" · ");
}

/** Whether trying a failed upload again may help: the network or a busy server, not a
 * refusal of the file itself (a 413 or 415 answers the same the next time). */
function retryable(error) {
  return !error.status || error.status === 408 || error.status === 429 || error.status >= 500;
}

function renderAttachments() {
  const list = $("chat-attachments");
  list.replaceChildren(
    ...attachments.map((a) => {
      const remove = el("button", { type: "button", "aria-label": `remove ${a.file.name}`, text: "×" });
      remove.addEventListener("click", () => {
        URL.revokeObjectURL(a.url);
        attachments = attachments.filter((b) => b !== a);
        renderAttachments();
      });
      const buttons = [remove];
      if (a.error && retryable(a.error)) {
        const retry = el("button", { type: "button", class: "retry", "aria-label": `retry ${a.file.name}`, text: "retry" });
        retry.addEventListener("click", () => {
          transfer(a);
          renderAttachments();
        });
        buttons.unshift(retry, " ");
      }
      const text = a.error
        ? `upload failed: ${a.error.message.replace(/\.$/, "")}. Not sent without it: ${retryable(a.error) ? "retry or remove it" : "remove it"}.`
        : a.media
          ? facts(a)
          : "uploading…";
      const thumb = kindOf(a) === "image" && !a.error ? [el("img", { class: "thumb", src: a.url, alt: "" }), " "] : [];
      const state = a.error ? "bad" : a.media ? "" : "pending";
      return el("li", { class: state }, ...thumb, el("strong", { text: a.file.name }), " ", el("span", { class: "facts", text }), " ", ...buttons);
    }),
  );
  renderSend();
}

/** Send and Stop as the chat stands: while a Send waits for uploads, the button says so and
 * Stop cancels the wait (the message stays in the box); the note says what it waits for. */
function renderSend() {
  const send = $("chat-send");
  send.disabled = Boolean(running || waiting);
  send.textContent = waiting ? "Uploading…" : "Send";
  $("chat-stop").disabled = !(running || waiting);
  const pending = attachments.filter((a) => a.ready).length;
  const note = $("chat-note");
  note.hidden = !waiting;
  note.textContent = waiting
    ? `Waiting for ${pending} upload${pending === 1 ? "" : "s"} to finish: the message goes with ${pending === 1 ? "it" : "them"}. Stop cancels.`
    : "";
}

function upload(files) {
  for (const file of files) {
    const a = { file, url: URL.createObjectURL(file) };
    attachments.push(a);
    transfer(a);
  }
  renderAttachments();
}

/** Upload one attachment after those chosen before it. Until it has its media or its error,
 * a.ready is a promise (it never rejects) that a Send waits for. */
function transfer(a) {
  a.error = null;
  const ready = (uploads = uploads.then(async () => {
    if (!attachments.includes(a)) return; // removed while it waited its turn
    const form = new FormData();
    form.append("file", a.file, a.file.name);
    try {
      const r = await api("/v1/media", { method: "POST", body: form });
      a.media = (await r.json()).data[0].media;
      if (a.media.kind === "audio") a.data = await base64(a.file);
    } catch (e) {
      a.error = e;
    }
  }));
  a.ready = ready.then(() => {
    a.ready = null;
    renderAttachments();
  });
}

/** Wait until no attachment is uploading (ones added meanwhile too): true, or false when
 * Stop cancelled the wait. */
async function settle() {
  waiting = new AbortController();
  const stopped = new Promise((resolve) => waiting.signal.addEventListener("abort", () => resolve(false)));
  renderSend();
  try {
    while (attachments.some((a) => a.ready)) {
      const ok = await Promise.race([Promise.all(attachments.map((a) => a.ready)), stopped]);
      if (ok === false) return false;
    }
    return true;
  } finally {
    waiting = null;
    renderSend();
  }
}

function base64(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(String(reader.result).split(",", 2)[1]);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

function part(a) {
  const m = a.media;
  if (m.kind === "image") return { type: "image_url", image_url: { url: `pie-media://${m.id}` } };
  if (m.kind === "video") return { type: "video_url", video_url: { url: `pie-media://${m.id}` } };
  const format = (m.metadata.format || a.file.name.split(".").pop() || "wav").toLowerCase();
  return { type: "input_audio", input_audio: { data: a.data, format } };
}

/** image, audio or video: by the file's own type (an animated GIF shows as an <img>, an
 * mp4 with sound as a <video>), else by what the server found in it. */
function kindOf(a) {
  const type = a.file.type.split("/")[0];
  return ["image", "audio", "video"].includes(type) ? type : a.media?.kind || "image";
}

/** A sent attachment as the user's bubble shows it: the local file itself through an object
 * URL (the API keeps no copy to serve back), a thumbnail or a player, with its name. */
function preview(a) {
  const kind = kindOf(a);
  const view =
    kind === "image"
      ? el("img", { src: a.url, alt: a.file.name })
      : el(kind, { src: a.url, controls: "", preload: "metadata" });
  const figure = el("figure", { class: `attached ${kind}` }, view, el("figcaption", { text: a.file.name }));
  view.addEventListener("error", () =>
    view.replaceWith(el("span", { class: "nopreview", text: `${kind}: no preview in this browser` })),
  );
  return figure;
}

function bubble(role, text, sent = []) {
  const log = $("chat-log");
  log.querySelector(".empty")?.remove();
  const body = el("div", { class: "text", text });
  const node = el("div", { class: `msg ${role}` }, el("div", { class: "who", text: role }));
  if (sent.length) node.append(el("div", { class: "media" }, ...sent.map(preview)));
  if (text || role !== "user") node.append(body);
  log.append(node);
  log.scrollTop = log.scrollHeight;
  return body;
}

/** A model's text as shown: without the newlines and spaces it may open with (a thinking
 * template's "\n\n" after its thought block, a random model's "\n\n\n"), which pre-wrap
 * would draw as a blank band above the first line. The history keeps the text as it came. */
function shown(text, done = false) {
  const start = text.replace(/^\s+/, "");
  return done ? start.replace(/\s+$/, "") : start;
}

/** The answer's thought channel (reasoning_content), folded above the answer; only made
 * once a thought has some text, so an empty one leaves no box behind. */
function showThought(out, thought) {
  const text = shown(thought);
  if (!text) return;
  let box = out.parentElement.querySelector(".reasoning");
  if (!box) {
    box = el("details", { class: "reasoning" }, el("summary", { text: "reasoning" }), el("div", { class: "text" }));
    out.before(box);
  }
  box.querySelector(".text").textContent = text;
}

function request(messages) {
  const body = {
    model: $("chat-model").value,
    messages,
    stream: true,
    temperature: Number($("chat-temperature").value),
    top_p: Number($("chat-top-p").value),
    max_tokens: Number($("chat-max-tokens").value),
  };
  if ($("chat-ignore-eos").checked) body.ignore_eos = true;
  return body;
}

async function send(e) {
  e.preventDefault();
  if (running || waiting) return;
  showError($("chat-error"), null);
  if (!$("chat-input").value.trim() && !attachments.length) return;
  if (!$("chat-model").value) {
    showError($("chat-error"), new Error("No chat model is served (or the key is missing): see the status line above."));
    return;
  }
  // a message goes with every attachment listed or not at all: wait for those still uploading
  if (attachments.some((a) => a.ready) && !(await settle())) return;
  const broken = attachments.filter((a) => a.error);
  if (broken.length) {
    const names = broken.map((a) => a.file.name).join(", ");
    const them = broken.length === 1 ? "it" : "them";
    const fix = broken.some((a) => retryable(a.error)) ? `Retry or remove ${them}` : `Remove ${them}`;
    showError($("chat-error"), new Error(`Not sent: ${names} did not upload, and the message never goes without ${them}. ${fix} (×), then press Send again.`));
    return;
  }
  const text = $("chat-input").value.trim();
  const ready = attachments;
  if (!text && !ready.length) return;
  const content = [...ready.map(part), ...(text ? [{ type: "text", text }] : [])];
  const user = { role: "user", content };
  bubble("user", text, ready);
  const out = bubble("assistant", "");
  out.classList.add("streaming");
  $("chat-input").value = "";
  shownUrls.push(...ready.map((a) => a.url));
  attachments = [];
  running = new AbortController();
  renderAttachments();
  let answer = "";
  let thought = "";
  let stopped = false;
  let failed = false;
  try {
    const r = await api("/v1/chat/completions", { method: "POST", json: request([...history, user]), signal: running.signal });
    for await (const { data } of sse(r)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      const err = messageOf(chunk);
      if (err) throw new ApiError(200, err.message, err.code);
      for (const c of chunk.choices || []) {
        answer += c.delta?.content || "";
        thought += c.delta?.reasoning_content || "";
      }
      showThought(out, thought);
      out.textContent = shown(answer);
    }
  } catch (err) {
    if (err.name === "AbortError") stopped = true;
    else {
      failed = true;
      showError($("chat-error"), err);
    }
  } finally {
    out.classList.remove("streaming");
    out.textContent = shown(answer, true);
    const gap = out.textContent ? " " : "";
    if (stopped) out.append(el("span", { class: "muted", text: `${gap}[stopped]` }));
    if (failed) out.append(el("span", { class: "muted", text: `${gap}[not answered: see the error below; this turn is left out of the chat]` }));
    out.parentElement.dataset.done = stopped ? "stopped" : failed ? "failed" : "done";
    // a refused turn stays on screen but not in the history: later turns would repeat it
    if (!failed) history.push(user, { role: "assistant", content: answer });
    running = null;
    renderSend();
  }
}

export function init() {
  dropZone($("chat-drop"), $("chat-files"), (files) => {
    upload(files);
    $("chat-files").value = "";
  });
  $("chat-model").addEventListener("change", renderAttachments);
  $("chat-form").addEventListener("submit", send);
  $("chat-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("chat-stop").addEventListener("click", () => {
    running?.abort();
    waiting?.abort();
  });
  $("chat-clear").addEventListener("click", () => {
    running?.abort();
    waiting?.abort();
    history = [];
    for (const url of shownUrls) URL.revokeObjectURL(url);
    shownUrls = [];
    $("chat-log").replaceChildren(el("p", { class: "empty", text: "New conversation." }));
  });
}
