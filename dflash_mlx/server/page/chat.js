// The chat page: this server's own OpenAI chat completions API, streamed (same origin:
// nothing is fetched from anywhere else). Under each reply, what the engine reported in
// `timings`: tokens, tok/s, τ, the share of drafted tokens accepted, TTFT, cached tokens.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { messages: [], controller: null, key: sessionStorage.getItem("dflash-key") || "" };

function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.key) h.Authorization = "Bearer " + state.key;
  return h;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (e) {
    return response.status + " " + response.statusText;
  }
}

function askForKey(message) {
  $("key-form").hidden = false;
  $("key-error").textContent = message || "";
  $("key").focus();
}

async function loadModel() {
  const response = await fetch("/v1/models", { headers: headers() });
  if (response.status === 401) {
    askForKey(state.key ? "That key was refused." : "");
    return false;
  }
  if (!response.ok) {
    $("model").textContent = await errorText(response);
    return false;
  }
  $("key-form").hidden = true;
  const card = (await response.json()).data[0];
  $("model").textContent = card.id + (card.draft ? " + draft " + card.draft : " (no draft)");
  return true;
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = role === "user" ? "you" : "assistant";
  const body = document.createElement("div");
  body.className = "body";
  if (role === "user") body.textContent = text;
  div.append(who, body);
  $("messages").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function statsLine(t) {
  const parts = [t.predicted_n + " tokens", t.predicted_per_second.toFixed(1) + " tok/s"];
  if (t.cycles) parts.push("τ " + t.tau.toFixed(2));
  if (t.draft_n) parts.push("accepted " + Math.round((100 * t.draft_n_accepted) / t.draft_n) + "%");
  parts.push("TTFT " + Math.round(t.prompt_ms) + " ms");
  parts.push(t.cache_n + " cached prompt tokens");
  return parts.join(" · ");
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith("data: ")) yield line.slice(6);
      }
    }
  }
}

async function send(text) {
  const system = $("system").value.trim();
  state.messages.push({ role: "user", content: text });
  addMessage("user", text);
  const div = addMessage("assistant", "");
  const body = div.querySelector(".body");
  const reasoningEl = document.createElement("div");
  reasoningEl.className = "reasoning";
  const stats = document.createElement("div");
  stats.className = "stats";
  div.append(stats);
  body.before(reasoningEl);
  let reply = "";
  let reasoning = "";
  const request = {
    messages: (system ? [{ role: "system", content: system }] : []).concat(state.messages),
    stream: true,
    temperature: Number($("temperature").value),
    max_tokens: Number($("max-tokens").value),
  };
  state.controller = new AbortController();
  setBusy(true);
  div.classList.add("streaming");
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(),
      body: JSON.stringify(request),
      signal: state.controller.signal,
    });
    if (!response.ok) {
      if (response.status === 401) askForKey("The key was refused.");
      throw new Error(await errorText(response));
    }
    for await (const data of sseEvents(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      const delta = choice.delta || {};
      if (delta.reasoning_content) {
        reasoning += delta.reasoning_content;
        reasoningEl.textContent = reasoning;
      }
      if (delta.content) {
        reply += delta.content;
        body.innerHTML = Markdown.render(reply);
      }
      if (choice.finish_reason) {
        stats.textContent = statsLine(chunk.timings || {}) + " · " + choice.finish_reason;
        div.classList.add("done");
      }
    }
  } catch (e) {
    if (e.name === "AbortError") {
      stats.textContent = "stopped";
      div.classList.add("stopped");
    } else {
      const err = document.createElement("div");
      err.className = "error";
      err.textContent = "error: " + e.message;
      div.append(err);
      div.classList.add("failed");
    }
  } finally {
    div.classList.remove("streaming");
    state.controller = null;
    setBusy(false);
    if (reply) state.messages.push({ role: "assistant", content: reply });
  }
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("input").value.trim();
  if (!text || state.controller) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("new-chat").addEventListener("click", () => {
  if (state.controller) state.controller.abort();
  state.messages = [];
  $("messages").replaceChildren();
  $("input").focus();
});
$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  state.key = $("key").value.trim();
  sessionStorage.setItem("dflash-key", state.key);
  loadModel();
});

loadModel();
