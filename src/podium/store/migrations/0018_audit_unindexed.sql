-- The audit log without its index on `at` (issue 17). Every submitted task writes an audit entry, and
-- each entry went into that index too, which no query reads: the audit listing and its count page
-- by `id` (the primary key, in the order the entries were written). One B-tree insert of ~49 a task
-- fewer (docs/benchmarks.md, "Fortieth session"). A server older than this migration reads the log
-- by `id` as well.
DROP INDEX IF EXISTS audit_log_at;
