// Small line charts drawn as SVG elements (no library, no markup strings). The x axis is
// the last `spanS` seconds ending now; each series is a polyline over the points in range.
import { clear } from "./dom.js";

const SVG = "http://www.w3.org/2000/svg";
const W = 300, H = 90, PAD = 12;

function svgEl(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  return node;
}

// series: [{key, className}]; fixedMax: a y-axis maximum (else the data's, at least 1).
export function drawChart(svg, points, series, { now, spanS, fixedMax, format }) {
  clear(svg);
  const inRange = points.filter((p) => p.t >= now - spanS);
  let max = fixedMax;
  if (max === undefined) {
    max = 1;
    for (const p of inRange) for (const s of series) max = Math.max(max, p[s.key]);
  }
  const x = (t) => ((t - (now - spanS)) / spanS) * W;
  const y = (v) => H - PAD - (v / max) * (H - 2 * PAD);
  svg.append(svgEl("line", { x1: 0, y1: y(0), x2: W, y2: y(0), class: "axis" }));
  svg.append(svgEl("line", { x1: 0, y1: y(max), x2: W, y2: y(max), class: "grid" }));
  const top = svgEl("text", { x: 2, y: PAD - 2, class: "label" });
  top.textContent = format ? format(max) : String(max);
  svg.append(top);
  for (const s of series) {
    if (inRange.length === 0) continue;
    const coords = inRange.map((p) => `${x(p.t).toFixed(1)},${y(p[s.key]).toFixed(1)}`);
    svg.append(svgEl("polyline", { points: coords.join(" "), class: `line ${s.className}` }));
  }
}
