// The gateway process's loop: the server's control messages (configuration,
// a session's listener added or taken back), accepting on each session's
// listener within the caps, a thread per connection (its checks are
// connection.cpp) and one event per connection back to the server.
#include "gateway.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "gateway_internal.hpp"

namespace cellblock::gateway {
using nlohmann::json;

namespace {

// Connections served at once across all sessions; past it a connection is
// refused unread (each one is a thread).
constexpr int kMaxThreads = 512;

void log_line(const std::string& text) {
    const std::string line = "cellblock-gateway: " + text + "\n";
    [[maybe_unused]] ssize_t n = ::write(STDERR_FILENO, line.data(), line.size());
}

class Gateway {
  public:
    explicit Gateway(int control_fd) : control_fd_(control_fd) {}
    int run();

  private:
    void on_control();
    void on_accept(const std::shared_ptr<Session>& session);
    void report(const Session& session, const Event& event);
    void handle(std::shared_ptr<Session> session, UniqueFd client);

    int control_fd_;
    Config config_;
    bool configured_ = false;
    bool done_ = false;
    std::map<std::string, std::shared_ptr<Session>> sessions_;
    std::mutex send_mutex_;
    std::atomic<int> threads_{0};
};

int Gateway::run() {
    while (!done_) {
        std::vector<pollfd> fds{{control_fd_, POLLIN, 0}};
        std::vector<std::shared_ptr<Session>> polled;
        for (auto& [id, session] : sessions_) {
            fds.push_back({session->listener.get(), POLLIN, 0});
            polled.push_back(session);
        }
        if (::poll(fds.data(), fds.size(), -1) < 0) {
            if (errno == EINTR) continue;
            log_line(std::string("poll: ") + std::strerror(errno));
            return 1;
        }
        if (fds[0].revents) on_control();
        for (std::size_t i = 1; i < fds.size(); ++i) {
            if (fds[i].revents & POLLIN) on_accept(polled[i - 1]);
        }
    }
    return 0;
}

void Gateway::on_control() {
    json message;
    int fd = -1;
    try {
        if (!receive_control(control_fd_, message, fd)) {
            done_ = true;  // the server is gone
            return;
        }
    } catch (const std::exception& e) {
        log_line(std::string("control: ") + e.what());
        return;
    }
    UniqueFd attached(fd);
    const std::string op = message.value("op", "");
    try {
        if (op == "config") {
            for (const auto& text : message.at("private")) {
                auto range = AddressRange::parse(text.get<std::string>());
                if (!range) throw std::runtime_error("not a CIDR: " + text.dump());
                config_.opted_in.push_back(*range);
            }
            for (const auto& [name, address] : message.at("resolve").items()) {
                auto ip = IpAddress::parse(address.get<std::string>());
                if (!ip) throw std::runtime_error("not an address: " + address.dump());
                config_.pins[normalise_host(name)] = *ip;
            }
            config_.dns = message.value("dns", true);
            config_.upstream_tls =
                std::make_unique<UpstreamTls>(message.value("extra_ca", std::string()));
            configured_ = true;
        } else if (op == "add") {
            if (!attached) throw std::runtime_error("add without a listener");
            auto session = std::make_shared<Session>();
            session->id = message.at("session").get<std::string>();
            SessionLimits limits;
            limits = SessionLimits::from_json(json{{"network", message.at("network")}}, limits);
            session->limits = limits.network;
            for (const auto& p : session->limits.allow)
                session->allow.push_back(HostPattern::parse(p));
            for (const auto& secret : message.value("secrets", json::array())) {
                session->secrets.push_back({secret.at("host").get<std::string>(),
                                            secret.at("header").get<std::string>(),
                                            secret.at("value").get<std::string>()});
            }
            if (!session->secrets.empty()) {
                session->tls =
                    std::make_unique<SessionTls>(CaPem{message.at("ca_key").get<std::string>(),
                                                       message.at("ca_cert").get<std::string>()});
            }
            session->listener = std::move(attached);
            if (auto old = sessions_.find(session->id); old != sessions_.end()) {
                old->second->close_all();
            }
            sessions_[session->id] = std::move(session);
        } else if (op == "remove") {
            auto it = sessions_.find(message.at("session").get<std::string>());
            if (it != sessions_.end()) {
                it->second->close_all();
                sessions_.erase(it);
            }
        } else {
            throw std::runtime_error("unknown op '" + op + "'");
        }
    } catch (const std::exception& e) {
        log_line("control " + op + ": " + e.what());
    }
}

void Gateway::on_accept(const std::shared_ptr<Session>& session) {
    UniqueFd client(::accept4(session->listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!client) return;
    // The caps hold before a thread exists: a session that opens connections
    // and sends nothing holds at most max_connections of them.
    const bool over_session_cap = session->active >= session->limits.max_connections;
    if (over_session_cap || threads_ >= kMaxThreads) {
        const std::string why =
            over_session_cap
                ? "this session has " + std::to_string(session->limits.max_connections) +
                      " connections open already (network.max_connections)"
                : "the gateway serves " + std::to_string(kMaxThreads) + " connections at once";
        const std::string answer = error_response(429, "cellblock: " + why);
        [[maybe_unused]] ssize_t n =
            ::send(client.get(), answer.data(), answer.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
        // One event for the first refusal and then one per hundred: a flood of
        // connections is not a flood of audit rows.
        if (++session->refused_at_accept % 100 == 1) {
            Event event;
            event.status = 429;
            event.reason =
                why + " (" + std::to_string(session->refused_at_accept) + " refused so far)";
            report(*session, event);
        }
        return;
    }
    ++threads_;
    ++session->active;
    std::thread([this, session, fd = client.release()] {
        handle(session, UniqueFd(fd));
        --threads_;
    }).detach();
}

void Gateway::report(const Session& session, const Event& event) {
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                        std::chrono::steady_clock::now() - event.started)
                        .count();
    json message = {{"op", "event"},          {"session", session.id},
                    {"host", event.host},     {"port", event.port},
                    {"method", event.method}, {"status", event.status},
                    {"bytes_up", event.up},   {"bytes_down", event.down},
                    {"duration_ms", ms},      {"verdict", event.verdict},
                    {"reason", event.reason}};
    if (event.tls) message["tls"] = "terminated";
    if (event.tls) message["upstream_tls_resumed"] = event.upstream_resumed;
    if (!event.secrets.empty()) message["secrets_added"] = event.secrets;
    std::lock_guard lock(send_mutex_);
    try {
        send_control(control_fd_, message);
    } catch (const std::exception& e) {
        log_line(std::string("report: ") + e.what());
    }
}

// The sandbox's forwarder hands over the code's own TCP connection: one byte
// with the socket attached (SCM_RIGHTS), so bytes then go between the code and
// the gateway with no copy in the sandbox. Anything that sends no socket is
// itself the client, its first byte already read into `first`. A passed
// descriptor that is not a TCP stream socket is refused (the sandbox chose it).
UniqueFd take_passed_socket(int conn, double timeout_s, std::string& first, std::string& why) {
    pollfd p{conn, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(timeout_s * 1000)) <= 0) {
        why = "no request within " + seconds_text(timeout_s) + " s (network.request_timeout_s)";
        return {};
    }
    char byte = 0;
    UniqueFd passed;
    int flags = 0;
    const ssize_t n = receive_with_fd(conn, &byte, 1, passed, flags);
    if (n <= 0) {
        why = "closed before a request";
        return {};
    }
    if (!passed) {
        first.assign(1, byte);
        return {};
    }
    int type = 0, domain = 0;
    socklen_t size = sizeof type;
    const bool stream =
        ::getsockopt(passed.get(), SOL_SOCKET, SO_TYPE, &type, &size) == 0 && type == SOCK_STREAM;
    size = sizeof domain;
    const bool inet = ::getsockopt(passed.get(), SOL_SOCKET, SO_DOMAIN, &domain, &size) == 0 &&
                      (domain == AF_INET || domain == AF_INET6);
    if (!stream || !inet || (flags & MSG_CTRUNC)) {
        why = "the forwarder passed a descriptor that is not a TCP connection";
        return {};
    }
    return passed;
}

void Gateway::handle(std::shared_ptr<Session> session, UniqueFd client) {
    Event event;
    std::string first;
    UniqueFd passed =
        take_passed_socket(client.get(), session->limits.request_timeout_s, first, event.reason);
    if (!passed && first.empty()) {
        --session->active;
        report(*session, event);
        return;
    }
    if (passed) client = std::move(passed);  // the forwarder's connection closes here
    session->track(client.get());
    try {
        serve_connection(config_, *session, client.get(), first, event);
    } catch (const std::exception& e) {
        event.reason = std::string("gateway error: ") + e.what();
    }
    session->untrack(client.get());
    --session->active;
    report(*session, event);
}

}  // namespace

int serve(int control_fd) {
    Gateway gateway(control_fd);
    return gateway.run();
}

}  // namespace cellblock::gateway
