// The console's page: polls the JSON views (sdk/console/app.py) and draws them with Cytoscape.js
// (the state machine graph, laid out by ELK's layered algorithm) and Chart.js (Gantt, curves, cost). The page's state
// is in its URL's hash (#job=ID&exec=ARN), so a link opens the same view.
"use strict";

const POLL_MS = 2000;           // while the selected job runs
const POLL_ENDED_MS = 10000;    // once it has ended (a resumption or a new job still shows up)
const COST_EVERY = 5;           // the cost reads every history: every 5th poll
const PHASE_COLOURS = { forward: "#4c72b0", backward: "#dd8452", sync: "#55a868" };
const STATUS_COLOURS = {
  NOT_STARTED: "#ffffff", IN_PROGRESS: "#0073bb", SUCCEEDED: "#1d8102",
  FAILED: "#d13212", CANCELLED: "#879596", CAUGHT_ERROR: "#ec7211",
};
const STATUS_LABELS = {
  IN_PROGRESS: "In progress", SUCCEEDED: "Succeeded", FAILED: "Failed",
  CAUGHT_ERROR: "Caught error", CANCELLED: "Cancelled", NOT_STARTED: "Not started",
};

const view = { job: null, exec: null, cy: null, cyArn: null, charts: {}, polls: 0, timer: null };

// cytoscape-elk registers its layout with the global cytoscape when it loads (ELK from elk.bundled.js)

// ---------------------------------------------------------------------------- helpers
async function api(path) {
  const r = await fetch(path, { cache: "no-store" });
  if (!r.ok) throw new Error(`${path}: ${r.status} ${await r.text()}`);
  return r.json();
}

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k.startsWith("data-")) e.setAttribute(k, v);
    else e[k] = v;
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(c ?? ""));
  return e;
}

function badge(status) { return el("span", { class: `badge ${status}` }, status); }
function shortArn(arn) { return arn.split(":").slice(-2).join(":"); }
function time(s) { return s ? s.replace(/\.\d+/, "").replace("+00:00", " UTC") : ""; }

function readHash() {
  const p = new URLSearchParams(location.hash.slice(1));
  view.job = p.get("job");
  view.exec = p.get("exec");
}

function writeHash() {
  const p = new URLSearchParams();
  if (view.job) p.set("job", view.job);
  if (view.exec) p.set("exec", view.exec);
  history.replaceState(null, "", "#" + p.toString());
}

function fillTable(id, rows) {
  const body = document.querySelector(`#${id} tbody`);
  body.replaceChildren(...rows);
}

// one Chart.js chart per canvas: created once, its data replaced on each poll
function chart(id, config) {
  const old = view.charts[id];
  if (old && old.config.type === config.type) {
    old.data = config.data;
    old.options = config.options;
    old.update("none");
  } else {
    if (old) old.destroy();
    view.charts[id] = new Chart(document.getElementById(id), config);
  }
  document.getElementById(id).dataset.points = config.data.datasets.reduce((n, d) => n + d.data.length, 0);
}

function titled(text, extra = {}) {
  return { animation: false, maintainAspectRatio: false, plugins: { title: { display: true, text } }, ...extra };
}

// ---------------------------------------------------------------------------- jobs
async function refreshJobs() {
  const [stack, jobs] = await Promise.all([api("/api/stack"), api("/api/jobs")]);
  document.getElementById("stack").textContent = `${stack.backend} stack ${stack.prefix} (${stack.region}, s3://${stack.bucket})`;
  if (!view.job && jobs.length) view.job = jobs[0].job;
  const items = jobs.map((j) => {
    const li = el("li", { "data-job": j.job, class: j.job === view.job ? "selected" : "" },
      j.job, " ", badge(j.status), el("span", { class: "name" }, `${j.name}, ${j.iterations} iterations, ${time(j.started)}`));
    li.onclick = () => { view.job = j.job; view.exec = null; writeHash(); poll(); };
    return li;
  });
  document.getElementById("jobs").replaceChildren(...(items.length ? items : [el("li", { class: "muted" }, "no jobs yet")]));
}

async function refreshJob() {
  const j = await api(`/api/jobs/${encodeURIComponent(view.job)}`);
  document.getElementById("job-empty").hidden = true;
  document.getElementById("job").hidden = false;
  document.getElementById("job-id").textContent = `${j.job} (${j.name})`;
  document.getElementById("job-status").replaceWith(Object.assign(badge(j.status), { id: "job-status" }));
  document.getElementById("progress-bar").style.width = `${(100 * j.iterations_done) / Math.max(1, j.iterations)}%`;
  document.getElementById("job-progress").textContent = `iteration ${j.iterations_done} of ${j.iterations} done`;
  const p = j.plan;
  document.getElementById("job-plan").textContent =
    `plan: ${p.balance.length} stages (layers ${JSON.stringify(p.balance)}) × ${p.replicas} replicas, ` +
    `${p.micro_batches} micro-batches, memory ${JSON.stringify(p.memory_mb)} MB`;
  const err = document.getElementById("job-error");
  const why = j.stop ? `stopped before iteration ${j.stop.version} (${j.stop.reason})` : j.error ? `${j.error}: ${j.cause || ""}` : "";
  err.hidden = !why;
  err.textContent = why;
  fillTable("chain", j.executions.map((e) => execRow(e.arn, [shortArn(e.arn), badge(e.status), time(e.started), time(e.stopped)])));
  fillTable("windows", j.windows.map((w, i) =>
    execRow(w.arn, [`#${i + 1} ${w.name}`, `[${w.start}, ${w.end})`, badge(w.status), time(w.started), time(w.stopped)])));
  const latest = j.windows.length ? j.windows[j.windows.length - 1].arn : j.executions[j.executions.length - 1].arn;
  return { job: j, exec: view.exec || latest };
}

function execRow(arn, cells) {
  const tr = el("tr", { class: "clickable", "data-arn": arn }, ...cells.map((c) => el("td", {}, c)));
  if (arn === view.exec) tr.classList.add("selected");
  tr.onclick = () => { view.exec = arn; writeHash(); poll(); };
  return tr;
}

// ---------------------------------------------------------------------------- state machine
function drawGraph(x) {
  const box = document.getElementById("graph");
  if (view.cyArn !== x.arn) {
    if (view.cy) view.cy.destroy();
    view.cy = cytoscape({
      container: box,
      elements: x.elements,
      wheelSensitivity: 0.3,
      style: [
        { selector: "node", style: {
          label: "data(label)", "text-valign": "center", "font-size": 10, shape: "round-rectangle",
          width: "label", height: 22, padding: 6, "border-width": 1, "border-color": "#545b64",
          "background-color": STATUS_COLOURS.NOT_STARTED, color: "#16191f" } },
        { selector: "node[type = 'Start'], node[type = 'End']", style: { shape: "ellipse", "background-color": "#545b64", color: "#fff" } },
        { selector: "node[type = 'Choice']", style: { shape: "diamond", height: 34 } },
        { selector: ":parent", style: {
          "text-valign": "top", "text-halign": "center", "background-opacity": 0.08, "border-style": "dashed" } },
        { selector: "edge", style: {
          width: 1, "curve-style": "bezier", "target-arrow-shape": "triangle", "arrow-scale": 0.7, "line-color": "#879596", "target-arrow-color": "#879596" } },
        { selector: "edge[kind = 'catch']", style: { "line-style": "dashed", "line-color": "#d13212", "target-arrow-color": "#d13212" } },
        ...Object.entries(STATUS_COLOURS).map(([s, c]) => ({
          selector: `node.${s}`, style: { "background-color": c, color: s === "NOT_STARTED" ? "#16191f" : "#fff" } })),
        ...Object.entries(STATUS_COLOURS).map(([s, c]) => ({
          selector: `:parent.${s}`, style: { "border-color": c, "border-width": 2, "background-color": c, color: "#16191f" } })),
      ],
      // layered top to bottom, Map and Parallel states laid out with their inner states
      layout: { name: "elk", nodeDimensionsIncludeLabels: true, elk: {
        algorithm: "layered", "elk.direction": "DOWN", "elk.hierarchyHandling": "INCLUDE_CHILDREN",
        "elk.layered.cycleBreaking.strategy": "DEPTH_FIRST", "elk.layered.spacing.nodeNodeBetweenLayers": 24, "elk.spacing.nodeNode": 16, "elk.padding": "[top=24,left=10,bottom=10,right=10]" } },
    });
    view.cyArn = x.arn;
  }
  view.cy.batch(() => {
    for (const [name, status] of Object.entries(x.states)) {
      const n = view.cy.getElementById(name);
      n.classes(status);
    }
  });
  box.dataset.rendered = view.cy.nodes().map((n) => n.id()).join(",");
  const items = Object.entries(x.states).map(([name, status]) =>
    el("li", { "data-state": name, "data-status": status }, `${name}: ${STATUS_LABELS[status]}`));
  document.getElementById("graph-states").replaceChildren(...items);
}

async function refreshExecution(arn) {
  const x = await api(`/api/executions/${encodeURIComponent(arn)}`);
  document.getElementById("exec-name").textContent = shortArn(arn);
  document.getElementById("exec-status").replaceWith(Object.assign(badge(x.status), { id: "exec-status" }));
  drawGraph(x);
  const rows = x.events.slice().reverse().map((e) =>
    el("tr", { class: e.error ? "error" : "", title: e.details }, ...[e.id, time(e.timestamp), e.type, e.state || "", e.error || ""].map((c) => el("td", {}, String(c)))));
  fillTable("events", rows);
  document.getElementById("events-count").textContent =
    x.events_total > x.events.length ? `(latest ${x.events.length} of ${x.events_total})` : `(${x.events_total})`;
}

// ---------------------------------------------------------------------------- charts
async function refreshGantt() {
  const g = await api(`/api/jobs/${encodeURIComponent(view.job)}/gantt`);
  document.getElementById("gantt-iterations").textContent = g.iterations.length ? `(iterations ${g.iterations[0]} to ${g.iterations[1]})` : "(no task has finished yet)";
  const datasets = Object.entries(PHASE_COLOURS).map(([phase, colour]) => ({
    label: phase,
    backgroundColor: colour,
    data: g.tasks.filter((t) => t.phase === phase).map((t) => ({ x: [t.start, t.end], y: g.rows[t.row], t: t.t, wait: t.wait_s })),
  }));
  // a row per stage and worker, each tall enough to read
  document.getElementById("gantt").parentElement.style.height = `${Math.max(240, 90 + 30 * g.rows.length)}px`;
  chart("gantt", {
    type: "bar",
    data: { labels: g.rows, datasets },
    options: titled("tasks per stage and worker (seconds from the first task shown)", {
      indexAxis: "y",
      grouped: false,
      scales: { x: { type: "linear", title: { display: true, text: "seconds" } }, y: { stacked: true, ticks: { autoSkip: false } } },
      plugins: {
        title: { display: true, text: "tasks per stage and worker (seconds from the first task shown)" },
        tooltip: { callbacks: { label: (c) => `${c.dataset.label} t=${c.raw.t}: ${c.raw.x[0].toFixed(2)}–${c.raw.x[1].toFixed(2)} s (waiting ${c.raw.wait.toFixed(2)} s)` } },
      },
    }),
  });
}

async function refreshCurves() {
  const c = await api(`/api/jobs/${encodeURIComponent(view.job)}/curves`);
  const its = c.losses.map((_, i) => i);
  chart("loss", {
    type: "line",
    data: { labels: its, datasets: [{ label: "training loss", data: c.losses, borderColor: "#4c72b0", pointRadius: 0, spanGaps: false }] },
    options: titled("loss per iteration", { scales: { x: { title: { display: true, text: "iteration" } } } }),
  });
  const groups = c.learning_rates.length ? c.learning_rates[0].length : 0;
  chart("lr", {
    type: "line",
    data: {
      labels: c.learning_rates.map((_, i) => i),
      datasets: [...Array(groups).keys()].map((g) => ({ label: `group ${g}`, data: c.learning_rates.map((r) => r[g]), pointRadius: 0 })),
    },
    options: titled(groups ? "learning rate per iteration" : "learning rate (recorded under a scheduler)", { scales: { x: { title: { display: true, text: "iteration" } } } }),
  });
  const names = c.evaluations.length ? Object.keys(c.evaluations[0].metrics) : [];
  chart("evaluation", {
    type: "line",
    data: {
      labels: c.evaluations.map((e) => e.version),
      datasets: [
        { label: "validation loss", data: c.evaluations.map((e) => e.loss), borderColor: "#c44e52" },
        ...names.map((n) => ({ label: n, data: c.evaluations.map((e) => e.metrics[n]) })),
      ],
    },
    options: titled(c.evaluations.length ? "evaluation per version" : "evaluation (a job with Job.evaluation)", { scales: { x: { title: { display: true, text: "iterations done" } } } }),
  });
}

function usd(v) { return v == null ? "—" : `$${v.toFixed(6)}`; }

async function refreshCost() {
  const c = await api(`/api/jobs/${encodeURIComponent(view.job)}/cost`);
  chart("cost", {
    type: "bar",
    data: {
      labels: ["USD per iteration"],
      datasets: [
        { label: "predicted (planner)", data: [c.predicted_usd_per_iteration], backgroundColor: "#879596" },
        { label: "measured", data: [c.measured_usd_per_iteration], backgroundColor: "#4c72b0" },
      ],
    },
    options: titled("predicted vs measured cost per iteration"),
  });
  const m = c.measured;
  const rows = [
    ["predicted per iteration", usd(c.predicted_usd_per_iteration), c.predicted_s_per_iteration == null ? "—" : `${c.predicted_s_per_iteration.toFixed(3)} s`],
    ["measured per iteration", usd(c.measured_usd_per_iteration), c.measured_s_per_iteration == null ? "—" : `${c.measured_s_per_iteration.toFixed(3)} s`],
    ["predicted, whole run", usd(c.predicted_usd), `${c.iterations} iterations`],
    ["measured so far", m ? usd(m.usd) : "—", m ? `${m.iterations} iterations` : "no prices in the job's spec"],
    ...(m ? Object.entries(m.phase_usd).map(([p, v]) => [`  ${p}`, usd(v), ""]) : []),
  ];
  fillTable("cost-table", rows.map((r) => el("tr", {}, ...r.map((x) => el("td", {}, x)))));
  if (c.predicted_usd_per_iteration == null) {
    document.querySelector("#cost-table tbody").append(el("tr", {}, el("td", { colSpan: 3, class: "muted" }, "no prediction stored with the job: a plan the planner made carries one, and `stagecoach train` records the one it prints; this job has neither")));
  }
}

async function refreshFailures() {
  const fs = await api(`/api/jobs/${encodeURIComponent(view.job)}/failures`);
  document.getElementById("failures-count").textContent = `(${fs.length})`;
  const items = fs.map((f) => {
    const who = f.phase ? `${f.phase} stage ${f.stage} #${f.index} t=${f.t}` : f.state;
    const log = f.log.lines.length ? f.log.lines.join("\n") : "(no lines of this task in the log)";
    return el("div", { class: f.retried ? "failure retried" : "failure", "data-error": f.error },
      el("strong", {}, `${who}: ${f.error}`), f.retried ? " (retried, then succeeded)" : "",
      el("div", {}, f.cause),
      el("div", { class: "muted" }, `${f.state} in ${shortArn(f.execution_arn)} at ${time(f.timestamp)}`),
      el("details", { open: true }, el("summary", {}, `worker's log (${f.log.source})`), el("pre", {}, log)));
  });
  document.getElementById("failures").replaceChildren(...(items.length ? items : [el("p", { class: "muted" }, "none")]));
}

// ---------------------------------------------------------------------------- polling
async function poll() {
  clearTimeout(view.timer);
  let running = true;
  try {
    await refreshJobs();
    if (view.job) {
      const { job, exec } = await refreshJob();
      running = job.status === "RUNNING";
      const parts = [refreshExecution(exec), refreshGantt(), refreshCurves(), refreshFailures()];
      if (view.polls % COST_EVERY === 0 || !running) parts.push(refreshCost());
      const results = await Promise.allSettled(parts);
      const failed = results.filter((r) => r.status === "rejected").map((r) => r.reason.message);
      if (failed.length) throw new Error(failed.join("; "));
    }
    document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (e) {
    document.getElementById("updated").textContent = `error: ${e.message}`;
  }
  view.polls += 1;
  view.timer = setTimeout(poll, running ? POLL_MS : POLL_ENDED_MS);
}

document.getElementById("legend").replaceChildren(...Object.entries(STATUS_LABELS).map(([s, label]) =>
  el("span", {}, Object.assign(el("i"), { style: `background:${STATUS_COLOURS[s]}` }), label)));
readHash();
window.addEventListener("hashchange", () => { readHash(); poll(); });
poll();
