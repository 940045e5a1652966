"""The `podium` command line (Typer + Rich)."""

import os as _os

# `podium dev` and `podium server` load gRPC before the agent package can say this (podium/agent/
# __init__.py): the processes they fork exec at once and never use gRPC, so its fork handlers only
# print "skipping fork() handlers" on the user's terminal.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
