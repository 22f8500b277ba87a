// The Docker Engine API client (docker_api.hpp).
#include "docker_api.hpp"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>

#include "cellblock/sandbox.hpp"
#include "cellblock/unique_fd.hpp"

namespace cellblock {
namespace {

using Clock = std::chrono::steady_clock;
constexpr std::size_t kMaxResponse = 64 << 20;

int remaining_ms(Clock::time_point deadline) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    return left > 0 ? static_cast<int>(left) : 0;
}

// Chunked transfer coding (RFC 9112 7.1) to its payload.
bool dechunk(std::string_view in, std::string& out) {
    for (;;) {
        const auto eol = in.find("\r\n");
        if (eol == std::string_view::npos) return false;
        std::size_t size = 0;
        const auto hex = in.substr(0, eol);
        const auto [end, ec] = std::from_chars(hex.data(), hex.data() + hex.size(), size, 16);
        if (ec != std::errc() || end == hex.data()) return false;
        in.remove_prefix(eol + 2);
        if (size == 0) return true;
        if (in.size() < size + 2) return false;
        out.append(in.substr(0, size));
        in.remove_prefix(size + 2);
    }
}

std::string lower(std::string s) {
    for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return s;
}

}  // namespace

std::string docker_filters(const nlohmann::json& filters) {
    static const char* hex = "0123456789ABCDEF";
    std::string out;
    for (unsigned char c : filters.dump()) {
        if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
            out.push_back(static_cast<char>(c));
        } else {
            out += '%';
            out += hex[c >> 4];
            out += hex[c & 15];
        }
    }
    return out;
}

DockerApi::DockerApi(std::string host, std::chrono::milliseconds timeout)
    : host_(std::move(host)), timeout_(timeout) {
    const std::string scheme = "unix://";
    if (host_.rfind(scheme, 0) != 0 || host_.size() == scheme.size()) {
        throw SandboxError("docker host " + host_ +
                           ": only unix:///path/to/docker.sock is supported");
    }
    socket_path_ = host_.substr(scheme.size());
    if (socket_path_.size() >= sizeof(sockaddr_un{}.sun_path)) {
        throw SandboxError("docker host " + host_ + ": the socket path is too long");
    }
}

DockerResponse DockerApi::call(const std::string& method, const std::string& path,
                               const nlohmann::json* body) const {
    const std::string what = "docker API " + method + " " + path + " (" + host_ + ")";
    const auto deadline = Clock::now() + timeout_;
    UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd) throw SandboxError(what + ": socket: " + std::strerror(errno));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, socket_path_.data(), socket_path_.size());
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
        throw SandboxError(what + ": cannot connect: " + std::strerror(errno));
    }
    const std::string payload = body ? body->dump() : std::string();
    std::string request = method + " " + path +
                          " HTTP/1.1\r\nHost: docker\r\nConnection: close\r\n"
                          "User-Agent: cellblock\r\n";
    if (body) {
        request +=
            "Content-Type: application/json\r\nContent-Length: " + std::to_string(payload.size()) +
            "\r\n";
    }
    request += "\r\n" + payload;
    for (std::size_t sent = 0; sent < request.size();) {
        const ssize_t n =
            ::send(fd.get(), request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) throw SandboxError(what + ": send: " + std::strerror(errno));
        sent += static_cast<std::size_t>(n);
    }
    std::string raw;
    char buf[65536];
    for (;;) {
        pollfd p{fd.get(), POLLIN, 0};
        const int ready = ::poll(&p, 1, remaining_ms(deadline));
        if (ready < 0 && errno == EINTR) continue;
        if (ready <= 0) {
            throw SandboxError(what + ": no answer within " +
                               std::to_string(timeout_.count() / 1000) + " s");
        }
        const ssize_t n = ::recv(fd.get(), buf, sizeof buf, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) throw SandboxError(what + ": recv: " + std::strerror(errno));
        if (n == 0) break;
        raw.append(buf, static_cast<std::size_t>(n));
        if (raw.size() > kMaxResponse) throw SandboxError(what + ": an answer over 64 MiB");
    }
    const auto head_end = raw.find("\r\n\r\n");
    if (raw.rfind("HTTP/1.", 0) != 0 || head_end == std::string::npos || raw.size() < 12) {
        throw SandboxError(what + ": not an HTTP answer");
    }
    DockerResponse response;
    response.status = std::atoi(raw.c_str() + 9);
    const std::string head = lower(raw.substr(0, head_end));
    std::string_view rest(raw);
    rest.remove_prefix(head_end + 4);
    if (head.find("\r\ntransfer-encoding: chunked") != std::string::npos) {
        if (!dechunk(rest, response.text)) throw SandboxError(what + ": a broken chunked body");
    } else {
        response.text = std::string(rest);
    }
    response.body = nlohmann::json::parse(response.text, nullptr, /*allow_exceptions=*/false);
    if (response.body.is_discarded()) response.body = nullptr;
    return response;
}

nlohmann::json DockerApi::expect(const std::string& method, const std::string& path,
                                 const nlohmann::json* body, int also_ok) const {
    DockerResponse r = call(method, path, body);
    if ((r.status >= 200 && r.status < 300) || (also_ok != 0 && r.status == also_ok)) {
        return r.body;
    }
    std::string message = r.body.is_object() ? r.body.value("message", "") : r.text;
    if (message.size() > 500) message.resize(500);
    throw SandboxError("docker API " + method + " " + path + ": " + std::to_string(r.status) + " " +
                       message);
}

}  // namespace cellblock
