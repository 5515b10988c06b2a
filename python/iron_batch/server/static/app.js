// iron-batch page: chat playground + live dashboard. Plain JavaScript, no dependencies;
// it only talks to this server (/ui/api/*, /v1/chat/completions, /generate, /health).
"use strict";

const KEY_STORAGE = "iron-batch-api-key"; // sessionStorage: this tab only
const POLL_MS = 1000;
const HISTORY_MAX = 300; // snapshots kept (one a second)

const $ = (id) => document.getElementById(id);
const state = {
  info: null,
  snapshots: [],
  lastSeq: 0,
  polling: null,
  messages: [], // chat history sent to /v1/chat/completions
  controller: null,
};

// ---------------------------------------------------------------- auth and fetching

class AuthError extends Error {}

function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE) || "";
}

function headers(extra) {
  const h = Object.assign({}, extra || {});
  const key = apiKey();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function api(path, options) {
  const opts = Object.assign({}, options || {});
  opts.headers = headers(opts.headers);
  const response = await fetch(path, opts);
  if (response.status === 401) throw new AuthError("unauthorized");
  return response;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (e) {
    return response.status + " " + response.statusText;
  }
}

function showAuth(message) {
  // No data while locked: drop what an earlier key showed.
  stopPolling();
  state.info = null;
  state.snapshots = [];
  state.lastSeq = 0;
  $("main").hidden = true;
  $("model-name").textContent = "locked";
  $("auth").hidden = false;
  const err = $("auth-error");
  err.hidden = !message;
  err.textContent = message || "";
  $("auth-key").focus();
}

$("auth-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY_STORAGE, $("auth-key").value.trim());
  $("auth-key").value = "";
  start();
});

$("forget-key").addEventListener("click", () => {
  sessionStorage.removeItem(KEY_STORAGE);
  showAuth("");
});

async function start() {
  let response;
  try {
    response = await api("/ui/api/info");
  } catch (e) {
    if (e instanceof AuthError) {
      showAuth(apiKey() ? "That key was not accepted." : "");
      return;
    }
    $("model-name").textContent = "server unreachable; retrying…";
    setTimeout(start, 2000);
    return;
  }
  if (!response.ok) {
    $("model-name").textContent = await errorText(response);
    return;
  }
  state.info = await response.json();
  $("auth").hidden = true;
  $("main").hidden = false;
  $("forget-key").hidden = !state.info.auth;
  renderInfo(state.info);
  setupPlayground();
  startPolling();
}

// ---------------------------------------------------------------- formatting

function fmt(value, digits) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  if (Math.abs(value) >= 1000) return Math.round(value).toLocaleString("en-US");
  return Number(value).toFixed(digits === undefined ? 1 : digits);
}

function fmtMs(ms) {
  if (ms === null || ms === undefined) return "–";
  if (ms >= 1000) return (ms / 1000).toFixed(2) + " s";
  if (ms >= 10) return ms.toFixed(0) + " ms";
  return ms.toFixed(2) + " ms";
}

function fmtBytes(n) {
  if (!n) return null;
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return n.toFixed(i ? 1 : 0) + " " + units[i];
}

// The pool's bytes and what K/V are stored as, e.g. " (512.0 MiB, int8 K/V)".
function kvStored(kv) {
  const parts = [];
  if (kv.bytes) parts.push(fmtBytes(kv.bytes));
  if (kv.dtype) parts.push(kv.dtype + " K/V");
  return parts.length ? " (" + parts.join(", ") + ")" : "";
}

function renderInfo(info) {
  const device = [info.dtype, info.device].filter(Boolean).join(" on ");
  $("model-name").textContent = info.model + " · " + info.backend + (device ? " · " + device : "");
  const kv = info.kv;
  const l = info.limits;
  const s = info.scheduler;
  const rows = [
    ["model", info.model],
    ["backend", info.backend + (info.backend_url ? " (" + info.backend_url + ")" : "")],
    ["dtype / device", device || "– (no weights)"],
    ["tokenizer", info.tokenizer ? (info.chat_template ? "yes, with chat template" : "yes, no chat template") : "none (token ids only)"],
    ["vocabulary", fmt(info.vocab_size, 0)],
    ["context", info.max_model_len ? fmt(info.max_model_len, 0) + " tokens" : "unbounded"],
    ["KV pool", kv.blocks + " blocks × " + kv.block_size + " tokens = " + fmt(kv.tokens, 0) + " tokens" + kvStored(kv)],
    ["prefix caching", s.prefix_caching ? "on" : "off"],
    ["step budget", fmt(s.max_batch_tokens, 0) + " tokens, " + s.max_running_seqs + " sequences"],
    ["per sequence", fmt(l.max_seq_tokens, 0) + " tokens" + (l.max_prompt_tokens ? ", prompt ≤ " + l.max_prompt_tokens : "") + (l.max_new_tokens ? ", new ≤ " + l.max_new_tokens : "")],
    ["queue", l.max_waiting_requests + " waiting requests" + (l.max_waiting_tokens ? ", " + l.max_waiting_tokens + " prompt tokens" : "")],
    ["body", fmtBytes(l.max_body_bytes)],
    ["API key", info.auth ? "required" : "not required"],
  ];
  const dl = $("config");
  dl.textContent = "";
  for (const [k, v] of rows) {
    const dt = document.createElement("dt");
    dt.textContent = k;
    const dd = document.createElement("dd");
    dd.textContent = v;
    dl.append(dt, dd);
  }
}

// ---------------------------------------------------------------- dashboard

const CHARTS = [
  { id: "tok-s", title: "output tok/s", series: [["tokens_per_sec", "tok/s", "#2f7ed8"]] },
  { id: "seqs", title: "sequences", series: [["running", "running", "#2f9e44"], ["waiting", "waiting", "#e8590c"]] },
  { id: "kv", title: "KV blocks", series: [["kv_blocks_used", "used", "#7048e8"], ["kv_blocks_cached", "cached", "#15aabf"]], max: "kv_blocks_total" },
  { id: "hit", title: "prefix-cache hit rate", series: [["prefix_cache_hit_rate", "hit rate", "#c2255c"]], fixedMax: 1, percent: true },
  { id: "preempt", title: "preemptions / s", series: [["preemptions_per_sec", "preemptions/s", "#e03131"]] },
  { id: "ttft", title: "TTFT (ms, last 10 s)", series: [["ttft_p50_ms", "p50", "#1971c2"], ["ttft_p99_ms", "p99", "#f08c00"]] },
  { id: "itl", title: "inter-token latency (ms, last 10 s)", series: [["itl_p50_ms", "p50", "#1971c2"], ["itl_p99_ms", "p99", "#f08c00"]] },
];

function buildCharts() {
  const box = $("charts");
  if (box.childElementCount) return;
  for (const chart of CHARTS) {
    const fig = document.createElement("figure");
    fig.className = "chart";
    const cap = document.createElement("figcaption");
    cap.textContent = chart.title + " ";
    for (const [, label, color] of chart.series) {
      const key = document.createElement("span");
      key.className = "key";
      key.style.setProperty("--c", color);
      key.textContent = label;
      cap.append(key);
    }
    const canvas = document.createElement("canvas");
    canvas.id = "chart-" + chart.id;
    fig.append(cap, canvas);
    box.append(fig);
  }
}

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function drawChart(chart, snaps, windowS) {
  const canvas = $("chart-" + chart.id);
  if (!canvas) return;
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  if (!w || !h) return;
  if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(h * dpr);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  const style = getComputedStyle(document.body);
  const ink = style.getPropertyValue("--muted").trim() || "#888";
  const grid = style.getPropertyValue("--grid").trim() || "#ddd";
  const left = 44, right = 6, top = 6, bottom = 16;
  const pw = w - left - right, ph = h - top - bottom;
  const now = snaps.length ? snaps[snaps.length - 1].time : Date.now() / 1000;
  const t0 = now - windowS;
  const shown = snaps.filter((s) => s.time >= t0);
  let max = 0;
  for (const s of shown) for (const [key] of chart.series) if (s[key] > max) max = s[key];
  const cap = chart.max && shown.length ? shown[shown.length - 1][chart.max] : 0;
  max = chart.fixedMax || (cap > 0 && cap >= max ? cap : niceMax(max)); // KV: the pool
  ctx.font = "10px system-ui, sans-serif";
  ctx.fillStyle = ink;
  ctx.strokeStyle = grid;
  ctx.lineWidth = 1;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (let i = 0; i <= 4; i++) {
    const v = (max * i) / 4;
    const y = top + ph - (ph * i) / 4;
    ctx.beginPath();
    ctx.moveTo(left, Math.round(y) + 0.5);
    ctx.lineTo(left + pw, Math.round(y) + 0.5);
    ctx.stroke();
    if (i % 2 === 0) ctx.fillText(chart.percent ? Math.round(v * 100) + "%" : fmt(v, v < 10 && v % 1 ? 1 : 0), left - 4, y);
  }
  ctx.textBaseline = "top";
  ctx.textAlign = "left";
  ctx.fillText("-" + Math.round(windowS / 60) + " min", left, top + ph + 3);
  ctx.textAlign = "right";
  ctx.fillText("now", left + pw, top + ph + 3);
  const x = (t) => left + ((t - t0) / windowS) * pw;
  const y = (v) => top + ph - (Math.min(v, max) / max) * ph;
  for (const [key, , color] of chart.series) {
    ctx.strokeStyle = color;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let pen = false;
    for (const s of shown) {
      const v = s[key];
      if (v === null || v === undefined) { pen = false; continue; }
      if (pen) ctx.lineTo(x(s.time), y(v));
      else ctx.moveTo(x(s.time), y(v));
      pen = true;
    }
    ctx.stroke();
  }
}

function renderDashboard() {
  buildCharts();
  const snaps = state.snapshots;
  const windowS = Number($("window").value);
  for (const chart of CHARTS) drawChart(chart, snaps, windowS);
  const s = snaps[snaps.length - 1];
  if (!s) return;
  $("stat-tok-s").textContent = fmt(s.tokens_per_sec);
  $("stat-running").textContent = s.running;
  $("stat-waiting").textContent = s.waiting;
  const pct = s.kv_blocks_total ? (100 * s.kv_blocks_used) / s.kv_blocks_total : 0;
  $("stat-kv").textContent = fmt(pct) + "%";
  $("stat-kv").title = s.kv_blocks_used + " used, " + s.kv_blocks_cached + " cached of " + s.kv_blocks_total + " blocks"
    + (s.cache_groups || []).map((g, i) => "\ngroup " + i + " (" + g.kind + (g.window ? " " + g.window : "") + "): " + g.used + " used, " + g.cached + " cached of " + g.total).join("");
  $("stat-hit").textContent = s.prefix_cache_hit_rate === null ? "–" : fmt(100 * s.prefix_cache_hit_rate) + "%";
  $("stat-preempt").textContent = fmt(s.preemptions, 0);
  $("stat-spec").textContent = s.spec_drafted_tokens
    ? fmt(100 * s.spec_accepted_tokens / s.spec_drafted_tokens) + "%" : "–";
  $("stat-spec").title = s.spec_accepted_tokens + " of " + s.spec_drafted_tokens + " proposed tokens accepted";
  $("stat-ttft").textContent = fmtMs(s.ttft_p50_ms) + " / " + fmtMs(s.ttft_p99_ms);
  $("stat-itl").textContent = fmtMs(s.itl_p50_ms) + " / " + fmtMs(s.itl_p99_ms);
  $("stat-tokens").textContent = fmt(s.tokens_generated, 0);
}

async function poll() {
  try {
    const response = await api("/ui/api/snapshots?after=" + state.lastSeq);
    if (response.ok) {
      const body = await response.json();
      for (const snap of body.snapshots) {
        if (snap.seq < state.lastSeq) state.snapshots = []; // the server restarted
        state.snapshots.push(snap);
        state.lastSeq = snap.seq;
      }
      if (state.snapshots.length > HISTORY_MAX) state.snapshots.splice(0, state.snapshots.length - HISTORY_MAX);
      renderDashboard();
    }
  } catch (e) {
    if (e instanceof AuthError) { showAuth("The API key is no longer accepted."); return; }
  }
  pollHealth();
}

let healthCounter = 0;
async function pollHealth() {
  if (healthCounter++ % 5) return;
  const dot = $("health");
  try {
    const response = await fetch("/health");
    const body = await response.json();
    dot.className = "health " + (response.ok ? "ok" : "bad");
    dot.title = "/health: " + body.status;
  } catch (e) {
    dot.className = "health bad";
    dot.title = "/health: unreachable";
  }
}

function startPolling() {
  stopPolling();
  poll();
  state.polling = setInterval(poll, POLL_MS);
}

function stopPolling() {
  if (state.polling) clearInterval(state.polling);
  state.polling = null;
}

$("window").addEventListener("change", renderDashboard);
window.addEventListener("resize", renderDashboard);

// ---------------------------------------------------------------- playground

function mode() {
  return document.querySelector("input[name=mode]:checked").value;
}

function setupPlayground() {
  const info = state.info;
  if (!info.chat_template) {
    document.querySelector("input[name=mode][value=raw]").checked = true;
  }
  updateModeNote();
}

function updateModeNote() {
  const info = state.info;
  const note = $("mode-note");
  const prompt = $("prompt");
  let text = "";
  let canSend = true;
  if (mode() === "chat") {
    prompt.placeholder = "Say something…";
    if (!info.chat_template) {
      canSend = false;
      text = info.tokenizer
        ? "This model has no chat template: use Raw completion."
        : "This model has no tokenizer (the mock backend generates token ids only), so it cannot chat: use Raw completion with token ids.";
    }
  } else if (info.tokenizer) {
    prompt.placeholder = "Prompt text to continue (POST /generate); hover a token for its id";
    text = "Raw completion: the prompt is sent as is, no chat template. Hover a token for its id.";
  } else {
    prompt.placeholder = "Token ids, e.g. 1 2 3 4";
    text = "No tokenizer: the prompt is token ids (space or comma separated) and the output is token ids.";
  }
  note.textContent = text;
  note.hidden = !text;
  $("send").disabled = !canSend || !!state.controller;
}

for (const radio of document.querySelectorAll("input[name=mode]")) {
  radio.addEventListener("change", updateModeNote);
}

function settings() {
  const out = {};
  const num = (id) => {
    const raw = $(id).value.trim();
    return raw === "" ? null : Number(raw);
  };
  const t = num("temperature"), p = num("top_p"), m = num("max_tokens"), seed = num("seed");
  if (t !== null) out.temperature = t;
  if (p !== null) out.top_p = p;
  if (m !== null) out.max_tokens = m;
  if (seed !== null) out.seed = seed;
  const stop = $("stop").value.split("|").filter((s) => s.length);
  if (stop.length) out.stop = stop;
  return out;
}

function addMessage(role, text) {
  const box = document.createElement("div");
  box.className = "msg " + role;
  const who = document.createElement("div");
  who.className = "role";
  who.textContent = role;
  const body = document.createElement("div");
  body.className = "body";
  if (text) body.textContent = text;
  const stats = document.createElement("div");
  stats.className = "stats";
  box.append(who, body, stats);
  $("transcript").append(box);
  box.scrollIntoView({ block: "end" });
  return { box, body, stats };
}

function generationStats(msg, run, reason) {
  const end = performance.now();
  const parts = [run.tokens + " tokens"];
  if (run.first !== null) {
    parts.push("TTFT " + fmtMs(run.first - run.start));
    const decode = (end - run.first) / 1000;
    if (run.tokens > 1 && decode > 0) parts.push(fmt((run.tokens - 1) / decode) + " tok/s");
  }
  if (reason) parts.push(reason);
  msg.stats.textContent = parts.join(" · ");
  msg.box.dataset.done = "1";
}

function setBusy(controller) {
  state.controller = controller;
  $("stop-gen").disabled = !controller;
  updateModeNote();
}

async function readLines(response, onLine) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let nl;
    while ((nl = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, nl).trim();
      buffer = buffer.slice(nl + 1);
      if (line) onLine(line);
    }
  }
  if (buffer.trim()) onLine(buffer.trim());
}

async function sendChat(text, controller) {
  state.messages.push({ role: "user", content: text });
  addMessage("user", text);
  const msg = addMessage("assistant", "");
  const run = { start: performance.now(), first: null, tokens: 0 };
  const body = Object.assign({ model: state.info.model, messages: state.messages, stream: true,
    stream_options: { include_usage: true } }, settings());
  const response = await api("/v1/chat/completions", {
    method: "POST", body: JSON.stringify(body), signal: controller.signal,
    headers: { "Content-Type": "application/json" },
  });
  if (!response.ok) {
    state.messages.pop();
    msg.box.classList.add("failed");
    msg.body.textContent = await errorText(response);
    msg.box.dataset.done = "1";
    return;
  }
  let reason = null, usage = null, reply = "";
  await readLines(response, (line) => {
    if (!line.startsWith("data:")) return;
    const data = line.slice(5).trim();
    if (data === "[DONE]") return;
    const chunk = JSON.parse(data);
    if (chunk.error) { reason = "error: " + chunk.error.message; return; }
    if (chunk.usage) usage = chunk.usage;
    for (const choice of chunk.choices || []) {
      const piece = choice.delta && choice.delta.content;
      if (piece) {
        if (run.first === null) run.first = performance.now();
        run.tokens += 1; // chunks until the final usage gives the exact count
        reply += piece;
        msg.body.textContent = reply;
      }
      if (choice.finish_reason) reason = choice.finish_reason;
    }
  });
  if (usage) run.tokens = usage.completion_tokens;
  state.messages.push({ role: "assistant", content: reply });
  generationStats(msg, run, reason);
}

function parseIds(text) {
  const parts = text.split(/[\s,]+/).filter((s) => s.length);
  const ids = parts.map(Number);
  if (!ids.length || ids.some((n) => !Number.isInteger(n) || n < 0)) {
    throw new Error("the prompt must be token ids: non-negative integers separated by spaces or commas");
  }
  return ids;
}

async function sendRaw(text, controller) {
  const info = state.info;
  const s = settings();
  const body = {};
  if (info.tokenizer) body.prompt = text;
  else body.prompt_token_ids = parseIds(text);
  for (const k of ["temperature", "top_p", "seed", "stop"]) if (k in s) body[k] = s[k];
  if ("max_tokens" in s) body.max_new_tokens = s.max_tokens;
  const user = addMessage("prompt", text);
  user.box.classList.add("raw");
  const msg = addMessage("completion", "");
  msg.box.classList.add("raw");
  const run = { start: performance.now(), first: null, tokens: 0 };
  const response = await api("/generate", {
    method: "POST", body: JSON.stringify(body), signal: controller.signal,
    headers: { "Content-Type": "application/json" },
  });
  if (!response.ok) {
    msg.box.classList.add("failed");
    msg.body.textContent = await errorText(response);
    msg.box.dataset.done = "1";
    return;
  }
  let reason = null;
  await readLines(response, (line) => {
    const event = JSON.parse(line);
    if (event.error) { reason = "error: " + (event.error.message || event.error); return; }
    if (event.token_id !== undefined) {
      if (run.first === null) run.first = performance.now();
      run.tokens += 1;
      const span = document.createElement("span");
      span.className = "tok" + (info.tokenizer ? "" : " id");
      span.textContent = info.tokenizer ? (event.text || "") : String(event.token_id);
      span.title = "token " + event.token_index + ": id " + event.token_id;
      span.dataset.id = event.token_id;
      msg.body.append(span);
      if (!info.tokenizer) msg.body.append(" ");
    }
    if (event.done) reason = event.finish_reason || reason;
  });
  generationStats(msg, run, reason);
}

$("prompt-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.controller) return;
  const controller = new AbortController();
  setBusy(controller);
  try {
    if (mode() === "chat") await sendChat(text, controller);
    else await sendRaw(text, controller);
    $("prompt").value = "";
  } catch (e) {
    if (e instanceof AuthError) showAuth("The API key is no longer accepted.");
    else if (e.name !== "AbortError") addMessage("error", e.message).box.dataset.done = "1";
    else {
      const last = $("transcript").lastElementChild;
      if (last) { last.dataset.done = "1"; last.querySelector(".stats").textContent = "stopped"; }
    }
  } finally {
    setBusy(null);
  }
});

$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("prompt-form").requestSubmit();
  }
});

$("stop-gen").addEventListener("click", () => {
  if (state.controller) state.controller.abort();
});

$("clear").addEventListener("click", () => {
  state.messages = [];
  $("transcript").textContent = "";
});

start();
