// Live pages: every element with data-live="URL" is refreshed from that URL (an HTML
// fragment) every 2 s while the tab is visible. Never a new request while one is pending;
// no refresh while the pointer is over the element or focus in it (a button must not move
// under a click): looked at before the fetch, and again when its answer comes.
(function () {
  "use strict";
  var PERIOD = 2000;
  function live(el) {
    var busy = false;
    function engaged() { return el.matches(":hover") || el.contains(document.activeElement); }
    setInterval(function () {
      if (busy || document.hidden || engaged()) return;
      busy = true;
      fetch(el.getAttribute("data-live"), {credentials: "same-origin", headers: {"Accept": "text/html"}})
        .then(function (r) { return r.ok ? r.text() : Promise.reject(r.status); })
        .then(function (html) {
          // The pointer came meanwhile: set aside (data-held: what shows is older than the
          // server's), for the next refresh once it leaves.
          if (engaged()) return el.setAttribute("data-held", "");
          el.innerHTML = html; el.classList.remove("stale"); el.removeAttribute("data-held");
        })
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
      var sel = '[name="id"][form="' + form.getAttribute("id") + '"]';
      var n = form.ownerDocument.querySelectorAll("input" + sel + ":checked, input[data-kept]" + sel).length;
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
  // Watched list pages (the p.live-note[data-watch] base.html draws, dashboard/watch.py):
  // poll the page's version every WATCH ms while the tab is shown (at once when it shows
  // again; slower after errors). When it changed, a page of things now (data-auto) redraws
  // itself in place unless the user is busy with it (a box ticked, a control focused, the
  // pointer on a table, form, button or link); else, and on lists that grow, the note says "N new — reload".
  // Redrawing keeps the ticked boxes (one no longer on the page stays selected, a hidden
  // input of the bulk form) and the scroll.
  var WATCH = 5000, WATCH_MAX = 60000;
  function watch(note) {
    var delay = WATCH, timer = null, busy = false;
    var text = note.querySelector(".live-text");
    function schedule(ms) { clearTimeout(timer); timer = setTimeout(poll, ms); }
    function poll() {
      if (document.hidden || busy) return;  // visibilitychange polls again
      busy = true;
      var since = note.getAttribute("data-version");
      var url = note.getAttribute("data-watch");
      url += (url.indexOf("?") < 0 ? "?" : "&") + "since=" + encodeURIComponent(since);
      fetch(url, {credentials: "same-origin", headers: {"Accept": "application/json"}})
        .then(function (r) { return r.ok ? r.json() : Promise.reject(r.status); })
        .then(function (v) {
          delay = WATCH; note.classList.remove("stale");
          if (v.version === since) return;
          if (note.hasAttribute("data-auto") && !engaged()) return redraw(true);
          tell(v["new"] > 0 ? v["new"] + " new \u2014" : "This list changed \u2014");
        })
        .catch(function (status) {
          delay = Math.min(delay * 2, WATCH_MAX); note.classList.add("stale");
          if (status === 404) tell("Gone (a worker that left, a queue deleted) \u2014");
        })
        .then(function () { busy = false; schedule(delay); });
    }
    function engaged() {
      var main = note.closest("main"), focus = document.activeElement;
      return !!(main.querySelector('input[name="id"]:checked, input[data-kept]') || (focus && focus !== document.body && main.contains(focus))
                || main.querySelector("table:hover, form:hover, button:hover, a:hover"));
    }
    function tell(what) { text.textContent = what; note.hidden = false; }
    // The page anew, in place. `auto` (not asked for): the user may have come to it while
    // the page was fetched, so it is looked at again then, and left with the note if so.
    function redraw(auto) {
      var main = note.closest("main");
      return fetch(window.location.href, {credentials: "same-origin", headers: {"Accept": "text/html"}})
        .then(function (r) { return r.ok ? r.text() : Promise.reject(r.status); })
        .then(function (html) {
          if (auto && engaged()) return tell("This list changed \u2014");
          var ticked = Array.prototype.map.call(main.querySelectorAll('input[name="id"]:checked, input[name="id"][data-kept]'), function (c) { return c.value; });
          var x = window.scrollX, y = window.scrollY;
          var fresh = new DOMParser().parseFromString(html, "text/html").querySelector("main");
          var freshNote = fresh && fresh.querySelector(".live-note");
          if (!freshNote) return Promise.reject("no page");
          fresh.querySelectorAll(".flash").forEach(function (f) { f.remove(); });
          note.setAttribute("data-version", freshNote.getAttribute("data-version"));
          note.hidden = true;
          freshNote.replaceWith(note);  // the same note (its timer) in the new page
          main.replaceChildren.apply(main, Array.prototype.slice.call(fresh.childNodes));
          restore(main, ticked);
          window.scrollTo(x, y);
        });
    }
    note.querySelector("[data-reload]").addEventListener("click", function () {
      redraw().catch(function () { window.location.reload(); });
    });
    document.addEventListener("visibilitychange", function () { if (!document.hidden) schedule(0); });
    schedule(delay);
  }
  // Tick again the boxes of `ids` the new page lists; the others stay selected as hidden
  // inputs of their bulk form (its "selected" buttons send them), and the note says so.
  function restore(main, ids) {
    var form = main.querySelector("form[data-bulk]"), kept = 0;
    ids.forEach(function (id) {
      var box = Array.prototype.find.call(main.querySelectorAll('input[name="id"]'), function (c) { return c.value === id; });
      if (box) { box.checked = true; return; }
      if (!form) return;
      var hidden = document.createElement("input");
      hidden.type = "hidden"; hidden.name = "id"; hidden.value = id; hidden.setAttribute("form", form.getAttribute("id"));  // form.id: its inputs named "id"
      hidden.setAttribute("data-kept", ""); form.appendChild(hidden); kept += 1;
    });
    if (kept && form) {
      var say = document.createElement("span");
      say.className = "muted kept"; say.textContent = " (" + kept + " selected not on this page)";
      form.appendChild(say);
    }
  }
  // The guards are on the document, attached as the script runs: base.html loads it in the
  // head, not deferred, so no button can be clicked before its confirm is in place (a click
  // into a deferred script's window posted a Delete unconfirmed).
  document.addEventListener("submit", function (e) {
    var b = e.submitter || e.target.querySelector("button.danger");
    if (e.target.hasAttribute("data-bulk")) return bulk(e);
    if (b && b.classList.contains("danger")
        && !window.confirm(b.getAttribute("data-confirm") || b.textContent.trim() + "? This cannot be undone.")) e.preventDefault();
  });
  document.addEventListener("change", function (e) {  // on the document: a redrawn table has new boxes
    var all = e.target;
    if (!all.hasAttribute || !all.hasAttribute("data-check-all")) return;
    document.querySelectorAll('input[type="checkbox"][name="id"][form="' + all.getAttribute("form") + '"]').forEach(function (c) { c.checked = all.checked; });
  });
  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("[data-live]").forEach(live);
    document.querySelectorAll(".live-note[data-watch]").forEach(watch);
  });
})();
