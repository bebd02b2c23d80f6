// The chat page: this server's own OpenAI chat completions API, streamed (same origin:
// nothing is fetched from anywhere else). Under each reply, what the engine reported in
// `timings`: tokens, tok/s, τ, the share of drafted tokens accepted, TTFT, cached tokens.
"use strict";

const $ = (id) => document.getElementById(id);
const state = {
  messages: [],
  controller: null,
  key: sessionStorage.getItem("dflash-key") || "",
  pinned: true, // the view follows the conversation until the user scrolls up
};

// Sticking to the bottom: while a reply streams the view follows it, unless the user
// scrolled up to read (then it stays where they are, until they scroll back down).
const SLACK = 48; // px from the bottom that still count as the bottom
function atBottom() {
  const page = document.scrollingElement;
  return page.scrollHeight - page.scrollTop - page.clientHeight <= SLACK;
}
function follow() {
  if (state.pinned) window.scrollTo(0, document.scrollingElement.scrollHeight);
}
window.addEventListener("scroll", () => {
  state.pinned = atBottom();
});

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
  follow();
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

// A reply's body, drawn as it streams: what can no longer change is appended once
// (Markdown.Stream), only the open part is drawn again; an open code fence is appended to.
function replyView(body) {
  const stream = new Markdown.Stream();
  const open = document.createElement("div");
  open.className = "md-open";
  body.append(open);
  let fence = null; // {start, text: the code's text node, shown: offset of reply shown}
  return {
    update(reply) {
      const step = stream.feed(reply);
      for (const html of step.html) open.insertAdjacentHTML("beforebegin", html);
      if (step.fence) {
        if (!fence || fence.start !== step.fence.body) {
          const pre = document.createElement("pre");
          const code = document.createElement("code");
          if (step.fence.lang) code.className = "language-" + step.fence.lang;
          const text = document.createTextNode("");
          fence = { start: step.fence.body, text, shown: step.fence.body };
          code.append(text);
          pre.append(code);
          open.replaceChildren(pre);
        }
        fence.text.appendData(reply.slice(fence.shown));
        fence.shown = reply.length;
      } else {
        fence = null;
        open.innerHTML = Markdown.render(reply.slice(step.tail));
      }
      follow();
    },
    end(reply) {
      // The open part as Markdown renders it (a fence never closed, a last paragraph).
      open.insertAdjacentHTML("beforebegin", Markdown.render(reply.slice(stream.settled)));
      open.remove();
    },
  };
}

async function send(text) {
  const system = $("system").value.trim();
  state.messages.push({ role: "user", content: text });
  state.pinned = true; // a new message: the view goes to it
  addMessage("user", text);
  const div = addMessage("assistant", "");
  const body = div.querySelector(".body");
  const reasoningEl = document.createElement("div");
  reasoningEl.className = "reasoning";
  const reasoningText = document.createTextNode("");
  reasoningEl.append(reasoningText);
  const view = replyView(body);
  const stats = document.createElement("div");
  stats.className = "stats";
  div.append(stats);
  body.before(reasoningEl);
  let reply = "";
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
        reasoningText.appendData(delta.reasoning_content);
        follow();
      }
      if (delta.content) {
        reply += delta.content;
        view.update(reply);
      }
      if (choice.finish_reason) {
        stats.textContent = statsLine(chunk.timings || {}) + " · " + choice.finish_reason;
        div.classList.add("done");
        follow();
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
    view.end(reply);
    follow();
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
