// Building the page: elements from data, never from HTML strings, so nothing
// a run, a tool or a model wrote can become markup.

/** An element: h("a", {href, class: "x", onclick: fn}, "text", child, [more]). */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith("on") && typeof value === "function") {
      el.addEventListener(name.slice(2), value);
    } else if (name === "class") {
      el.className = value;
    } else if (name === "value") {
      el.value = value;
    } else {
      el.setAttribute(name, value === true ? "" : String(value));
    }
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    if (Array.isArray(child)) append(el, child);
    else el.append(child instanceof Node ? child : String(child));
  }
}

/** A table cell; on a narrow screen, where rows become cards, it shows its label. */
export function cell(label, attrs, ...children) {
  return h("td", { ...attrs, "data-label": label }, ...children);
}

/** Replace an element's children. */
export function fill(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

/** A status as a coloured label; its text is the status. */
export function badge(text, kind = text) {
  return h("span", { class: `badge b-${kind}`, "data-badge": kind }, text);
}

/** The first characters of an id, the whole id on hover. */
export function short(id, n = 8) {
  if (!id) return "";
  return h("code", { title: id, class: "id" }, id.length > n ? id.slice(0, n) : id);
}

/** A JSON value, pretty; under a label that folds it when it is long. */
export function jsonBlock(value, label = "") {
  const text = typeof value === "string" ? value : (JSON.stringify(value, null, 2) ?? "null");
  const pre = h("pre", { class: "json" }, text);
  if (!label) return pre;
  return h("details", { open: text.length < 400 }, h("summary", {}, label), pre);
}

/** A timestamp (RFC 3339) as local time; the date too when not today. */
export function time(iso) {
  if (!iso) return "";
  const t = new Date(iso);
  if (Number.isNaN(t.getTime())) return iso;
  const today = new Date().toDateString() === t.toDateString();
  const clock = t.toLocaleTimeString([], { hour12: false });
  return today ? clock : `${t.toLocaleDateString()} ${clock}`;
}

/** A timestamp element: local time, the exact time on hover. */
export function when(iso) {
  return iso ? h("time", { datetime: iso, title: iso }, time(iso)) : "";
}

/** A message line: kind is "error", "ok" or "info". */
export function say(el, kind, ...text) {
  fill(el, ...text);
  el.className = `msg msg-${kind}`;
  el.hidden = false;
}
