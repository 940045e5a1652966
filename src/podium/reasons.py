"""The sentences Podium tells an operator about a task: why it is still queued, why it ended.

They are constants because the CLI, the UI, the API and the tests all read them, and because an
operator staring at "queued" deserves the same sentence every time. The first eight are the seed's,
word for word; the rest are added in the same voice: one plain sentence an operator can act on.
This module must never format a sentence with task-specific values: a reason is compared by equality.
"""

# --- the seed's sentences (shared/seeds/000), exactly as written -----------------------------------
NO_NODES = "no node is connected to the control plane"
NO_LABELS = "no online node carries every label this task requires"
ALL_DRAINING = "every node that could run this task is draining"
NO_ROOM = "no online node has enough free CPU or memory for this task"
FULL = "every node that could run this task is full"
NOT_ACCEPTED = "node did not accept assignment"
TIMEOUT = "timeout"
NO_LEASE = "the task is on no node and holds no lease"

# --- queued: placement reasons the seeds imply but do not word --------------------------------------
NO_POOL = "no online node is in the pool this task requires"
NO_ARCH = "no online node has the architecture this task requires"
NO_CAPABILITY = "no online node has every capability this task requires"
NO_BACKEND = "no online node offers the backend this task requires"
NO_PROTOCOL = "no online node speaks the agent protocol version this task requires"
HOME_UNAVAILABLE = "the task's home node is not online"
# A node whose stream is still open but which has sent no heartbeat for UnreachableAfter (frozen,
# partitioned): it is connected, so NO_NODES would be a lie, and it cannot take work.
UNREACHABLE = "every node that could run this task is unreachable"
TOO_LARGE = "the task is larger than any node that could run it can ever hold"
NO_DISK = "no online node has enough free disk for this task"
NO_GPU = "no online node has enough free GPUs for this task"
WAITING = "waiting for the scheduler to place this task"
NO_EGRESS = "no online node can provide the network egress this task requires"
# Capacity operations (seed Capacity.Operations): every node with room is already preparing (pulling,
# creating) as many tasks as it allows at once; one is free again as soon as one of them runs.
OPERATIONS_BUSY = "every node that could run this task is already preparing as many tasks as it allows at once"

# --- ended or requeued: what the promises say when they fire -----------------------------------------
CANCELLED = "cancelled by an operator"
NODE_LOST = "the node running this task went offline"
NODE_FORGOT = "the node reconnected without this task"
LEASE_EXPIRED = "the assignment's lease expired"
EXITED_NONZERO = "the task exited with a non-zero code"
RETRYABLE_ERROR = "the node reported an error another node may not have"
NODE_REVOKED = "the node was removed from the fleet"
SECRET_MISSING = "a secret this task needs does not exist"
SECRET_UNREADABLE = "a secret this task needs cannot be decrypted with this server's key"
OOM = "the task ran out of memory"
PROVISIONING_FAILED = "the node could not prepare the task's sandbox"
NODE_ERROR = "the node failed to run the task"
# another agent process took over the node's identity without this task; the task was given up
# only once the process that ran it had certainly stopped it (its fence deadline)
INSTANCE_REPLACED = "the agent process running this task was replaced by another one for the same node"
# `podium drain NODE --deadline`: the node is being taken out of service and the task was still on it
DRAIN_DEADLINE = "the node's drain deadline passed while this task was still on it"

# --- a dry run's answer (`podium submit --check`, POST /v1/tasks/check): the seed's ErrNoCompatibleRunner
NO_COMPATIBLE_RUNNER = "no compatible runner: no node of the fleet could ever run this task"

# --- the reconcile loop's results (the last one is shown with each attempt by `podium show`) ---------
RECONCILED_CONSISTENT = "consistent with what its node last said"
RECONCILED_NOT_CURRENT = "no longer its task's current attempt: nothing to check"
RECONCILED_NODE_REMOVED = "its node was removed from the fleet: the node-loss policy applied"
RECONCILED_NODE_OFFLINE = "its node is offline: the node-loss policy applied"
RECONCILED_NODE_FORGOT = "its node's last Hello did not list it: the node-loss policy applied"
RECONCILED_HANDOVER = "another agent process took its node over: waiting for the old one's fence deadline"
RECONCILED_DISCONNECTED = "its node is not connected: waiting for it to reconnect or go offline"
RECONCILED_UNREACHABLE = "its node is unreachable: it keeps running until the node is offline"
RECONCILED_RUNTIME_CHANGED = "its node's runtime changed since it was assigned, and the node still lists it"
RECONCILED_MOVED = "its task changed while it was being checked: it is checked again shortly"

# --- told to an agent process ------------------------------------------------------------------------
SUPERSEDED = "another agent process now presents this node's identity"

#: Every reason a queued task can carry, in the order placement checks for them.
QUEUED_REASONS = (
    NO_NODES,
    HOME_UNAVAILABLE,
    NO_POOL,
    NO_ARCH,
    NO_BACKEND,
    NO_PROTOCOL,
    NO_LABELS,
    NO_CAPABILITY,
    NO_EGRESS,
    ALL_DRAINING,
    UNREACHABLE,
    TOO_LARGE,
    NO_ROOM,
    NO_DISK,
    NO_GPU,
    FULL,
    OPERATIONS_BUSY,
)

# --- resolving a container image's tag to a digest when the task is placed ---------------------------
# The registry's own words (its error message, or the status line) are stored beside these.
REGISTRY_UNREACHABLE = "the image's registry cannot be reached"  # queued: it may answer later
IMAGE_NOT_FOUND = "the image does not exist in its registry"  # failed
REGISTRY_REFUSED = "the image's registry refused the credentials for it"  # failed
