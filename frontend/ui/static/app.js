// The built-in page: polls ui/api/stats (the numbers /metrics reports) and /ui/api/requests,
// draws small SVG charts, and streams from the server's own /v1 routes in the playground.
// It stays light: nothing is polled while the tab is hidden, only the shown view is drawn, and
// a redraw changes attributes and text of elements built once, only where a value changed.
"use strict";
// Every URL is relative to the page (served at / and /ui), so a --root-path prefix carries over.

const POLL_MS = 1000;
const HISTORY_S = 120;   // what a chart shows
const WINDOW_S = 60;     // the percentiles' window
const REQUESTS_KEPT = 100;
const $ = (id) => document.getElementById(id);
const state = { key: sessionStorage.getItem("engine-api-key") || "", history: [], view: "engine",
  selected: null, requests: [] };

// ---- fetching, with the API key when the server wants one ----

class AuthError extends Error {}

async function api(path, options = {}) {
  const headers = Object.assign({}, options.headers || {});
  if (state.key) headers["Authorization"] = "Bearer " + state.key;
  const resp = await fetch(path, Object.assign({}, options, { headers }));
  if (resp.status === 401) { showKeyBar(true); throw new AuthError("API key needed"); }
  return resp;
}

function showKeyBar(show, message) {
  $("keybar").hidden = !show;
  $("keyerror").textContent = message || (state.key ? "the key was refused" : "");
}

$("keyset").addEventListener("click", () => {
  state.key = $("key").value.trim();
  sessionStorage.setItem("engine-api-key", state.key);
  showKeyBar(false);
  poll();
});

// ---- numbers ----

function fmt(x, digits = 1) {
  if (x === null || x === undefined || Number.isNaN(x)) return "–";
  if (Math.abs(x) >= 1e6) return (x / 1e6).toFixed(digits) + "M";
  if (Math.abs(x) >= 1e4) return (x / 1e3).toFixed(digits) + "k";
  return Number.isInteger(x) ? String(x) : x.toFixed(digits);
}

function fmtSeconds(s) {
  if (s === null || s === undefined) return "–";
  return s < 1 ? (s * 1000).toFixed(s < 0.01 ? 1 : 0) + " ms" : s.toFixed(2) + " s";
}

// Prometheus's histogram_quantile over cumulative bucket counts (le: upper bounds, +Inf apart).
function quantile(q, le, cumulative, count) {
  if (!count) return null;
  const rank = q * count;
  let prevBound = 0, prevCount = 0;
  for (let i = 0; i < le.length; i++) {
    if (cumulative[i] >= rank) {
      const inBucket = cumulative[i] - prevCount;
      if (inBucket <= 0) return le[i];
      return prevBound + (le[i] - prevBound) * (rank - prevCount) / inBucket;
    }
    prevBound = le[i]; prevCount = cumulative[i];
  }
  return le.length ? le[le.length - 1] : null;  // in the +Inf bucket
}

// The histogram's observations between two snapshots.
function histogramDelta(newer, older) {
  const cumulative = newer.cumulative.map((c, i) => c - (older ? older.cumulative[i] || 0 : 0));
  return { le: newer.le, cumulative, count: newer.count - (older ? older.count : 0) };
}

function snapshotAt(t) {  // the oldest kept snapshot at or after t
  return state.history.find((s) => s.time >= t) || null;
}

function derive(cur, prev) {
  const m = cur.metrics, p = prev ? prev.metrics : null;
  const dt = prev ? cur.time - prev.time : 0;
  const rate = (k) => (p && dt > 0 ? Math.max(0, m[k] - p[k]) / dt : null);
  const dq = p ? m.prefix_cache_queries - p.prefix_cache_queries : 0;
  const dh = p ? m.prefix_cache_hits - p.prefix_cache_hits : 0;
  // Speculative decoding (null without it): accepted of drafted tokens, and 1 + accepted per
  // draft (the bonus token included, as vLLM counts the mean acceptance length).
  const spec = m.spec_drafts !== null && p && p.spec_drafts !== null;
  const dDrafts = spec ? m.spec_drafts - p.spec_drafts : 0;
  const dDrafted = spec ? m.spec_draft_tokens - p.spec_draft_tokens : 0;
  const dAccepted = spec ? m.spec_accepted_tokens - p.spec_accepted_tokens : 0;
  const base = snapshotAt(cur.time - WINDOW_S);
  const window = (name) => {
    const h = histogramDelta(m[name], base && base !== cur ? base.metrics[name] : null);
    return [0.5, 0.9, 0.99].map((q) => quantile(q, h.le, h.cumulative, h.count));
  };
  return {
    running: m.running, waiting: m.waiting, kv: m.kv_cache_usage * 100,
    hitRate: dq > 0 ? (100 * dh) / dq : null,
    promptRate: rate("prompt_tokens"), genRate: rate("generation_tokens"),
    preemptRate: rate("preemptions"), ttft: window("ttft"), itl: window("itl"),
    acceptRate: dDrafted > 0 ? (100 * dAccepted) / dDrafted : null,
    acceptLength: dDrafts > 0 ? 1 + dAccepted / dDrafts : null,
  };
}

// ---- charts ----

const CHARTS = [
  { id: "requests", title: "Requests", series: [["running", "#2f6fdb", "running"],
    ["waiting", "#e39b27", "waiting"]], value: (d) => `${d.running} <small>running</small> ${d.waiting} <small>waiting</small>` },
  { id: "kv", title: "KV cache usage", unit: "%", max: 100, series: [["kv", "#8a5cd1"]],
    value: (d) => fmt(d.kv) + " %" },
  { id: "hit", title: "Prefix cache hit rate (per second)", max: 100, series: [["hitRate", "#2e9e5b"]],
    value: (d, m) => fmt(d.hitRate) + " % <small>all time " + fmt(m.prefix_cache_queries ?
      100 * m.prefix_cache_hits / m.prefix_cache_queries : null) + " %</small>" },
  { id: "prompt", title: "Prompt tokens/s", series: [["promptRate", "#2f6fdb"]],
    value: (d) => fmt(d.promptRate) },
  { id: "gen", title: "Generation tokens/s", series: [["genRate", "#2e9e5b"]],
    value: (d) => fmt(d.genRate) },
  { id: "ttft", title: "Time to first token, last minute", seconds: true,
    series: [["ttft50", "#2f6fdb", "p50"], ["ttft90", "#e39b27", "p90"], ["ttft99", "#d64545", "p99"]],
    value: (d) => fmtSeconds(d.ttft[0]) + " <small>p90 " + fmtSeconds(d.ttft[1]) + " p99 " + fmtSeconds(d.ttft[2]) + "</small>" },
  { id: "itl", title: "Inter-token latency, last minute", seconds: true,
    series: [["itl50", "#2f6fdb", "p50"], ["itl90", "#e39b27", "p90"], ["itl99", "#d64545", "p99"]],
    value: (d) => fmtSeconds(d.itl[0]) + " <small>p90 " + fmtSeconds(d.itl[1]) + " p99 " + fmtSeconds(d.itl[2]) + "</small>" },
  { id: "spec", title: "Draft acceptance rate (per second)", max: 100,
    series: [["acceptRate", "#8a5cd1"]], when: (m) => m.spec_drafts !== null,
    value: (d, m) => fmt(d.acceptRate) + " % <small>mean acceptance length " +
      fmt(d.acceptLength, 2) + ", all time " + fmt(m.spec_draft_tokens ?
      100 * m.spec_accepted_tokens / m.spec_draft_tokens : null) + " % and " +
      fmt(m.spec_drafts ? 1 + m.spec_accepted_tokens / m.spec_drafts : null, 2) + "</small>" },
  { id: "preempt", title: "Preemptions/s", series: [["preemptRate", "#d64545"]],
    value: (d, m) => fmt(d.preemptRate) + " <small>total " + fmt(m.preemptions) + "</small>" },
];

function buildCharts() {
  $("charts").innerHTML = CHARTS.map((c) => `<div class="chart" id="chart-${c.id}"${c.when ? " hidden" : ""}>
    <div class="title">${c.title}</div><div class="value">–</div>
    <svg viewBox="0 0 300 70" preserveAspectRatio="none">
    <line x1="0" y1="67.5" x2="300" y2="67.5" stroke="#dde1e6"/>
    ${c.series.map((s) => `<path d="" fill="none" stroke="${s[1]}" stroke-width="1.5"
      vector-effect="non-scaling-stroke"/>`).join("")}
    <text x="2" y="10" font-size="9" fill="#6b7480" class="max"></text>
    <text x="298" y="10" font-size="9" fill="#6b7480" text-anchor="end">last ${HISTORY_S / 60} min</text>
    </svg>
    <div class="keys">${c.series.filter((s) => s[2]).map((s) =>
      `<i style="background:${s[1]}"></i>${s[2]}`).join("")}</div></div>`).join("");
  for (const c of CHARTS) {  // the elements a redraw touches, found once
    const el = $("chart-" + c.id);
    c.el = { root: el, value: el.querySelector(".value"), paths: el.querySelectorAll("path"),
      max: el.querySelector("text.max") };
  }
}

function setText(el, text) {  // a DOM write only when the text changes
  if (el.textContent !== text) el.textContent = text;
}

function setHTML(el, html) {
  if (el.dataset.html !== html) { el.innerHTML = html; el.dataset.html = html; }
}

function points(c) {  // per series: [[t, value]] over the kept history
  return c.series.map(([key]) => state.history.filter((s) => s.derived).map((s) => {
    const d = s.derived;
    const v = key.startsWith("ttft") ? d.ttft[{ 50: 0, 90: 1, 99: 2 }[key.slice(4)]]
      : key.startsWith("itl") ? d.itl[{ 50: 0, 90: 1, 99: 2 }[key.slice(3)]] : d[key];
    return [s.time, v];
  }));
}

function drawChart(c, now) {
  const series = points(c);
  let max = c.max || 0;
  for (const s of series) for (const [, v] of s) if (v !== null && v > max) max = v;
  if (!max) max = 1;
  const x = (t) => 300 - ((now - t) / HISTORY_S) * 300;
  const y = (v) => 67 - (v / max) * 62;
  for (let i = 0; i < series.length; i++) {
    let path = "", pen = false;
    for (const [t, v] of series[i]) {
      if (v === null) { pen = false; continue; }
      path += (pen ? "L" : "M") + x(t).toFixed(1) + " " + y(v).toFixed(1);
      pen = true;
    }
    if (c.el.paths[i].getAttribute("d") !== path) c.el.paths[i].setAttribute("d", path);
  }
  setText(c.el.max, c.seconds ? fmtSeconds(max) : fmt(max));
}

function drawEngineView() {
  const snap = state.history[state.history.length - 1];
  if (!snap) return;
  renderNow(snap.metrics);
  renderConfig(snap.config);
  renderProcesses(snap.processes);
  for (const c of CHARTS) {
    if (c.when) {  // a chart of metrics this server may not have (speculative decoding)
      c.el.root.hidden = !c.when(snap.metrics);
      if (c.el.root.hidden) continue;
    }
    setHTML(c.el.value, c.value(snap.derived, snap.metrics));
    drawChart(c, snap.time);
  }
}

// ---- the engine view ----

const NOW_ROWS = [  // data-metric: the /metrics family the test compares with
  ["running", "vllm:num_requests_running", "requests running"],
  ["waiting", "vllm:num_requests_waiting", "requests waiting"],
  ["kv_cache_usage", "vllm:kv_cache_usage_perc", "KV cache usage (0..1)"],
  ["prompt_tokens", "vllm:prompt_tokens_total", "prompt tokens"],
  ["generation_tokens", "vllm:generation_tokens_total", "generation tokens"],
  ["prefix_cache_queries", "vllm:prefix_cache_queries_total", "prefix cache queries (tokens)"],
  ["prefix_cache_hits", "vllm:prefix_cache_hits_total", "prefix cache hits (tokens)"],
  ["preemptions", "vllm:num_preemptions_total", "preemptions"],
  ["requests_finished", "vllm:request_success_total", "requests finished"],
  ["ttft.count", "vllm:time_to_first_token_seconds_count", "first tokens observed"],
  ["itl.count", "vllm:inter_token_latency_seconds_count", "inter-token gaps observed"],
  ["spec_drafts", "vllm:spec_decode_num_drafts_total", "drafts verified"],
  ["spec_draft_tokens", "vllm:spec_decode_num_draft_tokens_total", "draft tokens"],
  ["spec_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_total", "draft tokens accepted"],
];

function renderNow(m) {
  if (!state.nowRows) {  // the speculative-decoding rows only where the server has them
    state.nowRows = NOW_ROWS.filter(([key]) => m[key.split(".")[0]] !== null);
    $("now").innerHTML = state.nowRows.map(([, metric, label]) =>
      `<tr><td>${label}</td><td data-metric="${metric}"></td></tr>`).join("");
  }
  state.nowRows.forEach(([key], i) => {
    const v = key.includes(".") ? m[key.split(".")[0]][key.split(".")[1]] : m[key];
    const cell = $("now").rows[i].cells[1];
    if (cell.dataset.value === String(v)) return;
    cell.dataset.value = v;
    cell.textContent = Number.isInteger(v) ? v : +v.toFixed(4);
  });
}

function esc(s) {
  return String(s).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
}

function renderConfig(cfg) {
  const rows = [["model", cfg.model], ["path", cfg.model_path], ["max model length", cfg.max_model_len],
    ["block size", cfg.block_size], ["KV blocks", cfg.num_kv_blocks],
    ["KV capacity (tokens)", cfg.block_size * cfg.num_kv_blocks], ["dtype", cfg.dtype],
    ["device", cfg.device], ["tensor parallel", cfg.tensor_parallel_size],
    ["data parallel", cfg.data_parallel_size], ["max sequences", cfg.max_num_seqs],
    ["prefix caching", cfg.enable_prefix_caching ? "on" : "off"],
    ["tokenizer processes", cfg.tokenizer_workers]];
  setHTML($("config"), rows.map(([k, v]) =>
    `<tr><td>${k}</td><td data-config="${esc(k)}">${esc(v ?? "–")}</td></tr>`).join(""));
  setText($("model"), cfg.model);
}

function renderProcesses(procs) {
  setHTML($("processes").querySelector("tbody"), procs.map((p) => `<tr data-pid="${p.pid}"
    data-role="${esc(p.role)}"><td style="padding-left:${6 + 18 * p.depth}px">
    <span class="dot ${p.alive ? "up" : "down"}"></span>${esc(p.name)}</td><td>${esc(p.role)}</td>
    <td>${p.pid}</td><td>${esc(p.state)}</td></tr>`).join(""));
}

async function pollStats() {
  const resp = await api("ui/api/stats");
  if (!resp.ok) throw new Error("stats: HTTP " + resp.status);
  const snap = await resp.json();
  const prev = state.history[state.history.length - 1];
  if (prev && snap.time <= prev.time) return;  // the server's shared answer has not moved on
  state.history.push(snap);
  snap.derived = derive(snap, prev);
  while (state.history.length && state.history[0].time < snap.time - HISTORY_S - WINDOW_S) {
    state.history.shift();
  }
  if (state.view === "engine") drawEngineView();
  setText($("status"), "updated " + new Date(snap.time * 1000).toLocaleTimeString() +
    " by API server " + resp.headers.get("X-Engine-Api-Server"));
  $("status").dataset.time = snap.time;
}

// ---- the requests view ----

function renderRequests() {
  const rows = state.requests.slice(-50).reverse();
  const span = Math.max(0.001, ...rows.map((r) => r.finish - r.arrival));
  setHTML($("requests").querySelector("tbody"), rows.map((r) => {
    const total = r.finish - r.arrival;
    const ttft = r.first_token === null ? null : r.first_token - r.arrival;
    const w = (s) => ((s / span) * 100).toFixed(2);
    const wait = ttft === null ? total : ttft;
    // Scheduled as the engine core's clock says: clamped into [arrival, first token].
    const chunks = (r.prefill_chunks || []).map(([t, n]) => [Math.min(Math.max(t, 0), wait), n]);
    const queue = chunks.length ? chunks[0][0] : null;
    let bar = `<rect x="0" y="3" width="${w(wait)}%" height="8" fill="#e39b27"/>`;
    if (queue !== null) bar += `<rect x="0" y="3" width="${w(queue)}%" height="8" fill="#b8c0c9"/>`;
    for (const [t, n] of chunks) {
      bar += `<rect x="${w(t)}%" y="3" width="1" height="8" fill="#7a4a00"><title>${n} prompt tokens</title></rect>`;
    }
    if (ttft !== null) bar += `<rect x="${w(ttft)}%" y="3" width="${w(total - ttft)}%" height="8" fill="#2f6fdb"/>`;
    for (const t of r.ticks) bar += `<rect x="${w(t)}%" y="1" width="1" height="12" fill="#133a80"/>`;
    return `<tr data-id="${esc(r.id)}" class="${state.selected === r.id ? "selected" : ""}">
      <td title="${esc(r.id)}">${esc(r.kind)} ${esc(r.id.slice(-8))}</td>
      <td>${new Date(r.arrival * 1000).toLocaleTimeString()}</td>
      <td class="tl"><svg>${bar}</svg></td><td>${fmtSeconds(queue)}</td>
      <td data-chunks="${chunks.length}">${chunks.length || "–"}</td>
      <td>${fmtSeconds(ttft)}</td><td>${fmtSeconds(total)}</td>
      <td>${r.prompt_tokens}</td><td>${r.cached_tokens}</td><td>${r.output_tokens}</td>
      <td>${esc(r.finish_reason)}</td></tr>`;
  }).join(""));
}

async function pollRequests() {  // only the requests that finished since the newest one held
  const last = state.requests[state.requests.length - 1];
  // A margin: another API server may write a request a moment after it finished.
  const resp = await api("ui/api/requests" + (last ? "?after=" + (last.finish - 5) : ""));
  if (!resp.ok) throw new Error("requests: HTTP " + resp.status);
  const held = new Set(state.requests.map((r) => r.id));
  const fresh = (await resp.json()).requests.filter((r) => !held.has(r.id));
  if (!fresh.length) return;
  state.requests = state.requests.concat(fresh).sort((a, b) => a.finish - b.finish)
    .slice(-REQUESTS_KEPT);
  renderRequests();
}

$("requests").addEventListener("click", async (ev) => {
  const row = ev.target.closest("tr[data-id]");
  if (!row) return;
  state.selected = row.dataset.id;
  renderRequests();
  const detail = $("detail");
  detail.hidden = false;
  try {
    const resp = await api("ui/api/requests/" + encodeURIComponent(state.selected));
    const body = await resp.json();
    if (!resp.ok) { detail.textContent = body.error ? body.error.message : "HTTP " + resp.status; return; }
    detail.innerHTML = `<h2>${esc(body.id)}</h2><div class="muted">prompt</div><pre>${esc(body.prompt)}</pre>` +
      body.outputs.map((o, i) => `<div class="muted">output ${i}</div><pre class="output">${esc(o)}</pre>`).join("");
  } catch (e) {
    detail.textContent = e instanceof AuthError ? "an API key is needed to see the text" : String(e);
  }
});

// ---- the playground ----

let controller = null;

$("pg-mode").addEventListener("change", () => {
  $("pg-system-label").hidden = $("pg-mode").value !== "chat";
});

function playgroundBody() {
  const num = (id) => { const v = $(id).value; return v === "" ? null : Number(v); };
  const body = { model: $("model").textContent, stream: true,
    stream_options: { include_usage: true, continuous_usage_stats: true },
    max_tokens: num("pg-max_tokens"), temperature: num("pg-temperature"), top_p: num("pg-top_p"),
    top_k: num("pg-top_k") };
  if (num("pg-seed") !== null) body.seed = num("pg-seed");
  if ($("pg-stop").value) body.stop = [$("pg-stop").value];
  if ($("pg-mode").value === "chat") {
    body.messages = [];
    if ($("pg-system").value.trim()) body.messages.push({ role: "system", content: $("pg-system").value });
    body.messages.push({ role: "user", content: $("pg-prompt").value });
  } else {
    body.prompt = $("pg-prompt").value;
  }
  return body;
}

async function send() {
  const chat = $("pg-mode").value === "chat";
  const out = $("pg-output"), stats = $("pg-stats");
  out.textContent = "";
  controller = new AbortController();
  $("pg-send").disabled = true; $("pg-stop-btn").disabled = false;
  const start = performance.now();
  let first = null, tokens = 0, finish = null;
  const show = () => {
    const now = performance.now();
    const rate = first !== null && now > first ? (tokens - 1) / ((now - first) / 1000) : null;
    stats.textContent = `tokens ${tokens}` + (first !== null ? ` · first token ${((first - start)).toFixed(0)} ms` : "") +
      (rate !== null && tokens > 1 ? ` · ${rate.toFixed(1)} tokens/s` : "") + (finish ? ` · finish ${finish}` : "");
    stats.dataset.tokens = tokens;
  };
  try {
    const resp = await api(chat ? "v1/chat/completions" : "v1/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(playgroundBody()), signal: controller.signal });
    if (!resp.ok) {
      const body = await resp.json().catch(() => ({}));
      throw new Error(body.error ? body.error.message : "HTTP " + resp.status);
    }
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut); buffer = buffer.slice(cut + 2);
        if (!event.startsWith("data: ") || event === "data: [DONE]") continue;
        const chunk = JSON.parse(event.slice(6));
        if (chunk.error) throw new Error(chunk.error.message);
        for (const choice of chunk.choices || []) {
          const text = chat ? (choice.delta && choice.delta.content) || "" : choice.text || "";
          if (text && first === null) first = performance.now();
          out.textContent += text;
          if (choice.finish_reason) finish = choice.finish_reason;
        }
        if (chunk.usage) tokens = chunk.usage.completion_tokens;
        show();
      }
    }
    out.dataset.done = "1";
  } catch (e) {
    if (e.name !== "AbortError") stats.textContent = "error: " + e.message;
  } finally {
    $("pg-send").disabled = false; $("pg-stop-btn").disabled = true;
    controller = null;
  }
}

$("pg-send").addEventListener("click", () => { $("pg-output").dataset.done = ""; send(); });
$("pg-stop-btn").addEventListener("click", () => controller && controller.abort());

// ---- views and the poll loop ----

for (const button of document.querySelectorAll("nav button")) {
  button.addEventListener("click", () => {
    state.view = button.dataset.view;
    for (const b of document.querySelectorAll("nav button")) b.classList.toggle("active", b === button);
    for (const v of document.querySelectorAll(".view")) v.hidden = v.id !== "view-" + state.view;
    if (state.view === "engine") drawEngineView();
    poll();
  });
}

let polling = false;
async function poll() {
  if (polling || document.visibilityState === "hidden") return;
  polling = true;
  try {
    await pollStats();
    if (state.view === "requests") await pollRequests();
    showKeyBar(false);
  } catch (e) {
    if (!(e instanceof AuthError)) $("status").textContent = "not reachable: " + e.message;
  } finally {
    polling = false;
  }
}

document.addEventListener("visibilitychange", poll);  // shown again: catch up at once

buildCharts();
poll();
setInterval(poll, POLL_MS);
