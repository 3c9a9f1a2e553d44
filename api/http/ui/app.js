// The page's shell: the API key, the tabs, the served models; each panel is its own module.
import { api, getKey, setKey, UNREACHABLE } from "./api.js";
import * as chat from "./chat.js";
import * as inferlets from "./inferlets.js";
import * as jobs from "./jobs.js";
import * as server from "./server.js";
import * as speak from "./speak.js";
import { $ } from "./ui.js";

const panels = { chat, speak, jobs, inferlets, server };

function select(name) {
  for (const tab of document.querySelectorAll('[role="tab"]')) {
    const on = tab.id === `tab-${name}`;
    tab.setAttribute("aria-selected", String(on));
    tab.tabIndex = on ? 0 : -1;
    $(tab.getAttribute("aria-controls")).hidden = !on;
  }
  location.hash = name;
}

function setStatus(text, bad = false) {
  const s = $("status");
  s.textContent = text;
  s.classList.toggle("bad", bad);
}

/** GET /v1/models, then hand the list to every panel; a 401 asks for a key. */
async function loadModels() {
  try {
    const r = await api("/v1/models");
    const models = (await r.json()).data;
    const names = models.map((m) => `${m.id} (${m.kind})`).join(", ");
    setStatus(models.length ? `connected: ${names}` : "connected: no models served");
    for (const p of Object.values(panels)) p.setModels?.(models);
    return true;
  } catch (e) {
    if (e.code === "unreachable") return false; // watchServer says so
    setStatus(e.status === 401 ? `${e.message} (type the server's API key above)` : e.message, true);
    for (const p of Object.values(panels)) p.setModels?.([]);
    return false;
  }
}

const RETRY_MS = 2000;
let retry = null; // timer while the server is unreachable

/** Every call reports whether the server answered: when it stops, say so on the status line
 * (instead of panels going blank), poll /health, and reload the models once it is back. */
function watchServer() {
  window.addEventListener("pie-media:reached", (e) => {
    if (!e.detail && retry === null) {
      document.body.dataset.server = "down";
      setStatus(`${UNREACHABLE} Retrying every ${RETRY_MS / 1000} s…`, true);
      retry = setInterval(() => api("/health").catch(() => {}), RETRY_MS);
    } else if (e.detail && retry !== null) {
      clearInterval(retry);
      retry = null;
      document.body.dataset.server = "up";
      loadModels();
    }
  });
}

function init() {
  watchServer();
  const tabs = [...document.querySelectorAll('[role="tab"]')];
  tabs.forEach((tab, i) => {
    tab.addEventListener("click", () => select(tab.id.slice(4)));
    tab.addEventListener("keydown", (e) => {
      const step = { ArrowRight: 1, ArrowLeft: -1 }[e.key];
      if (!step) return;
      const next = tabs[(i + step + tabs.length) % tabs.length];
      next.focus();
      next.click();
    });
  });
  $("key-input").value = getKey();
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    setKey($("key-input").value.trim());
    loadModels();
  });
  for (const p of Object.values(panels)) p.init({ setStatus });
  const start = location.hash.slice(1);
  select(start in panels ? start : "chat");
  loadModels();
}

init();
