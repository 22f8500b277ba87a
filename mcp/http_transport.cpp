// Streamable HTTP (MCP 2025-03-26 and later): POST /mcp carries one
// JSON-RPC message; a request is answered with JSON, or with an SSE stream
// when progress notifications come before its response. GET (a
// server-initiated stream) is 405: this server sends nothing unasked.
// DELETE ends the MCP session. One thread per connection.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <list>
#include <thread>

#include <spdlog/spdlog.h>

#include "cellblock/signer.hpp"
#include "cellblock/unique_fd.hpp"
#include "http_message.hpp"
#include "protocol_version.hpp"
#include "transports.hpp"

namespace cellblock::mcp {
using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

constexpr std::size_t kMaxHeadBytes = 64u << 10;
constexpr int kIdleConnectionS = 120;  // a keep-alive connection idle this long is closed

bool send_all(int fd, std::string_view bytes) {
    while (!bytes.empty()) {
        const ssize_t n = ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return false;
        bytes.remove_prefix(static_cast<std::size_t>(n));
    }
    return true;
}

// Ends a connection whose request may not have been read whole (a refusal
// before the body): closing with unread bytes would send a reset that can
// destroy the response on its way, so the rest is read and dropped first
// (at most 1 MiB, at most a second).
void linger_close(int fd) {
    ::shutdown(fd, SHUT_WR);
    const timeval wait{1, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof wait);
    char sink[65536];
    for (std::size_t dropped = 0; dropped < (1u << 20);) {
        const ssize_t n = ::recv(fd, sink, sizeof sink, 0);
        if (n <= 0) break;
        dropped += static_cast<std::size_t>(n);
    }
    ::shutdown(fd, SHUT_RD);
}

std::string dump(const json& message) {
    return message.dump(-1, ' ', false, json::error_handler_t::replace);
}

// One POST's answer: JSON with a length, or (once a notification must go
// out first) an SSE stream that the response ends.
class PostReply : public Outbox {
  public:
    PostReply(int fd, bool sse_ok, std::string session_id)
        : fd_(fd), sse_ok_(sse_ok), session_id_(std::move(session_id)) {}

    void send(const json& message) override {
        const std::lock_guard lock(mutex_);
        if (!sse_ok_ || broken_) return;  // a client that takes JSON only gets no progress
        if (!streaming_) {
            streaming_ = true;
            broken_ = !send_all(fd_, response_head(200, headers("text/event-stream")));
        }
        if (!broken_) broken_ = !send_all(fd_, "event: message\ndata: " + dump(message) + "\n\n");
    }

    // Sends the response (or, for a cancelled request, ends the exchange);
    // returns whether the connection may carry another request.
    bool finish(const std::optional<json>& response) {
        const std::lock_guard lock(mutex_);
        if (streaming_) {
            if (response && !broken_)
                send_all(fd_, "event: message\ndata: " + dump(*response) + "\n\n");
            return false;  // the stream ends with the connection
        }
        if (!response) {
            // Cancelled: the client stopped waiting; accepted, and nothing follows.
            return send_all(fd_, response_head(202, {{"Content-Length", "0"}}));
        }
        const std::string body = dump(*response);
        auto h = headers("application/json");
        h.emplace_back("Content-Length", std::to_string(body.size()));
        return send_all(fd_, response_head(200, h) + body);
    }

  private:
    std::vector<std::pair<std::string, std::string>> headers(const std::string& type) const {
        std::vector<std::pair<std::string, std::string>> h = {{"Content-Type", type},
                                                              {"Cache-Control", "no-store"}};
        if (type == "text/event-stream") h.emplace_back("Connection", "close");
        if (!session_id_.empty()) h.emplace_back("Mcp-Session-Id", session_id_);
        return h;
    }

    int fd_;
    bool sse_ok_;
    std::string session_id_;
    std::mutex mutex_;
    bool streaming_ = false;
    bool broken_ = false;
};

struct HttpSession {
    std::unique_ptr<Conversation> conversation;
    Clock::time_point last_used = Clock::now();
};

struct Connection {
    UniqueFd fd;
    std::thread thread;
    std::atomic<bool> done{false};
};

class HttpServer {
  public:
    HttpServer(const McpOptions& options, const HttpOptions& http, zmq::context_t& context)
        : options_(options), http_(http), context_(context) {}

    void serve_connection(int fd);
    void reap_idle();
    void close_all();

  private:
    // The token and the Origin, checked before a byte of the body is read;
    // false once refused (the connection then closes).
    bool admit(int fd, const HttpRequest& request);
    bool respond(int fd, HttpRequest& request);
    bool simple(int fd, int status, const std::string& body,
                std::vector<std::pair<std::string, std::string>> extra = {});
    bool rpc_error_reply(int fd, int status, int code, const std::string& message);
    std::shared_ptr<HttpSession> find_session(const std::string& id);

    const McpOptions& options_;
    const HttpOptions& http_;
    zmq::context_t& context_;
    std::mutex mutex_;
    std::map<std::string, std::shared_ptr<HttpSession>> sessions_;
};

bool HttpServer::simple(int fd, int status, const std::string& body,
                        std::vector<std::pair<std::string, std::string>> extra) {
    extra.emplace_back("Content-Length", std::to_string(body.size()));
    if (!body.empty()) extra.emplace_back("Content-Type", "application/json");
    return send_all(fd, response_head(status, extra) + body);
}

bool HttpServer::rpc_error_reply(int fd, int status, int code, const std::string& message) {
    return simple(fd, status, dump(make_error(nullptr, code, message)));
}

std::shared_ptr<HttpSession> HttpServer::find_session(const std::string& id) {
    const std::lock_guard lock(mutex_);
    const auto it = sessions_.find(id);
    if (it == sessions_.end()) return nullptr;
    it->second->last_used = Clock::now();
    return it->second;
}

bool HttpServer::admit(int fd, const HttpRequest& request) {
    if (!http_.token.empty() && !bearer_matches(request.header("authorization"), http_.token)) {
        simple(fd, 401,
               dump(make_error(nullptr, rpc_error::kInvalidRequest,
                               "Unauthorized: a bearer token is required")),
               {{"WWW-Authenticate", "Bearer realm=\"cellblock-mcp\""}});
        return false;
    }
    const std::string origin = request.header("origin");
    if (!origin.empty() && !origin_allowed(origin, http_.allowed_origins)) {
        rpc_error_reply(fd, 403, rpc_error::kInvalidRequest, "Forbidden: Origin " + origin);
        return false;
    }
    return true;
}

bool HttpServer::respond(int fd, HttpRequest& request) {
    if (request.path != "/mcp") return simple(fd, 404, "");
    const std::string version = request.header("mcp-protocol-version");
    if (!version.empty() && !supported_protocol_version(version)) {
        return rpc_error_reply(fd, 400, rpc_error::kInvalidRequest,
                               "Bad Request: unsupported MCP-Protocol-Version " + version);
    }
    const std::string session_id = request.header("mcp-session-id");
    if (request.method == "GET") {
        // No server-initiated stream: everything this server sends answers a POST.
        return simple(fd, 405, "", {{"Allow", "POST, DELETE"}});
    }
    if (request.method == "DELETE") {
        std::shared_ptr<HttpSession> session;
        {
            const std::lock_guard lock(mutex_);
            if (const auto it = sessions_.find(session_id); it != sessions_.end()) {
                session = it->second;
                sessions_.erase(it);
            }
        }
        if (!session) return simple(fd, 404, "");
        session->conversation->close();
        return simple(fd, 200, "");
    }
    if (request.method != "POST") return simple(fd, 405, "", {{"Allow", "POST, DELETE"}});
    const std::string type = request.header("content-type");
    if (type.find("application/json") == std::string::npos) {
        return rpc_error_reply(fd, 415, rpc_error::kInvalidRequest,
                               "Unsupported Media Type: Content-Type must be application/json");
    }
    const std::string accept = request.header("accept");
    const bool sse_ok = accept.find("text/event-stream") != std::string::npos;
    if (!accept.empty() && accept.find("application/json") == std::string::npos && !sse_ok &&
        accept.find("*/*") == std::string::npos) {
        return rpc_error_reply(fd, 406, rpc_error::kInvalidRequest,
                               "Not Acceptable: the client must accept application/json and "
                               "text/event-stream");
    }

    RpcMessage message = parse_message(request.body);
    if (message.kind == RpcMessage::Kind::invalid)
        return simple(fd, 400, dump(message.error_response));
    std::shared_ptr<HttpSession> session;
    std::string new_id;
    if (message.kind == RpcMessage::Kind::request && message.method == "initialize") {
        {
            const std::lock_guard lock(mutex_);
            if (sessions_.size() >= http_.max_conversations) {
                return rpc_error_reply(
                    fd, 503, rpc_error::kInternalError,
                    "Service Unavailable: " + std::to_string(http_.max_conversations) +
                        " MCP sessions are open");
            }
        }
        session = std::make_shared<HttpSession>();
        session->conversation = std::make_unique<Conversation>(options_, context_);
        new_id = make_random_key();
    } else {
        if (session_id.empty()) {
            return rpc_error_reply(fd, 400, rpc_error::kInvalidRequest,
                                   "Bad Request: Mcp-Session-Id header is required");
        }
        session = find_session(session_id);
        if (!session) {
            return rpc_error_reply(fd, 404, rpc_error::kInvalidRequest,
                                   "Session not found (closed or expired): initialize again");
        }
    }
    if (message.kind != RpcMessage::Kind::request) {
        PostReply quiet(fd, false, "");
        session->conversation->handle(message, quiet);
        return simple(fd, 202, "");
    }
    PostReply reply(fd, sse_ok, new_id);
    const auto response = session->conversation->handle(message, reply);
    if (!new_id.empty() && response && response->contains("result")) {
        const std::lock_guard lock(mutex_);
        sessions_[new_id] = session;
    }
    if (session) {
        const std::lock_guard lock(mutex_);
        session->last_used = Clock::now();
    }
    return reply.finish(response);
}

void HttpServer::serve_connection(int fd) {
    const timeval wait{kIdleConnectionS, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof wait);
    std::string buffer;
    char chunk[65536];
    for (;;) {
        // The head.
        std::size_t head_end;
        while ((head_end = buffer.find("\r\n\r\n")) == std::string::npos) {
            if (buffer.size() > kMaxHeadBytes) {
                simple(fd, 431, "");
                return;
            }
            const ssize_t n = ::recv(fd, chunk, sizeof chunk, 0);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) return;
            buffer.append(chunk, static_cast<std::size_t>(n));
        }
        auto request = parse_request_head(std::string_view(buffer).substr(0, head_end));
        if (!request) {
            simple(fd, 400, "");
            return;
        }
        buffer.erase(0, head_end + 4);
        if (!admit(fd, *request)) return;
        if (!request->header("transfer-encoding").empty()) {
            simple(fd, 411, "");  // MCP clients send a Content-Length
            return;
        }
        std::size_t length = 0;
        const std::string declared = request->header("content-length");
        if (!declared.empty()) {
            try {
                std::size_t used = 0;
                const unsigned long long value = std::stoull(declared, &used);
                if (used != declared.size()) throw std::invalid_argument(declared);
                if (value > http_.max_body_bytes) {
                    rpc_error_reply(
                        fd, 413, rpc_error::kInvalidRequest,
                        "a body over " + std::to_string(http_.max_body_bytes) + " bytes");
                    return;
                }
                length = static_cast<std::size_t>(value);
            } catch (const std::exception&) {
                simple(fd, 400, "");
                return;
            }
        }
        while (buffer.size() < length) {
            const ssize_t n = ::recv(fd, chunk, std::min(sizeof chunk, length - buffer.size()), 0);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) return;
            buffer.append(chunk, static_cast<std::size_t>(n));
        }
        request->body = buffer.substr(0, length);
        buffer.erase(0, length);
        bool keep = false;
        try {
            keep = respond(fd, *request);
        } catch (const std::exception& e) {
            spdlog::error("mcp http: {}", e.what());
            rpc_error_reply(fd, 500, rpc_error::kInternalError, e.what());
        }
        if (!keep || request->version == "HTTP/1.0" ||
            request->header("connection").find("close") != std::string::npos)
            return;
    }
}

void HttpServer::reap_idle() {
    std::vector<std::shared_ptr<HttpSession>> idle;
    {
        const std::lock_guard lock(mutex_);
        const auto limit = std::chrono::seconds(http_.idle_timeout_s);
        for (auto it = sessions_.begin(); it != sessions_.end();) {
            if (it->second->conversation->busy() == 0 &&
                Clock::now() - it->second->last_used > limit) {
                spdlog::info("mcp http: session idle for {} s, closed", http_.idle_timeout_s);
                idle.push_back(it->second);
                it = sessions_.erase(it);
            } else {
                ++it;
            }
        }
    }
    for (const auto& session : idle) session->conversation->close();
}

void HttpServer::close_all() {
    std::map<std::string, std::shared_ptr<HttpSession>> sessions;
    {
        const std::lock_guard lock(mutex_);
        sessions.swap(sessions_);
    }
    for (const auto& [id, session] : sessions) session->conversation->close();
}

}  // namespace

int serve_http(const McpOptions& options, const HttpOptions& http, zmq::context_t& context) {
    const auto address = parse_listen_address(http.listen);
    if (!address) throw std::runtime_error("--http " + http.listen + ": expected ADDR:PORT");
    if (!is_loopback(*address) && http.token.empty()) {
        throw std::runtime_error("--http " + http.listen +
                                 " is not a loopback address: give a bearer token with "
                                 "--token-file (anyone who can reach it could run code)");
    }
    UniqueFd listener(::socket(address->ipv6 ? AF_INET6 : AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!listener) throw std::runtime_error(std::string("socket: ") + std::strerror(errno));
    const int one = 1;
    ::setsockopt(listener.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_storage storage{};
    socklen_t size;
    if (address->ipv6) {
        auto* a = reinterpret_cast<sockaddr_in6*>(&storage);
        a->sin6_family = AF_INET6;
        a->sin6_port = htons(static_cast<std::uint16_t>(address->port));
        inet_pton(AF_INET6, address->host.c_str(), &a->sin6_addr);
        size = sizeof *a;
    } else {
        auto* a = reinterpret_cast<sockaddr_in*>(&storage);
        a->sin_family = AF_INET;
        a->sin_port = htons(static_cast<std::uint16_t>(address->port));
        inet_pton(AF_INET, address->host.c_str(), &a->sin_addr);
        size = sizeof *a;
    }
    if (::bind(listener.get(), reinterpret_cast<sockaddr*>(&storage), size) != 0 ||
        ::listen(listener.get(), 64) != 0) {
        throw std::runtime_error("listen on " + http.listen + ": " + std::strerror(errno));
    }
    ::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&storage), &size);
    const int port = ntohs(address->ipv6 ? reinterpret_cast<sockaddr_in6*>(&storage)->sin6_port
                                         : reinterpret_cast<sockaddr_in*>(&storage)->sin_port);
    const std::string host = address->ipv6 ? "[" + address->host + "]" : address->host;
    spdlog::info("mcp: listening on http://{}:{}/mcp{}", host, port,
                 http.token.empty() ? " (no token: loopback only)" : " (bearer token required)");

    HttpServer server(options, http, context);
    std::list<Connection> connections;
    auto last_reap = Clock::now();
    while (!stop_requested()) {
        for (auto it = connections.begin(); it != connections.end();) {
            if (it->done) {
                it->thread.join();
                it = connections.erase(it);
            } else {
                ++it;
            }
        }
        if (Clock::now() - last_reap > std::chrono::seconds(5)) {
            server.reap_idle();
            last_reap = Clock::now();
        }
        pollfd item{listener.get(), POLLIN, 0};
        if (::poll(&item, 1, 500) <= 0) continue;
        UniqueFd fd(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
        if (!fd) continue;
        if (connections.size() >= http.max_connections) {
            send_all(fd.get(), response_head(503, {{"Content-Length", "0"}, {"Retry-After", "1"}}));
            continue;
        }
        auto& connection = connections.emplace_back();
        connection.fd = std::move(fd);
        connection.thread = std::thread([&server, &connection] {
            server.serve_connection(connection.fd.get());
            linger_close(connection.fd.get());
            connection.done = true;
        });
    }
    spdlog::info("mcp: stopping; closing the MCP sessions' cellblock sessions");
    server.close_all();  // cancels what runs: each request finishes soon after
    for (auto& connection : connections) ::shutdown(connection.fd.get(), SHUT_RD);
    for (auto& connection : connections) connection.thread.join();
    return 0;
}

}  // namespace cellblock::mcp
