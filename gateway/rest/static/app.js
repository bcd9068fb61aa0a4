// The inflight web page: a chat playground over /v1/chat/completions (streamed) and the
// fleet view over GET /fleet. No framework, no network beyond this gateway. The API key is
// kept in sessionStorage only (gone when the tab closes); every text from the server is set
// with textContent, never parsed as HTML.
"use strict";

const KEY_SLOT = "inflight.apiKey";
const $ = (id) => document.getElementById(id);
const state = { history: [], controller: null, fleetTimer: null };

function apiKey() { return sessionStorage.getItem(KEY_SLOT) || ""; }

function headers(json) {
  const h = { Authorization: "Bearer " + apiKey() };
  if (json) h["Content-Type"] = "application/json";
  return h;
}

async function errorText(resp) {
  try {
    const body = await resp.json();
    return `${resp.status}: ${(body.error && body.error.message) || JSON.stringify(body)}`;
  } catch (_) {
    return `${resp.status} ${resp.statusText}`;
  }
}

// ------------------------------------------------------------------ key
async function loadModels() {
  const select = $("model");
  select.textContent = "";
  if (!apiKey()) { $("key-state").textContent = "no key"; return; }
  const resp = await fetch("/v1/models", { headers: headers(false) });
  if (!resp.ok) { $("key-state").textContent = await errorText(resp); return; }
  const body = await resp.json();
  for (const card of body.data) {
    const option = document.createElement("option");
    option.value = option.textContent = card.id;
    select.appendChild(option);
  }
  $("key-state").textContent = `key ok · ${body.data.length} model(s)`;
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY_SLOT, $("api-key").value.trim());
  $("api-key").value = "";
  loadModels();
  if (!$("view-fleet").hidden) refreshFleet();
});

// ----------------------------------------------------------------- tabs
for (const tab of document.querySelectorAll(".tab")) {
  tab.addEventListener("click", () => show(tab.dataset.view));
}

function show(view) {
  for (const tab of document.querySelectorAll(".tab")) tab.classList.toggle("active", tab.dataset.view === view);
  $("view-chat").hidden = view !== "chat";
  $("view-fleet").hidden = view !== "fleet";
  clearInterval(state.fleetTimer);
  if (view === "fleet") { refreshFleet(); state.fleetTimer = setInterval(refreshFleet, 2000); }
}

// ----------------------------------------------------------------- chat
function addMessage(role, text) {
  const box = document.createElement("div");
  box.className = "msg " + role;
  const label = document.createElement("span");
  label.className = "role";
  label.textContent = role;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  box.append(label, body);
  $("messages").appendChild(box);
  $("messages").scrollTop = $("messages").scrollHeight;
  return box;
}

function requestBody(messages) {
  const body = { model: $("model").value, messages, stream: true,
                 stream_options: { include_usage: true } };
  const temperature = parseFloat($("temperature").value);
  if (!Number.isNaN(temperature)) body.temperature = temperature;
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (!Number.isNaN(maxTokens)) body.max_tokens = maxTokens;
  const stop = $("stop").value.split("\n").filter((s) => s.length > 0);
  if (stop.length) body.stop = stop;
  return body;
}

// Server-sent events: "data: {json}" lines separated by blank lines, ending with "data: [DONE]".
async function* sseEvents(resp) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith("data: ")) yield line.slice(6);
      }
    }
  }
}

async function send(text) {
  const system = $("system").value.trim();
  const messages = (system ? [{ role: "system", content: system }] : []).concat(state.history,
    [{ role: "user", content: text }]);
  addMessage("user", text);
  const reply = addMessage("assistant", "");
  const out = reply.querySelector(".text");
  state.controller = new AbortController();
  $("send").disabled = true; $("stop-btn").disabled = false; $("chat-state").textContent = "waiting…";
  const started = performance.now();
  let finish = null, usage = null, first = null;
  try {
    const resp = await fetch("/v1/chat/completions", { method: "POST", headers: headers(true),
      body: JSON.stringify(requestBody(messages)), signal: state.controller.signal });
    if (!resp.ok) throw new Error(await errorText(resp));
    $("chat-state").textContent = "streaming…";
    for await (const data of sseEvents(resp)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        if (choice.delta && choice.delta.content) {
          if (first === null) first = performance.now();
          out.textContent += choice.delta.content;
          $("messages").scrollTop = $("messages").scrollHeight;
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    }
    state.history.push({ role: "user", content: text }, { role: "assistant", content: out.textContent });
  } catch (err) {
    if (err.name === "AbortError") finish = "stopped";
    else { reply.classList.add("error"); out.textContent += (out.textContent ? "\n" : "") + err.message; }
  } finally {
    const meta = document.createElement("span");
    meta.className = "meta";
    const secs = ((performance.now() - started) / 1000).toFixed(1);
    const ttft = first === null ? "" : ` · first token ${((first - started) / 1000).toFixed(2)} s`;
    const tokens = usage ? ` · ${usage.completion_tokens} tokens, ${(usage.completion_tokens / secs).toFixed(1)} tok/s` : "";
    meta.textContent = `${finish || "ended"} · ${secs} s${ttft}${tokens}`;
    reply.appendChild(meta);
    state.controller = null;
    $("send").disabled = false; $("stop-btn").disabled = true; $("chat-state").textContent = "";
  }
}

$("prompt-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); $("prompt-form").requestSubmit(); }
});
$("stop-btn").addEventListener("click", () => state.controller && state.controller.abort());
$("clear").addEventListener("click", () => { state.history = []; $("messages").textContent = ""; });

// ---------------------------------------------------------------- fleet
function duration(seconds) {
  const s = Math.floor(seconds);
  if (s >= 3600) return `${Math.floor(s / 3600)}h ${String(Math.floor(s % 3600 / 60)).padStart(2, "0")}m`;
  return s >= 60 ? `${Math.floor(s / 60)}m ${String(s % 60).padStart(2, "0")}s` : `${s}s`;
}
const rate = (v) => (v === null || v === undefined ? "-" : v.toFixed(1));

function cell(row, text, field) {
  const td = document.createElement("td");
  td.textContent = text;
  if (field) td.dataset.field = field;
  row.appendChild(td);
}

async function refreshFleet() {
  const error = $("fleet-error");
  if (!apiKey()) { error.hidden = false; error.textContent = "Enter an admin API key above."; return; }
  let view;
  try {
    const resp = await fetch("/fleet", { headers: headers(false) });
    if (!resp.ok) throw new Error(await errorText(resp));
    view = await resp.json();
  } catch (err) {
    error.hidden = false; error.textContent = err.message; return;
  }
  error.hidden = true;
  $("fleet-workers").textContent = view.workers.length;
  $("fleet-prompt-tps").textContent = view.prompt_tps.toFixed(1);
  $("fleet-generation-tps").textContent = view.generation_tps.toFixed(1);
  $("fleet-queues").textContent = Object.entries(view.queue_depth).map(([p, n]) => `p${p} ${n}`).join(" · ");
  const rejected = Object.entries(view.rejections_last_minute);
  $("fleet-rejections").textContent = rejected.length ? rejected.map(([r, n]) => `${r} ${n}`).join(", ") : "0";
  $("fleet-queues").dataset.total = Object.values(view.queue_depth).reduce((a, b) => a + b, 0);
  const body = document.querySelector("#fleet-table tbody");
  body.textContent = "";
  for (const w of view.workers) {
    const row = document.createElement("tr");
    row.dataset.worker = w.worker_id;
    cell(row, w.worker_id); cell(row, w.model); cell(row, w.batching); cell(row, duration(w.up_s));
    cell(row, String(w.running), "running"); cell(row, String(w.waiting), "waiting");
    cell(row, (100 * w.kv_usage).toFixed(1) + "%", "kv_usage");
    cell(row, rate(w.prompt_tps), "prompt_tps"); cell(row, rate(w.generation_tps), "generation_tps");
    body.appendChild(row);
  }
  $("fleet-updated").textContent = "updated " + new Date(view.taken_unix_s * 1000).toLocaleTimeString();
}

loadModels();
