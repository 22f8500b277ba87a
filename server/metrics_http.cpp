#include "metrics_http.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <stdexcept>

#include <spdlog/spdlog.h>

#include "http_head.hpp"

namespace cellblock {

namespace {

using Clock = std::chrono::steady_clock;

std::string_view trim(std::string_view s) {
    while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
    while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
    return s;
}

bool iequals(std::string_view a, std::string_view b) {
    return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
               return std::tolower(static_cast<unsigned char>(x)) ==
                      std::tolower(static_cast<unsigned char>(y));
           });
}

// The q of one Accept element's parameters ("version=1.0.0;q=0.5"): 1 when absent.
double quality(std::string_view params) {
    while (!params.empty()) {
        const auto semi = params.find(';');
        const std::string_view param = trim(params.substr(0, semi));
        params = semi == std::string_view::npos ? std::string_view() : params.substr(semi + 1);
        if (param.size() > 2 && (param[0] == 'q' || param[0] == 'Q') && param[1] == '=') {
            double q = 0;
            const auto value = param.substr(2);
            const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), q);
            if (ec != std::errc() || end != value.data() + value.size()) return 0;
            return std::clamp(q, 0.0, 1.0);
        }
    }
    return 1;
}

HealthCheck checked(const std::function<HealthCheck()>& check) {
    if (!check) return {false, "no check configured"};
    try {
        return check();
    } catch (const std::exception& e) {
        return {false, std::string("the check failed: ") + e.what()};
    }
}

}  // namespace

std::string HttpResponse::wire() const {
    std::string out = "HTTP/1.1 " + std::to_string(status) + " ";
    out += gateway::http_reason_phrase(status);
    out += "\r\nContent-Type: " + content_type;
    out += "\r\nContent-Length: " + std::to_string(body.size());
    out += "\r\nConnection: close\r\nCache-Control: no-store";
    for (const auto& [name, value] : headers) out += "\r\n" + name + ": " + value;
    out += "\r\n\r\n";
    if (!head_only) out += body;
    return out;
}

HttpResponse text_response(int status, std::string_view body) {
    HttpResponse r;
    r.status = status;
    r.body = std::string(body);
    if (r.body.empty() || r.body.back() != '\n') r.body += '\n';
    return r;
}

MetricsFormat negotiate_format(std::string_view accept) {
    double openmetrics = 0, other = 0;
    while (!accept.empty()) {
        const auto comma = accept.find(',');
        std::string_view element = trim(accept.substr(0, comma));
        accept = comma == std::string_view::npos ? std::string_view() : accept.substr(comma + 1);
        const auto semi = element.find(';');
        const std::string_view type = trim(element.substr(0, semi));
        const double q =
            quality(semi == std::string_view::npos ? std::string_view() : element.substr(semi + 1));
        if (iequals(type, "application/openmetrics-text")) {
            openmetrics = std::max(openmetrics, q);
        } else if (!type.empty()) {
            other = std::max(other, q);
        }
    }
    return openmetrics > 0 && openmetrics >= other ? MetricsFormat::openmetrics
                                                   : MetricsFormat::prometheus_text;
}

std::optional<HttpResponse> answer_http(std::string_view received,
                                        const MetricsEndpoints& endpoints,
                                        const MetricsHttpLimits& limits) {
    gateway::HttpLimits head_limits;
    head_limits.max_head_bytes = limits.max_request_bytes;
    head_limits.max_line_bytes = std::min(head_limits.max_line_bytes, limits.max_request_bytes);
    head_limits.max_headers = 64;
    const gateway::HeadParse parse = gateway::parse_request_head(received, head_limits);
    if (parse.status == gateway::HeadParse::Status::incomplete) {
        if (received.size() < limits.max_request_bytes) return std::nullopt;
        return text_response(
            431, "the request head is over " + std::to_string(limits.max_request_bytes) + " bytes");
    }
    if (parse.status == gateway::HeadParse::Status::error) {
        return text_response(parse.error_status ? parse.error_status : 400, parse.error);
    }
    const gateway::HttpRequestHead& head = parse.head;
    const bool head_only = head.method == "HEAD";
    if (head.method != "GET" && !head_only) {
        HttpResponse r =
            text_response(405, "method " + head.method + " not allowed: GET or HEAD only");
        r.headers.emplace_back("Allow", "GET, HEAD");
        return r;
    }
    const std::string_view path = std::string_view(head.target).substr(0, head.target.find('?'));
    HttpResponse r;
    if (path == "/metrics") {
        std::string_view accept;
        for (const auto& [name, value] : head.headers) {
            if (iequals(name, "Accept")) accept = value;
        }
        const MetricsFormat format = negotiate_format(accept);
        try {
            r.body = endpoints.metrics ? endpoints.metrics(format) : std::string();
            r.content_type = std::string(metrics_content_type(format));
        } catch (const std::exception& e) {
            r = text_response(500, std::string("metrics: ") + e.what());
        }
    } else if (path == "/healthz" || path == "/readyz") {
        const HealthCheck check =
            checked(path == "/healthz" ? endpoints.healthz : endpoints.readyz);
        r = text_response(check.ok ? 200 : 503, check.text);
    } else {
        r = text_response(404, "no " + std::string(path) +
                                   " here: the endpoints are /metrics, /healthz and /readyz");
    }
    r.head_only = head_only;
    return r;
}

ListenAddress parse_listen_address(const std::string& text) {
    ListenAddress out;
    std::string port = text;
    if (const auto colon = text.rfind(':'); colon != std::string::npos) {
        out.host = text.substr(0, colon);
        port = text.substr(colon + 1);
        if (out.host.size() >= 2 && out.host.front() == '[' && out.host.back() == ']') {
            out.host = out.host.substr(1, out.host.size() - 2);
        } else if (out.host.find(':') != std::string::npos) {
            throw std::invalid_argument("metrics address '" + text +
                                        "': write an IPv6 address in brackets, [::1]:PORT");
        }
    }
    if (out.host.empty()) out.host = "127.0.0.1";  // a port alone stays on this host
    int value = -1;
    const auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
    if (port.empty() || ec != std::errc() || end != port.data() + port.size() || value < 0 ||
        value > 65535) {
        throw std::invalid_argument("metrics address '" + text +
                                    "': expected PORT, ADDR:PORT or [ADDR]:PORT (port 0-65535)");
    }
    out.port = value;
    return out;
}

MetricsHttpServer::MetricsHttpServer(const ListenAddress& address, MetricsEndpoints endpoints,
                                     MetricsHttpLimits limits)
    : endpoints_(std::move(endpoints)), limits_(limits) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    addrinfo* found = nullptr;
    const std::string port = std::to_string(address.port);
    const std::string where = "metrics endpoint " + address.host + ":" + port;
    if (const int rc = ::getaddrinfo(address.host.c_str(), port.c_str(), &hints, &found); rc != 0) {
        throw std::runtime_error(where + ": " + ::gai_strerror(rc));
    }
    std::unique_ptr<addrinfo, void (*)(addrinfo*)> owned(found, ::freeaddrinfo);
    std::string error = "no address";
    for (addrinfo* ai = found; ai && !listener_; ai = ai->ai_next) {
        UniqueFd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
        if (!fd) continue;
        const int one = 1;
        ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(fd.get(), 64) != 0) {
            error = std::strerror(errno);
            continue;
        }
        listener_ = std::move(fd);
    }
    if (!listener_) throw std::runtime_error(where + ": cannot listen: " + error);
    sockaddr_storage bound{};
    socklen_t len = sizeof bound;
    ::getsockname(listener_.get(), reinterpret_cast<sockaddr*>(&bound), &len);
    char host[INET6_ADDRSTRLEN] = "";
    int bound_port = 0;
    if (bound.ss_family == AF_INET6) {
        const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&bound);
        ::inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof host);
        bound_port = ntohs(in6->sin6_port);
        address_ = "[" + std::string(host) + "]:" + std::to_string(bound_port);
    } else {
        const auto* in4 = reinterpret_cast<const sockaddr_in*>(&bound);
        ::inet_ntop(AF_INET, &in4->sin_addr, host, sizeof host);
        bound_port = ntohs(in4->sin_port);
        address_ = std::string(host) + ":" + std::to_string(bound_port);
    }
    stop_.reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (!stop_) throw std::runtime_error(where + ": eventfd: " + std::strerror(errno));
    thread_ = std::thread([this] { serve(); });
}

MetricsHttpServer::~MetricsHttpServer() {
    const std::uint64_t one = 1;
    [[maybe_unused]] auto n = ::write(stop_.get(), &one, sizeof one);
    if (thread_.joinable()) thread_.join();
}

void MetricsHttpServer::serve() {
    struct Connection {
        UniqueFd fd;
        std::string in;
        std::string out;
        std::size_t sent = 0;
        bool answered = false;
        Clock::time_point deadline;
    };
    std::vector<Connection> connections;
    const auto answer = [&](Connection& c, const HttpResponse& response) {
        c.out = response.wire();
        c.answered = true;
        c.deadline = Clock::now() + limits_.write_timeout;
    };
    // One try to say why a connection is not served, without waiting on it.
    const auto refuse = [](int fd, int status, std::string_view why) {
        const std::string wire = text_response(status, why).wire();
        [[maybe_unused]] auto n = ::send(fd, wire.data(), wire.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    };
    std::vector<pollfd> polled;
    for (;;) {
        polled.clear();
        polled.push_back({stop_.get(), POLLIN, 0});
        polled.push_back({listener_.get(), POLLIN, 0});
        auto next = Clock::time_point::max();
        for (const auto& c : connections) {
            polled.push_back({c.fd.get(), static_cast<short>(c.answered ? POLLOUT : POLLIN), 0});
            next = std::min(next, c.deadline);
        }
        int timeout_ms = -1;
        if (next != Clock::time_point::max()) {
            timeout_ms = static_cast<int>(std::clamp<long long>(
                std::chrono::duration_cast<std::chrono::milliseconds>(next - Clock::now()).count() +
                    1,
                0, 60000));
        }
        if (::poll(polled.data(), polled.size(), timeout_ms) < 0 && errno != EINTR) {
            spdlog::error("metrics endpoint: poll: {}", std::strerror(errno));
            return;
        }
        if (polled[0].revents) return;
        const auto now = Clock::now();
        // Connections first (their pollfds follow the two fixed ones), then accepts.
        std::vector<bool> done(connections.size(), false);
        for (std::size_t i = 0; i < connections.size(); ++i) {
            Connection& c = connections[i];
            const short revents = polled[i + 2].revents;
            if (!c.answered && (revents & (POLLIN | POLLHUP | POLLERR))) {
                char buffer[4096];
                const std::size_t room = limits_.max_request_bytes + 1 - c.in.size();
                const ssize_t n = ::recv(c.fd.get(), buffer, std::min(room, sizeof buffer), 0);
                if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
                    done[i] = true;  // the client left before asking
                    continue;
                }
                if (n > 0) c.in.append(buffer, static_cast<std::size_t>(n));
                if (auto response = answer_http(c.in, endpoints_, limits_)) answer(c, *response);
            } else if (c.answered && (revents & (POLLOUT | POLLHUP | POLLERR))) {
                const ssize_t n =
                    ::send(c.fd.get(), c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL);
                if (n < 0 && errno != EAGAIN && errno != EINTR) {
                    done[i] = true;
                    continue;
                }
                if (n > 0) c.sent += static_cast<std::size_t>(n);
                if (c.sent == c.out.size()) {
                    ::shutdown(c.fd.get(), SHUT_WR);
                    done[i] = true;
                }
            }
            if (!done[i] && now >= c.deadline) {
                if (!c.answered) refuse(c.fd.get(), 408, "no whole request in time");
                done[i] = true;
            }
        }
        for (std::size_t i = connections.size(); i-- > 0;) {
            if (done[i]) connections.erase(connections.begin() + static_cast<std::ptrdiff_t>(i));
        }
        if (polled[1].revents & POLLIN) {
            for (;;) {
                UniqueFd fd(
                    ::accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
                if (!fd) break;
                if (connections.size() >= limits_.max_connections) {
                    refuse(fd.get(), 503,
                           std::to_string(limits_.max_connections) + " connections open already");
                    continue;
                }
                Connection c;
                c.fd = std::move(fd);
                c.deadline = Clock::now() + limits_.request_timeout;
                connections.push_back(std::move(c));
            }
        }
    }
}

}  // namespace cellblock
