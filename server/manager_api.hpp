// The manager socket's protocol, apart from what its requests do: a ROUTER
// whose messages are verified (frames, signature, replay), held to a size and
// a frame count, checked to be a request, and handed to the one handler
// registered for their msg_type; what the handler returns, or the error it
// throws, goes back as the signed reply. The server registers a handler per
// request (server_startup.cpp) and answers later ones through reply() and
// reply_error(); nothing here knows what a session is.
// Unit-tested over real ZMQ sockets in tests/unit/manager_api_test.cpp.
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>
#include <zmq.hpp>

#include "cellblock/frame.hpp"
#include "cellblock/replay_guard.hpp"
#include "cellblock/signer.hpp"
#include "cellblock/wire_message.hpp"

namespace cellblock {

// The manager socket reads a frame up to this size so that a request too
// large gets an answer (MessageTooLarge); requests themselves are far smaller.
inline constexpr std::size_t kManagerFrameCeiling = 256u << 20;
inline constexpr std::size_t kManagerMaxFrames = 64;

// A manager request failed in a way the client should be told about.
struct RequestError {
    std::string ename, evalue;
};

class ManagerApi {
  public:
    struct Request {
        WireMessage message;
        // The message's buffers, still in the received frames: an upload's
        // chunk is written from there, not copied first. Valid only during
        // the handler's call.
        std::vector<std::string_view> buffers;
    };
    // Returns the reply's content (its buffers in `reply_buffers`), or null
    // when the request is answered later (reply()). Throws RequestError,
    // or any error with an ename() (FileRequestError, PolicyError): the
    // reply names it; anything else is answered ServerError and logged.
    using Handler =
        std::function<nlohmann::json(Request&, std::vector<std::string>& reply_buffers)>;
    // Sees every reply before it is sent (the metrics count create replies).
    using ReplyWatch =
        std::function<void(const WireMessage& request, const nlohmann::json& content)>;

    ManagerApi(zmq::context_t& context, std::string key);

    void handle(const std::string& msg_type, Handler handler);
    void watch_replies(ReplyWatch watch) { watch_ = std::move(watch); }
    // The largest message a request may be, all frames (MessageTooLarge past it).
    void set_max_request_bytes(std::size_t bytes) { max_request_bytes_ = bytes; }
    // A planned restart's next server answers with the last one's key: its
    // clients hold it (session_handover.cpp).
    void set_key(std::string key);
    const std::string& key() const { return key_; }
    // The local file socket (local_files.cpp) signs and verifies with the
    // same key, and a message seen on either socket is a replay on both.
    const Signer& signer() const { return signer_; }
    ReplayGuard& replay_guard() { return replay_; }

    // Binds the socket; returns the endpoint bound (a wildcard port resolved).
    // Throws zmq::error_t.
    std::string bind(const std::string& endpoint);
    const std::string& endpoint() const { return endpoint_; }
    zmq::socket_t& socket() { return socket_; }

    // The socket is readable: a burst of requests handled, at most 64 a turn
    // so that sessions keep flowing.
    void on_readable();

    void reply(const WireMessage& request, nlohmann::json content,
               std::vector<std::string> buffers = {});
    void reply_error(const WireMessage& request, const std::string& ename,
                     const std::string& evalue);
    // An error reply and one log line: a request the manager will not handle.
    void refuse(const WireMessage& request, const std::string& ename, const std::string& evalue);

  private:
    void dispatch(Request& request);

    zmq::socket_t socket_;
    std::string endpoint_;
    std::string key_;
    Signer signer_;
    ReplayGuard replay_;
    Multipart scratch_;
    std::map<std::string, Handler, std::less<>> handlers_;
    ReplyWatch watch_;
    std::size_t max_request_bytes_ = 64u << 20;
};

}  // namespace cellblock
