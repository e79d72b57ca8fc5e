// Number and size formatting shared by the views.

const INT = new Intl.NumberFormat("en-US");

export function int(n) {
  return Number.isFinite(n) ? INT.format(Math.round(n)) : "–";
}

/** Bytes in binary units, as the CLI prints them (KiB, MiB, GiB). */
export function bytes(n) {
  if (!Number.isFinite(n)) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) {
    n /= 1024;
    i++;
  }
  return i === 0 ? `${Math.round(n)} B` : `${n.toFixed(n >= 100 ? 0 : 1)} ${units[i]}`;
}

export function rate(n) {
  if (!Number.isFinite(n)) return "–";
  return n >= 100 ? int(n) : n.toFixed(1);
}

/** "x 24" style ratio of seen tokens to heap slots; "" when the heap has not overflowed. */
export function times(seen, capacity) {
  if (!capacity || seen <= capacity) return "";
  const r = seen / capacity;
  return r >= 100 ? int(r) : r.toFixed(r >= 10 ? 0 : 1);
}

export function shortId(id) {
  return id ? id.replace(/^sess_/, "").slice(0, 6) : "";
}

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children) if (c !== null && c !== undefined) node.append(c);
  return node;
}
