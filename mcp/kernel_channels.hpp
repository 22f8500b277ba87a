// A small Jupyter client of one session's channels: shell and IOPub to run
// code, control to interrupt it. Signs with the session's own key. The
// semantics are clients/python/cellblock/client.py's Session.run.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <optional>
#include <string>

#include <zmq.hpp>

#include "cellblock/connection_info.hpp"
#include "cellblock/signer.hpp"
#include "execution.hpp"

namespace cellblock::mcp {

class KernelChannels {
  public:
    // Connects (does not wait): wait_ready() before the first execute().
    KernelChannels(zmq::context_t& context, const ConnectionInfo& info);
    KernelChannels(const KernelChannels&) = delete;
    KernelChannels& operator=(const KernelChannels&) = delete;

    // Until a kernel_info round trip also shows on IOPub (the SUB socket has
    // joined, so no output of the first execution is lost). Throws on timeout.
    void wait_ready(std::chrono::milliseconds timeout);

    struct Hooks {
        // Called about every `tick` while the execution runs.
        std::function<void(std::chrono::milliseconds elapsed)> on_tick;
        std::chrono::milliseconds tick{1000};
    };
    // Runs `code` and collects what it produced. `timeout_s` asks the server
    // for this execution's timeout (0: the session's `session_timeout_s`).
    // One execution at a time per session: a second caller waits its turn.
    // Throws std::runtime_error when no reply comes well past the server's deadline.
    Execution execute(const std::string& code, double timeout_s, double session_timeout_s,
                      const Hooks& hooks);

    // interrupt_request on the control channel; its reply's content. Callable
    // while execute() runs on another thread.
    nlohmann::json interrupt(std::chrono::milliseconds timeout);

  private:
    void send(zmq::socket_t& socket, const WireMessage& msg);
    std::optional<WireMessage> receive(zmq::socket_t& socket);

    ConnectionInfo info_;
    Signer signer_;
    std::string session_ = make_uuid();
    std::mutex run_mutex_;  // shell and IOPub belong to one execute() at a time
    zmq::socket_t shell_;
    zmq::socket_t iopub_;
    std::mutex control_mutex_;
    zmq::socket_t control_;
};

}  // namespace cellblock::mcp
