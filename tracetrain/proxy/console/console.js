// The tracetrain console: plain JavaScript over the gateway's documented JSON API, no build step.
// Every page is drawn from API answers only; the key kept in a cookie goes out as `Authorization: Bearer`.
"use strict";

const COOKIE = "tt_console_key";
const state = { key: null, me: null, timer: null, view: null, lastOverview: null, policies: [] };

// ---------- small helpers ----------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (name === "class") node.className = value;
    else node.setAttribute(name, value === true ? "" : value);
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function fmt(value, digits = 3) {
  if (value === null || value === undefined) return "—";
  if (typeof value === "number") return Number.isInteger(value) ? String(value) : value.toFixed(digits);
  return String(value);
}

function age(iso) {
  if (!iso) return "—";
  const seconds = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
  if (seconds < 60) return `${Math.round(seconds)} s`;
  if (seconds < 3600) return `${Math.round(seconds / 60)} min`;
  if (seconds < 86400) return `${(seconds / 3600).toFixed(1)} h`;
  return `${(seconds / 86400).toFixed(1)} d`;
}

function when(iso) {
  return iso ? new Date(iso).toLocaleString() : "—";
}

function counts(dict) {
  const entries = Object.entries(dict || {}).filter(([, v]) => v !== 0);
  return entries.length ? entries.map(([k, v]) => `${k}: ${v}`).join(", ") : "—";
}

// A finite number, written as one: "1", "-0.5", "2e-3". Anything else (text, NaN, Infinity) is refused.
function parseReward(text) {
  const trimmed = String(text).trim();
  if (!/^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$/.test(trimmed)) return null;
  const value = Number(trimmed);
  return Number.isFinite(value) ? value : null;
}

// ---------- the API ----------

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(path, options = {}) {
  const headers = { Accept: "application/json" };
  if (state.key) headers.Authorization = `Bearer ${state.key}`;
  if (options.body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, {
    method: options.method || "GET", headers,
    body: options.body === undefined ? undefined : JSON.stringify(options.body),
  });
  const data = await response.json().catch(() => null);
  if (!response.ok) {
    const message = data && data.error ? data.error.message : `${response.status} ${response.statusText}`;
    if (response.status === 401 && !options.login) showLogin(message);
    throw new ApiError(response.status, message);
  }
  return data;
}

function query(params) {
  const search = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== "" && v !== null && v !== undefined) search.set(k, v);
  const text = search.toString();
  return text ? `?${text}` : "";
}

// ---------- login ----------

function readCookie() {
  const found = document.cookie.split("; ").find((c) => c.startsWith(`${COOKIE}=`));
  return found ? decodeURIComponent(found.slice(COOKIE.length + 1)) : null;
}

function writeCookie(key) {
  const secure = location.protocol === "https:" ? "; Secure" : "";
  document.cookie = key === null
    ? `${COOKIE}=; Path=/ui; Max-Age=0; SameSite=Strict`
    : `${COOKIE}=${encodeURIComponent(key)}; Path=/ui; Max-Age=${30 * 86400}; SameSite=Strict${secure}`;
}

function showLogin(message) {
  stopTimer();
  state.me = null;
  document.getElementById("nav").hidden = true;
  document.getElementById("policy-pick").hidden = true;
  document.getElementById("logout").hidden = true;
  document.getElementById("who").textContent = "";
  document.getElementById("view").replaceChildren();
  document.getElementById("login").hidden = false;
  document.getElementById("login-error").textContent = message && state.key ? message : "";
  document.getElementById("login-key").focus();
}

async function identify() {
  state.me = await api("/v1/whoami", { login: true });
  document.getElementById("login").hidden = true;
  document.getElementById("nav").hidden = false;
  for (const link of document.querySelectorAll("#nav [data-admin]")) link.hidden = !state.me.admin;
  const who = state.me.keys_required ? `${state.me.admin ? "admin" : "agent key"} ${state.me.owner.slice(0, 8)}`
    : "no keys (loopback)";
  document.getElementById("who").textContent = who + (state.me.policy ? `, policy ${state.me.policy}` : "");
  document.getElementById("logout").hidden = !state.me.keys_required;
  await loadPolicies();
}

async function start() {
  state.key = readCookie();
  try {
    await identify();  // a gateway without keys answers without one: no login page
  } catch (error) {
    showLogin(error.message);
    return;
  }
  route();
}

document.getElementById("login-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  state.key = document.getElementById("login-key").value.trim();
  try {
    await identify();
  } catch (error) {
    document.getElementById("login-error").textContent = error.message;
    return;
  }
  writeCookie(state.key);
  document.getElementById("login-key").value = "";
  route();
});

document.getElementById("logout").addEventListener("click", () => {
  writeCookie(null);
  state.key = null;
  showLogin("");
});

// ---------- the policy selector ----------

// The policies a page can be narrowed to: every one for the admin (`GET /v1/policies`), only its own for a
// key bound to one, and `default` for any other agent key (the list of policies is the admin's to read).
async function loadPolicies() {
  if (state.me.policy) {
    state.policies = [state.me.policy];
  } else if (state.me.admin) {
    // Without the list the selector still offers every policy and `default`; a page shows the API's error.
    state.policies = await api("/v1/policies").then((l) => l.policies.map((p) => p.name), () => ["default"]);
  } else {
    state.policies = ["default"];
  }
}

// The policy the pages show: the one the hash names (`?policy=`), "" for every policy. A key bound to a
// policy always sees its own, whatever a link says: the API would answer nothing else.
function selectedPolicy(params) {
  return state.me.policy || params.get("policy") || "";
}

// The pages whose figures the selector narrows; a session is in one policy already, and capture quality is
// counted per model (a policy's name is its model name).
const POLICY_PAGES = new Set(["overview", "sessions", "policies"]);

function showPolicyPick(page, policy) {
  const pick = document.getElementById("policy-pick");
  const select = document.getElementById("policy");
  const bound = Boolean(state.me.policy);
  const names = [...state.policies];
  if (policy && !names.includes(policy)) names.push(policy);  // a link naming one this list lacks: the API judges it
  const options = (bound ? [] : [["", "all policies"]]).concat(names.map((name) => [name, name]));
  select.replaceChildren(...options.map(([value, text]) => el("option", { value, selected: value === policy }, text)));
  select.value = policy;
  select.disabled = bound;
  pick.classList.toggle("fixed", bound);
  pick.title = bound ? `This API key is bound to policy ${state.me.policy}: it sees that policy only.` : "";
  pick.hidden = !POLICY_PAGES.has(page);
}

document.getElementById("policy").addEventListener("change", (event) => {
  const [path, search] = location.hash.replace(/^#\/?/, "").split("?");
  const params = new URLSearchParams(search || "");
  params.delete("offset");  // another policy's list starts at its first page
  if (event.target.value) params.set("policy", event.target.value); else params.delete("policy");
  const text = params.toString();
  location.hash = `#/${path || (state.me.admin ? "overview" : "sessions")}${text ? `?${text}` : ""}`;
});

// ---------- routing and live refresh ----------

function stopTimer() {
  if (state.timer) clearInterval(state.timer);
  state.timer = null;
}

function live(refresh, seconds) {
  stopTimer();
  const tick = () => refresh().catch((error) => showError(error));
  tick();
  state.timer = setInterval(tick, seconds * 1000);
}

function showError(error) {
  const box = document.getElementById("view-error");
  if (box) box.textContent = error.message;
}

function route() {
  if (!state.me) return;
  const hash = location.hash.replace(/^#\/?/, "");
  const [path, search] = hash.split("?");
  const params = new URLSearchParams(search || "");
  const parts = path.split("/");
  const page = parts[0] || (state.me.admin ? "overview" : "sessions");
  const policy = selectedPolicy(params);
  const carried = state.me.policy ? "" : policy;  // the links keep the selection from page to page
  for (const link of document.querySelectorAll("#nav a")) {
    const target = link.dataset.page;
    link.setAttribute("href", carried ? `#/${target}?policy=${encodeURIComponent(carried)}` : `#/${target}`);
    link.classList.toggle("active", target === (page === "session" ? "sessions" : page));
  }
  showPolicyPick(page, policy);
  stopTimer();
  const view = document.getElementById("view");
  view.replaceChildren(el("p", { id: "view-error", class: "error", role: "alert" }));
  const pages = { overview: overviewPage, sessions: sessionsPage, session: sessionPage, policies: policiesPage,
                  capture: capturePage };
  const draw = pages[page] || sessionsPage;
  draw(view, page === "session" ? decodeURIComponent(parts.slice(1).join("/")) : params);
}

window.addEventListener("hashchange", route);

// ---------- overview ----------

function card(label, value, sub, id) {
  return el("div", { class: "card", id },
    el("div", { class: "label" }, label), el("div", { class: "value" }, value), el("div", { class: "sub" }, sub || ""));
}

function scopeTitle(title, policy) {
  return el("h1", {}, title, el("span", { class: "muted", id: "scope" }, policy ? ` · policy ${policy}`
    : " · all policies"));
}

function overviewPage(view, params) {
  const policy = selectedPolicy(params);
  state.lastOverview = null;  // rates only between readings taken while this page is open
  const cards = el("div", { class: "cards" });
  view.append(scopeTitle("Overview", policy), cards,
    el("p", { class: "muted" }, "Rates are measured between two readings of this gateway process's counters, " +
      "which count every policy's traffic. " + (policy ? `Sessions, versions and the trainer's counts are policy ${
        policy}'s.` : "Versions and the last publish are the default policy's; pick a policy for its own.")));
  live(async () => {
    const now = await api(`/v1/overview${query({ policy })}`);
    const before = state.lastOverview;
    state.lastOverview = now;
    const rate = (field) => {
      if (!before || now.time <= before.time) return "—";
      return ((field(now) - field(before)) / (now.time - before.time)).toFixed(2);
    };
    const c = now.counters;
    const trainer = now.trainer;
    const publish = now.last_publish;
    cards.replaceChildren(
      card("requests/s", rate((o) => o.counters.requests), `${c.requests} answered, ${c.failed_requests} failed`),
      card("tokens/s", rate((o) => o.counters.prompt_tokens + o.counters.completion_tokens),
        `${c.prompt_tokens} prompt, ${c.completion_tokens} sampled`),
      card("sessions open", fmt(now.sessions.open), policy ? `of policy ${policy}`
        : `${c.sessions_created} created by this process`, "sessions-open"),
      card("sessions finished", fmt(now.sessions.final), policy ? `of policy ${policy}` : "", "sessions-final"),
      card("rewards received", fmt(c.rewards), "reward events since start"),
      card("store queue depth", fmt(now.store_queue_depth)),
      card("serving policy", `v${now.served_version}`, policy ? `policy ${policy}` : ["default policy",
        ...Object.entries(now.served_versions).filter(([name]) => name !== "default")
          .map(([name, version]) => `${name} v${version}`)].join("; "), "serving"),
      card("trainer", trainer.state, `${trainer.ready} ready, ${trainer.leased} claimed` +
        (trainer.holders.length ? `; held by ${trainer.holders.join(", ")}` : "") +
        (trainer.last_step_at ? `; last step ${age(trainer.last_step_at)} ago` : ""), "trainer-state"),
      card("last publish", publish ? `v${publish.version}` : "—",
        !publish ? "no version trained yet" : publish.error ? `failed: ${publish.error}`
          : publish.published_at ? `took ${fmt(publish.seconds, 2)} s, ${age(publish.published_at)} ago`
            : "not published", "last-publish"),
    );
  }, 2);
}

// ---------- sessions ----------

const PAGE = 50;

function sessionsPage(view, params) {
  const policy = selectedPolicy(params);
  const value = (name) => params.get(name) || "";
  const field = (label, name, attrs = {}) =>
    el("label", {}, label, el("input", { name, value: value(name), ...attrs }));
  const choice = (label, name, options) => el("label", {}, label, el("select", { name },
    options.map(([v, text]) => el("option", { value: v, selected: value(name) === v }, text))));
  const form = el("form", { class: "filters", id: "filters" },
    choice("status", "status", [["", "any"], ["open", "open"], ["final", "finished"]]),
    field("reward ≥", "reward_min", { size: 6 }), field("reward ≤", "reward_max", { size: 6 }),
    field("group", "group", { size: 12 }), field("model", "model", { size: 12 }),
    field("text in messages", "q", { size: 18, type: "search" }),
    choice("excluded", "excluded", [["", "any"], ["true", "excluded"], ["false", "not excluded"]]),
    el("button", { type: "submit" }, "Apply"));
  const table = el("table", { id: "sessions" });
  const pager = el("div", { class: "pager" });
  view.append(scopeTitle("Sessions", policy), form, pager, table);

  const sort = params.get("sort") || "created";
  const order = params.get("order") || "desc";
  const offset = Number(params.get("offset") || 0);
  const go = (changes) => {
    const next = new URLSearchParams(params);
    for (const [k, v] of Object.entries(changes)) if (v === "" || v === null) next.delete(k); else next.set(k, v);
    location.hash = `#/sessions?${next}`;
  };

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const data = new FormData(form);
    for (const bound of ["reward_min", "reward_max"]) {
      const text = String(data.get(bound)).trim();
      if (text !== "" && parseReward(text) === null) {
        showError(new Error(`${bound.replace("_", " ")}: "${text}" is not a finite number.`));
        return;
      }
    }
    const changes = { offset: "" };
    for (const [k, v] of data.entries()) changes[k] = String(v).trim();
    go(changes);
  });

  const header = (label, key, cls) => {
    if (!key) return el("th", { class: cls }, label);
    const arrow = sort === key ? (order === "desc" ? " ▼" : " ▲") : "";
    return el("th", { class: `sortable ${cls || ""}`, "data-sort": key,
      onclick: () => go({ sort: key, order: sort === key && order === "desc" ? "asc" : "desc", offset: "" }) },
    label + arrow);
  };

  live(async () => {
    const filters = {};
    for (const name of ["status", "reward_min", "reward_max", "group", "model", "q", "excluded"]) {
      filters[name] = value(name);
    }
    const page = await api(`/v1/sessions${query({ ...filters, policy, sort, order, limit: PAGE, offset })}`);
    table.replaceChildren(
      el("thead", {}, el("tr", {}, header("session"), header("policy"), header("status"), header("reward", "reward", "num"),
        header("group"), header("calls", "calls", "num"), header("tokens", "tokens", "num"), header("versions"),
        header("training"), header("age", "created"), header("updated", "updated"))),
      el("tbody", {}, page.data.map((s) => el("tr", { "data-id": s.id },
        el("td", {}, el("a", { href: `#/session/${encodeURIComponent(s.id)}` }, s.id)),
        el("td", { class: "policy" }, s.policy),
        el("td", {}, s.status === "final" ? "finished" : "open"),
        el("td", { class: "num" }, fmt(s.reward), s.reward_override !== null ? el("span", { class: "badge warn",
          title: "overridden by an admin" }, " override") : ""),
        el("td", {}, s.group_id),
        el("td", { class: "num" }, s.calls), el("td", { class: "num" }, s.tokens),
        el("td", {}, s.policy_version_min === null ? "—" : s.policy_version_min === s.policy_version_max
          ? `v${s.policy_version_min}` : `v${s.policy_version_min}–v${s.policy_version_max}`),
        el("td", {}, s.purged ? el("span", { class: "badge bad" }, PURGED[s.purged] || s.purged)
          : noTrain(s) ? el("span", { class: "badge bad" }, "not for training")
            : s.excluded ? el("span", { class: "badge bad" }, "excluded")
              : s.trained_version !== null ? `trained in v${s.trained_version}`
                : s.skip_reason ? el("span", { class: "badge warn" }, `set aside: ${s.skip_reason}`) : ""),
        el("td", {}, age(s.created_at)), el("td", {}, age(s.updated_at)),
      ))),
    );
    const last = offset + page.data.length;
    pager.replaceChildren(
      el("button", { type: "button", disabled: offset === 0,
        onclick: () => go({ offset: Math.max(0, offset - PAGE) || "" }) }, "◀ previous"),
      el("span", { id: "page-info" }, page.total ? `${offset + 1}–${last} of ${page.total}` : "no sessions match"),
      el("button", { type: "button", disabled: !page.has_more, onclick: () => go({ offset: offset + PAGE }) },
        "next ▶"),
    );
  }, 5);
}

// ---------- one session ----------

function heat(logprob) {
  // Probability of the sampled token: green when the policy was sure, red when it was a long shot.
  const p = Math.exp(logprob);
  return `hsla(${Math.round(120 * p)}, 75%, 55%, 0.35)`;
}

function tokensView(segment) {
  const box = el("div", { class: "tokens" });
  let version = null;
  const texts = segment.token_texts || segment.token_ids.map((id) => `[${id}]`);
  for (let i = 0; i < segment.token_ids.length; i += 1) {
    const sampled = segment.loss_mask[i] === 1;
    if (sampled && segment.policy_versions[i] !== version) {
      version = segment.policy_versions[i];
      box.append(el("span", { class: "ver", title: `sampled by policy version ${version}` }, `v${version}`));
    }
    const title = sampled
      ? `sampled · logprob ${segment.logprobs[i].toFixed(3)} · p ${Math.exp(segment.logprobs[i]).toFixed(3)} · ` +
        `v${segment.policy_versions[i]} · id ${segment.token_ids[i]}`
      : `prompt · id ${segment.token_ids[i]}`;
    const token = el("span", { class: `tok ${sampled ? "sampled" : "prompt"}`, title }, texts[i]);
    if (sampled) token.style.background = heat(segment.logprobs[i]);
    box.append(token);
  }
  return box;
}

function versionSpans(segment) {
  const spans = [];
  segment.policy_versions.forEach((v, i) => {
    if (segment.loss_mask[i] !== 1) return;
    const last = spans[spans.length - 1];
    if (last && last.version === v) last.count += 1; else spans.push({ version: v, count: 1 });
  });
  return spans.map((s) => `v${s.version} × ${s.count}`).join(" → ") || "no sampled tokens";
}

// One item of a call's conversation, labelled by what it is: a tool result comes back to the model as
// prompt tokens, so in the token view it is not told apart from the rest of the prompt; here it is.
function conversationItem(item, reply) {
  const text = item.truncated ? `${item.text}…` : item.text;
  const tool = [item.name, item.tool_call_id ? `(${item.tool_call_id})` : ""].filter(Boolean).join(" ");
  if (item.type === "tool_call") {
    return el("div", { class: "item tool-call", "data-item": "tool_call" },
      el("span", { class: "label" }, reply ? "tool call" : "tool call (sent)"), " ",
      el("code", {}, `${item.name || "?"}(${text})`),
      item.tool_call_id ? el("span", { class: "muted" }, ` ${item.tool_call_id}`) : "");
  }
  if (item.type === "tool_result") {
    return el("div", { class: "item tool-result", "data-item": "tool_result" },
      el("span", { class: "label" }, "tool result"), " ", el("span", { class: "muted" }, tool || "—"),
      el("pre", {}, text));
  }
  const label = reply ? "reply" : item.role || "message";
  return el("div", { class: `item message ${reply ? "reply" : ""}`, "data-item": reply ? "reply" : item.role },
    el("span", { class: "label" }, label), " ", text ? el("span", { class: "text" }, text) : el("span",
      { class: "muted" }, "(empty)"));
}

function callTree(calls) {
  const children = new Map();
  for (const call of calls) {
    const parent = call.parent_id || "";
    if (!children.has(parent)) children.set(parent, []);
    children.get(parent).push(call);
  }
  const known = new Set(calls.map((c) => c.id));
  const item = (call) => {
    const reason = ["extend", "branch"].includes(call.link) ? call.link : `new segment: ${call.link}`;
    return el("li", { "data-call": call.id },
      el("strong", {}, `#${call.seq}${call.choice_index ? `.${call.choice_index}` : ""} `),
      el("span", { class: `badge ${call.link === "extend" ? "" : "warn"}` }, reason), " ",
      el("span", { class: "muted" }, `v${call.policy_version} · ${call.prompt_tokens} prompt / ` +
        `${call.completion_tokens} sampled · ${call.finish_reason || "?"} · ${Math.round(call.latency_ms)} ms`),
      // What the request added (tool results, user turns), then what the model replied (text, tool calls).
      el("div", { class: "items added" }, (call.added_items || []).map((i) => conversationItem(i, false))),
      el("div", { class: "items reply" }, (call.reply_items || []).map((i) => conversationItem(i, true))),
      (children.get(call.id) || []).length ? el("ul", {}, children.get(call.id).map(item)) : "");
  };
  const roots = calls.filter((c) => !c.parent_id || !known.has(c.parent_id));
  return el("ul", { class: "tree", id: "call-tree" }, roots.map(item));
}

// Why a session is never trained on (its skip_reason), and why its content is gone (its `purged`).
const NO_TRAIN = { no_train_key: "its key's setting", no_train_header: "its request (X-Train: no)",
  no_train_admin: "an admin" };
const PURGED = { retention: "content purged", deleted: "content deleted" };

function noTrain(session) {
  return Object.hasOwn(NO_TRAIN, session.skip_reason || "");
}

function trainingState(session) {
  if (noTrain(session)) return `not for training (${NO_TRAIN[session.skip_reason]})`;
  if (session.purged) return `never (${PURGED[session.purged] || session.purged})`;
  if (session.excluded) return "excluded";
  if (session.trained_version !== null) return `trained in v${session.trained_version}`;
  return session.skip_reason ? `set aside: ${session.skip_reason}` : "not yet";
}

function change(old, now) {
  return Object.keys(now).map((k) => `${k.replace("_", " ")} ${fmt(old[k])} → ${fmt(now[k])}`).join(", ");
}

function timeline(rewards, actions) {
  const events = [
    ...rewards.map((r) => ({ at: r.created_at, node: el("li", { class: "reward" },
      el("strong", {}, `reward ${fmt(r.value)}`), r.final ? " (final)" : "",
      r.call_id ? ` on call ${r.call_id}` : "", r.components ? ` ${counts(r.components)}` : "",
      el("span", { class: "muted" }, ` · ${when(r.created_at)}`)) })),
    ...actions.map((a) => ({ at: a.created_at, node: el("li", { class: "action" },
      el("strong", {}, a.action.replace("_", " ")), `: ${change(a.old_value, a.new_value)}`,
      a.note ? ` — “${a.note}”` : "",
      el("span", { class: "muted" }, ` · by ${a.actor ? a.actor.slice(0, 8) : "anonymous"} · ${when(a.created_at)}`)) })),
  ].sort((x, y) => Date.parse(x.at) - Date.parse(y.at));
  return events.length ? el("ol", { class: "timeline", id: "timeline" }, events.map((e) => e.node))
    : el("p", { class: "muted", id: "timeline" }, "No rewards yet.");
}

function actionsPanel(session, reload, notice) {
  const message = el("p", { id: "action-error", class: "error", role: "alert" });
  const done = el("p", { id: "action-ok", class: "ok" }, notice || "");
  const reward = el("input", { id: "override-reward", inputmode: "decimal", size: 8, placeholder: "e.g. 0.5" });
  const note = el("input", { id: "action-note", size: 40, maxlength: 4000, placeholder: "why" });
  const run = async (path, body, method = "POST") => {
    message.textContent = "";
    done.textContent = "";
    try {
      await api(`/v1/sessions/${encodeURIComponent(session.id)}/${path}`, { method, body });
    } catch (error) {
      message.textContent = error.message;
      return;
    }
    await reload(method === "DELETE" ? `Cleared: ${path.replace("_", " ")}.` : `Saved: ${path.replace("_", " ")}.`);
  };
  const override = (event) => {
    event.preventDefault();
    const value = parseReward(reward.value);
    if (value === null) {
      message.textContent = `The reward must be a finite number, not "${reward.value}".`;
      done.textContent = "";
      return;
    }
    run("reward_override", { reward: value, note: note.value });
  };
  // A session not for training can be neither included again nor marked twice.
  const toggle = noTrain(session) ? "" : session.excluded
    ? el("button", { type: "button", id: "include", onclick: () => run("include", { note: note.value }) },
      "Include in training")
    : el("button", { type: "button", id: "exclude", onclick: () => run("exclude", { note: note.value }) },
      "Exclude from training");
  const never = noTrain(session) ? "" : el("button", { type: "button", id: "no-train", class: "danger",
    title: "For good: no one can include it again (a user withdrew consent)",
    onclick: () => window.confirm("Never train on this session or export it? No one can undo this.")
      && run("no_train", { note: note.value }) }, "Never train on it");
  // Only with an override to clear: the trainer then uses the posted rewards again.
  const clear = session.reward_override === null ? "" : el("button", { type: "button", id: "clear-override",
    onclick: () => run("reward_override", { note: note.value }, "DELETE") }, "Clear override");
  return el("div", { class: "panel", id: "actions" }, el("h2", {}, "Actions"),
    el("form", { class: "actions", onsubmit: override },
      el("label", {}, "reward", reward), el("label", {}, "note", note),
      el("button", { type: "submit", id: "override" }, "Override reward"), clear, toggle, never),
    message, done);
}

function sessionPage(view, id) {
  const body = el("div", {});
  view.append(el("p", {}, el("a", { href: "#/sessions" }, "← sessions")), el("h1", {}, `Session ${id}`), body);
  const base = `/v1/sessions/${encodeURIComponent(id)}`;
  const load = async (notice) => {
    const [session, trajectory, actions] = await Promise.all([
      api(base), api(`${base}/trajectory?text=true`),
      state.me.admin ? api(`${base}/actions`).then((a) => a.data) : Promise.resolve([]),
    ]);
    const facts = [
      ["status", session.status === "final" ? "finished" : "open"],
      ["reward (for training)", fmt(session.reward)],
      ["posted rewards, summed", fmt(session.reward_total)],
      ["override", session.reward_override === null ? "—" : fmt(session.reward_override)],
      ["training", trainingState(session)],
      ["content", session.purged ? `${PURGED[session.purged] || session.purged} ${when(session.purged_at)}` : "kept"],
      ["policy", session.policy], ["group", session.group_id], ["model", session.model || "—"], ["calls", session.calls.length],
      ["tokens", session.tokens], ["created", when(session.created_at)], ["updated", when(session.updated_at)],
    ];
    const segments = trajectory.trajectories.map((t, ti) => el("div", { class: "panel" },
      el("h2", {}, `Trajectory ${ti + 1} (to call ${t.leaf_call_id})`),
      t.segments.map((s, si) => el("div", { class: "segment" },
        el("p", {}, el("strong", {}, `Segment ${si + 1}`), " started by ",
          el("span", { class: "badge warn" }, s.reason), el("span", { class: "muted" },
            ` · ${s.token_ids.length} tokens, ${s.loss_mask.filter((m) => m === 1).length} sampled · ` +
            `versions: ${versionSpans(s)}`)),
        tokensView(s))),
    ));
    body.replaceChildren(
      el("div", { class: "panel" }, el("dl", { class: "kv", id: "facts" },
        facts.map(([k, v]) => [el("dt", {}, k), el("dd", { "data-fact": k }, v)]))),
      state.me.admin ? actionsPanel(session, load, notice) : "",
      el("div", { class: "panel" }, el("h2", {}, "Rewards and corrections"), timeline(session.rewards, actions)),
      el("div", { class: "panel" }, el("h2", {}, "Calls"), callTree(session.calls)),
      el("p", { class: "legend" }, "Sampled tokens are outlined and coloured by the policy's probability: ",
        el("span", { class: "swatch", style: `background:${heat(Math.log(0.02))}` }), "unlikely",
        el("span", { class: "swatch", style: `background:${heat(0)}` }), "certain",
        "; prompt tokens are grey; ", el("span", { class: "ver" }, "vN"), " marks the policy version that sampled."),
      ...segments,
    );
  };
  load().catch(showError);
}

// ---------- policies ----------

const SERIES_COLOURS = ["#2f6fde", "#e67e22", "#16a085", "#8e44ad", "#c0392b", "#7f8c8d", "#d4ac0d"];

// One series per policy (`lines`: name → its trained versions). Each policy numbers its own versions, so
// the series share the x axis only where their numbers (or times) meet; between its points a series spans
// the others' x values.
function chart(target, title, lines, x, timeAxis) {
  target.replaceChildren();
  const names = [...lines.keys()];
  if (names.length === 0) {
    target.append(el("p", { class: "muted" }, `${title}: no trained versions yet.`));
    return;
  }
  const xs = [...new Set(names.flatMap((name) => lines.get(name).map(x)))].sort((a, b) => a - b);
  const ys = names.map((name) => {
    const at = new Map(lines.get(name).map((p) => [x(p), p.metrics.reward_mean]));
    return xs.map((v) => (at.has(v) ? at.get(v) : null));
  });
  const width = Math.min(620, Math.max(320, (target.parentElement.clientWidth || 1200) / 2 - 40));
  // eslint-disable-next-line no-undef
  new uPlot({
    title, width, height: 260,
    scales: { x: { time: timeAxis } },
    axes: [timeAxis ? { label: "time" } : { label: "policy version", incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500] },
      { label: "reward mean" }],
    series: [{ label: timeAxis ? "time" : "version" }, ...names.map((name, i) => ({ label: name, spanGaps: true,
      stroke: SERIES_COLOURS[i % SERIES_COLOURS.length], width: 2, points: { show: true, size: 6 } }))],
  }, [xs, ...ys], target);
}

// Where a version's step went, in order (trainer/loop.py `step_times`), then until its first call served.
const STEP_PARTS = [["wait_data", "wait"], ["claim", "claim"], ["forward_backward", "fwd/bwd"],
  ["optimizer", "opt"], ["step", "step"], ["checkpoint", "ckpt"], ["publish", "publish"]];

function stepTime(p) {
  const times = p.metrics.time_s || {};
  const parts = STEP_PARTS.filter(([key]) => times[key] !== undefined)
    .map(([key, label]) => `${label} ${fmt(times[key], 2)}`);
  if (p.first_call_at && p.published_at) {
    const seconds = (Date.parse(p.first_call_at) - Date.parse(p.published_at)) / 1000;
    parts.push(`first call ${fmt(Math.max(0, seconds), 2)}`);
  }
  return parts.length ? parts.join(" · ") : "—";
}

// The publish probe on each replica (engines/probe.py): did every replica serve the trainer's weights?
function probeBadge(probes) {
  const results = Object.entries(probes || {});
  if (!results.length) return "—";
  const failed = results.filter(([, r]) => !r.ok);
  const detail = results.map(([url, r]) => `${url}: mean |diff| ${fmt(r.mean_diff, 5)}`).join("\n");
  return el("span", { class: failed.length ? "badge bad" : "badge", title: detail },
    failed.length ? `${failed.length}/${results.length} failed` : `${results.length} ok`);
}

// A version's promotion under canary promotion: a canary on trial shows its test's figures so far.
function promotionBadge(p, canaries) {
  if (!p.promotion) return "—";
  const trial = canaries[p.line];
  const test = p.promotion === "canary" && trial && trial.version === p.version ? trial.test : null;
  const title = test ? `canary ${test.canary_n} sessions (mean ${fmt(test.canary_mean)}), incumbent ` +
    `${test.incumbent_n} (mean ${fmt(test.incumbent_mean)})` : (p.decision && p.decision.reason) || "";
  const cls = p.promotion === "rolled_back" ? "badge bad" : p.promotion === "canary" ? "badge" : "";
  return el("span", { class: cls, title }, p.promotion.replace("_", " "));
}

function policiesPage(view, params) {
  const policy = selectedPolicy(params);
  const summary = el("p", { id: "policy-sessions" });
  const hints = el("div", { id: "policy-hints" });
  const byVersion = el("div", { class: "chart", id: "chart-version" });
  const byTime = el("div", { class: "chart", id: "chart-time" });
  const table = el("table", { id: "policies" });
  view.append(scopeTitle("Policies", policy), summary, hints, el("div", { class: "charts" }, byVersion, byTime),
    el("h2", {}, "Versions"), table);
  let drawn = -1;
  live(async () => {
    const listed = await api(`/v1/policies${query({ policy })}`);
    const names = listed.policies.map((p) => p.name);
    if (!policy && names.join() !== state.policies.join()) {  // one created since login: offer it too
      state.policies = names;
      showPolicyPick("policies", policy);
    }
    const s = listed.sessions;
    const serving = Object.entries(listed.served_versions).map(([name, version]) => `${name} v${version}`);
    const canaries = listed.promotion.canaries || {};
    const trials = Object.entries(canaries).map(([name, c]) => `${name} v${c.version}`);
    summary.textContent = `Serving ${serving.join(", ")}. ` +
      (trials.length ? `Canary on trial: ${trials.join(", ")}. ` : "") +
      `Sessions ready for the trainer: ${s.ready}; claimed by a step: ${s.leased}; set aside: ${counts(s.set_aside)}.`;
    hints.replaceChildren(...(listed.hints || []).map((text) => el("p", { class: "hint" }, text)));
    const trained = listed.data.filter((p) => p.version > 0 && p.metrics.reward_mean !== undefined);
    if (trained.length !== drawn) {  // redraw only when a version appeared
      drawn = trained.length;
      const lines = new Map();
      for (const p of trained) lines.set(p.line, [...(lines.get(p.line) || []), p]);
      chart(byVersion, "Reward against policy version", lines, (p) => p.version, false);
      chart(byTime, "Reward against time", lines, (p) => Date.parse(p.created_at) / 1000, true);
    }
    const m = (p, name, digits) => el("td", { class: "num" }, fmt(p.metrics[name], digits));
    table.replaceChildren(
      el("thead", {}, el("tr", {}, ["policy", "version", "created", "kind", "reward mean", "advantage spread", "loss", "KL",
        "entropy", "clip fraction", "samples", "set aside", "staleness", "step time (s)", "probe", "published",
        "promotion"]
        .map((h) => el("th", {}, h)))),
      el("tbody", {}, [...listed.data].reverse().map((p) => el("tr", { "data-version": p.version, "data-line": p.line },
        el("td", {}, p.line), el("td", {}, `v${p.version}`), el("td", {}, when(p.created_at)), el("td", {}, p.kind),
        m(p, "reward_mean"), m(p, "advantage_std"), m(p, "loss", 4), m(p, "kl", 4), m(p, "entropy"),
        m(p, "clip_fraction"),
        el("td", { class: "num samples" }, fmt(p.metrics.samples) +
          (p.metrics.replayed ? ` + ${p.metrics.replayed} replayed` : "")),
        el("td", {}, counts(p.metrics.set_aside)), el("td", {}, counts(p.metrics.staleness)),
        el("td", { class: "step-time" }, stepTime(p)), el("td", {}, probeBadge(p.probes)),
        el("td", {}, p.publish_error ? el("span", { class: "badge bad", title: p.publish_error }, "failed")
          : p.published_at ? when(p.published_at) : "—"),
        el("td", { class: "promotion" }, promotionBadge(p, canaries)),
      ))),
    );
  }, 5);
}

// ---------- capture quality ----------

function capturePage(view) {
  const table = el("table", { id: "capture" });
  view.append(el("h1", {}, "Capture quality"),
    el("p", { class: "muted" }, "Calls that extended their session's token chain exactly, why new segments " +
      "began, and finished sessions the trainer left unconsumed, per model and API key."), table);
  live(async () => {
    const stats = await api("/v1/stats/capture");
    const row = (r, label) => el("tr", {},
      el("td", {}, label || r.model || "—"), el("td", {}, label ? "" : r.owner ? r.owner.slice(0, 8) : "no key"),
      el("td", { class: "num" }, r.calls), el("td", { class: "num" }, r.chained),
      el("td", { class: "num" }, r.chained_share === null ? "—" : `${(100 * r.chained_share).toFixed(1)} %`),
      el("td", {}, counts(r.segment_starts)), el("td", {}, counts(r.set_aside)));
    table.replaceChildren(
      el("thead", {}, el("tr", {}, ["model", "key", "calls", "chained", "chained share", "segment starts",
        "set aside"].map((h) => el("th", {}, h)))),
      el("tbody", {}, stats.data.map((r) => row(r)), row(stats.total, "all")),
    );
  }, 5);
}

start();
