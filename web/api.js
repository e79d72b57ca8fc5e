// HTTP and server-sent events against the localheap server (same origin).
// Every call goes through fetch so the optional API key travels as a header
// (EventSource cannot send one).

const KEY_STORE = "localheap.apiKey";

export class ApiError extends Error {
  constructor(status, message, code = null) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export function apiKey() {
  return localStorage.getItem(KEY_STORE) || "";
}

export function setApiKey(key) {
  if (key) localStorage.setItem(KEY_STORE, key);
  else localStorage.removeItem(KEY_STORE);
}

function headers(sessionId, json) {
  const h = { "X-Localheap-Client": "web" };   // sessions this page opens are listed as its conversations
  if (json) h["Content-Type"] = "application/json";
  if (sessionId) h["X-Session-Id"] = sessionId;
  const key = apiKey();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

// The server's OpenAI-style error body -> ApiError.
async function failure(response) {
  let message = `${response.status} ${response.statusText}`;
  let code = null;
  try {
    const err = (await response.json()).error;
    if (err) {
      message = err.message || message;
      code = err.code || null;
    }
  } catch { /* not JSON */ }
  return new ApiError(response.status, message, code);
}

/** fetch with the API key and session header; throws ApiError unless 2xx. */
export async function request(method, path, { body, sessionId, signal } = {}) {
  let response;
  try {
    response = await fetch(path, {
      method,
      headers: headers(sessionId, body !== undefined),
      body: body === undefined ? undefined : JSON.stringify(body),
      signal,
      cache: "no-store",
    });
  } catch (e) {   // fetch's own TypeError ("Failed to fetch"): no answer at all
    if (e instanceof TypeError) throw new ApiError(0, "The server could not be reached: is it still running?", "unreachable");
    throw e;
  }
  if (!response.ok) throw await failure(response);
  return response;
}

export async function getJSON(path, opts) {
  return (await request("GET", path, opts)).json();
}

export async function postJSON(path, body, opts = {}) {
  return (await request("POST", path, { ...opts, body })).json();
}

/** The {event, data} messages of a text/event-stream response, as they arrive. */
export async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let event = "message";
  let data = [];
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let nl;
      while ((nl = buffer.search(/\r?\n/)) >= 0) {
        const line = buffer.slice(0, nl);
        buffer = buffer.slice(nl + (buffer[nl] === "\r" ? 2 : 1));
        if (line === "") {
          if (data.length) yield { event, data: data.join("\n") };
          event = "message";
          data = [];
        } else if (line.startsWith(":")) {
          continue;   // comment (keep-alive ping)
        } else {
          const colon = line.indexOf(":");
          const field = colon < 0 ? line : line.slice(0, colon);
          let value = colon < 0 ? "" : line.slice(colon + 1);
          if (value.startsWith(" ")) value = value.slice(1);
          if (field === "event") event = value;
          else if (field === "data") data.push(value);
        }
      }
    }
    if (data.length) yield { event, data: data.join("\n") };
  } finally {
    reader.cancel().catch(() => {});
  }
}
