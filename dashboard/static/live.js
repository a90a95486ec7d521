// Live pages: every element with data-live="URL" is refreshed from that URL (an HTML
// fragment) every 2 s while the tab is visible. Never a new request while one is pending;
// no refresh while the pointer is over the element (a button must not move under a click).
(function () {
  "use strict";
  var PERIOD = 2000;
  function live(el) {
    var busy = false;
    setInterval(function () {
      if (busy || document.hidden || el.matches(":hover") || el.contains(document.activeElement)) return;
      busy = true;
      fetch(el.getAttribute("data-live"), {credentials: "same-origin", headers: {"Accept": "text/html"}})
        .then(function (r) { return r.ok ? r.text() : Promise.reject(r.status); })
        .then(function (html) { el.innerHTML = html; el.classList.remove("stale"); })
        .catch(function () { el.classList.add("stale"); })
        .then(function () { busy = false; });
    }, PERIOD);
  }
  // Bulk retry and delete of failed jobs (the Failed page's form[data-bulk]): the ticked
  // ones in one request; "all matching" in batches of BATCH, each answering a cursor for the
  // next, with a progress bar between them.
  var BATCH = 200;
  function bulk(e) {
    var form = e.target, b = e.submitter, danger = b && b.classList.contains("danger");
    if (b && b.hasAttribute("data-selected")) {
      var n = form.ownerDocument.querySelectorAll('input[name="id"][form="' + form.getAttribute("id") + '"]:checked').length;
      if (!n) { e.preventDefault(); window.alert("Tick the jobs first."); return; }
      if (danger && !window.confirm("Delete " + n + " selected job" + (n === 1 ? "" : "s") + "? This cannot be undone.")) e.preventDefault();
      return;
    }
    if (!b || !b.hasAttribute("data-all")) return;
    e.preventDefault();
    var total = +b.getAttribute("data-all"), verb = danger ? "deleted" : "retried";
    if (!window.confirm(b.textContent.trim() + (danger ? "? This cannot be undone." : "?"))) return;
    var box = form.querySelector(".progress"), bar = box.querySelector("progress"), text = box.querySelector(".progress-text");
    var counts = {done: 0, refused: 0, gone: 0};
    box.hidden = false; bar.max = Math.max(total, 1); bar.value = 0;
    form.querySelectorAll("button").forEach(function (x) { x.disabled = true; });
    function step(cursor) {
      var data = new FormData(form);
      data.delete("id");
      data.set("all", "1"); data.set("limit", String(BATCH));
      if (cursor) Object.keys(cursor).forEach(function (k) { data.set("cursor_" + k, String(cursor[k])); });
      fetch(b.getAttribute("formaction") || form.getAttribute("action"), {method: "POST", body: data, credentials: "same-origin", headers: {"Accept": "application/json"}})
        .then(function (r) {
          if (r.ok) return r.json();
          return r.json().then(function (j) { return Promise.reject(j.error); }, function () { return Promise.reject("HTTP " + r.status); });
        })
        .then(function (out) {
          counts.done += out.done; counts.refused += out.refused; counts.gone += out.gone;
          var seen = counts.done + counts.refused + counts.gone;
          bar.max = Math.max(seen + out.left, 1); bar.value = seen;
          text.textContent = verb + " " + counts.done + " of " + (seen + out.left) + "…";
          if (out.cursor) return step(out.cursor);
          text.textContent = "Done: " + counts.done + " " + verb + ", " + counts.refused + " refused, " + counts.gone + " gone. ";
          var again = document.createElement("a");
          again.href = window.location.href; again.textContent = "Show the list again";
          text.appendChild(again);
        })
        .catch(function (err) {
          text.textContent = "Stopped: " + err + " (" + counts.done + " " + verb + " before).";
          form.querySelectorAll("button").forEach(function (x) { x.disabled = false; });
        });
    }
    step(null);
  }
  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("[data-live]").forEach(live);
    document.addEventListener("submit", function (e) {
      var b = e.submitter || e.target.querySelector("button.danger");
      if (e.target.hasAttribute("data-bulk")) return bulk(e);
      if (b && b.classList.contains("danger")
          && !window.confirm(b.getAttribute("data-confirm") || b.textContent.trim() + "? This cannot be undone.")) e.preventDefault();
    });
    document.querySelectorAll("[data-check-all]").forEach(function (all) {
      all.addEventListener("change", function () {
        document.querySelectorAll('input[name="id"][form="' + all.getAttribute("form") + '"]').forEach(function (c) { c.checked = all.checked; });
      });
    });
  });
})();
