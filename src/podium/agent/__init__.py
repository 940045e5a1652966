"""The agent: runs on each node, holds one gRPC stream to a server, runs what it is assigned and
reports back. It owns no truth: the server's answer to its reports is final."""

import os as _os

# The agent forks task processes while gRPC threads run; gRPC's fork handlers are for children that
# keep using gRPC, which ours never do (they exec at once).
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
