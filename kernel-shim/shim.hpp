// What the shim's parts share: shim.cpp (the init: the kernel, the lifeline,
// signals, zombies, the kernel's stderr), egress_forwarder.cpp and
// engine_sandbox.cpp. libc only, like the rest of the shim.
#pragma once

#include <sys/types.h>

namespace cellblock::shim {

// "cellblock-shim: " + fmt (with one %s of arg) + '\n' on stderr, the session's log.
void say(const char* fmt, const char* arg = "");

// Makes a directory of the sandbox's user (0700); an existing one is fine.
void make_dir(const char* path);

// In a child about to exec or to serve alone: closes every descriptor from
// `first` up (below the shim's own ceiling), none of which it owns as an
// object. The one place the shim calls close() itself; elsewhere a UniqueFd
// owns each descriptor.
void close_inherited(int first);

// Starts the egress forwarder (docs/network.md): one process listening on
// 127.0.0.1:3128 that hands each connection to the gateway through
// /run/cellblock/egress.sock (or, under runsc, copies it), or answers that
// there is none. It holds none of the shim's descriptors.
// `copy`: copy each connection instead of passing its socket (under runsc,
// whose sockets cannot reach the host, and under --engine, where the
// listener is the kernel's own tunnel, kernel-shim/cellblock_egress_tunnel.py).
void start_egress_forwarder(bool copy);

// `--engine UID` (docs/scale-out.md): as root under a container engine, the
// default routes deleted, home and the shared directories prepared, then uid
// UID with no capability and no_new_privs, and the server's seccomp program
// (kSeccompBpfEnv) installed. False (said why) if a step failed.
bool enter_engine_sandbox(uid_t uid);

// Whether a front holds a connection to one of the kernel's ports
// (sandbox_protocol::front_attached over the task's /proc/net/tcp and tcp6).
bool front_attached();

}  // namespace cellblock::shim
