// The swarm dashboard page: fetches /api/state every poll period and redraws the summary, the charts
// (hand-written SVG), the peer table and the expert coverage map, without reloading the page.
// Peer ids and other values come from the DHT, i.e. from strangers: they are only ever set as text
// (textContent / attributes), never as HTML.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const H = 240, PAD = { left: 56, right: 12, top: 12, bottom: 26 };
// fetchedAt: when (performance.now()) the server's clock read lastState.now, taken halfway through the request
let lastState = null, fetchedAt = 0, shownStatuses = "";

// -- formatting ----------------------------------------------------------------------------------------
const fmtInt = (x) => (x == null ? "–" : Math.round(x).toLocaleString("en-US"));
function fmtSI(x, unit = "") {
  if (x == null) return "–";
  const a = Math.abs(x);
  for (const [k, s] of [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]]) {
    if (a >= k) return (x / k).toFixed(a >= 10 * k ? 1 : 2) + " " + s + unit;
  }
  return (Number.isInteger(x) ? x : x.toFixed(1)) + (unit ? " " + unit : "");
}
const fmtBytes = (x) => (x == null ? "–" : fmtSI(x, "B"));
const fmtLoss = (x) => (x == null ? "–" : x.toFixed(3));
function fmtAge(s) {
  if (s == null) return "–";
  if (s < 60) return s.toFixed(0) + " s";
  if (s < 3600) return Math.floor(s / 60) + " min " + Math.floor(s % 60) + " s";
  return (s / 3600).toFixed(1) + " h";
}
function colorOf(peerId) { // a stable colour per peer, the same in the table and the charts
  let h = 0;
  for (const c of peerId) h = (h * 31 + c.charCodeAt(0)) >>> 0;
  return "s" + (h % 8);
}

// -- DOM helpers ----------------------------------------------------------------------------------------
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v; else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : String(c));
  return node;
}
function svg(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text != null) node.textContent = text;
  return node;
}
const setText = (id, text) => { document.getElementById(id).textContent = text; };
const badge = (status) => el("span", { class: "badge " + status }, status);

// -- summary ---------------------------------------------------------------------------------------------
function drawSummary(st) {
  const s = st.summary;
  setText("run-id", st.run_id);
  setText("s-peers", fmtInt(s.peers_online));
  setText("s-peers-sub", `${s.peers_stale} stale · ${s.peers_offline} offline`);
  setText("s-tps", fmtSI(s.tokens_per_s));
  setText("s-tokens", `${fmtSI(s.tokens)} tokens trained`);
  setText("s-rounds", fmtInt(s.rounds));
  setText("s-rounds-sub", `peer rounds: ${fmtInt(s.rounds_ok)} ok · ${fmtInt(s.rounds_failed)} failed`);
  const E = s.n_experts_known ? s.n_experts : `${s.n_experts}?`;
  setText("s-covered", `${s.experts_covered} / ${E}`);
  const covered = document.getElementById("s-covered");
  covered.classList.toggle("bad", s.uncovered.length > 0);
  setText("s-uncovered", s.uncovered.length ? `uncovered: ${s.uncovered.join(", ")}` : "all covered");
  setText("s-repl", s.replication.mean.toFixed(2));
  setText("s-repl-sub", `holders per expert: min ${s.replication.min} · max ${s.replication.max}`);
  setText("s-bytes", fmtBytes(s.bytes_sent + s.bytes_recv));
  setText("s-bytes-sub", `sent ${fmtBytes(s.bytes_sent)} · received ${fmtBytes(s.bytes_recv)}`);
}

// -- charts -----------------------------------------------------------------------------------------------
// series: [{name, cls, values (aligned on t), total}]; null values break a line into segments.
function drawChart(svgId, legendId, t, now, series, fmtY) {
  const root = document.getElementById(svgId);
  // the drawing is as wide as its box, so that labels keep their size on a phone (no scaling down)
  const W = Math.max(280, Math.round(root.getBoundingClientRect().width) || 640);
  root.setAttribute("viewBox", `0 0 ${W} ${H}`);
  root.replaceChildren();
  const legend = document.getElementById(legendId);
  legend.replaceChildren();
  const ys = series.flatMap((s) => s.values.filter((v) => v != null));
  if (t.length < 2 || ys.length < 2) {
    root.append(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "nodata" }, "collecting history…"));
    return;
  }
  const t0 = t[0], t1 = Math.max(t[t.length - 1], t0 + 1);
  let lo = Math.min(...ys), hi = Math.max(...ys);
  if (hi - lo < 1e-9) { lo -= Math.abs(lo) * 0.05 + 0.5; hi += Math.abs(hi) * 0.05 + 0.5; }
  const pad = (hi - lo) * 0.08; lo -= pad; hi += pad;
  if (Math.min(...ys) >= 0 && lo < 0) lo = 0;
  const x = (ti) => PAD.left + ((ti - t0) / (t1 - t0)) * (W - PAD.left - PAD.right);
  const y = (v) => H - PAD.bottom - ((v - lo) / (hi - lo)) * (H - PAD.top - PAD.bottom);
  for (let i = 0; i <= 4; i++) { // horizontal grid with value labels
    const v = lo + ((hi - lo) * i) / 4, yy = y(v).toFixed(1);
    root.append(svg("line", { x1: PAD.left, x2: W - PAD.right, y1: yy, y2: yy, class: "gridline" }));
    root.append(svg("text", { x: PAD.left - 6, y: +yy + 4, "text-anchor": "end", class: "axis" }, fmtY(v)));
  }
  for (let i = 0; i <= 3; i++) { // time labels, relative to now
    const ti = t0 + ((t1 - t0) * i) / 3, ago = now - ti;
    const label = ago < 1 ? "now" : ago < 120 ? `-${ago.toFixed(0)} s` : ago < 7200 ? `-${(ago / 60).toFixed(0)} min`
      : `-${(ago / 3600).toFixed(1)} h`;
    const anchor = i === 0 ? "start" : i === 3 ? "end" : "middle";
    root.append(svg("text", { x: x(ti).toFixed(1), y: H - 6, "text-anchor": anchor, class: "axis" }, label));
  }
  for (const s of series) {
    let seg = [];
    const flush = () => {
      if (seg.length >= 1) {
        const pts = seg.length === 1 ? [seg[0], seg[0]] : seg; // a lone point still shows as a dot
        root.append(svg("polyline", {
          points: pts.map(([a, b]) => `${a.toFixed(1)},${b.toFixed(1)}`).join(" "),
          class: s.cls, "data-series": s.name, "data-points": String(seg.length),
        }));
      }
      seg = [];
    };
    s.values.forEach((v, i) => { if (v == null) flush(); else seg.push([x(t[i]), y(v)]); });
    flush();
    legend.append(el("span", {}, el("span", { class: "swatch " + s.cls }), s.label));
  }
}

function drawCharts(st) {
  const h = st.history, shortOf = {};
  for (const p of st.peers) shortOf[p.peer_id] = p.short_id;
  const perPeer = (key) => Object.entries(h.peers).map(([pid, v]) => ({
    name: pid, label: shortOf[pid] || pid.slice(-8), cls: colorOf(pid), values: v[key],
  }));
  drawChart("chart-loss", "legend-loss", h.t, st.now,
    [...perPeer("loss"), { name: "mean", label: "mean", cls: "total", values: h.loss }], (v) => v.toFixed(2));
  drawChart("chart-tps", "legend-tps", h.t, st.now,
    [...perPeer("tokens_per_s"), { name: "total", label: "swarm total", cls: "total", values: h.tokens_per_s }],
    (v) => fmtSI(v));
}

// -- tables -------------------------------------------------------------------------------------------------
function drawPeers(st) {
  const body = document.querySelector("#peers tbody");
  const rows = st.peers.map((p) => {
    const lastRound = p.last_round >= 0 ? `#${p.last_round}, ${fmtAge(p.last_round_age_s)} ago` : "none yet";
    const tr = el("tr", { class: p.status, "data-peer": p.peer_id, "data-status": p.status },
      el("td", { title: p.peer_id }, el("span", { class: "swatch " + colorOf(p.peer_id) }), el("code", {}, p.short_id)),
      el("td", {}, badge(p.status)),
      el("td", {}, p.state),
      el("td", { class: "experts" }, p.experts.join(", ")),
      el("td", { class: "num" }, fmtInt(p.step)),
      el("td", { class: "num" }, fmtSI(p.tokens)),
      el("td", { class: "num" }, fmtLoss(p.loss)),
      el("td", { class: "num" }, fmtSI(p.tokens_per_s)),
      el("td", { class: "num" }, lastRound),
      el("td", { class: "num" }, fmtBytes(p.bytes_per_round)),
      el("td", { class: "num" }, `${fmtInt(p.rounds_ok)} / ${fmtInt(p.rounds_failed)}`),
      el("td", { class: "num" }, p.status !== "offline" ? `${fmtAge(p.age_s)} ago`
        : p.gone_at == null ? "gone" : `gone ${fmtAge(Math.max(0, st.now - p.gone_at))}`));
    return tr;
  });
  if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: "12", class: "empty" }, "no peer has published a heartbeat yet")));
  body.replaceChildren(...rows);
}

function drawEntryPoints(st) {
  const list = document.querySelector("#entry-points");
  const items = st.peers.filter((p) => p.status === "online").flatMap((p) =>
    (p.addrs || []).map((a) => el("li", { "data-peer": p.peer_id }, el("code", {}, a), " ", el("span", { class: "hint" }, p.short_id))));
  list.replaceChildren(...(items.length ? items : [el("li", { class: "empty" }, "none online")]));
}

function drawCoverage(st) {
  const live = st.peers.filter((p) => p.status !== "offline");
  const liveIds = new Set(live.map((p) => p.peer_id));
  const head = el("tr", {}, el("th", { scope: "col" }, "Expert"), el("th", { scope: "col", class: "num" }, "Holders"),
    ...live.map((p) => el("th", { scope: "col", class: "peer", title: p.peer_id }, p.short_id)));
  document.querySelector("#coverage thead").replaceChildren(head);
  let uncovered = 0;
  const rows = st.experts.map((x) => {
    const holders = new Set(x.holders.filter((h) => liveIds.has(h)));
    uncovered += holders.size === 0;
    const count = holders.size ? String(holders.size) : badge("uncovered");
    return el("tr", { class: holders.size ? "" : "uncovered", "data-expert": String(x.expert) },
      el("th", { scope: "row" }, String(x.expert)), el("td", { class: "num" }, count),
      ...live.map((p) => el("td", { class: "cell" },
        holders.has(p.peer_id) ? el("span", { class: "dot " + p.status, title: `${p.short_id} (${p.status})` }) : "")));
  });
  document.querySelector("#coverage tbody").replaceChildren(...rows);
  setText("coverage-note", uncovered ? `${uncovered} expert(s) have no live holder: marked in red.`
    : "Each row is an expert; a dot marks a live peer that trains it (amber: its heartbeat is stale).");
}

// Between two fetches heartbeats keep ageing: the page moves a peer to stale, and to offline once its
// record expires, at the moment the server would (from the record's own times and the server's clock),
// not up to a refresh period late. It only ever downgrades; the next fetch has the last word.
function statusAt(p, st, now) {
  if (p.status === "offline") return "offline";
  if (p.expires_in_s != null && now >= st.now + p.expires_in_s) return "offline";
  if (p.sent_at != null && now - p.sent_at > 2 * p.period_s) return "stale";
  return p.status;
}

function tick() {
  if (!lastState) return;
  const now = lastState.now + (performance.now() - fetchedAt) / 1000;
  const peers = lastState.peers.map((p) => {
    const status = statusAt(p, lastState, now);
    return { ...p, status, gone_at: status === "offline" && p.gone_at == null ? now : p.gone_at };
  });
  const key = peers.map((p) => p.status).join();
  if (key === shownStatuses) return;
  shownStatuses = key;
  const st = { ...lastState, now, peers };
  drawPeers(st);
  drawEntryPoints(st);
  drawCoverage(st);
}

// -- the loop -------------------------------------------------------------------------------------------------
function draw(st) {
  shownStatuses = st.peers.map((p) => p.status).join();
  drawSummary(st);
  drawCharts(st);
  drawPeers(st);
  drawEntryPoints(st);
  drawCoverage(st);
}

async function refresh() {
  const conn = document.getElementById("conn");
  let wait = 2000;
  try {
    const sent = performance.now();
    const res = await fetch("/api/state", { cache: "no-store" });
    if (!res.ok) throw new Error(`HTTP ${res.status}`);
    const st = await res.json();
    lastState = window.dashboardState = st;
    fetchedAt = (sent + performance.now()) / 2;
    draw(st);
    wait = Math.max(1000, Math.min(10000, st.poll_s * 1000));
    const failed = st.reads.last == null || st.now - st.reads.last > 3 * st.poll_s + 5;
    conn.textContent = failed ? `the DHT has not answered lately${st.reads.error ? ` (${st.reads.error})` : ""}: showing what was last read`
      : `updated ${new Date(st.now * 1000).toLocaleTimeString()} · every ${st.poll_s} s`;
    conn.classList.toggle("error", failed);
  } catch (err) {
    conn.textContent = `dashboard unreachable (${err.message}); retrying`;
    conn.classList.add("error");
  }
  setTimeout(refresh, wait);
}

document.addEventListener("DOMContentLoaded", () => { refresh(); setInterval(tick, 250); });
window.addEventListener("resize", () => { if (lastState) drawCharts(lastState); });
