// ladle's playground. Chat mode streams from /v1/chat/completions: each reply shows its
// reasoning (collapsible), tool calls, time to first token and tokens/s. Completion mode streams
// from /v1/completions: the text typed is continued as it is, with no chat template, which is
// how a base model (one not trained to chat) is used. Stop aborts the request (the server aborts
// it in the engine when the connection closes).
"use strict";

const $ = (id) => document.getElementById(id);
const state = { messages: [], controller: null, key: localStorage.getItem("ladle-api-key") || "" };

function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.key) h.Authorization = "Bearer " + state.key;
  return h;
}

function setStatus(text) { $("status").textContent = text; }

async function loadModels() {
  const res = await fetch("/v1/models", { headers: headers() });
  if (res.status === 401) {  // the server runs with --api-key
    $("key-box").hidden = false;
    setStatus("API key needed");
    return;
  }
  $("key-box").hidden = true;
  const body = await res.json();
  $("model").replaceChildren(...body.data.map((m) => new Option(m.id, m.id)));
  setStatus("ready");
}

// ---- one request ------------------------------------------------------------------------------
function numberField(id, parse) {
  const raw = $(id).value.trim();
  return raw === "" ? undefined : parse(raw);
}

function isCompletion() { return $("mode").value === "completion"; }

// The body for the mode: chat sends the conversation so far, completion the text to continue.
function buildRequest(prompt) {
  const body = { model: $("model").value };
  if (isCompletion()) {
    body.prompt = prompt;
  } else {
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...state.messages);
    body.messages = messages;
  }
  Object.assign(body, {
    stream: true,
    stream_options: { include_usage: true, continuous_usage_stats: true },
    temperature: numberField("temperature", parseFloat),
    top_p: numberField("top_p", parseFloat),
    top_k: numberField("top_k", (v) => parseInt(v, 10)),
    min_p: numberField("min_p", parseFloat),
    max_tokens: numberField("max_tokens", (v) => parseInt(v, 10)),
    seed: numberField("seed", (v) => parseInt(v, 10)),
  });
  const schema = $("schema").value.trim();
  if (schema) {
    body.response_format = { type: "json_schema", json_schema: { name: "playground", schema: JSON.parse(schema) } };
  }
  return body;
}

// Reads an SSE body and calls onData with each parsed `data:` payload until [DONE].
async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of frame.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onData(JSON.parse(data));
      }
    }
  }
}

// ---- the page ---------------------------------------------------------------------------------
function addTurn(role, text) {
  const turn = document.createElement("div");
  turn.className = "turn " + role;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text || "";
  turn.append(content);
  $("log").append(turn);
  turn.scrollIntoView({ block: "end" });
  return turn;
}

class Reply {
  // The assistant's turn on the page, filled as chunks arrive. In completion mode the turn
  // shows the prompt, then the continuation as it streams.
  constructor(prompt) {
    this.turn = addTurn(prompt === undefined ? "assistant" : "assistant completion", "");
    this.content = this.turn.querySelector(".content");
    if (prompt !== undefined) {
      const shown = document.createElement("span");
      shown.className = "prompt";
      shown.textContent = prompt;
      this.turn.insertBefore(shown, this.content);
    }
    this.text = "";
    this.reasoning = null;
    this.calls = [];
    this.stats = document.createElement("div");
    this.stats.className = "stats";
    this.turn.append(this.stats);
  }

  addReasoning(text) {
    if (!this.reasoning) {
      const details = document.createElement("details");
      details.open = true;
      details.innerHTML = "<summary>reasoning</summary>";
      this.reasoning = document.createElement("div");
      this.reasoning.className = "reasoning";
      details.append(this.reasoning);
      this.turn.insertBefore(details, this.content);
    }
    this.reasoning.textContent += text;
  }

  addContent(text) {
    this.text += text;
    this.content.textContent = this.text;
  }

  addToolCall(piece) {
    let call = this.calls[piece.index];
    if (!call) {
      const el = document.createElement("pre");
      el.className = "tool-call";
      this.turn.insertBefore(el, this.stats);
      call = this.calls[piece.index] = { el, name: "", args: "" };
    }
    if (piece.function?.name) call.name = piece.function.name;
    call.args += piece.function?.arguments || "";
    call.el.textContent = `tool call: ${call.name}(${call.args})`;
  }

  showStats(t0, tFirst, numTokens, note) {
    const ttft = tFirst === null ? "-" : `${Math.round(tFirst - t0)} ms`;
    const seconds = tFirst === null ? 0 : (performance.now() - tFirst) / 1000;
    const rate = seconds > 0 && numTokens > 1 ? ((numTokens - 1) / seconds).toFixed(1) : "-";
    this.stats.textContent = `${numTokens} tokens · TTFT ${ttft} · ${rate} tokens/s${note ? " · " + note : ""}`;
  }

  showError(message) {
    const el = document.createElement("div");
    el.className = "error";
    el.textContent = message;
    this.turn.insertBefore(el, this.stats);
  }
}

async function send(text) {
  const completion = isCompletion();
  let reply;
  if (completion) {
    reply = new Reply(text);
  } else {
    state.messages.push({ role: "user", content: text });
    addTurn("user", text);
    reply = new Reply();
  }
  let body;
  try {
    body = buildRequest(text);
  } catch (e) {
    reply.showError("JSON schema: " + e.message);
    if (!completion) state.messages.pop();
    return;
  }
  state.controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  setStatus("generating");
  const t0 = performance.now();
  let tFirst = null;
  let numTokens = 0;
  let finish = null;
  try {
    const res = await fetch(completion ? "/v1/completions" : "/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: state.controller.signal,
    });
    if (!res.ok) {
      const err = await res.json().catch(() => ({}));
      throw new Error(err.error?.message || `HTTP ${res.status}`);
    }
    await readEvents(res, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) numTokens = chunk.usage.completion_tokens;
      const choice = chunk.choices?.[0];
      if (!choice) return;
      // A completion chunk carries `text`; a chat chunk a `delta`.
      const d = completion ? { content: choice.text } : (choice.delta || {});
      if (tFirst === null && (d.content || d.reasoning_content || d.tool_calls)) tFirst = performance.now();
      if (d.reasoning_content) reply.addReasoning(d.reasoning_content);
      if (d.content) reply.addContent(d.content);
      for (const piece of d.tool_calls || []) reply.addToolCall(piece);
      if (choice.finish_reason) finish = choice.finish_reason;
      reply.showStats(t0, tFirst, numTokens);
    });
    reply.showStats(t0, tFirst, numTokens, finish && `finish: ${finish}`);
  } catch (e) {
    if (e.name === "AbortError") reply.showStats(t0, tFirst, numTokens, "stopped");
    else reply.showError(e.message);
  } finally {
    if (!completion) state.messages.push({ role: "assistant", content: reply.text });
    state.controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
    setStatus("ready");
  }
}

// ---- wiring -----------------------------------------------------------------------------------
$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  // A completion prompt is sent as typed: a trailing space changes what a base model writes.
  const raw = $("message").value;
  const text = isCompletion() ? raw : raw.trim();
  if (!text.trim() || state.controller) return;
  $("message").value = "";
  send(text);
});
// Each mode keeps its own page: switching clears the log and the conversation.
function applyMode() {
  const completion = isCompletion();
  $("system-label").hidden = completion;
  $("message").placeholder = completion
    ? "Text for the model to continue (Enter sends, Shift+Enter adds a line)"
    : "Message (Enter sends, Shift+Enter adds a line)";
  state.messages = [];
  $("log").replaceChildren();
}
$("mode").addEventListener("change", applyMode);
$("message").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) {
    ev.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => state.controller?.abort());
$("clear").addEventListener("click", () => {
  state.messages = [];
  $("log").replaceChildren();
});
$("save-key").addEventListener("click", () => {
  state.key = $("api-key").value.trim();
  localStorage.setItem("ladle-api-key", state.key);
  loadModels();
});
applyMode();
loadModels().catch((e) => setStatus("cannot reach the server: " + e.message));
