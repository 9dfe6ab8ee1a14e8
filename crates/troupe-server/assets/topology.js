// The topology page of `troupe serve`: agents as nodes, observed links as edges, calls
// and messages animated from the event stream, and a side panel per agent.
// Hand-written, no framework, nothing loaded from elsewhere (the server's CSP forbids it).
//
// Token: if the API answers 401, the page asks for the bearer token, keeps it in
// sessionStorage and sends it as `Authorization: Bearer` on every request. The event
// stream is read with a streaming fetch (EventSource cannot send headers), so the
// token is never put in a URL.
"use strict";

const TOKEN_KEY = "troupe.token";
const SVG_NS = "http://www.w3.org/2000/svg";
const VIEW_W = 640;
const VIEW_H = 520;
const NODE_R = 34;
// Timings, in milliseconds.
const REFRESH_EVERY_MS = 5000;
const REFRESH_DEBOUNCE_MS = 250;
const PULSE_MS = 1200;
const RECONNECT_MS = 2000;
// How many live events the list shows.
const EVENTS_SHOWN = 40;
// How many history entries the panel shows.
const HISTORY_SHOWN = 20;

const state = {
  agents: new Map(), // id -> agent JSON from /v1/topology
  links: new Map(), // "from\u0000to" -> {from, to, calls, messages, calls_refused}
  positions: new Map(), // id -> {x, y}
  selected: null,
  refreshTimer: null,
  refreshAsked: 0,
  refreshApplied: 0,
  panelTimer: null,
};

const $ = (id) => document.getElementById(id);

function token() {
  return sessionStorage.getItem(TOKEN_KEY);
}

async function api(path, options = {}) {
  const headers = Object.assign({}, options.headers || {});
  const t = token();
  if (t) headers["Authorization"] = "Bearer " + t;
  const response = await fetch(path, Object.assign({}, options, { headers }));
  if (response.status === 401) {
    showLogin("The token was refused: enter this server's bearer token.");
    throw new Error("unauthorized");
  }
  return response;
}

async function apiJson(path, options) {
  const response = await api(path, options);
  const body = await response.json();
  if (!response.ok) {
    const error = body && body.error ? body.error.code + ": " + body.error.message : String(response.status);
    throw new Error(error);
  }
  return body;
}

function el(tag, attrs = {}, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function svg(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

function agentName(actor) {
  if (!actor) return null;
  return actor.startsWith("agent/") ? actor.slice("agent/".length) : null;
}

function setStatus(text, cls) {
  const status = $("status");
  status.textContent = text;
  status.className = "status " + (cls || "");
}

// ---- login ---------------------------------------------------------------------------

function showLogin(message) {
  $("main").hidden = true;
  $("login").hidden = false;
  const error = $("login-error");
  error.hidden = !message;
  error.textContent = message || "";
  setStatus("token needed", "bad");
  $("token").focus();
}

$("login").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, $("token").value);
  $("token").value = "";
  start();
});

// ---- layout and drawing --------------------------------------------------------------

function layout(ids) {
  const cx = VIEW_W / 2;
  const cy = VIEW_H / 2;
  const r = Math.min(VIEW_W, VIEW_H) / 2 - NODE_R - 30;
  state.positions.clear();
  ids.forEach((id, i) => {
    const angle = -Math.PI / 2 + (2 * Math.PI * i) / ids.length;
    state.positions.set(id, { x: cx + r * Math.cos(angle), y: cy + r * Math.sin(angle) });
  });
}

function linkKey(from, to) {
  return from + "\u0000" + to;
}

function edgeLabel(link) {
  const parts = [];
  if (link.calls) parts.push(link.calls + (link.calls === 1 ? " call" : " calls"));
  if (link.messages) parts.push(link.messages + (link.messages === 1 ? " msg" : " msgs"));
  return parts.join(" · ");
}

function edgeGeometry(from, to) {
  const a = state.positions.get(from);
  const b = state.positions.get(to);
  if (!a || !b) return null;
  const dx = b.x - a.x;
  const dy = b.y - a.y;
  const len = Math.hypot(dx, dy) || 1;
  const ux = dx / len;
  const uy = dy / len;
  // Bend to the right of the direction, so a -> b and b -> a do not overlap.
  const bend = 28;
  const mx = (a.x + b.x) / 2 - uy * bend;
  const my = (a.y + b.y) / 2 + ux * bend;
  const sx = a.x + ux * NODE_R;
  const sy = a.y + uy * NODE_R;
  const ex = b.x - ux * (NODE_R + 2);
  const ey = b.y - uy * (NODE_R + 2);
  return { d: `M ${sx} ${sy} Q ${mx} ${my} ${ex} ${ey}`, lx: (sx + 2 * mx + ex) / 4, ly: (sy + 2 * my + ey) / 4 };
}

function edgeElement(from, to) {
  const edges = $("edges");
  for (const g of edges.children) {
    if (g.dataset.from === from && g.dataset.to === to) return g;
  }
  const geometry = edgeGeometry(from, to);
  if (!geometry) return null;
  const g = svg("g", { class: "edge", "data-from": from, "data-to": to });
  g.appendChild(svg("title", {}, from + " → " + to));
  g.appendChild(svg("path", { d: geometry.d, "marker-end": "url(#arrow)" }));
  g.appendChild(svg("text", { x: geometry.lx, y: geometry.ly, class: "edge-label", "text-anchor": "middle" }));
  edges.appendChild(g);
  return g;
}

function drawEdge(link) {
  const g = edgeElement(link.from, link.to);
  if (!g) return;
  g.querySelector("text").textContent = edgeLabel(link);
  const configured = !!(link.source && link.source.startsWith("configured"));
  g.classList.toggle("configured", configured);
  g.classList.toggle("disabled", configured && link.configured && !link.configured.enabled);
  g.classList.toggle("idle", !link.calls && !link.messages);
  g.classList.toggle("refused", link.calls > 0 && link.calls_refused === link.calls && !link.messages);
}

function drawNodes() {
  const nodes = $("nodes");
  nodes.replaceChildren();
  for (const [id, agent] of state.agents) {
    const p = state.positions.get(id);
    const g = svg("g", { class: "node", "data-agent": id, tabindex: 0, role: "button", transform: `translate(${p.x} ${p.y})` });
    g.appendChild(svg("title", {}, id + ": " + (agent.description || "")));
    g.appendChild(svg("circle", { r: NODE_R }));
    g.appendChild(svg("text", { class: "node-name", "text-anchor": "middle", dy: "0.35em" }, id));
    const badge = svg("g", { class: "badge", transform: `translate(${NODE_R * 0.75} ${-NODE_R * 0.75})` });
    badge.appendChild(svg("circle", { r: 11 }));
    badge.appendChild(svg("text", { "text-anchor": "middle", dy: "0.35em" }));
    g.appendChild(badge);
    g.addEventListener("click", () => select(id));
    g.addEventListener("keydown", (event) => {
      if (event.key === "Enter" || event.key === " ") select(id);
    });
    nodes.appendChild(g);
    drawBadge(id);
  }
}

function drawBadge(id) {
  const agent = state.agents.get(id);
  const g = document.querySelector(`#nodes .node[data-agent="${CSS.escape(id)}"]`);
  if (!agent || !g) return;
  const turns = Math.max(0, agent.turns_running || 0);
  g.classList.toggle("busy", turns > 0);
  g.classList.toggle("active", !!agent.active);
  g.classList.toggle("selected", state.selected === id);
  g.querySelector(".badge text").textContent = turns > 0 ? String(turns) : "";
}

function pulse(element) {
  if (!element) return;
  element.classList.remove("pulse");
  // Restart the animation.
  void element.getBoundingClientRect();
  element.classList.add("pulse");
  clearTimeout(element._pulse);
  element._pulse = setTimeout(() => element.classList.remove("pulse"), PULSE_MS);
}

// ---- data ----------------------------------------------------------------------------

async function refresh() {
  // Answers may arrive out of order: only a newer one than the last applied is drawn.
  const seq = ++state.refreshAsked;
  const topology = await apiJson("/v1/topology");
  if (seq < state.refreshApplied) return;
  state.refreshApplied = seq;
  const ids = topology.agents.map((a) => a.id);
  const changed = ids.join("\u0000") !== [...state.agents.keys()].join("\u0000");
  state.agents = new Map(topology.agents.map((a) => [a.id, a]));
  if (changed) {
    layout(ids);
    $("edges").replaceChildren();
    drawNodes();
    fillSelect(ids);
  } else {
    for (const id of ids) drawBadge(id);
  }
  state.links = new Map();
  for (const link of topology.links) {
    if (!state.agents.has(link.from) || !state.agents.has(link.to)) continue;
    state.links.set(linkKey(link.from, link.to), link);
    drawEdge(link);
  }
  if (state.selected) drawCounts(state.selected);
}

function scheduleRefresh() {
  clearTimeout(state.refreshTimer);
  state.refreshTimer = setTimeout(() => refresh().catch(() => {}), REFRESH_DEBOUNCE_MS);
}

function fillSelect(ids) {
  const select = $("send-agent");
  const current = select.value;
  select.replaceChildren(...ids.map((id) => el("option", { value: id }, id)));
  if (ids.includes(current)) select.value = current;
  else if (ids.includes("coordinator")) select.value = "coordinator";
}

// ---- live events ---------------------------------------------------------------------

function logEvent(text, cls) {
  const list = $("events");
  const item = el("li", { class: cls || "" }, text);
  list.insertBefore(item, list.firstChild);
  while (list.children.length > EVENTS_SHOWN) list.removeChild(list.lastChild);
}

function countOnLink(from, to, field) {
  const key = linkKey(from, to);
  const link = state.links.get(key) || { from, to, source: "observed", calls: 0, messages: 0, calls_refused: 0 };
  link[field] = (link[field] || 0) + 1;
  state.links.set(key, link);
  drawEdge(link);
  pulse(edgeElement(from, to));
  // The server's count follows (a count seen both in a snapshot and as an event is
  // corrected by it).
  scheduleRefresh();
}

function onEvent(type, data) {
  switch (type) {
    case "call_started": {
      const caller = agentName(data.caller);
      const target = agentName(data.target);
      if (caller && target && state.agents.has(caller) && state.agents.has(target)) {
        countOnLink(caller, target, "calls");
      }
      logEvent(`call ${data.call}: ${caller || "user"} → ${target} (depth ${data.depth})`, "call");
      break;
    }
    case "call_finished":
      logEvent(`call ${data.call} ${data.outcome}`, "finish " + data.outcome);
      schedulePanel();
      break;
    case "message_sent": {
      const from = agentName(data.from);
      const to = agentName(data.to);
      if (from && to && state.agents.has(from) && state.agents.has(to)) countOnLink(from, to, "messages");
      logEvent(`${data.kind.toLowerCase()}: ${from || "user"} → ${to}`, "message");
      break;
    }
    case "turn_started":
    case "turn_ended": {
      const id = agentName(data.agent);
      const agent = state.agents.get(id);
      // The badge (turns running) comes from the server's count, refreshed just after;
      // the node pulses now.
      if (agent && type === "turn_started") pulse(document.querySelector(`#nodes .node[data-agent="${CSS.escape(id)}"]`));
      if (type === "turn_ended") {
        logEvent(`${id} turn ended ${data.ok ? "ok" : "with an error"}`, "turn");
        schedulePanel();
      }
      scheduleRefresh();
      break;
    }
    case "lagged":
      logEvent(`missed ${data.missed} events`, "lagged");
      scheduleRefresh();
      break;
    default:
      break;
  }
}

async function readEvents() {
  for (;;) {
    try {
      const response = await api("/v1/events", { headers: { Accept: "text/event-stream" } });
      if (!response.ok || !response.body) throw new Error("status " + response.status);
      setStatus("live", "good");
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value.replace(/\r\n/g, "\n");
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          let type = "message";
          const data = [];
          for (const line of block.split("\n")) {
            if (line.startsWith("event:")) type = line.slice(6).trim();
            else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
          }
          if (data.length === 0) continue;
          try {
            onEvent(type, JSON.parse(data.join("\n")));
          } catch (error) {
            console.warn("bad event", type, error);
          }
        }
      }
    } catch (error) {
      if (error.message === "unauthorized") {
        eventsStarted = false;
        return;
      }
    }
    setStatus("reconnecting…", "bad");
    await new Promise((resolve) => setTimeout(resolve, RECONNECT_MS));
  }
}

// ---- side panel ----------------------------------------------------------------------

function select(id) {
  state.selected = id;
  for (const other of state.agents.keys()) drawBadge(other);
  const panel = $("panel");
  const agent = state.agents.get(id);
  panel.replaceChildren(
    el("h2", { id: "panel-title" }, id),
    el("p", { class: "description" }, agent ? agent.description : ""),
    el("dl", { id: "panel-counts", class: "counts" }),
    el("h3", {}, "Conversation"),
    el("ol", { id: "conversation", class: "conversation" }),
    el("h3", {}, "Call tree of the last request"),
    el("div", { id: "call-tree", class: "call-tree" }),
  );
  drawCounts(id);
  loadPanel().catch((error) => {
    $("call-tree").textContent = "could not load: " + error.message;
  });
}

function drawCounts(id) {
  const counts = $("panel-counts");
  const agent = state.agents.get(id);
  if (!counts || !agent) return;
  const rows = [
    ["active", agent.active ? "yes" : "no"],
    ["turns running", agent.turns_running],
    ["inbox / outbox", `${agent.inbox ?? "?"} / ${agent.outbox ?? "?"}`],
    ["calls made", agent.calls_made],
    ["calls received", agent.calls_received],
    ["messages sent / received", `${agent.messages_sent} / ${agent.messages_received}`],
  ];
  counts.replaceChildren(...rows.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, String(v))]));
}

function schedulePanel() {
  if (!state.selected) return;
  clearTimeout(state.panelTimer);
  state.panelTimer = setTimeout(() => loadPanel().catch(() => {}), REFRESH_DEBOUNCE_MS);
}

async function loadPanel() {
  const id = state.selected;
  if (!id) return;
  const enc = encodeURIComponent(id);
  const [history, tree] = await Promise.all([
    apiJson(`/v1/agents/${enc}/history?limit=${HISTORY_SHOWN}`),
    apiJson(`/v1/topology/agents/${enc}/call-tree`),
  ]);
  if (state.selected !== id) return;
  const conversation = $("conversation");
  conversation.replaceChildren(
    ...history.messages.map((m) => {
      const item = el("li", { class: "msg " + m.role });
      item.appendChild(el("span", { class: "role" }, m.role));
      let text = m.content || "";
      if (m.tool_calls && m.tool_calls.length) {
        text += (text ? " " : "") + "[calls " + m.tool_calls.map((c) => (c.name || "tool") + (c.arguments && c.arguments.agent_id ? " " + c.arguments.agent_id : "")).join(", ") + "]";
      }
      item.appendChild(el("span", { class: "text" }, text));
      return item;
    }),
  );
  if (history.messages.length === 0) conversation.appendChild(el("li", { class: "hint" }, "no messages yet"));
  // The latest entry in view.
  conversation.scrollTop = conversation.scrollHeight;
  const holder = $("call-tree");
  holder.replaceChildren(tree.root ? treeList([tree.root]) : el("p", { class: "hint" }, "no request seen since the server started"));
}

function treeList(nodes) {
  const list = el("ul", { class: "tree" });
  for (const node of nodes) {
    const item = el("li", { class: "tree-node", "data-call": node.call });
    const caller = node.caller || "user";
    item.appendChild(el("span", { class: "tree-call" }, `${caller} → ${node.target}`));
    let outcome = "running";
    if (node.outcome) {
      const ms = Math.round((node.finished_us - node.started_us) / 1000);
      outcome = `${node.outcome} · ${ms} ms`;
      if (node.detail && node.detail.cause) outcome += ` · ${node.detail.cause}`;
    }
    item.appendChild(el("span", { class: "outcome " + (node.outcome || "running") }, outcome));
    if (node.children && node.children.length) item.appendChild(treeList(node.children));
    list.appendChild(item);
  }
  return list;
}

// ---- sending -------------------------------------------------------------------------

$("send").addEventListener("submit", async (event) => {
  event.preventDefault();
  const agent = $("send-agent").value;
  const text = $("send-text").value || $("send-text").placeholder;
  const result = $("send-result");
  const button = $("send-button");
  button.disabled = true;
  result.className = "result";
  result.textContent = `waiting for ${agent}…`;
  try {
    const reply = await apiJson(`/v1/agents/${encodeURIComponent(agent)}/messages`, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ text }),
    });
    result.className = "result ok";
    result.textContent = `${agent}: ${reply.text}`;
  } catch (error) {
    result.className = "result error";
    result.textContent = `${agent} failed: ${error.message}`;
  } finally {
    button.disabled = false;
  }
  scheduleRefresh();
  if (state.selected === agent) schedulePanel();
  else select(agent);
});

// ---- start ---------------------------------------------------------------------------

let eventsStarted = false;
let refreshing = false;

async function start() {
  try {
    await refresh();
  } catch (error) {
    if (error.message !== "unauthorized") setStatus("cannot reach the server: " + error.message, "bad");
    return;
  }
  $("login").hidden = true;
  $("main").hidden = false;
  if (!eventsStarted) {
    eventsStarted = true;
    readEvents();
  }
  if (!refreshing) {
    refreshing = true;
    setInterval(() => refresh().catch(() => {}), REFRESH_EVERY_MS);
  }
}

start();
