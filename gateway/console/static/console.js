// The omnigate console: every value on these pages comes from the admin API under /admin, fetched
// with the session cookie; each change sends the page's CSRF token. Text is set with textContent
// only (tenant names, notes and audit content are data, never markup).
"use strict";

const ADMIN = "/admin";
const CSRF = document.querySelector('meta[name="csrf-token"]').content;
const $ = (id) => document.getElementById(id);

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function row(cells) {
  const tr = el("tr");
  for (const c of cells) {
    const td = el("td");
    if (c instanceof Node) td.appendChild(c); else td.textContent = c === null || c === undefined ? "" : String(c);
    tr.appendChild(td);
  }
  return tr;
}

function fill(tableId, rows) {
  const body = $(tableId).querySelector("tbody");
  body.replaceChildren(...rows);
}

function status(message, bad) {
  const s = $("status");
  s.textContent = message || "";
  s.className = bad ? "status error" : "status";
}

async function api(method, path, body) {
  const opts = { method, credentials: "same-origin", headers: { "accept": "application/json" } };
  if (method !== "GET") opts.headers["x-csrf-token"] = CSRF;
  if (body !== undefined) {
    opts.headers["content-type"] = "application/json";
    opts.body = JSON.stringify(body);
  }
  const r = await fetch(ADMIN + path, opts);
  if (r.status === 401) { window.location.href = "login"; throw new Error("signed out"); }
  let data = null;
  try { data = await r.json(); } catch (e) { data = null; }
  return { status: r.status, ok: r.ok, data };
}

function errorText(res) {
  const e = res.data && res.data.error;
  return e ? `${res.status}: ${e.message}` : `HTTP ${res.status}`;
}

function time(ts) {
  if (typeof ts === "number") return new Date(ts * 1000).toISOString().replace("T", " ").slice(0, 19);
  return ts ? String(ts).replace("T", " ").slice(0, 19) : "";
}

// The in-page confirmation step before any change to routing, keys or config.
function confirmThen(text, action) {
  $("confirm-text").textContent = text;
  $("confirm").hidden = false;
  const done = () => { $("confirm").hidden = true; $("confirm-yes").onclick = null; };
  $("confirm-no").onclick = done;
  $("confirm-yes").onclick = async () => { done(); await action(); };
}

function result(id, message, bad) {
  const r = $(id);
  r.textContent = message;
  r.className = bad ? "result error" : "result ok";
}

function routingRows(st) {
  const rows = [];
  for (const model of Object.keys(st.weights).sort()) {
    for (const [engine, weight] of Object.entries(st.weights[model])) {
      const limit = st.limits && st.limits[engine];
      rows.push(row([model, engine, weight.toFixed(2), st.pins[model] || "", limit === undefined ? "" : limit]));
    }
  }
  return rows;
}

// -- Overview -------------------------------------------------------------------------------------
async function overview() {
  const [routing, engines, traffic] = await Promise.all(
    [api("GET", "/routing"), api("GET", "/engines"), api("GET", "/traffic")]);
  if (!routing.ok || !engines.ok) { status(errorText(routing.ok ? engines : routing), true); return; }
  status("");
  const st = routing.data;
  const kinds = Object.fromEntries(engines.data.engines.map((e) => [e.name, e.kind]));
  $("replica").textContent = st.replica;
  $("leader").textContent = st.leader || "none";
  $("version").textContent = st.version;
  $("frozen").textContent = st.frozen ? "frozen" : (st.enabled ? "running" : "disabled");
  fill("engines", st.engines.map((e) => {
    const tr = row([e.name, kinds[e.name], e.variant, e.role, e.serves.join(", "),
      e.healthy ? "healthy" : "unhealthy", e.circuit, e.state,
      `${e.in_flight} / ${e.cap === null ? "∞" : e.cap}`, e.waiting, e.weight.toFixed(2)]);
    tr.dataset.engine = e.name;
    tr.className = e.healthy ? "" : "bad";
    return tr;
  }));
  fill("routing", routingRows(st));
  const t = traffic.data || {};
  const kv = !traffic.ok ? [["Admission", errorText(traffic)]] : t.enabled ? [
    ["In flight", t.in_flight === null ? `unknown (${t.store_error})` : t.in_flight],
    ["Soft limit / hard limit", `${t.soft_limit} / ${t.hard_limit}`],
    ["Overloaded", t.overloaded ? "yes" : "no"],
    ["Slot store", t.store],
    ["Shed (this replica)", Object.entries(t.shed).map(([k, v]) => `${k} ${v}`).join(", ")],
    ["Classes", t.priorities.map((p) => `${p.name} ${p.soft}/${p.hard}`).join(", ")],
  ] : [["Admission", "off (traffic.enabled: false)"]];
  fill("admission", kv.map(([k, v]) => { const r = row([k, v]); r.firstChild.className = "key"; return r; }));
  $("updated").textContent = new Date().toISOString().slice(11, 19) + " UTC";
}

// -- Rollback -------------------------------------------------------------------------------------
let transitionsCursor = null;

function signalOf(t) {
  const d = t.detail || {};
  if (d.signal === undefined) return "";
  const bound = d.above !== undefined ? ` > ${d.above}` : (d.recover_below !== undefined ? ` < ${d.recover_below}` : "");
  return `${d.signal} = ${typeof d.value === "number" ? d.value.toFixed(3) : d.value}${bound}`;
}

async function transitions(more) {
  const q = more && transitionsCursor ? `?before_seq=${transitionsCursor}` : "";
  const res = await api("GET", "/routing/transitions" + q);
  if (!res.ok) { status(errorText(res), true); return; }
  const rows = res.data.transitions.map((t) => {
    const d = t.detail || {};
    return row([time(t.at), t.source, t.action, t.reason, t.engine || "", (t.models || []).join(", "),
      signalOf(t), t.took_s === undefined ? "" : `${t.took_s} s`, [d.actor, d.note].filter(Boolean).join(": ")]);
  });
  const body = $("transitions").querySelector("tbody");
  if (more) body.append(...rows); else body.replaceChildren(...rows);
  transitionsCursor = res.data.next_before_seq;
  $("more-transitions").hidden = !transitionsCursor;
  $("history-source").textContent = res.data.source === "audit" ? "(from the audit trail, all replicas)"
    : "(this replica's recent ones; audit is off)";
}

let variantsByModel = {};

async function rollbackState() {
  const res = await api("GET", "/routing");
  if (!res.ok) { status(errorText(res), true); return; }
  const st = res.data;
  $("controller-state").textContent = st.frozen ? "frozen" : (st.enabled ? "running" : "disabled");
  const pins = Object.entries(st.pins);
  $("pins").textContent = pins.length ? pins.map(([m, v]) => `${m} → ${v}`).join(", ") : "none";
  fill("routing", routingRows(st));
  fill("incidents", Object.entries(st.incidents).map(([key, inc]) => {
    const clear = el("button", "Clear", "danger");
    clear.type = "button";
    clear.dataset.incident = key;
    clear.onclick = () => confirmThen(`Clear ${key}? Its rule's change to routing is undone now.`,
      () => routingAction("/routing/clear", { incident: key, note: $("pin-note").value || undefined }, `clear ${key}`));
    const tr = row([key, inc.rule, inc.engine, inc.action, time(inc.since),
      typeof inc.value === "number" ? inc.value.toFixed(3) : inc.value, clear]);
    tr.dataset.incident = key;
    return tr;
  }));
  const holds = Object.entries(st.holds || {});
  $("holds").textContent = holds.length ? "Held: " + holds.map(([k, why]) => `${k} (${why})`).join(", ") : "";
  const byModel = {};
  for (const e of st.engines) for (const m of e.serves) (byModel[m] = byModel[m] || new Set()).add(e.variant);
  if (Object.keys(variantsByModel).length === 0) {
    variantsByModel = byModel;
    $("pin-model").replaceChildren(...Object.keys(byModel).sort().map((m) => el("option", m)));
    pinVariants();
  }
}

function pinVariants() {
  const vs = variantsByModel[$("pin-model").value] || new Set();
  $("pin-variant").replaceChildren(...[...vs].sort().map((v) => el("option", v)));
}

async function routingAction(path, body, what) {
  // No actor in the body: the gateway records the credential that made the call (the console session).
  const res = await api("POST", path, body);
  if (!res.ok) { result("action-result", errorText(res), true); return; }
  result("action-result", res.data.changed ? `${what}: done (routing version ${res.data.version})`
    : `${what}: nothing to change`);
  await rollbackState();
  await transitions(false);
}

function rollback() {
  $("pin-model").onchange = pinVariants;
  $("pin-form").onsubmit = (ev) => {
    ev.preventDefault();
    const model = $("pin-model").value, variant = $("pin-variant").value, note = $("pin-note").value || undefined;
    confirmThen(`Pin ${model} to ${variant}? Traffic moves at once on every replica.`,
      () => routingAction("/routing/pin", { model, variant, note }, `pin ${model} to ${variant}`));
  };
  $("unpin").onclick = () => {
    const model = $("pin-model").value, note = $("pin-note").value || undefined;
    confirmThen(`Unpin ${model}?`, () => routingAction("/routing/unpin", { model, note }, `unpin ${model}`));
  };
  $("freeze").onclick = () => confirmThen("Freeze the rollback controller? It stops moving traffic until resumed.",
    () => routingAction("/routing/freeze", { note: $("pin-note").value || undefined }, "freeze"));
  $("resume").onclick = () => confirmThen("Resume the rollback controller?",
    () => routingAction("/routing/resume", { note: $("pin-note").value || undefined }, "resume"));
  $("more-transitions").onclick = () => transitions(true);
  rollbackState();
  transitions(false);
  setInterval(() => { rollbackState(); }, 2000);
}

// -- Tenants and keys -----------------------------------------------------------------------------
async function tenantsPage() {
  const [tenants, keys, config] = await Promise.all([api("GET", "/tenants"), api("GET", "/keys"), api("GET", "/config")]);
  if (!tenants.ok || !keys.ok) { status(errorText(tenants.ok ? keys : tenants), true); return; }
  fill("tenants", tenants.data.tenants.map((t) => row([t.name, t.source, t.enabled ? "yes" : "no", t.priority,
    t.policy_set || "(policies)", t.models ? t.models.join(", ") : "all", t.requests_per_minute || "",
    t.tokens_per_minute || "", t.max_concurrency || "", t.audit_content, t.keys.length])));
  fill("keys", keys.data.keys.map((k) => {
    let action = "";
    if (k.enabled && k.source === "admin") {
      action = el("button", "Revoke", "danger");
      action.type = "button";
      action.dataset.key = k.id;
      action.onclick = () => confirmThen(`Revoke key ${k.id} of ${k.tenant}? Requests with it are refused at once.`,
        async () => {
          const res = await api("DELETE", `/keys/${encodeURIComponent(k.id)}`);
          result("action-result", res.ok ? `key ${k.id} revoked` : errorText(res), !res.ok);
          await tenantsPage();
        });
    }
    const tr = row([k.id, k.tenant, k.enabled ? "yes" : "revoked", k.source, time(k.created_at), action]);
    tr.dataset.key = k.id;
    return tr;
  }));
  const names = tenants.data.tenants.map((t) => t.name);
  const keep = $("key-tenant").value;
  $("key-tenant").replaceChildren(...names.map((n) => el("option", n)));
  if (names.includes(keep)) $("key-tenant").value = keep;
  if (config.ok && $("tenant-set").options.length === 0) {
    $("tenant-set").replaceChildren(el("option", "(policies)"),
      ...Object.keys(config.data.policy_sets).map((n) => el("option", n)));
    $("tenant-set").options[0].value = "";
  }
}

let defaultPriority = "standard";

function tenants() {
  api("GET", "/traffic").then((t) => {
    const classes = t.ok && t.data.enabled ? t.data.priorities.map((p) => p.name) : ["standard"];
    $("tenant-priority").replaceChildren(...classes.map((c) => el("option", c)));
    defaultPriority = classes.includes("standard") ? "standard" : classes[0];
    $("tenant-priority").value = defaultPriority;
  });
  $("tenant-form").onsubmit = async (ev) => {
    ev.preventDefault();
    const body = { name: $("tenant-name").value, priority: $("tenant-priority").value };
    if ($("tenant-set").value) body.policy_set = $("tenant-set").value;
    if ($("tenant-rpm").value) body.requests_per_minute = Number($("tenant-rpm").value);
    if ($("tenant-concurrency").value) body.max_concurrency = Number($("tenant-concurrency").value);
    body.audit_content = $("tenant-audit").value;
    const res = await api("POST", "/tenants", body);
    result("action-result", res.ok ? `tenant ${body.name} created` : errorText(res), !res.ok);
    if (res.ok) {
      $("tenant-form").reset();
      $("tenant-priority").value = defaultPriority;
    }
    await tenantsPage();
  };
  $("key-form").onsubmit = async (ev) => {
    ev.preventDefault();
    const res = await api("POST", "/keys", { tenant: $("key-tenant").value });
    if (!res.ok) { result("action-result", errorText(res), true); return; }
    $("new-key-value").textContent = res.data.key;
    $("new-key").hidden = false;
    result("action-result", `key ${res.data.id} created for ${res.data.tenant}`);
    await tenantsPage();
  };
  tenantsPage();
}

// -- Audit ----------------------------------------------------------------------------------------
let recordsCursor = null;
const FILTERS = ["since", "until", "request_id", "client_request_id", "tenant", "kind", "outcome", "engine", "policy", "verdict", "degraded", "unscanned"];

function filterQuery() {
  const q = new URLSearchParams();
  for (const f of FILTERS) {
    const v = $("f-" + f).value.trim();
    if (v) q.set(f, v);
  }
  return q;
}

async function search(more) {
  const q = filterQuery();
  $("export").href = ADMIN + "/audit/export" + (q.toString() ? "?" + q : "");
  if (more && recordsCursor) q.set("before_seq", recordsCursor);
  const res = await api("GET", "/audit/records?" + q);
  if (!res.ok) { status(errorText(res), true); return; }
  status(res.data.records.length ? "" : "No record matches.");
  const rows = res.data.records.map((r) => {
    const link = el("a", r.seq);
    link.href = "#record-" + r.seq;
    link.onclick = (ev) => { ev.preventDefault(); detail(r.seq); };
    const tr = row([link, time(r.ts), r.kind + (r.action ? ` (${r.action})` : ""), r.request_id || "", r.tenant || "",
      r.public_model || "", r.engine || "", r.outcome || "", r.status || "", (r.policies || []).join(", "),
      (r.degraded || []).join(", ")]);
    tr.dataset.seq = r.seq;
    return tr;
  });
  const body = $("records").querySelector("tbody");
  if (more) body.append(...rows); else body.replaceChildren(...rows);
  recordsCursor = res.data.next_before_seq;
  $("more-records").hidden = !recordsCursor;
}

// A guard's receipt in words: what it looked at, what it could not, and what followed.
function receipt(x) {
  const saw = x.saw;
  if (!saw) return "";
  const said = [];
  if (!saw.text && !(saw.parts || []).length && !(saw.missed || []).length) said.push("nothing to scan");
  if (saw.text) said.push(`text of messages ${saw.text.messages.join(", ")} (${saw.text.chars} chars)`);
  for (const part of saw.parts || []) {
    const what = part.kind === "image" ? `${part.width}x${part.height} px`
      : part.kind === "video" ? `${part.frames} of ${part.of} frames`
      : part.kind === "audio" ? `${part.ms} ms in ${part.segments} segments`
      : part.kind === "text" ? `${part.claims} claims` : "";
    said.push(`${part.kind} ${part.part}: ${what}`);
  }
  for (const miss of saw.missed || []) said.push(`NOT SCANNED ${miss.part}: ${miss.why}`);
  if (saw.model) said.push(`model ${saw.model}${saw.model_digest ? " " + saw.model_digest.slice(0, 12) : ""}`);
  if (saw.threshold !== undefined) said.push(`threshold ${saw.threshold}`);
  if (saw.on_error) said.push(`on_error ${saw.on_error}`);
  return said.join("; ");
}

async function detail(seq) {
  const res = await api("GET", `/audit/records/${seq}`);
  if (!res.ok) { status(errorText(res), true); return; }
  const r = res.data, p = r.data.payload || {};
  $("detail").hidden = false;
  $("detail-seq").textContent = r.seq;
  const head = [["Time", r.ts], ["Kind", r.kind], ["Request id", r.request_id], ["Tenant", r.tenant],
    ["Key id", p.key_id], ["Model", p.public_model], ["Engine", p.engine && `${p.engine} (${p.variant})`],
    ["Outcome", p.outcome && `${p.outcome} (${p.status}${p.error_code ? ", " + p.error_code : ""})`],
    ["Duration", p.duration_ms !== undefined ? `${p.duration_ms} ms` : undefined],
    ["Degraded", (p.degraded || []).join(", ")], ["Previous hash", r.prev_hash], ["Hash", r.hash]]
    .filter(([, v]) => v !== undefined && v !== null && v !== "");
  fill("detail-head", head.map(([k, v]) => { const x = row([k, v]); x.firstChild.className = "key"; return x; }));
  fill("detail-policies", (p.policies || []).map((x) => row([x.name, x.stage, x.verdict, x.duration_ms,
    x.shadow ? "shadow" : "", x.attempt, x.detail === null || x.detail === undefined ? "" : JSON.stringify(x.detail),
    receipt(x)])));
  const control = { ...(p.control || {}), degraded: p.degraded, notes: p.notes, attempts: p.attempts,
    retries: p.retries, ttft_ms: p.ttft_ms, priority: p.priority, policy_set: p.policy_set };
  $("detail-control").textContent = JSON.stringify(control, null, 2);
  $("detail-digests").textContent = JSON.stringify({ input: p.input, output: p.output }, null, 2);
  const other = r.kind === "request" ? p.content : p;
  $("detail-content").textContent = other ? JSON.stringify(other, null, 2)
    : "not kept (the tenant's audit_content is digests)";
  $("detail").scrollIntoView();
}

function showVerify(res) {
  const box = $("verify-result");
  const d = res.data;
  if (!d || d.records === undefined) { result("verify-result", errorText(res), true); return; }
  const range = d.range ? `records ${d.range.from_seq}..${d.range.to_seq}` : "the whole chain";
  box.replaceChildren();
  if (d.ok) {
    box.className = "result ok";
    box.append(el("p", `Verified ${range}: ${d.records} records intact, head ${d.head_seq}, ` +
      `${d.checkpoints_signed} signed checkpoints checked.`));
  } else {
    box.className = "result error";
    box.append(el("p", `The chain breaks at record ${d.problem.seq} (${d.problem.kind}): ${d.problem.message}.`));
    const link = el("a", `Show record ${d.problem.seq}`);
    link.id = "broken-record";
    link.href = "#record-" + d.problem.seq;
    link.onclick = (ev) => { ev.preventDefault(); detail(d.problem.seq); };
    box.append(link);
  }
}

function audit() {
  $("search").onsubmit = (ev) => { ev.preventDefault(); search(false); };
  $("more-records").onclick = () => search(true);
  $("verify-form").onsubmit = async (ev) => {
    ev.preventDefault();
    showVerify(await api("GET", `/audit/verify/range?from_seq=${$("v-from").value}&to_seq=${$("v-to").value}`));
  };
  $("verify-all").onclick = async () => showVerify(await api("GET", "/audit/verify"));
  const wanted = new URLSearchParams(window.location.search);
  for (const f of FILTERS) if (wanted.get(f)) $("f-" + f).value = wanted.get(f);
  search(false).then(() => {
    const first = $("records").querySelector("tbody tr");
    if (first && !$("v-to").value) $("v-to").value = first.dataset.seq;
  });
}

// -- Configuration --------------------------------------------------------------------------------
async function configPage() {
  const res = await api("GET", "/config");
  if (!res.ok) { status(errorText(res), true); return; }
  const c = res.data;
  const chain = (name, d) => row([name, d.pre.join(" → "), d.stream.join(" → "), d.post.join(" → ")]);
  fill("chains", [chain("policies (default)", c.policies),
    ...Object.entries(c.policy_sets).map(([n, d]) => chain(`policy_sets.${n}`, d))]);
  fill("tenant-chains", c.tenants.map((t) => row([t.name, t.source, t.priority,
    t.policy_set ? `policy_sets.${t.policy_set}` : "policies (default)"])));
  fill("engine-config", c.engines.map((e) => row([e.name, e.kind, e.model, e.variant, e.role,
    e.weight === null ? "" : e.weight, e.serves.join(", "), e.base_url || "", e.max_in_flight === null ? "∞" : e.max_in_flight,
    `${e.connect_timeout_s} / ${e.first_byte_timeout_s} / ${e.read_timeout_s}`])));
  $("check").disabled = $("reload").disabled = !c.reloadable;
  if (!c.reloadable) result("check-result", "Started without a config file: there is nothing to reload.", true);
}

function showCheck(res, what) {
  const d = res.data || {};
  if (res.ok && d.ok !== false) {
    const later = (d.restart_required || []).length ? ` Needs a restart to apply: ${d.restart_required.join(", ")}.` : "";
    const now = d.applies_at_once ? ` Applies at once: ${d.applies_at_once.join(", ") || "nothing changed"}.` : "";
    result("check-result", `${what}: ${d.message}.${now}${later}`);
  } else {
    result("check-result", `${what}: refused. ${d.message || errorText(res)}`, true);
  }
}

function config() {
  $("check").onclick = async () => showCheck(await api("POST", "/config/check"), "Check");
  // Reload shows the check's verdict first; a file that does not validate is never offered for reload.
  $("reload").onclick = async () => {
    const checked = await api("POST", "/config/check");
    showCheck(checked, "Check");
    if (!checked.ok || !checked.data.ok) return;
    const d = checked.data;
    const now = d.applies_at_once.length ? d.applies_at_once.join(", ") : "nothing";
    const later = d.restart_required.length ? ` Needs a restart: ${d.restart_required.join(", ")}.` : "";
    confirmThen(`The file is valid. Applies at once: ${now}.${later} Reload it on this replica now?`,
      async () => { showCheck(await api("POST", "/config/reload"), "Reload"); await configPage(); });
  };
  configPage();
}

// -- every page -----------------------------------------------------------------------------------
$("sign-out").onclick = async () => {
  await fetch("logout", { method: "POST", credentials: "same-origin", headers: { "x-csrf-token": CSRF } });
  window.location.href = "login";
};

const PAGES = {
  overview: () => { overview(); setInterval(overview, 2000); },
  rollback, tenants, audit, config,
};
PAGES[document.body.dataset.page]();
