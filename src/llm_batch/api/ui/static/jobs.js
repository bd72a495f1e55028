// The "Batch jobs" page: reads /batch/ui/api/* with the Airflow session cookie (same-origin
// GETs); the cancel POST carries the session's JWT in the Authorization header (docs/ui.md).
"use strict";
(function () {
  const API = location.pathname.replace(/\/ui\/jobs\/?$/, "");  // ".../batch"
  const AIRFLOW = API.replace(/\/batch$/, "");                  // Airflow's UI root
  const REFRESH_MS = 2000;
  let session = null, cursors = [null], timer = null;

  const $ = (sel) => document.querySelector(sel);
  const el = (tag, attrs, ...children) => {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v; else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v);
    }
    for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(c == null ? "" : String(c)));
    return node;
  };
  // Airflow shows the page in a same-origin iframe: it follows Airflow's own settings.
  const airflowWindow = (() => { try { return window.parent !== window && window.parent.document ? window.parent : null; } catch (e) { return null; } })();
  // The time zone chosen in Airflow's UI (its localStorage "timezone", JSON), else the
  // browser's, as Airflow's own default is.
  function timeZone() {
    try {
      const stored = localStorage.getItem("timezone");
      const zone = stored ? JSON.parse(stored) : null;
      if (zone) { new Intl.DateTimeFormat("en", { timeZone: zone }); return zone; }
    } catch (e) { /* not a zone: the browser's */ }
    return Intl.DateTimeFormat().resolvedOptions().timeZone;
  }
  const when = (iso, opts) => (iso ? new Intl.DateTimeFormat(undefined, { timeZone: timeZone(), dateStyle: "medium",
    timeStyle: "medium", ...(opts || {}) }).format(new Date(iso)) : "");
  const clock = (ms) => new Intl.DateTimeFormat(undefined, { timeZone: timeZone(), timeStyle: "medium" }).format(new Date(ms));
  // Airflow's colour mode (next-themes: class "dark" on its <html>), followed live.
  function followTheme() {
    const apply = () => {
      const root = airflowWindow ? airflowWindow.document.documentElement : null;
      const dark = root ? root.classList.contains("dark")
        : window.matchMedia && window.matchMedia("(prefers-color-scheme: dark)").matches;
      document.documentElement.classList.toggle("dark", dark);
    };
    apply();
    if (airflowWindow) new MutationObserver(apply).observe(airflowWindow.document.documentElement,
      { attributes: true, attributeFilter: ["class", "style"] });
  }
  // A link into Airflow's UI: inside Airflow's iframe (no top navigation allowed), Airflow's
  // own router is moved (history + popstate, as its links do); outside, a plain link.
  function airflowLink(path, text, cls) {
    const href = AIRFLOW + path;
    return el("a", { href, class: cls, target: airflowWindow ? "_self" : "_top", onclick: (event) => {
      if (!airflowWindow || event.ctrlKey || event.metaKey || event.shiftKey || event.button !== 0) return;
      event.preventDefault();
      airflowWindow.history.pushState({}, "", href);
      airflowWindow.dispatchEvent(new PopStateEvent("popstate", { state: {} }));
    } }, text);
  }
  const say = (text) => { $("#message").textContent = text || ""; };

  async function get(path) {
    const response = await fetch(API + path, { credentials: "same-origin", headers: { Accept: "application/json" } });
    if (!response.ok) throw new Error(await problem(response));
    return response.json();
  }
  async function problem(response) {
    try {
      const body = await response.json();
      // Every error says `message` (OpenAI's routes inside `error`); a 422's `detail` is a list.
      return `${response.status}: ${body.message || (body.error && body.error.message) || body.detail || ""}`;
    } catch (e) { return `${response.status} ${response.statusText}`; }
  }

  function bar(done, total, failed) {
    const pct = total > 0 ? Math.min(100, (100 * done) / total) : 0;
    const outer = el("span", { class: "bar" + (failed ? " failed" : ""), role: "progressbar",
      "aria-valuenow": String(done), "aria-valuemax": String(total), title: `${done} / ${total}` },
      el("span", { style: `width:${pct.toFixed(1)}%` }));
    return el("span", {}, outer, ` ${done} / ${total}`);
  }
  // The status word; while the job waits for Airflow to start it, WAITING and its place in the
  // queue (its status, QUEUED or RUNNING, in the tooltip).
  const status = (job) => job.queue
    ? el("span", { title: `${job.status}: waits for ${job.queue.waiting_for}` },
        el("span", { class: "status WAITING" }, "WAITING"), el("span", { class: "queue" }, ` #${job.queue.position} in queue`))
    : el("span", { class: "status " + job.status }, job.status);
  const labels = (pairs) => el("span", {}, ...Object.entries(pairs || {}).map(([k, v]) => el("span", { class: "label" }, `${k}=${v}`)));

  // -- list ----------------------------------------------------------------------------------
  function query() {
    const form = new FormData($("#filters"));
    const params = new URLSearchParams({ limit: "50" });
    for (const name of ["q", "status", "owner", "model", "label"]) {
      const value = (form.get(name) || "").trim();
      if (value) params.append(name, value);
    }
    const after = cursors[cursors.length - 1];
    if (after) params.set("after", after);
    return params;
  }
  async function showList() {
    const page = await get("/ui/api/jobs?" + query());
    const body = $("#jobs tbody");
    body.replaceChildren(...page.jobs.map((job) => el("tr", { class: "job", "data-id": job.id, onclick: () => { location.hash = "job=" + job.id; } },
      el("td", {}, el("a", { href: "#job=" + job.id }, job.id)),
      el("td", {}, status(job)),
      el("td", {}, bar(job.completed, job.total, job.failed > 0)),
      el("td", {}, `${job.succeeded} / ${job.failed}`),
      el("td", {}, job.tokens_per_s.toFixed(1)),
      el("td", {}, job.model), el("td", {}, job.endpoint), el("td", {}, job.owner),
      el("td", {}, labels(job.labels)), el("td", {}, when(job.created_at)), el("td", {}, when(job.ended_at)))));
    $("#count").textContent = page.total == null ? `${page.jobs.length} jobs on this page` :
      `${page.total} jobs` + (cursors.length > 1 ? ` (page ${cursors.length})` : "");
    $("#next").disabled = !page.next_after;
    $("#next").onclick = () => { cursors.push(page.next_after); refresh(); };
    $("#first").disabled = cursors.length === 1;
  }

  // The caller's own usage (GET /v1/usage counts only their jobs; an admin's names themself).
  async function showUsage() {
    const report = await get("/v1/usage?" + new URLSearchParams({ owner: session.user }));
    const all = report.data[0];
    const n = (v) => Number(v || 0).toLocaleString();
    $("#usage").textContent = all ? `Your usage: ${n(all.jobs)} jobs, ${n(all.requests.total)} requests ` +
      `(${n(all.requests.succeeded)} succeeded, ${n(all.requests.failed)} failed), ` +
      `${n(all.prompt_tokens)} prompt + ${n(all.completion_tokens)} completion tokens` : "Your usage: no jobs yet";
  }

  // -- detail --------------------------------------------------------------------------------
  function plot(svg, series, points) {
    // series: [{key, color, name}]; points: [{at, ...}]
    const W = 520, H = 200, L = 44, R = 8, T = 8, B = 24;
    const NS = "http://www.w3.org/2000/svg";
    const s = (tag, attrs) => { const n = document.createElementNS(NS, tag); for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v); return n; };
    svg.replaceChildren();
    if (points.length === 0) return;
    const xs = points.map((p) => Date.parse(p.at));
    const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1000);
    const y1 = Math.max(1, ...series.flatMap((line) => points.map((p) => p[line.key] || 0)));
    const X = (t) => L + ((t - x0) / (x1 - x0)) * (W - L - R);
    const Y = (v) => H - B - (v / y1) * (H - T - B);
    svg.append(s("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#a0aec0" }),
      s("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#a0aec0" }));
    const label = (x, y, text, anchor) => { const t = s("text", { x, y, "text-anchor": anchor }); t.textContent = text; svg.append(t); };
    label(L - 4, T + 8, y1 >= 100 ? Math.round(y1) : y1.toFixed(1), "end");
    label(L - 4, H - B, "0", "end");
    label(L, H - 8, clock(x0), "start");
    label(W - R, H - 8, clock(x1), "end");
    series.forEach((line) => {
      const d = points.map((p, j) => `${j ? "L" : "M"}${X(xs[j]).toFixed(1)},${Y(p[line.key] || 0).toFixed(1)}`).join(" ");
      svg.append(s("path", { d, fill: "none", stroke: line.color, "stroke-width": 2, class: "series-" + line.key }));
    });
  }
  // The legend beside a plot: a swatch of each line's colour and its name.
  const legend = (series) => el("ul", { class: "legend" }, ...series.map((line) => el("li", { "data-series": line.key },
    el("span", { class: "swatch", style: `background:${line.color}` }), line.name)));

  // Two clicks, no confirm(): Airflow shows the page in a sandboxed iframe, where modal
  // dialogs are blocked (confirm() answers false at once).
  let armed = null; // the job whose cancel button was clicked once (kept across refreshes)
  async function cancel(job, button) {
    if (armed !== job.id) {
      armed = job.id;
      button.dataset.armed = "yes";
      button.textContent = `Really cancel ${job.id}? Click again`;
      return;
    }
    armed = null;
    const headers = { Accept: "application/json" };
    if (session.token) headers.Authorization = "Bearer " + session.token;
    const response = await fetch(`${API}/ui/api/jobs/${encodeURIComponent(job.id)}/cancel`,
      { method: "POST", credentials: "omit", headers });
    if (!response.ok) { say("Cancel refused: " + (await problem(response))); return; }
    say("");
    refresh();
  }

  // Retry (the failed and never-run lines) or run again: a new job, opened once made.
  function derive(job, kind, text) {
    return el("button", { type: "button", class: kind, onclick: async (event) => {
      event.currentTarget.disabled = true;
      const headers = { Accept: "application/json" };
      if (session.token) headers.Authorization = "Bearer " + session.token;
      const response = await fetch(`${API}/v1/jobs/${encodeURIComponent(job.id)}/${kind}`,
        { method: "POST", credentials: "omit", headers });
      if (!response.ok) { say(`${text} refused: ` + (await problem(response))); return; }
      say("");
      location.hash = "job=" + (await response.json()).id;
    } }, text);
  }

  // The estimate kept at validation beside what the job took: "expected (took)" per figure,
  // the expected end beside the real one. A figure the server could not estimate (no ended
  // job of the model to measure a rate on) says so instead of a bare "?".
  function estimateText(est, used, endedAt) {
    const fig = (v, d) => Number(v).toLocaleString(undefined, { maximumFractionDigits: d });
    const engine = est.engine_seconds === null || est.engine_seconds === undefined
      ? "engine time unknown (no ended job of this model to measure its rate on yet)"
      : `engine ${fig(est.engine_seconds, 1)} s` +
        (est.overhead_seconds ? ` + about ${fig(est.overhead_seconds, 0)} s to start and merge` : "");
    const expectedEnd = est.expected_end ? when(new Date(est.expected_end * 1000).toISOString()) : "unknown";
    return `${engine} (took ${fig(used.engine_seconds, 1)} s) · ` +
      `prompt ${fig(est.prompt_tokens, 0)} tokens (took ${fig(used.prompt_tokens, 0)}) · ` +
      `output at most ${fig(est.max_output_tokens, 0)} (took ${fig(used.completion_tokens, 0)}) · ` +
      `end expected ${expectedEnd}` + (endedAt ? ` (ended ${when(endedAt)})` : "");
  }

  async function showDetail(id) {
    const job = await get("/ui/api/jobs/" + encodeURIComponent(id));
    $("#d-title").textContent = `Job ${job.id}`;
    const dl = el("dl", {});
    const row = (k, v) => dl.append(el("dt", {}, k), el("dd", {}, v));
    row("Status", el("span", { class: "status " + job.status }, job.status));
    if (job.queue) row("Queue", `#${job.queue.position}: waits for ${job.queue.waiting_for}`);
    if (job.status_reason) row("Reason", job.status_reason);
    if (job.derived_from) row("Made from", el("span", {}, job.derived_from.kind === "retry" ? "retry of " : "run again of ",
      el("a", { href: "#job=" + job.derived_from.job_id, class: "derived-from" }, job.derived_from.job_id)));
    row("Progress", bar(job.completed, job.total, job.failed > 0));
    row("Succeeded / failed", `${job.succeeded} / ${job.failed}`);
    // What the result cache answered, and answers that failed the job's output_check.
    if (job.cached) row("From the result cache", `${job.cached} lines (${job.cached_tokens} tokens, no engine time)`);
    if (job.invalid_output || job.output_retries) {
      row("Checked outputs", `${job.invalid_output} invalid after their tries; ${job.output_retries} answers tried again`);
    }
    row("Tokens/s", job.tokens_per_s.toFixed(1));
    if (job.estimate) row("Estimate vs took", estimateText(job.estimate, job.usage, job.ended_at));
    row("Model", job.model); row("Endpoint", job.endpoint); row("Owner", job.owner);
    row("Labels", labels(job.labels)); row("Created", when(job.created_at)); row("Ended", when(job.ended_at));
    $("#d-summary").replaceChildren(dl);

    const actions = [];
    const download = (fileId, name) => el("a", { href: `${API}/v1/files/${encodeURIComponent(fileId)}/content`,
      download: `${job.id}-${name}.jsonl`, class: "download-" + name }, `Download ${name}`);
    if (job.output_file_id) actions.push(download(job.output_file_id, "output"));
    if (job.error_file_id) actions.push(download(job.error_file_id, "errors"));
    if (job.links) {
      actions.push(airflowLink(job.links.run, "DAG run", "dag-run"));
      actions.push(airflowLink(job.links.logs, "Task logs", "dag-logs"));
    }
    if (job.can_retry) actions.push(derive(job, "retry", "Retry failed lines"));
    if (job.can_rerun) actions.push(derive(job, "rerun", "Run again"));
    if (job.can_cancel) {
      const again = armed === job.id;
      const button = el("button", { type: "button", class: "cancel", onclick: (event) => cancel(job, event.currentTarget) },
        again ? `Really cancel ${job.id}? Click again` : "Cancel job");
      if (again) button.dataset.armed = "yes";
      actions.push(button);
    }
    $("#d-actions").replaceChildren(...actions);

    const counts = [{ key: "completed", color: "#3182ce", name: "done" },
      { key: "succeeded", color: "#38a169", name: "succeeded" }, { key: "failed", color: "#e53e3e", name: "failed" }];
    const rate = [{ key: "tokens_per_s", color: "#805ad5", name: "tokens/s" }];
    plot($("#plot-counts"), counts, job.history);
    plot($("#plot-rate"), rate, job.history);
    $("#legend-counts").replaceChildren(legend(counts));
    $("#legend-rate").replaceChildren(legend(rate));

    $("#shards tbody").replaceChildren(...job.shards.map((sh) => el("tr", {},
      el("td", {}, sh.shard), el("td", {}, sh.state), el("td", {}, bar(sh.done, sh.total, sh.failed > 0)),
      el("td", {}, `${sh.succeeded} / ${sh.failed}`), el("td", {}, sh.tokens_per_s.toFixed(1)),
      el("td", {}, sh.reason || ""), el("td", {}, when(sh.updated_at)))));
    // A running job's preview is its first finished lines (a partial read), said so.
    const previewTable = job.preview.length ? el("table", { id: "preview" },
      el("thead", {}, el("tr", {}, el("th", {}, "custom_id"), el("th", {}, "Answer"))),
      el("tbody", {}, ...job.preview.map((r) => el("tr", {}, el("td", {}, r.custom_id || ""), el("td", { class: "message" }, r.answer)))))
      : null;
    $("#d-preview").replaceChildren(...(job.preview_partial
      ? [el("p", { id: "preview-partial" }, job.preview.length ? "Finished so far (the job has not ended):" : "No line has finished yet."), ...(previewTable ? [previewTable] : [])]
      : [previewTable || el("p", {}, job.output_file_id ? "No succeeded lines." : "No results.")]));
    const errors = [];
    for (const e of job.errors || []) errors.push(el("p", {}, typeof e === "string" ? e : (e.message || JSON.stringify(e))));
    if (job.error_lines.length) {
      errors.push(el("p", {}, `First ${job.error_lines.length} failed lines:`), el("table", { id: "error-lines" },
        el("thead", {}, el("tr", {}, el("th", {}, "Line"), el("th", {}, "custom_id"), el("th", {}, "Code"), el("th", {}, "Message"))),
        el("tbody", {}, ...job.error_lines.map((e) => el("tr", {}, el("td", {}, e.line == null ? "" : e.line),
          el("td", {}, e.custom_id || ""), el("td", {}, e.code || ""), el("td", { class: "message" }, e.message || ""))))));
    }
    if (!errors.length) errors.push(el("p", {}, job.failed ? "The error file is written when the job ends." : "No failed lines."));
    $("#d-errors").replaceChildren(...errors);
  }

  // -- routing -------------------------------------------------------------------------------
  async function refresh() {
    clearTimeout(timer);
    const match = location.hash.match(/^#job=(.+)$/);
    $("#list-view").hidden = !!match;
    $("#detail-view").hidden = !match;
    try {
      if (match) await showDetail(decodeURIComponent(match[1])); else await Promise.all([showList(), showUsage()]);
      if (!/refused/.test($("#message").textContent)) say("");
    } catch (e) { say(String(e.message || e)); }
    timer = setTimeout(refresh, REFRESH_MS);
  }

  async function start() {
    followTheme();
    try { session = await get("/ui/api/session"); } catch (e) { say(String(e.message || e)); return; }
    $("#who").textContent = `${session.user}${session.is_admin ? " (admin)" : session.can_submit ? "" : " (read only)"}`;
    const select = $("#filters select[name=status]");
    for (const status of session.statuses) select.append(el("option", { value: status }, status));
    $("#filters").addEventListener("submit", (event) => { event.preventDefault(); cursors = [null]; refresh(); });
    $("#first").addEventListener("click", () => { cursors = [null]; refresh(); });
    $("#back").addEventListener("click", (event) => { event.preventDefault(); location.hash = ""; });
    window.addEventListener("hashchange", refresh);
    refresh();
  }
  start();
})();
