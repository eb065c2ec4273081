// The chat: a conversation streamed through /v1/chat/completions (the server applies the
// model's chat template). Invariants: `turns` holds only completed or stopped exchanges (a
// failed one is shown, marked, and left out of what is sent next); at most one stream runs;
// every model and user string is put into the page as text; a stream cut off by "clear"
// changes nothing after the clear (the epoch tells).
import { request, sseData, APIError } from "./api.js";
import { byId, clear, el } from "./dom.js";

export class Chat {
  constructor(getModel) {
    this.getModel = getModel;
    this.turns = [];          // [{role, content}] sent as the history
    this.controller = null;   // AbortController of the running stream
    this.epoch = 0;           // bumped by clear(): a send from before it records nothing
    this.messages = byId("messages");
    this.status = byId("chat-status");
    this.prompt = byId("prompt");
    byId("composer").addEventListener("submit", (e) => { e.preventDefault(); this.send(); });
    this.prompt.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); this.send(); }
    });
    byId("stop").addEventListener("click", () => this.stop());
    byId("clear").addEventListener("click", () => this.clear());
  }

  get streaming() { return this.controller !== null; }

  setStreaming(on) {
    byId("send").hidden = on;
    byId("stop").hidden = !on;
  }

  bubble(role, text) {
    const body = el("div", { className: "text", text });
    const node = el("div", { className: `msg ${role}`, dataset: { role } },
                    el("div", { className: "role", text: role }), body);
    if (role === "assistant") {
      const copy = el("button", { type: "button", className: "copy link", text: "Copy",
                                  title: "copy this answer" });
      copy.addEventListener("click", () => copyText(body.textContent, copy));
      node.append(el("div", { className: "meta" }, copy, el("span", { className: "info" })));
    }
    this.messages.append(node);
    node.scrollIntoView({ block: "end" });
    return node;
  }

  showError(message) {
    const node = el("div", { className: "msg error", dataset: { role: "error" } },
                    el("div", { className: "role", text: "error" }),
                    el("div", { className: "text", text: message }));
    this.messages.append(node);
    node.scrollIntoView({ block: "end" });
  }

  // The request's sampling settings; a JSON schema (settings box) constrains the answer
  // through response_format. Throws SettingsError when the schema box is not JSON.
  settings() {
    const body = {};
    const number = (id) => {
      const raw = byId(id).value.trim();
      return raw === "" ? undefined : Number(raw);
    };
    const temperature = number("temperature");
    const topP = number("top-p");
    const maxTokens = number("max-tokens");
    if (temperature !== undefined) body.temperature = temperature;
    if (topP !== undefined) body.top_p = topP;
    if (maxTokens !== undefined) body.max_tokens = maxTokens;
    const schemaText = byId("json-schema").value.trim();
    if (schemaText) {
      let schema;
      try {
        schema = JSON.parse(schemaText);
      } catch (err) {
        throw new SettingsError(`the JSON schema in the settings is not JSON: ${err.message}`);
      }
      body.response_format = { type: "json_schema",
                               json_schema: { name: "answer", schema, strict: true } };
    }
    return body;
  }

  async send() {
    const text = this.prompt.value;
    if (this.streaming || !text.trim()) return;
    let settings;
    try {
      settings = this.settings();
    } catch (err) {
      if (!(err instanceof SettingsError)) throw err;
      this.showError(err.message);   // nothing sent; the message stays in the box
      return;
    }
    this.prompt.value = "";
    const system = byId("system-prompt").value.trim();
    const history = [...this.turns, { role: "user", content: text }];
    const messages = system ? [{ role: "system", content: system }, ...history] : history;
    const userNode = this.bubble("user", text);
    const answer = this.bubble("assistant", "");
    const textNode = answer.querySelector(".text");
    const info = answer.querySelector(".info");
    answer.classList.add("streaming");
    const controller = new AbortController();
    const epoch = this.epoch;
    this.controller = controller;
    this.setStreaming(true);
    this.status.textContent = "waiting for the first token…";
    const started = performance.now();
    let firstAt = null, finish = null, usage = null, failed = null;
    try {
      const response = await request("/v1/chat/completions", {
        method: "POST", signal: controller.signal,
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ model: this.getModel(), messages, stream: true,
                               stream_options: { include_usage: true }, ...settings }),
      });
      for await (const data of sseData(response)) {
        if (data === "[DONE]") break;
        const event = JSON.parse(data);
        if (event.error) { failed = event.error.message || "the server reported an error"; break; }
        if (event.usage) usage = event.usage;
        for (const choice of event.choices || []) {
          const piece = choice.delta && choice.delta.content;
          if (piece) {
            if (firstAt === null) firstAt = performance.now();
            textNode.append(piece);   // a text node: markup in the output stays text
            this.status.textContent = `generating… ${textNode.textContent.length} characters`;
            answer.scrollIntoView({ block: "end" });
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }
    } catch (err) {
      if (err.name === "AbortError") finish = "stopped";
      else failed = err instanceof APIError ? err.message : `request failed: ${err.message}`;
    } finally {
      this.controller = null;
      this.setStreaming(false);
      answer.classList.remove("streaming");
    }
    const seconds = (performance.now() - started) / 1000;
    if (epoch !== this.epoch) return;   // cleared meanwhile
    if (failed !== null) {
      answer.classList.add("failed");
      userNode.classList.add("failed");
      if (!textNode.textContent) answer.remove();
      this.showError(failed);
      if (!this.prompt.value) this.prompt.value = text;  // the failed turn can be sent again
      this.status.textContent = "";
      return;
    }
    const answerText = textNode.textContent;
    this.turns.push({ role: "user", content: text }, { role: "assistant", content: answerText });
    answer.dataset.finish = finish || "unknown";
    const parts = [finish === "stopped" ? "stopped" : `finished: ${finish || "?"}`];
    if (usage) {
      const rate = firstAt !== null && usage.completion_tokens > 1
        ? (usage.completion_tokens - 1) / ((performance.now() - firstAt) / 1000) : null;
      parts.push(`${usage.prompt_tokens} prompt + ${usage.completion_tokens} tokens`);
      if (rate !== null) parts.push(`${rate.toFixed(1)} tok/s`);
    }
    if (firstAt !== null) parts.push(`first token ${((firstAt - started) / 1000).toFixed(2)} s`);
    parts.push(`${seconds.toFixed(2)} s`);
    info.textContent = parts.join(" · ");
    this.status.textContent = "";
  }

  stop() {
    if (this.controller) this.controller.abort();
  }

  clear() {
    this.stop();
    this.epoch += 1;
    this.turns = [];
    clear(this.messages);
    this.status.textContent = "";
  }
}

class SettingsError extends Error {}

async function copyText(text, button) {
  let ok = false;
  try {
    await navigator.clipboard.writeText(text);
    ok = true;
  } catch (_) {  // no clipboard API (plain http on another host): select and copy
    const area = el("textarea", { className: "offscreen" });
    area.value = text;
    document.body.append(area);
    area.select();
    ok = document.execCommand("copy");
    area.remove();
  }
  button.textContent = ok ? "Copied" : "Copy failed";
  setTimeout(() => { button.textContent = "Copy"; }, 1500);
}
