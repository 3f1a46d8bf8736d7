// The console's only script: follow the server-sent events and, on each change, fetch the page's live part
// again (the same URL, rendered by the same template) and put it in place. Forms sit outside the live part,
// so a refresh never clears what an operator is typing. At most one fetch runs; changes during it ask for one
// more after it.
(function () {
  "use strict";
  var live = document.getElementById("live");
  var body = document.body;
  if (!live || !window.EventSource || !window.fetch) { return; }
  var busy = false, again = false, refreshed = 0;
  // A refused form's page answers a POST: show, reload and refresh the page it belongs to, never the action.
  if (body.getAttribute("data-page") && window.history.replaceState) {
    window.history.replaceState(null, "", body.getAttribute("data-page"));
  }

  function refresh() {
    if (busy) { again = true; return; }
    busy = true;
    fetch(window.location.href, { headers: { "X-Console-Live": "1" }, credentials: "same-origin", cache: "no-store" })
      .then(function (resp) {
        if (resp.status === 401) { window.location.reload(); return null; }  // the session ended: show the refusal
        return resp.text();
      })
      .then(function (html) {
        if (html !== null) {
          live.innerHTML = html;
          refreshed += 1;
          body.setAttribute("data-refreshed", String(refreshed));
        }
      })
      .catch(function () { /* the next change or reconnection asks again */ })
      .then(function () {
        busy = false;
        if (again) { again = false; refresh(); }
      });
  }

  var events = new EventSource(body.getAttribute("data-events"));
  events.addEventListener("changed", refresh);
  events.addEventListener("open", function () {
    body.setAttribute("data-live", "on");
    // What committed between the page's rendering (or the stream's loss) and this subscription was announced to
    // nobody: one refresh covers it.
    refresh();
  });
  events.addEventListener("error", function () { body.setAttribute("data-live", "off"); });
})();
