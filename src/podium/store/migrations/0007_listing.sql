-- Keyset paging of task listings. Newest first is (created_at, id) descending, which is a backward
-- scan of an ascending (created_at, id) index; the row comparison (created_at, id) < (cursor) is then
-- an index condition, so page 1,000 costs what page 1 costs. The mixed-direction indexes of 0001
-- could not serve the row comparison: these replace them (they serve every query those did).
CREATE INDEX tasks_page ON tasks (created_at, id);
CREATE INDEX tasks_state_page ON tasks (state, created_at, id);
-- `?name=` pages through one name's tasks without reading the others (most tasks have no name).
CREATE INDEX tasks_name_page ON tasks (name, created_at, id) WHERE name IS NOT NULL;
DROP INDEX IF EXISTS tasks_created;
DROP INDEX IF EXISTS tasks_state_created;
