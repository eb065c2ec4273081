// Wiring of the page: tabs (#chat / #engine), the served model's name, the engine core's
// status in the header and the dashboard's polling (every second while the Engine tab is
// shown, every five otherwise, paused while the browser tab is hidden).
import { APIError, apiKey, forgetKey, getJSON } from "./api.js";
import { Chat } from "./chat.js";
import { Dashboard } from "./dashboard.js";
import { byId } from "./dom.js";

const FAST_MS = 1000, SLOW_MS = 5000;

let model = null;
const chat = new Chat(() => model);
const dashboard = new Dashboard();
let pollTimer = null;

function engineShown() {
  return !byId("engine-view").hidden;
}

function showTab(name) {
  const engine = name === "engine";
  byId("chat-view").hidden = engine;
  byId("engine-view").hidden = !engine;
  byId("tab-chat").setAttribute("aria-selected", String(!engine));
  byId("tab-engine").setAttribute("aria-selected", String(engine));
  if (location.hash !== `#${name}`) history.replaceState(null, "", `#${name}`);
  schedulePoll(0);
}

function setCoreStatus(snapshot, error) {
  const node = byId("core-status");
  if (!snapshot) {  // an answer that is not a snapshot, or none at all (server gone)
    const answered = error instanceof APIError;
    node.className = `status ${answered ? "unknown" : "bad"}`;
    node.textContent = answered ? "core ?" : "unreachable";
    node.title = error ? error.message : "";
    return;
  }
  const e = snapshot.engine;
  node.className = `status ${e.alive ? (e.draining ? "warn" : "ok") : "bad"}`;
  node.textContent = e.alive ? (e.draining ? "draining" : `${e.device} ok`) : "core dead";
  node.title = e.fatal_error || `engine core pid ${e.core_pid}`;
}

async function poll() {
  pollTimer = null;
  if (document.visibilityState !== "hidden") {
    setCoreStatus(await dashboard.refresh(), dashboard.error);
  }
  schedulePoll(engineShown() ? FAST_MS : SLOW_MS);
}

function schedulePoll(ms) {
  if (pollTimer !== null) clearTimeout(pollTimer);
  pollTimer = setTimeout(poll, ms);
}

async function loadModel() {
  try {
    const models = await getJSON("/v1/models");
    model = models.data.length ? models.data[0].id : null;
    byId("model-name").textContent = model || "(no model)";
  } catch (err) {
    byId("model-name").textContent = `(models: ${err.message})`;
  }
}

byId("tab-chat").addEventListener("click", () => showTab("chat"));
byId("tab-engine").addEventListener("click", () => showTab("engine"));
byId("forget-key").addEventListener("click", forgetKey);
byId("forget-key").hidden = !apiKey();
document.addEventListener("visibilitychange", () => schedulePoll(0));
window.addEventListener("hashchange", () => showTab(location.hash === "#engine" ? "engine" : "chat"));
showTab(location.hash === "#engine" ? "engine" : "chat");
loadModel().then(() => { document.body.dataset.ready = "true"; });
