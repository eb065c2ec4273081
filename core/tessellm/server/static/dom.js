// DOM helpers. Every string from the model, a client or the server goes into the page as
// text (textContent / text nodes), never as markup: nothing here parses HTML.

export function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(props)) {
    if (value === undefined || value === null) continue;
    if (name === "className") node.className = value;
    else if (name === "text") node.textContent = String(value);
    else if (name === "dataset") Object.assign(node.dataset, value);
    else if (name === "hidden") node.hidden = Boolean(value);
    else node.setAttribute(name, String(value));
  }
  append(node, children);
  return node;
}

export function append(node, children) {
  for (const child of children.flat()) {
    if (child === undefined || child === null) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

export function clear(node) {
  while (node.firstChild) node.removeChild(node.firstChild);
  return node;
}

export function byId(id) {
  return document.getElementById(id);
}

// A <dl> of [term, value] pairs; values are text.
export function fillList(dl, pairs) {
  clear(dl);
  for (const [term, value, cls] of pairs) {
    dl.append(el("dt", { text: term }), el("dd", { text: value, className: cls }));
  }
}

export function fmtNumber(x, digits = 0) {
  if (x === null || x === undefined || Number.isNaN(x)) return "–";
  return Number(x).toLocaleString("en-US", { maximumFractionDigits: digits,
                                             minimumFractionDigits: digits });
}

export function fmtSeconds(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1) return `${(s * 1000).toFixed(s < 0.01 ? 2 : 1)} ms`;
  return `${s.toFixed(2)} s`;
}

export function fmtPercent(fraction) {
  if (fraction === null || fraction === undefined) return "–";
  return `${(fraction * 100).toFixed(1)}%`;
}

export function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}
