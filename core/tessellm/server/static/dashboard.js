// The engine dashboard: polls /api/dashboard (once a second while shown) and renders the
// snapshot. Every value is put into the page as text; kernel and model names included.
import { getJSON } from "./api.js";
import { drawChart } from "./charts.js";
import { byId, clear, el, fillList, fmtBytes, fmtNumber, fmtPercent, fmtSeconds } from "./dom.js";

const CHART_SPAN_S = 300;

function tokenRange(run) {
  return run.from_tokens === run.to_tokens ? `T${run.from_tokens}`
    : `T${run.from_tokens}–${run.to_tokens}`;
}

// Speculative decoding's rows of the tokens card (none when the engine does not speculate).
function speculativeRows(spec) {
  if (!spec) return [];
  return [
    [`speculation (${spec.method}) acceptance`, fmtPercent(spec.acceptance_rate)],
    ["mean accepted length", fmtNumber(spec.mean_accepted_length, 2)],
    ["draft tokens accepted", `${fmtNumber(spec.accepted_tokens)} / ${fmtNumber(spec.draft_tokens)}`],
  ];
}

export class Dashboard {
  constructor() {
    this.timer = null;
    this.last = null;
    this.error = null;   // the latest refresh's failure (null after a success)
  }

  render(d) {
    this.last = d;
    const e = d.engine;
    byId("dash-error").hidden = true;
    const plugin = e.plugin ? `${e.plugin}${e.plugin_version ? " " + e.plugin_version : ""}` : "–";
    const alive = e.alive ? (e.draining ? "draining" : "alive") : "dead";
    fillList(byId("card-engine"), [
      ["device", e.device], ["plugin", plugin], ["dtype", e.dtype],
      ["engine core", `${alive} (pid ${e.core_pid})`, e.alive ? "ok" : "bad"],
      ["last report", fmtSeconds(e.last_report_age_s) + " ago"],
      ["weights", fmtBytes(e.weight_bytes)],
      ...(e.fatal_error ? [["error", e.fatal_error, "bad"]] : []),
    ]);
    const r = d.requests;
    fillList(byId("card-requests"), [
      ["running", fmtNumber(r.running)], ["waiting", fmtNumber(r.waiting)],
      ["preemptions", fmtNumber(d.preemptions)], ["engine steps", fmtNumber(d.steps)],
    ]);
    const rows = byId("priority-rows");
    clear(rows);
    for (const p of r.by_priority) {
      rows.append(el("tr", { dataset: { priority: p.priority } },
                     el("td", { text: p.priority }), el("td", { text: p.running }),
                     el("td", { text: p.waiting })));
    }
    const kv = d.kv;
    fillList(byId("card-kv"), [
      ["blocks in use", `${fmtNumber(kv.blocks_used)} / ${fmtNumber(kv.blocks_total)}`],
      ["usage", fmtPercent(kv.usage)],
      ["prefix-cache hit rate", fmtPercent(d.prefix_cache.hit_rate)],
      ["prefix-cache hits", `${fmtNumber(d.prefix_cache.hits)} / ${fmtNumber(d.prefix_cache.queries)} tokens`],
    ]);
    byId("kv-bar").style.width = `${Math.min(100, kv.usage * 100).toFixed(1)}%`;
    fillList(byId("card-tokens"), [
      ["generated tok/s", fmtNumber(d.tokens.gen_tps, 1)],
      ["prompt tok/s", fmtNumber(d.tokens.prompt_tps, 1)],
      ["generated", fmtNumber(d.tokens.generated)], ["prompt", fmtNumber(d.tokens.prompt)],
      ...speculativeRows(d.speculative),
    ]);
    byId("latency-window").textContent = `last ${Math.round(d.latency.window_s / 60)} min`;
    const lat = byId("latency-rows");
    clear(lat);
    for (const [name, s] of [["TTFT", d.latency.ttft], ["TPOT", d.latency.tpot]]) {
      lat.append(el("tr", {}, el("th", { text: name }), el("td", { text: fmtSeconds(s.p50) }),
                    el("td", { text: fmtSeconds(s.p90) }), el("td", { text: fmtSeconds(s.p99) }),
                    el("td", { text: s.count })));
    }
    byId("card-replicas").hidden = d.replicas.length === 0;
    const replicas = byId("replica-rows");
    clear(replicas);
    for (const rep of d.replicas) {
      replicas.append(el("tr", { dataset: { replica: rep.name } },
                         el("td", { text: rep.name }),
                         el("td", { text: rep.alive ? (rep.responsive ? "in rotation" : "unresponsive")
                           : "down", className: rep.alive && rep.responsive ? "ok" : "bad" }),
                         el("td", { text: rep.core_pid }), el("td", { text: rep.running }),
                         el("td", { text: rep.waiting }), el("td", { text: fmtPercent(rep.kv_usage) }),
                         el("td", { text: `${fmtNumber(rep.prefix_cache_hits)} / ${fmtNumber(rep.prefix_cache_queries)}` })));
    }
    fillList(byId("card-finished"), Object.entries(r.finished).map(
      ([reason, n]) => [reason, fmtNumber(n)]));
    const kernels = byId("kernel-rows");
    clear(kernels);
    for (const k of d.kernels) {
      kernels.append(el("tr", {}, el("td", { text: k.op }), el("td", { text: k.dims }),
                        el("td", { text: k.dtype }),
                        el("td", { text: k.runs.map((run) => `${run.kernel} (${tokenRange(run)})`)
                          .join(", ") })));
    }
    const points = d.history.points;
    const opts = { now: d.time, spanS: CHART_SPAN_S };
    drawChart(byId("chart-tps"), points, [{ key: "gen_tps", className: "s-tps" }],
              { ...opts, format: (v) => `${fmtNumber(v, 0)} tok/s` });
    drawChart(byId("chart-requests"), points,
              [{ key: "running", className: "s-running" }, { key: "waiting", className: "s-waiting" }],
              { ...opts, format: (v) => `${fmtNumber(v, 0)} req` });
    drawChart(byId("chart-kv"), points.map((p) => ({ ...p, kv_pct: p.kv_usage * 100 })),
              [{ key: "kv_pct", className: "s-kv" }], { ...opts, fixedMax: 100, format: () => "100%" });
  }

  async refresh() {
    try {
      this.render(await getJSON("/api/dashboard"));
      this.error = null;
      return this.last;
    } catch (err) {
      this.error = err;
      const box = byId("dash-error");
      box.textContent = `dashboard: ${err.message}`;
      box.hidden = false;
      return null;
    }
  }
}
