// The server's five connected sockets to one sandboxed kernel, opened and
// proven by probe_kernel(), then handed to the session's proxy.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <zmq.hpp>

#include "cellblock/sandbox.hpp"
#include "kernel_socket.hpp"

namespace cellblock {

struct InnerChannels {
    std::unique_ptr<RelaySocket> shell, control, stdin_, iopub, hb;
    std::vector<std::string>
        probe_msg_ids;  // the probe's own requests (late replies are dropped quietly)
};

// Connects to the sandbox's kernel and waits until it answers kernel_info on
// shell and its iopub reaches us (so no later output is lost to a slow
// subscription). Throws SandboxError naming why: timeout, or the kernel
// exiting, or `abandoned` turning true (a stopping server does not wait out
// a slow kernel's start), with the end of the sandbox's log. `transport`
// says how the server's side speaks to the kernel's sockets; ZMTP in the
// server's loop needs ipc endpoints, so a backend's tcp ports (a Swarm
// node's) always go through libzmq. With `warm_up`, the kernel then also
// runs the image's preload imports and a first `1+1` (a fresh interpreter's
// first execution costs about twice a later one): a booted kernel always
// needs it (its preload is imported there); a forked one (its zygote
// imported the preload) is warmed up only when no client waits for it.
std::unique_ptr<InnerChannels> probe_kernel(zmq::context_t& context, Sandbox& sandbox,
                                            std::chrono::milliseconds timeout,
                                            int max_frame_bytes = 64 << 20,
                                            const std::atomic<bool>* abandoned = nullptr,
                                            RelayTransport transport = RelayTransport::libzmq,
                                            bool warm_up = true, bool on_control = false);
// `on_control`: kernel_info is asked on control, which the kernel answers
// while an execution runs (an adopted kernel's may: docs/restarts.md); no
// warm-up then, and what waits on shell is left for the relay.

}  // namespace cellblock
