// Requests to this server (same origin only) with the API key when one is set, and the
// key prompt: a 401 opens it, and the request is retried once the user has given a key.
// The key lives in sessionStorage (this tab only), never in the URL.
import { byId } from "./dom.js";

const KEY_STORAGE = "tessellm.apiKey";

export class APIError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE);
}

export function forgetKey() {
  sessionStorage.removeItem(KEY_STORAGE);
  byId("forget-key").hidden = true;
}

let pendingKey = null;  // one prompt at a time: every 401 waits for the same answer

function askForKey(wrong) {
  if (pendingKey) return pendingKey;
  const dialog = byId("key-dialog");
  const input = byId("api-key");
  const note = byId("key-error");
  note.hidden = !wrong;
  note.textContent = wrong ? "That key was refused; try again." : "";
  dialog.hidden = false;
  input.value = "";
  input.focus();
  pendingKey = new Promise((resolve) => {
    byId("key-form").onsubmit = (event) => {
      event.preventDefault();
      const key = input.value.trim();
      if (!key) return;
      sessionStorage.setItem(KEY_STORAGE, key);
      byId("forget-key").hidden = false;
      dialog.hidden = true;
      pendingKey = null;
      resolve(key);
    };
  });
  return pendingKey;
}

// The message of an OpenAI error object, or the status line when the body is not one.
export async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  let code = null;
  try {
    const body = await response.json();
    if (body && body.error && typeof body.error.message === "string") {
      message = body.error.message;
      code = body.error.code;
    }
  } catch (_) { /* not JSON: keep the status line */ }
  return new APIError(response.status, message, code);
}

// fetch() on this origin with the key; a 401 asks for a key and retries. Non-2xx answers
// raise APIError carrying the server's message.
export async function request(path, options = {}) {
  for (let attempt = 0; ; attempt += 1) {
    const headers = new Headers(options.headers || {});
    const key = apiKey();
    if (key) headers.set("Authorization", `Bearer ${key}`);
    const response = await window.fetch(path, { ...options, headers, credentials: "omit",
                                                mode: "same-origin", cache: "no-store" });
    if (response.status === 401 && attempt < 5) {
      await askForKey(Boolean(key));
      continue;
    }
    if (!response.ok) throw await errorOf(response);
    return response;
  }
}

export async function getJSON(path) {
  return (await request(path)).json();
}

// Server-sent events of a response body: yields each event's data (the `data:` lines
// joined), in order. Reading stops when the body ends or `signal` aborts.
export async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder("utf-8");
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
        const data = event.split(/\r?\n/).filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
        if (data) yield data;
      }
    }
  } finally {
    reader.cancel().catch(() => {});  // early exit closes the connection (aborts the request)
  }
}
