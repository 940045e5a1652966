"""The scheduler: places queued work on nodes and keeps the promises that placement makes.

`policy` is the pure part (what a node's event, a deadline or a lost node means for a task);
`service` holds the two loops that read state and `now` from the database, call the pure parts and
write their decisions back through the store's compare-and-set.
"""
