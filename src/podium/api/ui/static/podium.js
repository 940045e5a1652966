// The UI's only script of its own (htmx does the rest). A task row can arrive twice: once in the
// page and once as the live event of its creation, replayed from the moment the page was rendered
// and inserted above it. The row that was there first is at least as fresh (it was rendered after
// the task was created, and may carry the reason placement gave it since, which no event repeats),
// so of each id keep the last in the table: the one already there.
document.addEventListener("htmx:sseMessage", function () {
  var seen = {};
  var rows = Array.prototype.slice.call(document.querySelectorAll("#task-rows > tr[id]")).reverse();
  rows.forEach(function (row) {
    if (seen[row.id]) { row.remove(); } else { seen[row.id] = true; }
  });
});
