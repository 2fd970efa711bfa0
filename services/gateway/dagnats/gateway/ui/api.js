// The gateway's API, with the API token from session storage.
//
// Every call sends `Authorization: Bearer <token>` when a token is stored. A
// 401 clears the stored token and calls the handler set with onUnauthenticated
// (the console then asks for a token), saying whether a token was refused or
// none was sent. Event streams are read with fetch, not EventSource, which
// cannot send the header.

const TOKEN_KEY = "dagnats.api-token";

export class ApiError extends Error {
  constructor(status, code, message, field) {
    super(message);
    this.status = status;
    this.code = code;
    this.field = field;
  }

  /** The message as the console shows it. */
  get text() {
    return this.field ? `${this.message} (${this.field})` : this.message;
  }
}

export const token = {
  get: () => sessionStorage.getItem(TOKEN_KEY) || "",
  set: (value) => sessionStorage.setItem(TOKEN_KEY, value),
  clear: () => sessionStorage.removeItem(TOKEN_KEY),
};

let unauthenticated = () => {};

/** fn(refused): refused is true when a stored token was refused, false when none was sent. */
export function onUnauthenticated(fn) {
  unauthenticated = fn;
}

function headers(extra = {}) {
  const out = { ...extra };
  const stored = token.get();
  if (stored) out.Authorization = `Bearer ${stored}`;
  return out;
}

async function failure(res) {
  let body = null;
  try {
    body = await res.json();
  } catch {
    // not JSON: a proxy's page, say
  }
  const err = new ApiError(
    res.status,
    body?.code ?? "http_error",
    body?.message ?? `the gateway answered ${res.status} ${res.statusText}`,
    body?.field,
  );
  if (res.status === 401) {
    const refused = Boolean(token.get());
    token.clear();
    unauthenticated(refused);
  }
  return err;
}

/** One call: the JSON answer (null for 204); throws ApiError. */
export async function call(method, path, { body, signal } = {}) {
  let res;
  try {
    res = await fetch(path, {
      method,
      signal,
      headers: headers(body === undefined ? {} : { "Content-Type": "application/json" }),
      body: body === undefined ? undefined : JSON.stringify(body),
    });
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError(0, "unreachable", `the gateway cannot be reached (${err.message})`);
  }
  if (!res.ok) throw await failure(res);
  if (res.status === 204) return null;
  return res.json();
}

export const get = (path, options) => call("GET", path, options);
export const post = (path, body) => call("POST", path, { body: body ?? {} });
export const del = (path) => call("DELETE", path);

/** Path segments, escaped. */
export function path(...parts) {
  return "/" + parts.map((p) => encodeURIComponent(p)).join("/");
}

/**
 * Follow server-sent events at `url` until closed or an `end` event:
 * on.event(type, data, id) for each event, on.state("live" | "reconnecting" |
 * "ended" | "failed", detail). A stream that breaks is opened again after the
 * server's `retry`, with Last-Event-ID when `resume` is set. A 4xx ends it
 * (on.state("failed", ApiError)). Returns { close() }.
 */
export function follow(url, on, { resume = false } = {}) {
  const controller = new AbortController();
  let lastId = "";
  let retry = 1000;
  let closed = false;
  const state = on.state ?? (() => {});

  async function once() {
    const extra = { Accept: "text/event-stream" };
    if (resume && lastId) extra["Last-Event-ID"] = lastId;
    const res = await fetch(url, { headers: headers(extra), signal: controller.signal });
    if (!res.ok) {
      const err = await failure(res);
      if (res.status < 500) {
        closed = true;
        state("failed", err);
        return;
      }
      throw err;
    }
    state("live");
    const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    let event = { type: "message", data: [], id: null };
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let nl;
      while ((nl = buffer.indexOf("\n")) >= 0) {
        const line = buffer.slice(0, nl).replace(/\r$/, "");
        buffer = buffer.slice(nl + 1);
        if (line === "") {
          if (event.data.length) {
            if (event.id !== null) lastId = event.id;
            const data = JSON.parse(event.data.join("\n"));
            on.event(event.type, data, event.id);
            if (event.type === "end") {
              closed = true;
              controller.abort();
              state("ended", data);
              return;
            }
          }
          event = { type: "message", data: [], id: null };
          continue;
        }
        if (line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const val = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "event") event.type = val;
        else if (field === "data") event.data.push(val);
        else if (field === "id") event.id = val;
        else if (field === "retry" && /^\d+$/.test(val)) retry = Number(val);
      }
    }
  }

  (async () => {
    while (!closed) {
      let broke = null;
      try {
        await once();
      } catch (err) {
        if (closed || err.name === "AbortError") return;
        broke = err;
      }
      if (closed) return;
      state("reconnecting", broke);
      await new Promise((resolve) => setTimeout(resolve, retry));
    }
  })();

  return {
    close() {
      closed = true;
      controller.abort();
    },
  };
}
