-- A task's output is read in the order the agent read it, never in the order rows were inserted:
-- by attempt (fencing tokens grow with attempts), then by the agent's `seq`, which from now on counts
-- both streams of an attempt together. Each chunk also keeps its byte offset within its attempt's
-- stream, so a reader can resume at a byte and check that nothing is missing or doubled.
ALTER TABLE log_chunks ADD COLUMN byte_offset bigint;

-- Chunks stored before: their seq counted each stream on its own, which is the true order within a
-- stream; between the streams the best evidence is when each was stored (one flush per `at`).
-- Renumbered through negative values, so no row meets another's key halfway.
UPDATE log_chunks l
SET seq = -1 - r.pos, byte_offset = r.byte_offset
FROM (
    SELECT task_id, fencing_token, stream, seq,
           row_number() OVER (PARTITION BY task_id, fencing_token ORDER BY at, seq, stream) - 1 AS pos,
           coalesce(sum(length(data)) OVER (PARTITION BY task_id, fencing_token, stream ORDER BY seq
                                            ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS byte_offset
    FROM log_chunks
) r
WHERE (l.task_id, l.fencing_token, l.stream, l.seq) = (r.task_id, r.fencing_token, r.stream, r.seq);
UPDATE log_chunks SET seq = -1 - seq WHERE seq < 0;

ALTER TABLE log_chunks ALTER COLUMN byte_offset SET NOT NULL;
ALTER TABLE log_chunks ADD CONSTRAINT log_chunks_byte_offset CHECK (byte_offset >= 0);
ALTER TABLE log_chunks ADD CONSTRAINT log_chunks_seq CHECK (seq >= 0);
CREATE INDEX log_chunks_order ON log_chunks (task_id, fencing_token, seq, stream);
