"""The agent gateway: holds each node's gRPC stream, turns what nodes say into store transitions
and delivers what the store says nodes owe (Assigns, stops) onto their streams."""
