-- A node enrolled by a join token gets its credential in the Welcome. If the stream broke between the
-- enrolment's commit and that Welcome (a database blip, a dropped connection), the agent never had
-- the credential and tried again with the join token — refused for ever, since a join token cannot
-- take an enrolled node over. The agent instance that enrolled the node is kept until it first
-- presents its credential: until then that same instance (and only it) may enrol the node again.
ALTER TABLE nodes ADD COLUMN enrolled_by_instance text;
