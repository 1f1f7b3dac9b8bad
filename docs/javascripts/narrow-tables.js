/* Tables that do not fit the content column are shown as cards (docs/stylesheets/extra.css):
   one card per row, each cell under its column's heading. A table that fits stays a table, so at
   1280 px and wider every table is still one; on a phone a wide alias, translation or API table
   becomes cards instead of hiding its last columns off-screen.

   Each cell gets its column's heading in `data-label`; a table that is wider than its box gets
   `data-cards`. Checked on every page Material shows (instant navigation included), when the
   window is resized, and when a details block or a content tab opens. tests/test_browser.py
   checks the result at 390, 1280 and 1920 px. */
(function () {
  "use strict";

  function label(table) {
    var headings = Array.prototype.map.call(
      table.querySelectorAll("thead tr:first-child > th"),
      function (th) { return th.textContent.trim(); }
    );
    table.querySelectorAll("tbody tr").forEach(function (row) {
      var column = 0;
      Array.prototype.forEach.call(row.children, function (cell) {
        var heading = headings[column];
        if (heading && !cell.hasAttribute("data-label")) cell.setAttribute("data-label", heading);
        column += cell.colSpan || 1;
      });
    });
  }

  function fit(table) {
    if (!table.getClientRects().length) return; // hidden (a closed details block, another tab)
    table.removeAttribute("data-cards");
    var box = table.closest(".md-typeset__scrollwrap") || table.parentElement;
    var wide = box.scrollWidth > box.clientWidth + 1 || table.scrollWidth > table.clientWidth + 1;
    if (wide) table.setAttribute("data-cards", "");
  }

  function tables() {
    return document.querySelectorAll("article.md-content__inner table:not([class])");
  }

  function fitAll() {
    tables().forEach(fit);
  }

  function setUp() {
    tables().forEach(label);
    fitAll();
  }

  var pending = false;
  function later() {
    if (pending) return;
    pending = true;
    window.requestAnimationFrame(function () {
      pending = false;
      fitAll();
    });
  }

  window.addEventListener("resize", later);
  document.addEventListener("toggle", later, true); // <details> opened or closed
  document.addEventListener("change", later, true); // a content tab chosen
  if (window.document$ && typeof window.document$.subscribe === "function") {
    window.document$.subscribe(setUp);
  } else if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", setUp);
  } else {
    setUp();
  }
})();
