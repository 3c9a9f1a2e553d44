// Chat: media uploaded through POST /v1/media, answers streamed from /v1/chat/completions.
import { ApiError, api, messageOf, sse } from "./api.js";
import { $, dropZone, el, fillSelect, fmtBytes, showError } from "./ui.js";

let history = []; // OpenAI messages of this conversation
let attachments = []; // {file, url, media?, error?, data?}
let shownUrls = []; // object URLs of the media in this conversation's bubbles
let running = null; // AbortController of the streaming answer
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

function renderAttachments() {
  const list = $("chat-attachments");
  list.replaceChildren(
    ...attachments.map((a, i) => {
      const remove = el("button", { type: "button", "aria-label": `remove ${a.file.name}`, text: "×" });
      remove.addEventListener("click", () => {
        URL.revokeObjectURL(a.url);
        attachments.splice(i, 1);
        renderAttachments();
      });
      const text = a.error ? a.error.message : a.media ? facts(a) : "uploading…";
      const thumb = kindOf(a) === "image" && !a.error ? [el("img", { class: "thumb", src: a.url, alt: "" }), " "] : [];
      return el("li", { class: a.error ? "bad" : "" }, ...thumb, el("strong", { text: a.file.name }), " ", el("span", { class: "facts", text }), " ", remove);
    }),
  );
}

async function upload(files) {
  for (const file of files) {
    const a = { file, url: URL.createObjectURL(file) };
    attachments.push(a);
    renderAttachments();
    const form = new FormData();
    form.append("file", file, file.name);
    try {
      const r = await api("/v1/media", { method: "POST", body: form });
      a.media = (await r.json()).data[0].media;
      if (a.media.kind === "audio") a.data = await base64(file);
    } catch (e) {
      a.error = e;
    }
    renderAttachments();
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
  if (running) return;
  showError($("chat-error"), null);
  const text = $("chat-input").value.trim();
  const ready = attachments.filter((a) => a.media);
  if (!text && !ready.length) return;
  if (!$("chat-model").value) {
    showError($("chat-error"), new Error("No chat model is served (or the key is missing): see the status line above."));
    return;
  }
  const content = [...ready.map(part), ...(text ? [{ type: "text", text }] : [])];
  const user = { role: "user", content };
  bubble("user", text, ready);
  const out = bubble("assistant", "");
  out.classList.add("streaming");
  $("chat-input").value = "";
  shownUrls.push(...ready.map((a) => a.url));
  for (const a of attachments) if (!ready.includes(a)) URL.revokeObjectURL(a.url);
  attachments = [];
  renderAttachments();
  running = new AbortController();
  $("chat-send").disabled = true;
  $("chat-stop").disabled = false;
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
    $("chat-send").disabled = false;
    $("chat-stop").disabled = true;
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
  $("chat-stop").addEventListener("click", () => running?.abort());
  $("chat-clear").addEventListener("click", () => {
    running?.abort();
    history = [];
    for (const url of shownUrls) URL.revokeObjectURL(url);
    shownUrls = [];
    $("chat-log").replaceChildren(el("p", { class: "empty", text: "New conversation." }));
  });
}
