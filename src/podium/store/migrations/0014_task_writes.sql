-- Fewer writes per task (issue 17). A task row is written five times or so on its way (submitted, its
-- queued reason, placed, accepted, ended), and a new row version that is not a HOT update adds an
-- entry to every index of the table: write-ahead log and buffers for each.

-- Room on each page for a row's next version: a write that changes no indexed column (a queued task
-- given the reason it waits) is then a HOT update, which writes no index entry at all.
ALTER TABLE tasks SET (fillfactor = 70);

-- Not yet: the idempotency key's UNIQUE constraint indexes the NULL of every version of every task
-- without a key (~5 index entries a task). A partial unique index of the keys alone would not: the
-- submission's ON CONFLICT names the predicate already (it infers this constraint and such an index
-- alike), but a server older than that clause infers only the constraint, and would fail every
-- submission against a database migrated under it by a newer replica. The constraint goes once no
-- such server can be running.
