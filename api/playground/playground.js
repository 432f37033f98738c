// The playground: a chat that streams from /v1/chat/completions with the official
// request shape, and shows each answer's usage and timing. No build step.
"use strict";

const $ = (id) => document.getElementById(id);
const history = [];  // the conversation so far, as Chat Completions messages

function headers() {
  const key = $("api-key").value.trim();
  localStorage.setItem("sluice-api-key", key);
  const result = { "Content-Type": "application/json" };
  if (key) result.Authorization = `Bearer ${key}`;
  return result;
}

async function loadModels() {
  showError("");
  const response = await fetch("/v1/models", { headers: headers() });
  if (!response.ok) return showError(await errorText(response));
  const { data } = await response.json();
  $("model").replaceChildren(...data.map((model) => new Option(model.id, model.id)));
}

function readImage(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

function addTurn(role, text, image) {
  const turn = document.createElement("div");
  turn.className = `turn ${role}`;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  turn.append(body);
  if (image) {
    const picture = document.createElement("img");
    picture.src = image;
    turn.append(picture);
  }
  $("log").append(turn);
  return turn;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return body.error?.message || JSON.stringify(body);
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

function showError(message) {
  $("status").textContent = message;
}

// Yields the JSON of each SSE `data:` line until [DONE].
async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, end).trim();
      buffer = buffer.slice(end + 1);
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

async function send(event) {
  event.preventDefault();
  const text = $("message").value.trim();
  const file = $("image").files[0];
  if (!text && !file) return;
  showError("");
  const image = file ? await readImage(file) : null;
  const content = image
    ? [{ type: "text", text }, { type: "image_url", image_url: { url: image } }]
    : text;
  history.push({ role: "user", content });
  addTurn("user", text, image);
  $("message").value = "";
  $("image").value = "";
  const system = $("system").value.trim();
  const body = {
    model: $("model").value,
    messages: system ? [{ role: "system", content: system }, ...history] : history,
    temperature: Number($("temperature").value),
    max_tokens: Number($("max-tokens").value),
    stream: true,
    stream_options: { include_usage: true },
  };
  const turn = addTurn("assistant", "");
  const answer = turn.querySelector(".text");
  $("send").disabled = true;
  const started = performance.now();
  let firstToken = null;
  let usage = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body),
    });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      const delta = chunk.choices?.[0]?.delta?.content;
      if (delta) {
        firstToken ??= performance.now();
        answer.textContent += delta;
      }
      if (chunk.usage) usage = chunk.usage;
    }
    history.push({ role: "assistant", content: answer.textContent });
    const stats = document.createElement("div");
    stats.className = "stats";
    stats.textContent = describe(usage, started, firstToken, performance.now());
    turn.append(stats);
  } catch (error) {
    history.pop();
    showError(error.message);
  } finally {
    $("send").disabled = false;
  }
}

function describe(usage, started, firstToken, ended) {
  if (!usage) return "";
  const ttft = firstToken === null ? "-" : `${Math.round(firstToken - started)} ms`;
  const decoding = firstToken === null ? 0 : (ended - firstToken) / 1000;
  const rate = decoding > 0 && usage.completion_tokens > 1
    ? `${((usage.completion_tokens - 1) / decoding).toFixed(1)} tok/s`
    : "-";
  return `${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens · `
    + `first token ${ttft} · ${rate}`;
}

$("composer").addEventListener("submit", send);
$("message").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("clear").addEventListener("click", () => {
  history.length = 0;
  $("log").replaceChildren();
  showError("");
});
$("api-key").addEventListener("change", loadModels);
$("api-key").value = localStorage.getItem("sluice-api-key") || "";
loadModels();
