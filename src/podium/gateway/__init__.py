"""The agent gateway: holds each node's gRPC stream, turns what nodes say into store transitions
and delivers what the store says nodes owe (Assigns, stops) onto their streams.

One module per piece of state: `sessions` (the streams, Hello reconciliation), `reports` (the report
batcher and its backlog, release proofs), `outbox` (delivery), `liveness` (heartbeats, log flushes),
and `service` (the `Connect` stream that wires them).
"""
