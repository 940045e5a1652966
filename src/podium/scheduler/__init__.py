"""The scheduler: places queued work on nodes and keeps the promises that placement makes.

`policy` is the pure part (what a node's event, a deadline or a lost node means for a task: a Step);
`apply` is the one place a Step becomes a compare-and-set in the store; `dispatch`, `watchdog` and
`resolver` are the loops (each a `woken` loop or a timer) that read state and `now` from the
database, ask the pure parts and apply their answers; `service` wires them and holds the operator's
actions (explain, check, cancel).
"""
