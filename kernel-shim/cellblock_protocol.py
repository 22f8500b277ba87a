"""What the zygote shares with the server and the shim (both C++), under the
names of CELLBLOCK_SANDBOX_PROTOCOL in include/cellblock/sandbox_protocol.hpp,
which defines them; tests/unit/sandbox_protocol_test.cpp fails when this file
says otherwise. A change here is a change there."""

# Paths inside every sandbox.
SHIM = "/opt/cellblock/cellblock-shim"
CONNECTION_FILE = "/run/cellblock/kernel.json"

# The zygote's command line (after the interpreter and the script).
SOCKET_OPTION = "--socket"
PRELOAD_OPTION = "--preload"
WARM_IMPORTS_OPTION = "--warm-imports"

# Server -> zygote on its control socket: "seccomp <BPF program>" once, then
# fork requests (JSON, with FORK_FDS attached). Replies are JSON objects with
# these keys.
SECCOMP = "seccomp"
MAX_REQUEST = 65536
REPLY_PID = "pid"
REPLY_REFUSED = "refused"
REPLY_SKIPPED = "skipped"
REPLY_ERROR = "error"

# A fork's reports on its report socket, and the server's answers, in order:
# "userns", "mapped", "init PID", "cgrouped", "ready"; "error WHY" at any step.
REPORT_USERNS = "userns"
ANSWER_MAPPED = "mapped"
REPORT_INIT = "init"
ANSWER_CGROUPED = "cgrouped"
REPORT_READY = "ready"
REPORT_ERROR = "error"

# The descriptors attached to a fork request, in this order; then one v1
# cgroup `tasks` file per hierarchy (the request's "cgroups" count), at most
# MAX_CGROUP_FDS.
FORK_FDS = ("report", "lifeline", "log", "ipc", "input", "output")
MAX_CGROUP_FDS = 32

# The shim adopting a forked kernel: `cellblock-shim --adopt KERNEL_PID
# STDERR_FD`, with the lifeline at its usual fd and the kernel's stderr pipe
# at the next one.
SHIM_ADOPT_OPTION = "--adopt"
LIFELINE_FD = 3
ADOPTED_STDERR_FD = 4
# A fork request's grace (ms) for the session's sandbox to outlive its
# server, passed to the forked session's shim in this variable.
ADOPT_GRACE_ENV = "CELLBLOCK_ADOPT_GRACE_MS"
ADOPT_GRACE_REQUEST = "adopt_grace_ms"

# A Swarm task's egress tunnel (docs/scale-out.md, "Egress"): when its
# connection file has EGRESS_TUNNEL_FIELD, the kernel binds a CurveZMQ ROUTER
# on that port and the front connects a DEALER. Every message is [verb,
# connection id, ...]: hello (front, id "": the trust store, which the kernel
# writes to CA_BUNDLE, and its HMAC-SHA256 in hex with the kernel's message
# key, without which it is refused; the kernel answers hello and listens on
# EGRESS_SOCKET), open (kernel: a client came), data (either: offset, bytes),
# ack (either: bytes delivered in all), eof (either: no more data), close
# (either: gone). At most TUNNEL_WINDOW bytes unacknowledged per connection
# and way, TUNNEL_CHUNK per data, TUNNEL_MAX_CONNECTIONS at once.
EGRESS_TUNNEL_FIELD = "cellblock_egress_port"
EGRESS_TUNNEL_PORT = 5560
EGRESS_SOCKET = "/run/cellblock/egress.sock"
CA_BUNDLE = "/run/cellblock/ca-certificates.crt"
TUNNEL_HELLO = "hello"
TUNNEL_OPEN = "open"
TUNNEL_DATA = "data"
TUNNEL_ACK = "ack"
TUNNEL_EOF = "eof"
TUNNEL_CLOSE = "close"
TUNNEL_CHUNK = 65536
TUNNEL_WINDOW = 262144
TUNNEL_MAX_CONNECTIONS = 128

# Set (to 1) in the kernel's environment by a shim that bridges its channels
# (the exact level on runsc): ipykernel starts without its IOPub pipe, a
# loopback TCP socket that `runsc checkpoint` refuses ("endpoint still has
# waiters upon save").
NO_IOPUB_PIPE_ENV = "CELLBLOCK_NO_IOPUB_PIPE"
