/* Tessera usage dashboard: fetches the JSON feeds, draws Chart.js charts, and keeps the live
   engine panel fresh from the ws/dashboard/engine/ websocket. All text goes in via textContent. */
(function () {
  "use strict";

  const COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7"];
  const BLOCK_COLORS = { f: "#e6e9ef", c: "#9ecae1", u: "#3182bd", s: "#e6550d" };
  const charts = {};
  const state = { range: "24h", ticks: 0, live: { labels: [], tps: [], running: [], waiting: [] } };
  window.tesseraDashboard = { charts, state };

  // ------------------------------------------------------------------ helpers
  const $ = (id) => document.getElementById(id);
  const root = () => $("dashboard");  // its data-* attributes carry the feed URLs and test hooks
  const fmtInt = (n) => (n === null || n === undefined ? "–" : Math.round(n).toLocaleString("en-US"));
  const fmtPct = (x, digits = 1) => (x === null || x === undefined ? "–" : (100 * x).toFixed(digits) + "%");
  const fmtMs = (x) => (x === null || x === undefined ? "–" : x >= 1000 ? (x / 1000).toFixed(2) + " s" : x.toFixed(1) + " ms");
  function fmtBytes(n) {
    if (typeof n !== "number") return String(n);
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return n.toFixed(i ? 2 : 0) + " " + units[i];
  }
  function fmtAge(s) {
    if (s === null || s === undefined) return "–";
    if (s < 120) return s.toFixed(1) + " s";
    if (s < 7200) return Math.round(s / 60) + " min";
    return (s / 3600).toFixed(1) + " h";
  }
  function bucketLabel(iso, bucket) {
    const d = new Date(iso);
    const pad = (v) => String(v).padStart(2, "0");
    const day = pad(d.getUTCMonth() + 1) + "-" + pad(d.getUTCDate());
    return bucket === "day" ? day : day + " " + pad(d.getUTCHours()) + ":00";
  }
  function el(tag, text, attrs) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    Object.entries(attrs || {}).forEach(([k, v]) => node.setAttribute(k, v));
    return node;
  }
  function fillTable(id, rows, cells, empty) {
    const table = $(id);
    if (!table) return;
    const body = table.tBodies[0];
    body.replaceChildren();
    if (!rows.length) {
      const tr = el("tr");
      tr.appendChild(el("td", empty || "nothing here", { colspan: table.tHead.rows[0].cells.length, class: "muted" }));
      body.appendChild(tr);
      return;
    }
    rows.forEach((row) => {
      const tr = el("tr");
      cells(row).forEach((cell) => {
        const td = el("td");
        if (cell instanceof Node) td.appendChild(cell); else td.textContent = cell;
        tr.appendChild(td);
      });
      body.appendChild(tr);
    });
  }

  // One Chart per canvas, updated in place so the page never flickers or leaks.
  function chart(id, config) {
    const canvas = $(id);
    if (!canvas) return null;
    if (charts[id]) {
      charts[id].data = config.data;
      charts[id].update("none");
      return charts[id];
    }
    config.options = Object.assign({ responsive: true, maintainAspectRatio: false, animation: false,
      interaction: { mode: "index", intersect: false } }, config.options || {});
    charts[id] = new Chart(canvas, config);
    return charts[id];
  }
  const line = (label, data, i, extra) => Object.assign({ label, data, borderColor: COLORS[i % COLORS.length],
    backgroundColor: COLORS[i % COLORS.length] + "33", pointRadius: 0, borderWidth: 2, tension: 0.25 }, extra || {});

  // ------------------------------------------------------------------ usage
  function card(parent, label, value, hint) {
    const box = el("div", null, { class: "card" });
    box.appendChild(el("div", label, { class: "label" }));
    box.appendChild(el("div", value, { class: "value" }));
    if (hint) box.appendChild(el("div", hint, { class: "hint" }));
    parent.appendChild(box);
  }

  function renderTotals(data) {
    const t = data.totals;
    const cards = $("usage-cards");
    cards.replaceChildren();
    card(cards, "Requests", fmtInt(t.requests));
    card(cards, "Prompt tokens", fmtInt(t.prompt_tokens), fmtInt(t.cached_tokens) + " from prefix cache");
    card(cards, "Completion tokens", fmtInt(t.completion_tokens));
    card(cards, "TTFT p95", fmtMs(t.latency.ttft.p95), "p50 " + fmtMs(t.latency.ttft.p50));
    card(cards, "Latency p95", fmtMs(t.latency.latency.p95), "p99 " + fmtMs(t.latency.latency.p99));
    card(cards, "Error rate", fmtPct(t.error_rate, 2), fmtPct(t.rate_limited_rate, 2) + " were 429");
    const w = data.window;
    $("window-label").textContent = w.start.slice(0, 16).replace("T", " ") + " → " +
      w.end.slice(0, 16).replace("T", " ") + " UTC, by " + w.bucket;
  }

  function renderUsageCharts(data) {
    const bucket = data.window.bucket;
    const labels = data.over_time.map((b) => bucketLabel(b.t, bucket));
    chart("chart-tokens", { type: "bar", data: { labels, datasets: [
      line("prompt tokens", data.over_time.map((b) => b.prompt_tokens), 0, { stack: "t", borderWidth: 0, backgroundColor: COLORS[0] }),
      line("completion tokens", data.over_time.map((b) => b.completion_tokens), 1, { stack: "t", borderWidth: 0, backgroundColor: COLORS[1] }),
    ] }, options: { scales: { x: { stacked: true }, y: { stacked: true, beginAtZero: true } } } });
    if (data.source_over_time) {
      const series = Object.entries(data.source_over_time.series);
      chart("chart-sources", { type: "line", data: { labels, datasets: series.map(([name, s], i) =>
        line(name, s.requests, i, { fill: false })) }, options: { scales: { y: { beginAtZero: true } } } });
    }
    if (data.model_over_time) {
      const series = Object.entries(data.model_over_time.series);
      chart("chart-models", { type: "line", data: { labels, datasets: series.map(([name, s], i) =>
        line(name, s.tokens, i + 3, { fill: true, stack: "m" })) },
        options: { scales: { y: { stacked: true, beginAtZero: true } } } });
    }
    const doughnut = (id, rows, key) => chart(id, { type: "doughnut", data: {
      labels: rows.map((r) => r[key]), datasets: [{ data: rows.map((r) => r.total_tokens),
        backgroundColor: rows.map((_, i) => COLORS[(i + (key === "model" ? 3 : 0)) % COLORS.length]) }] },
      options: { plugins: { legend: { position: "right" } } } });
    doughnut("chart-model-share", data.by_model, "model");
    doughnut("chart-source-share", data.by_source, "source");
  }

  function renderLatency(data) {
    const bucket = data.window.bucket;
    const rows = data.latency_over_time || [];
    const labels = rows.map((b) => bucketLabel(b.t, bucket));
    ["ttft", "tpot", "latency"].forEach((metric) => {
      const id = { ttft: "chart-ttft", tpot: "chart-tpot", latency: "chart-e2e" }[metric];
      chart(id, { type: "line", data: { labels, datasets: ["p50", "p95", "p99"].map((q, i) =>
        line(q, rows.map((b) => b[metric][q]), i, { spanGaps: true })) },
        options: { scales: { y: { beginAtZero: true } } } });
    });
    if (data.over_time) {
      chart("chart-errors", { type: "line", data: { labels: data.over_time.map((b) => bucketLabel(b.t, bucket)),
        datasets: [line("errors (all)", data.over_time.map((b) => 100 * b.error_rate), 3),
                   line("429 rate limited", data.over_time.map((b) => 100 * b.rate_limited_rate), 1)] },
        options: { scales: { y: { beginAtZero: true, ticks: { callback: (v) => v + "%" } } } } });
    }
  }

  function renderTables(data) {
    const userUrl = root().dataset.userUrl;
    fillTable("top-users", data.top_users || [], (r) => {
      const link = el("a", r.username, { href: userUrl.replace("/0/", "/" + r.user_id + "/") });
      return [link, fmtInt(r.requests), fmtInt(r.total_tokens), fmtPct(r.error_rate, 2)];
    }, "no usage in this window");
    fillTable("top-keys", data.top_api_keys || data.api_keys || [], (r) =>
      [r.label + (r.revoked ? " (revoked)" : ""), r.username, fmtInt(r.requests), fmtInt(r.total_tokens)],
      "no API key traffic in this window");
    const quotas = data.quotas || (data.quota ? [data.quota] : []);
    fillTable("quota-table", quotas, (r) => [r.username, r.plan,
      fmtInt(r.tokens_today) + (r.tokens_per_day ? " / " + fmtInt(r.tokens_per_day) : ""),
      fmtInt(r.tokens_this_month) + (r.tokens_per_month ? " / " + fmtInt(r.tokens_per_month) : ""),
      el("span", r.state + (r.used !== null ? " " + fmtPct(r.used, 0) : ""), { class: "badge " + r.state })],
      "nobody is near a limit");
  }

  function renderBatches(b) {
    if (!b || !$("chart-batches")) return;
    const statuses = Object.keys(b.by_status);
    chart("chart-batches", { type: "bar", data: { labels: statuses, datasets: [{ label: "batches",
      data: statuses.map((s) => b.by_status[s]), backgroundColor: statuses.map((_, i) => COLORS[i % COLORS.length]) }] },
      options: { plugins: { legend: { display: false } }, scales: { y: { beginAtZero: true, ticks: { precision: 0 } } } } });
    $("batch-rate").textContent = "Lines finished: " + b.lines_per_s.toFixed(2) + " /s (last minute)";
    const o = b.oldest_running;
    $("batch-oldest").textContent = o ? "Oldest running: " + o.id + " of " + o.user + ", " + o.status + " for " +
      fmtAge(o.age_s) + " (" + (o.completed + o.failed) + "/" + o.total + " lines)" +
      (o.paused_reason ? " — paused: " + o.paused_reason : "") : "No batch is running.";
  }

  async function loadUsage() {
    const url = root().dataset.usageUrl + "?range=" + encodeURIComponent(state.range);
    document.querySelectorAll(".ranges button").forEach((b) => b.classList.toggle("active", b.dataset.range === state.range));
    const response = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
    if (!response.ok) throw new Error("usage feed answered " + response.status);
    const data = await response.json();
    renderTotals(data);
    renderUsageCharts(data);
    renderLatency(data);
    renderTables(data);
    renderBatches(data.batches);
    root().dataset.usageLoaded = String(Number(root().dataset.usageLoaded || 0) + 1);
  }

  // ------------------------------------------------------------------ live engine
  function renderEngine(snap) {
    state.lastSnapshot = snap;
    const t = snap.totals;
    $("live-running").textContent = fmtInt(t.num_running);
    $("live-waiting").textContent = fmtInt(t.num_waiting);
    $("live-kv").textContent = fmtPct(t.kv_usage);
    $("live-hit").textContent = fmtPct(t.prefix_cache_hit_rate);
    $("live-preempt").textContent = fmtInt(t.num_preemptions);
    $("live-tps").textContent = t.tokens_per_s.toFixed(1);
    $("live-spec").textContent = t.spec_decode_acceptance_rate === null ? "off"
      : fmtPct(t.spec_decode_acceptance_rate) + " / " + t.spec_decode_mean_acceptance_length.toFixed(2);
    chart("chart-kv-gauge", { type: "doughnut", data: { labels: ["used", "free"], datasets: [{
      data: [t.kv_usage, Math.max(0, 1 - t.kv_usage)], backgroundColor: ["#3182bd", "#e6e9ef"], borderWidth: 0 }] },
      options: { rotation: -90, circumference: 180, cutout: "70%", interaction: {},
        plugins: { legend: { display: false }, tooltip: { enabled: false } } } });

    const live = state.live;
    live.labels.push(new Date(snap.at * 1000).toISOString().slice(11, 19));
    live.tps.push(t.tokens_per_s); live.running.push(t.num_running); live.waiting.push(t.num_waiting);
    if (live.labels.length > 120) Object.values(live).forEach((a) => a.shift());
    chart("chart-live", { type: "line", data: { labels: live.labels.slice(), datasets: [
      line("tokens/s", live.tps.slice(), 0, { yAxisID: "y" }),
      line("running", live.running.slice(), 2, { yAxisID: "y1", stepped: true }),
      line("waiting", live.waiting.slice(), 3, { yAxisID: "y1", stepped: true })] },
      options: { scales: { y: { beginAtZero: true, position: "left" },
        y1: { beginAtZero: true, position: "right", grid: { drawOnChartArea: false }, ticks: { precision: 0 } } } } });

    fillTable("workers-table", snap.workers, (w) => [w.worker_id, w.model, w.host, fmtAge(w.heartbeat_age_s) + " ago",
      fmtAge(w.uptime_s), fmtInt(w.num_running), fmtInt(w.num_waiting), fmtPct(w.kv_usage), w.tokens_per_s.toFixed(1),
      memoryCell(w.memory, w.max_model_len)], "no engine worker has a fresh heartbeat");
    renderTenantShares(snap.tenant_shares);
    renderBlockMaps(snap.workers);
    state.ticks += 1;
    root().dataset.liveTicks = String(state.ticks);
    $("live-status").textContent = "live · " + new Date(snap.at * 1000).toISOString().slice(11, 19) + " UTC";
    $("live-status").className = "status ok";
  }

  // The top tenants by share of the last minute's service, the rest summed (docs/architecture.md, Fair share).
  function renderTenantShares(shares) {
    if (!shares) return;
    const rows = shares.tenants.map((r) => [r.name, fmtInt(r.tokens), fmtPct(r.share), r.weight.toLocaleString("en-US")]);
    if (shares.others.tokens) rows.push(["others", fmtInt(shares.others.tokens), fmtPct(shares.others.share), "–"]);
    fillTable("tenant-shares", rows, (r) => r, "no tokens served in the last minute");
  }

  function memoryCell(memory, maxLen) {
    if (!memory) return "–";
    const list = el("ul", null, { class: "memory" });
    Object.entries(memory).forEach(([k, v]) => {
      const isBytes = /_bytes$/.test(k) && typeof v === "number";
      const value = isBytes ? fmtBytes(v) : typeof v === "number" ? v.toLocaleString("en-US") : String(v);
      list.appendChild(el("li", k.replace(/_bytes$/, "").replace(/_/g, " ") + ": " + value));
    });
    if (maxLen && !("max_model_len" in memory)) list.appendChild(el("li", "max model len: " + fmtInt(maxLen)));
    return list;
  }

  function renderBlockMaps(workers) {
    const root = $("block-maps");
    root.replaceChildren();
    workers.filter((w) => w.block_map).forEach((w) => {
      const m = w.block_map;
      const box = el("div", null, { class: "blockmap", "data-worker": w.worker_id });
      box.appendChild(el("h3", "KV block map · " + w.worker_id + " · " + m.blocks.length + " blocks"));
      const legend = el("div", null, { class: "legend" });
      [["f", "free"], ["c", "cached"], ["u", "in use"], ["s", "shared"]].forEach(([k, name]) => {
        const item = el("span", name + " " + m.counts[{ f: "free", c: "cached", u: "used", s: "shared" }[k]]);
        item.prepend(el("i", null, { style: "background:" + BLOCK_COLORS[k] }));
        legend.appendChild(item);
      });
      box.appendChild(legend);
      const grid = el("div", null, { class: "grid" });
      for (const letter of m.blocks) grid.appendChild(el("i", null, { class: "b " + letter }));
      box.appendChild(grid);
      if (m.top_requests.length) {
        const top = el("ol", null, { class: "top-requests" });
        m.top_requests.forEach((r) => top.appendChild(el("li", r.request_id + " — " + r.blocks + " blocks")));
        box.appendChild(el("h4", "Requests holding the most blocks"));
        box.appendChild(top);
      }
      root.appendChild(box);
    });
  }

  function connectLive(delay) {
    const path = root().dataset.wsPath;
    if (!path) return;
    const socket = new WebSocket((location.protocol === "https:" ? "wss://" : "ws://") + location.host + path);
    socket.onmessage = (event) => {
      const msg = JSON.parse(event.data);
      if (msg.type === "engine") renderEngine(msg);
      else if (msg.type === "error") $("live-status").textContent = msg.message;
    };
    socket.onopen = () => { delay = 1000; };
    socket.onclose = () => {
      $("live-status").textContent = "disconnected, retrying…";
      $("live-status").className = "status bad";
      setTimeout(() => connectLive(Math.min(delay * 2, 15000)), delay);
    };
  }

  // ------------------------------------------------------------------ start
  function start() {
    Chart.defaults.font.family = "system-ui, -apple-system, Segoe UI, Roboto, sans-serif";
    Chart.defaults.color = "#445";
    document.querySelectorAll(".ranges button").forEach((button) => button.addEventListener("click", () => {
      state.range = button.dataset.range;
      loadUsage().catch(showError);
    }));
    loadUsage().catch(showError);
    setInterval(() => loadUsage().catch(showError), 60000);  // the current hour keeps moving
    connectLive(1000);
  }
  function showError(err) {
    const label = $("window-label");
    if (label) label.textContent = String(err);
  }
  document.addEventListener("DOMContentLoaded", start);
})();
