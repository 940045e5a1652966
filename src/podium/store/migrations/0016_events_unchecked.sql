-- A task's events without a foreign key (issue 17). Every event row is written by the statement that
-- writes its task's row (a submission, a placement, a compare-and-set), from the rows it wrote: it
-- can name no other task. The key's check cost a lookup and a row lock on `tasks` for every event,
-- five a task (~6 µs of the database's CPU each here, a tenth of what the events cost). What the
-- cascade did, pruning does itself: it deletes a pruned task's events with it (`prune_finished`).
ALTER TABLE task_events DROP CONSTRAINT IF EXISTS task_events_task_id_fkey;
