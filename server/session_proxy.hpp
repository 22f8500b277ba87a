// One session's relay between the client's five channels (outer key) and
// the sandboxed kernel's five channels (inner key). Everything the kernel
// sends is treated as hostile: a message whose parent is not a request of
// this session is dropped, and each request gets at most one reply.
#pragma once

#include <chrono>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <zmq.hpp>

#include "cellblock/connection_info.hpp"
#include "cellblock/replay_guard.hpp"
#include "cellblock/sandbox.hpp"
#include "cellblock/signer.hpp"
#include "cellblock/wire_message.hpp"
#include "multipart.hpp"

namespace cellblock {

struct ProxyOptions {
    WireLimits outer_limits;
    WireLimits inner_limits;
    std::chrono::milliseconds shutdown_grace{3000};
    int max_frame_bytes = 64 << 20;  // ZMQ_MAXMSGSIZE on every socket
};

class SessionProxy {
public:
    static constexpr std::size_t kPollItems = 10;

    // Binds the outer channels of `outer` (throws zmq::error_t naming nothing:
    // callers add context).
    SessionProxy(zmq::context_t& context, std::string session_id, const ConnectionInfo& outer,
                 ProxyOptions options = {});
    ~SessionProxy();
    SessionProxy(const SessionProxy&) = delete;
    SessionProxy& operator=(const SessionProxy&) = delete;

    // Connects the inner channels to a started sandbox and starts relaying.
    void attach(std::unique_ptr<Sandbox> sandbox);

    // Appends exactly kPollItems entries; handle() receives a pointer to them.
    void add_poll_items(std::vector<zmq::pollitem_t>& items);
    void handle(const zmq::pollitem_t* items);
    // Earliest time on_timer() must run, if any.
    std::optional<std::chrono::steady_clock::time_point> next_deadline() const;
    void on_timer(std::chrono::steady_clock::time_point now);

    // Ends the session: answers what is pending, destroys the sandbox.
    void close(const std::string& reason);
    bool finished() const { return finished_; }
    const std::string& close_reason() const { return close_reason_; }
    const std::string& session_id() const { return session_id_; }
    Sandbox* sandbox() { return sandbox_.get(); }

private:
    struct PendingRequest {
        Channel channel;
        std::vector<std::string> identities;
        std::string msg_type;
        std::string header;  // raw bytes, to parent replies the server writes itself
    };

    void on_outer_request(Channel channel);
    void on_outer_stdin();
    void on_outer_heartbeat();
    void on_inner_reply(Channel channel);
    void on_inner_iopub();
    void on_inner_stdin();
    void on_inner_heartbeat();
    void on_lifeline();

    void answer_interrupt(const PendingRequest& request);
    void fail_pending(const std::string& ename, const std::string& evalue);
    void remember_parent(const std::string& msg_id);
    bool known_parent(std::string_view msg_id) const;
    void publish_status(const nlohmann::json& parent, const char* state);
    void send_reply(const PendingRequest& request, const std::string& msg_type,
                    nlohmann::json content);
    void publish(const nlohmann::json& parent, const std::string& msg_type, nlohmann::json content);
    zmq::socket_t& outer_socket(Channel channel);
    zmq::socket_t& inner_socket(Channel channel);
    void reject(const char* channel, std::string_view identity, const std::string& why);

    std::string session_id_;
    std::string server_session_;  // the "session" field of headers the server writes
    ProxyOptions options_;
    Signer outer_signer_;
    Signer inner_signer_{""};
    ReplayGuard replay_;

    zmq::socket_t outer_shell_, outer_control_, outer_stdin_, outer_iopub_, outer_hb_;
    zmq::socket_t inner_shell_, inner_control_, inner_stdin_, inner_iopub_, inner_hb_;
    std::unique_ptr<Sandbox> sandbox_;

    std::unordered_map<std::string, PendingRequest> pending_;
    std::deque<std::string> recent_order_;
    std::unordered_set<std::string> recent_;

    std::optional<std::chrono::steady_clock::time_point> shutdown_deadline_;
    std::optional<PendingRequest> shutdown_request_;
    bool finished_ = false;
    std::string close_reason_;
    Multipart scratch_;
};

}  // namespace cellblock
