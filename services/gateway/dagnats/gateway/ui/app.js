// The console: a page per location hash, and the token prompt.
//
//   #/runs?workflow=&status=      the runs, live; start a run
//   #/runs/<run>                  a run: its steps, cancel, the journal check
//   #/runs/<run>/steps/<step>     a step's journal, live tokens, its inputs
//   #/runs/<a>/diff/<b>           two runs' journals side by side
//
// A page is a function (view, params, crumbs) that fills `view` and returns
// the function that stops what it follows; leaving a page calls it.

import { onUnauthenticated, token } from "./api.js";
import { fill, h } from "./dom.js";
import { diffPage } from "./fork.js";
import { runPage } from "./run.js";
import { runsPage } from "./runs.js";
import { stepPage } from "./step.js";

const view = document.getElementById("view");
const crumbs = document.getElementById("crumbs");
const auth = document.getElementById("auth");
const authMessage = document.getElementById("auth-message");
const tokenInput = document.getElementById("token-input");
const forget = document.getElementById("forget-token");
let stop = null;

function route() {
  const [where, query = ""] = location.hash.replace(/^#\/?/, "").split("?");
  const parts = where.split("/").filter(Boolean).map(decodeURIComponent);
  const params = new URLSearchParams(query);
  if (parts.length <= 1 && (parts[0] ?? "runs") === "runs") {
    return [runsPage, { workflow: params.get("workflow") ?? "", status: params.get("status") ?? "" }];
  }
  if (parts[0] === "runs" && parts.length === 2) return [runPage, { run: parts[1] }];
  if (parts[0] === "runs" && parts[2] === "diff" && parts.length === 4) {
    return [diffPage, { run: parts[1], other: parts[3] }];
  }
  if (parts[0] === "runs" && parts[2] === "steps" && parts.length === 4) {
    return [stepPage, { run: parts[1], step: parts[3] }];
  }
  return [notFound, {}];
}

function notFound(el) {
  fill(el, h("section", { class: "panel" }, h("p", {}, "No such page. "), h("a", { href: "#/runs" }, "All runs")));
  return () => {};
}

function show() {
  stop?.();
  stop = null;
  forget.hidden = !token.get();
  const [page, params] = route();
  fill(view);
  stop = page(view, params, (...items) => fill(crumbs, ...items));
}

function askForToken(refused) {
  stop?.();
  stop = null;
  fill(view);
  forget.hidden = true;
  const wasShown = !auth.hidden;
  // A refusal says more than "none sent": keep it when several calls fail.
  if (!wasShown || refused) {
    authMessage.textContent = refused
      ? "The gateway refused the token: it is wrong, or it has expired (the gateway's token was changed). Enter the API token again."
      : "This gateway needs its API token to show runs. Enter it to go on.";
    authMessage.className = refused ? "msg msg-error" : "msg msg-info";
    authMessage.dataset.reason = refused ? "refused" : "missing";
  }
  auth.hidden = false;
  tokenInput.value = "";
  tokenInput.focus();
}

document.getElementById("token-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const value = tokenInput.value.trim();
  if (!value) return;
  token.set(value);
  auth.hidden = true;
  show();
});

forget.addEventListener("click", () => {
  token.clear();
  show();
});

onUnauthenticated(askForToken);
window.addEventListener("hashchange", () => {
  if (auth.hidden) show();
});
show();
