// The UI's only script of its own (htmx does the rest). A task row can arrive twice, once in the
// page and once as a live event for the moment the page was rendered: keep the first of each id.
document.addEventListener("htmx:sseMessage", function () {
  var seen = {};
  document.querySelectorAll("#task-rows > tr[id]").forEach(function (row) {
    if (seen[row.id]) { row.remove(); } else { seen[row.id] = true; }
  });
});
