-- Fewer writes per task (issue 17). A task row is written five times or so on its way (submitted, its
-- queued reason, placed, accepted, ended), and a new row version that is not a HOT update adds an
-- entry to every index of the table: write-ahead log and buffers for each.

-- The idempotency key is unique among the tasks that have one. A UNIQUE constraint indexes every NULL
-- too, so every version of every task without a key wrote an entry for a key it does not have.
ALTER TABLE tasks DROP CONSTRAINT IF EXISTS tasks_idempotency_key_key;
CREATE UNIQUE INDEX tasks_idempotency_key ON tasks (idempotency_key) WHERE idempotency_key IS NOT NULL;

-- Room on each page for a row's next version: a write that changes no indexed column (a queued task
-- given the reason it waits) is then a HOT update, which writes no index entry at all.
ALTER TABLE tasks SET (fillfactor = 70);
