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
  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("[data-live]").forEach(live);
    document.addEventListener("submit", function (e) {
      var b = e.target.querySelector("button.danger");
      if (b && !window.confirm(b.textContent.trim() + "? This cannot be undone.")) e.preventDefault();
    });
  });
})();
