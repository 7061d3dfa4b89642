// The dashboard's client: polls the JSON API every POLL_MS, fills the data-metric elements
// (text formatted, data-value raw) and draws the charts with uPlot. It only ever GETs.
// Every string from the server goes in through textContent, never as HTML. With a token, the
// page is opened once as ?token=TOKEN: see takeToken.
"use strict";

const POLL_MS = 2000;
const CHART_HEIGHT = 220;
const COLORS = { overall: "#4fc3f7", saved: "#9ccc65", tiers: ["#81c784", "#ffb74d", "#ba68c8", "#e57373", "#4dd0e1"] };
const AXIS = { stroke: "#8b949e", grid: { stroke: "#222a36", width: 1 }, ticks: { stroke: "#222a36", width: 1 } };

// ---- formatting: one function per unit; null (no data) reads as a dash ----------------------

const fmt = {
  pct: (x) => (x == null ? "–" : (100 * x).toFixed(1) + "%"),
  tokens: (n) => scaled(n, 1000, ["", "k", "M", "B", "T"], ""),
  bytes: (n) => scaled(n, 1024, ["B", "KiB", "MiB", "GiB", "TiB"], " "),
  count: (n) => (n == null ? "–" : Math.round(n).toLocaleString("en-US")),
  ms: (s) => (s == null ? "–" : (1000 * s).toPrecision(3) + " ms"),
  duration: (seconds) => {
    const s = Math.floor(seconds);
    const parts = [[Math.floor(s / 86400), "d"], [Math.floor((s % 86400) / 3600), "h"], [Math.floor((s % 3600) / 60), "m"], [s % 60, "s"]];
    const first = parts.findIndex(([v]) => v > 0);  // the two largest units: "3d 4h", "5m 12s"
    return first < 0 ? "0s" : parts.slice(first, first + 2).map(([v, unit]) => v + unit).join(" ");
  },
};

/** n in the largest unit it reaches (steps of `base`), one decimal past the first unit. */
function scaled(n, base, units, sep) {
  if (n == null) return "–";
  let i = 0;
  while (Math.abs(n) >= base && i < units.length - 1) { n /= base; i++; }
  const text = i === 0 ? String(Math.round(n)) : n.toFixed(1);
  return units[i] ? text + sep + units[i] : text;
}

// ---- the data-metric elements --------------------------------------------------------------

function setMetric(name, raw, text, tier) {
  const selector = `[data-metric="${name}"]` + (tier == null ? ":not([data-tier])" : `[data-tier="${CSS.escape(tier)}"]`);
  for (const el of document.querySelectorAll(selector)) {
    el.textContent = text;
    el.dataset.value = raw == null ? "" : String(raw);
  }
}

function renderSummary(s) {
  setMetric("uptime", s.uptime_s, fmt.duration(s.uptime_s));
  setMetric("hit_rate", s.hit_rate, fmt.pct(s.hit_rate));
  setMetric("hit_tokens", s.hit_tokens, fmt.tokens(s.hit_tokens));
  setMetric("lookup_tokens", s.lookup_tokens, fmt.tokens(s.lookup_tokens));
  setMetric("lookups", s.lookups, fmt.count(s.lookups));
  setMetric("prefill_saved", s.prefill_tokens_saved, fmt.tokens(s.prefill_tokens_saved));
  setMetric("prefill_computed", s.prefill_tokens_computed, fmt.tokens(s.prefill_tokens_computed));
  setMetric("prefill_saved_fraction", s.prefill_saved_fraction, fmt.pct(s.prefill_saved_fraction));
  const loaded = Object.values(s.loaded_tokens_by_tier).reduce((a, b) => a + b, 0);
  setMetric("loaded_tokens", loaded, fmt.tokens(loaded));
  document.getElementById("loaded-by-tier").textContent =
    Object.entries(s.loaded_tokens_by_tier).map(([tier, n]) => `${tier} ${fmt.tokens(n)}`).join(" · ") || "–";
  setMetric("namespaces", s.namespaces, fmt.count(s.namespaces));
  setMetric("leases_active", s.leases_active, fmt.count(s.leases_active));
  renderTiers(s);
}

function renderTiers(s) {
  const box = document.getElementById("tiers");
  if (box.dataset.tiers !== s.tiers.map((t) => t.name).join(",")) buildTierCards(box, s.tiers);
  s.tiers.forEach((t) => {
    const fraction = t.capacity_bytes > 0 ? t.used_bytes / t.capacity_bytes : null;
    setMetric("tier_used_bytes", t.used_bytes, fmt.bytes(t.used_bytes), t.name);
    setMetric("tier_capacity_bytes", t.capacity_bytes, fmt.bytes(t.capacity_bytes), t.name);
    setMetric("tier_used_fraction", fraction, fmt.pct(fraction), t.name);
    setMetric("tier_blocks", t.blocks, fmt.count(t.blocks), t.name);
    setMetric("tier_evictions", t.evictions, fmt.count(t.evictions), t.name);
    setMetric("tier_demotions", t.demotions, fmt.count(t.demotions), t.name);
    setMetric("tier_hit_tokens", s.hit_tokens_by_tier[t.name], fmt.tokens(s.hit_tokens_by_tier[t.name]), t.name);
    const fill = box.querySelector(`.tier[data-tier="${CSS.escape(t.name)}"] .fill`);
    fill.style.width = `${Math.min(100, 100 * (fraction || 0))}%`;
  });
}

function buildTierCards(box, tiers) {
  box.replaceChildren(...tiers.map((t, i) => {
    const card = el("div", "card tier");
    card.dataset.tier = t.name;
    card.style.setProperty("--tier-color", tierColor(i));
    const head = el("div", "tier-head");
    head.append(el("span", "swatch"), el("h3", "", t.name), metricSpan("tier_used_fraction", t.name, "pct"));
    const bar = el("div", "bar");
    bar.append(el("div", "fill"));
    const bytes = el("div", "tier-bytes");
    bytes.append(metricSpan("tier_used_bytes", t.name), document.createTextNode(" of "),
      metricSpan("tier_capacity_bytes", t.name));
    const facts = el("dl");
    for (const [name, label] of [["tier_blocks", "blocks"], ["tier_hit_tokens", "hit tokens"],
      ["tier_evictions", "evictions"], ["tier_demotions", "demotions in"]]) {
      const item = el("div");
      const value = el("dd");
      value.append(metricSpan(name, t.name));
      item.append(el("dt", "", label), value);
      facts.append(item);
    }
    card.append(head, bar, bytes, facts);
    return card;
  }));
  box.dataset.tiers = tiers.map((t) => t.name).join(",");
}

function el(tag, className = "", text = "") {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text) node.textContent = text;
  return node;
}

function metricSpan(name, tier, className = "") {
  const span = el("span", className, "–");
  span.dataset.metric = name;
  span.dataset.tier = tier;
  return span;
}

function tierColor(i) { return COLORS.tiers[i % COLORS.tiers.length]; }

function renderNamespaces(ns) {
  const body = document.querySelector("#namespaces tbody");
  if (!ns.rows.length) {
    const row = el("tr", "empty");
    row.append(Object.assign(el("td", "", "no lookups yet"), { colSpan: 5 }));
    body.replaceChildren(row);
    return;
  }
  body.replaceChildren(...ns.rows.map((r) => {
    const row = el("tr");
    row.dataset.namespace = r.namespace;
    const rate = el("td", "num");
    const meter = el("span", "meter");
    meter.style.setProperty("--fraction", r.hit_rate || 0);
    rate.append(meter, document.createTextNode(fmt.pct(r.hit_rate)));
    row.append(el("td", "ns", r.namespace), el("td", "num", fmt.count(r.lookups)),
      el("td", "num", fmt.tokens(r.lookup_tokens)), rate, el("td", "num", fmt.tokens(r.prefill_tokens_saved)));
    return row;
  }));
}

function renderCurve(c) {
  setMetric("curve_requests", c.window_requests, fmt.count(c.window_requests));
  setMetric("curve_capacity", c.current_capacity_bytes, fmt.bytes(c.current_capacity_bytes));
  setMetric("curve_current_hit_rate", c.current.hit_rate, fmt.pct(c.current.hit_rate));
  setMetric("curve_observed_hit_rate", c.observed_hit_rate, fmt.pct(c.observed_hit_rate));
  document.getElementById("curve-rule").textContent = `Current capacity: ${c.capacity_rule}.`;
  const points = c.points.filter((p) => p.capacity_bytes > 0);
  const xs = points.map((p) => p.capacity_bytes);
  charts.update("chart-curve", "curve", () => curveOptions(), [
    xs,
    points.map((p) => p.hit_rate),
    points.map((p) => (p.capacity_factor === 1 ? p.hit_rate : null)),
    points.map(() => c.observed_hit_rate),
  ]);
}

// ---- charts ------------------------------------------------------------------------------

/** The uPlot instances by figure id, rebuilt when their series change (a tier appears). */
const charts = {
  plots: new Map(),
  update(figureId, shape, options, data) {
    let entry = this.plots.get(figureId);
    if (entry && entry.shape !== shape) {
      entry.resize.disconnect(); // else the destroyed plot's observer lives on, one more per rebuild
      entry.plot.destroy();
      entry = null;
    }
    if (!entry) {
      const box = document.querySelector(`#${figureId} .plot`);
      const plot = new uPlot({ ...options(), width: box.clientWidth, height: CHART_HEIGHT }, data, box);
      const resize = new ResizeObserver(() => plot.setSize({ width: box.clientWidth, height: CHART_HEIGHT }));
      resize.observe(box);
      entry = { shape, plot, resize };
      this.plots.set(figureId, entry);
    } else {
      entry.plot.setData(data);
    }
  },
};

function line(label, stroke, value, extra = {}) {
  return { label, stroke, width: 2, value: (u, v) => value(v), points: { show: true, size: 6, fill: stroke, filter: isolated }, ...extra };
}

/** Indices of values with no neighbour to draw a line to (one busy interval among idle ones): dots. */
function isolated(u, seriesIdx) {
  const ys = u.data[seriesIdx];
  const out = [];
  for (let i = 0; i < ys.length; i++) if (ys[i] != null && ys[i - 1] == null && ys[i + 1] == null) out.push(i);
  return out;
}

/** Options of a time chart; `y` may set range (fixed [lo, hi]), incrs (tick steps) and size (px). */
function timeOptions(series, yValues, y = {}) {
  const range = y.range || ((u, lo, hi) => [0, hi > 0 ? hi * 1.1 : 1]);
  return {
    series: [{}, ...series],
    scales: { x: { time: true }, y: { range } },
    axes: [{ ...AXIS }, { ...AXIS, size: y.size || 60, ...(y.incrs && { incrs: y.incrs }), values: (u, ticks) => ticks.map(yValues) }],
    cursor: { drag: { x: false, y: false } },
  };
}

const BINARY_STEPS = Array.from({ length: 50 }, (_, i) => 2 ** i);  // byte ticks at round KiB, MiB, GiB

function curveOptions() {
  return {
    series: [
      { label: "capacity", value: (u, v) => fmt.bytes(v) },
      line("LRU estimate", COLORS.overall, fmt.pct, { points: { show: true, size: 5 } }),
      line("current capacity", "#ffffff", fmt.pct, { paths: () => null, points: { show: true, size: 11, fill: "#ffffff" } }),
      line("observed", COLORS.saved, fmt.pct, { dash: [6, 4], width: 1.5 }),
    ],
    scales: { x: { time: false, distr: 3, log: 2 }, y: { range: [0, 1] } },
    axes: [
      { ...AXIS, values: (u, ticks) => ticks.map(fmt.bytes) },
      { ...AXIS, size: 64, values: (u, ticks) => ticks.map((t) => (100 * t).toFixed(0) + "%") },
    ],
    cursor: { drag: { x: false, y: false } },
  };
}

function renderTimeseries(ts) {
  const shape = ts.tiers.join(",");
  const p = ts.points;
  const times = p.map((q) => q.time_s);
  const perTier = (f) => ts.tiers.map((tier) => p.map((q) => f(q, tier)));
  const tierLines = (value, extra) => ts.tiers.map((tier, i) => line(tier, tierColor(i), value, extra));

  charts.update("chart-hit-rate", shape, () => timeOptions(
    [line("overall", COLORS.overall, fmt.pct, { width: 2.5 }), ...tierLines(fmt.pct, { width: 1.5 })],
    (t) => (100 * t).toFixed(0) + "%", { range: [0, 1] }),
  [times, p.map((q) => q.hit_rate), ...perTier((q, tier) => q.hit_rate_by_tier[tier] ?? null)]);

  const perSecond = (v) => (v == null ? "–" : fmt.tokens(v) + "/s");
  charts.update("chart-tokens", shape, () => timeOptions(
    [line("looked up", COLORS.overall, perSecond), line("prefill saved", COLORS.saved, perSecond, { fill: "rgba(156,204,101,0.12)" })],
    fmt.tokens),
  [times, p.map((q) => q.lookup_tokens_per_s), p.map((q) => q.prefill_saved_per_s)]);

  charts.update("chart-bytes", shape, () => timeOptions(
    [...tierLines(fmt.bytes), ...ts.tiers.map((tier, i) => line(tier + " capacity", tierColor(i), fmt.bytes, { dash: [6, 4], width: 1 }))],
    fmt.bytes, { incrs: BINARY_STEPS, size: 80 }),
  [times, ...perTier((q, tier) => q.used_bytes[tier] ?? null), ...perTier((q, tier) => q.capacity_bytes[tier] ?? null)]);

  charts.update("chart-evictions", shape, () => timeOptions(
    tierLines((v) => (v == null ? "–" : v.toFixed(1) + "/s")), (t) => t.toFixed(t < 10 ? 1 : 0)),
  [times, ...perTier((q, tier) => q.evictions_per_s[tier] ?? null)]);

  const ms = (v) => (v == null ? "–" : v.toPrecision(3) + " ms");
  const latency = (key) => p.map((q) => (q.load_latency_s[key] == null ? null : 1000 * q.load_latency_s[key]));
  charts.update("chart-latency", "latency", () => timeOptions(
    [line("p50", "#4fc3f7", ms), line("p90", "#ffb74d", ms), line("p99", "#e57373", ms)], (t) => t.toPrecision(2)),
  [times, latency("p50"), latency("p90"), latency("p99")]);
}

// ---- the token ----------------------------------------------------------------------------

const TOKEN_KEY = "kvstore.token";

/** The sidecar's bearer token, or null when none was given. Read from ?token= once, kept in this
 * tab's sessionStorage (it survives a reload) and dropped from the address bar, so that it is not
 * bookmarked, shared or kept in the history. */
function takeToken() {
  const url = new URL(window.location.href);
  const given = url.searchParams.get("token");
  if (given !== null) {
    sessionStorage.setItem(TOKEN_KEY, given);
    url.searchParams.delete("token");
    history.replaceState(history.state, "", url.pathname + url.search + url.hash);
  }
  return sessionStorage.getItem(TOKEN_KEY);
}

const TOKEN = takeToken();

// ---- polling -------------------------------------------------------------------------------

async function getJSON(path) {
  const headers = TOKEN === null ? {} : { Authorization: `Bearer ${TOKEN}` };
  const response = await fetch(path, { cache: "no-store", headers });
  if (response.status === 401) throw new Unauthorized(path);
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

class Unauthorized extends Error {
  constructor(path) { super(`${path}: HTTP 401, the sidecar wants its token`); }
}

function setStatus(state, text) {
  const status = document.getElementById("status");
  status.dataset.state = state;
  status.textContent = text;
}

async function refresh() {
  try {
    const [summary, series, namespaces, curve] = await Promise.all([
      getJSON("api/summary"), getJSON("api/timeseries?window_s=600"),
      getJSON("api/namespaces?limit=10"), getJSON("api/hit_rate_curve"),
    ]);
    renderSummary(summary);
    renderTimeseries(series);
    renderNamespaces(namespaces);
    renderCurve(curve);
    document.body.dataset.updates = String(Number(document.body.dataset.updates) + 1);
    setStatus("live", "live · " + new Date().toLocaleTimeString());
  } catch (err) {
    console.error(err);
    if (err instanceof Unauthorized) setStatus("error", "needs the token · open ?token=TOKEN");
    else setStatus("error", "offline · retrying");
  } finally {
    setTimeout(refresh, POLL_MS);
  }
}

refresh();
