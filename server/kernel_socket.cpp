#include "kernel_socket.hpp"

#include <sys/socket.h>
#include <sys/un.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <thread>

#include <spdlog/spdlog.h>

namespace cellblock {

std::optional<KernelTransport> parse_kernel_transport(std::string_view name) {
    if (name == "libzmq") return KernelTransport::libzmq;
    if (name == "zmtp") return KernelTransport::zmtp;
    return std::nullopt;
}

const char* kernel_transport_name(KernelTransport transport) {
    return transport == KernelTransport::zmtp ? "zmtp" : "libzmq";
}

namespace {

class ZmqKernelSocket final : public KernelSocket {
  public:
    explicit ZmqKernelSocket(zmq::socket_t socket) : socket_(std::move(socket)) {}
    ~ZmqKernelSocket() override { close(); }

    bool send(std::vector<zmq::message_t>& frames) override {
        return socket_ && send_multipart(socket_, frames);
    }
    bool receive(Multipart& out, std::size_t max_frames) override {
        return socket_ && recv_multipart(socket_, out, max_frames);
    }
    pollfd poll_item() override {
        return {socket_ ? static_cast<int>(socket_.get(zmq::sockopt::fd)) : -1, POLLIN, 0};
    }
    void watch(EventLoop& loop, EventLoop::Handler on_readable) override {
        loop_ = &loop;
        watch_ = loop.watch(socket_, std::move(on_readable));
    }
    void close() override {
        if (loop_ && watch_) loop_->unwatch(*watch_);
        watch_.reset();
        if (socket_) socket_.close();
    }
    bool is_open() const override { return static_cast<bool>(socket_); }

  private:
    zmq::socket_t socket_;
    EventLoop* loop_ = nullptr;
    std::optional<EventLoop::WatchId> watch_;
};

// Frames past this size are handed to the relay without a copy: the
// zmq::message_t owns the string the codec read the body into.
constexpr std::size_t kAdoptBytes = 4096;
// A kernel that does not read its shell is not queued for without end (what
// libzmq's send high-water mark does for the other transport).
constexpr std::size_t kMaxBacklogBytes = 96 << 20;
// Whole messages decoded ahead of the relay: past this, reading pauses and
// the kernel's own queue (its high-water mark) takes the backlog.
constexpr std::size_t kMaxInbox = 64;

zmq::message_t adopt(std::string&& bytes) {
    if (bytes.size() < kAdoptBytes) return zmq::message_t(bytes.data(), bytes.size());
    auto* owned = new std::string(std::move(bytes));
    return zmq::message_t(
        owned->data(), owned->size(),
        [](void*, void* hint) { delete static_cast<std::string*>(hint); }, owned);
}

class ZmtpKernelSocket final : public KernelSocket {
  public:
    ZmtpKernelSocket(UniqueFd fd, zmtp::Connection connection, std::string label)
        : fd_(std::move(fd)), zmtp_(std::move(connection)), label_(std::move(label)) {
        flush();  // the greeting
    }
    ~ZmtpKernelSocket() override { close(); }

    bool send(std::vector<zmq::message_t>& frames) override {
        if (!fd_ || broken_) return false;
        if (zmtp_.output().size() > kMaxBacklogBytes) return false;
        std::vector<std::string_view> views;
        views.reserve(frames.size());
        for (const auto& f : frames) views.emplace_back(static_cast<const char*>(f.data()), f.size());
        zmtp_.send(views);
        flush();
        return true;
    }

    bool receive(Multipart& out, std::size_t max_frames) override {
        if (!fd_) return false;
        if (!zmtp_.has_message()) pump();
        if (!zmtp_.has_message()) return false;
        zmtp::Message m = zmtp_.pop();
        out.frames.clear();
        out.dropped_frames = 0;
        out.total_bytes = m.total_bytes;
        for (auto& frame : m.frames) {
            if (out.frames.size() < max_frames) {
                out.frames.push_back(adopt(std::move(frame)));
            } else {
                ++out.dropped_frames;
            }
        }
        return true;
    }

    pollfd poll_item() override {
        const short events = static_cast<short>(
            (broken_ ? 0 : POLLIN) | (!broken_ && !zmtp_.output().empty() ? POLLOUT : 0));
        return {fd_.get(), events, 0};
    }

    void watch(EventLoop& loop, EventLoop::Handler on_readable) override {
        loop_ = &loop;
        watch_ = loop.watch_fd(
            fd_.get(),
            [this, on_readable = std::move(on_readable)] {
                pump();
                if (zmtp_.has_message()) on_readable();
                // The peer is gone and what it sent is relayed: the fd stays
                // readable (end of file), so stop watching it.
                if (fd_ && broken_ && !zmtp_.has_message()) stop_watching();
            },
            [this] { return fd_ && zmtp_.has_message(); });
        if (!zmtp_.output().empty()) set_writable(true);
    }

    void close() override {
        stop_watching();
        fd_.reset();
    }
    bool is_open() const override { return static_cast<bool>(fd_); }

  private:
    void stop_watching() {
        if (loop_ && watch_) loop_->unwatch(*watch_);
        watch_.reset();
        writable_ = false;
    }

    void set_writable(bool writable) {
        if (writable == writable_ || !loop_ || !watch_) return;
        loop_->want_writable(*watch_, writable);
        writable_ = writable;
    }

    void broke(const std::string& why) {
        if (broken_) return;
        broken_ = true;
        // A kernel that exits closes its sockets: its lifeline says so too,
        // with the exit status, so this is only detail.
        spdlog::debug("{}: connection ended: {}", label_, why);
        set_writable(false);
    }

    // Writes what is queued, as far as the socket takes it.
    void flush() {
        while (fd_ && !broken_ && !zmtp_.output().empty()) {
            const auto out = zmtp_.output();
            const ssize_t n = ::send(fd_.get(), out.data(), out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
            if (n > 0) {
                zmtp_.consumed(static_cast<std::size_t>(n));
                continue;
            }
            if (n < 0 && errno == EINTR) continue;
            if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
                set_writable(true);
                return;
            }
            broke(std::string("send: ") + std::strerror(errno));
            return;
        }
        set_writable(false);
    }

    // Writes what is queued and reads what has arrived, without blocking.
    void pump() {
        flush();
        for (int reads = 0; fd_ && !broken_ && reads < 16 && zmtp_.queued_messages() < kMaxInbox;
             ++reads) {
            const auto span = zmtp_.read_buffer();
            if (span.size == 0) break;
            const ssize_t n = ::recv(fd_.get(), span.data, span.size, MSG_DONTWAIT);
            if (n > 0) {
                const auto skipped = zmtp_.skipped_messages();
                if (!zmtp_.commit(static_cast<std::size_t>(n))) {
                    spdlog::warn("{}: {}; closing the connection", label_, zmtp_.error());
                    broke(zmtp_.error());
                    break;
                }
                if (zmtp_.skipped_messages() != skipped) {
                    spdlog::warn("{}: dropped a message over the frame limits", label_);
                }
                // A short read took all there was: no need to hear EAGAIN.
                if (static_cast<std::size_t>(n) < span.size) break;
                continue;
            }
            if (n < 0 && errno == EINTR) continue;
            if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
            broke(n == 0 ? std::string("end of file") : std::string("recv: ") + std::strerror(errno));
        }
        // A handshake step (READY) may have queued output while reading.
        if (!zmtp_.output().empty()) flush();
    }

    UniqueFd fd_;
    zmtp::Connection zmtp_;
    std::string label_;
    bool broken_ = false;
    EventLoop* loop_ = nullptr;
    std::optional<EventLoop::WatchId> watch_;
    bool writable_ = false;
};

}  // namespace

std::unique_ptr<KernelSocket> make_zmq_kernel_socket(zmq::socket_t socket) {
    return std::make_unique<ZmqKernelSocket>(std::move(socket));
}

std::unique_ptr<KernelSocket> connect_zmtp_kernel_socket(const std::string& path,
                                                         const std::string& socket_type,
                                                         const std::string& identity,
                                                         zmtp::Limits limits, std::string label,
                                                         std::chrono::steady_clock::time_point deadline) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (path.size() >= sizeof addr.sun_path) {
        throw std::runtime_error(label + ": socket path too long: " + path);
    }
    std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
    while (true) {
        UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
        if (!fd) throw std::runtime_error(label + ": socket: " + std::strerror(errno));
        if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0) {
            zmtp::Connection connection(socket_type, identity, limits);
            if (socket_type == "SUB") connection.send({std::string_view("\x01", 1)});
            return std::make_unique<ZmtpKernelSocket>(std::move(fd), std::move(connection),
                                                      std::move(label));
        }
        // Bound but not yet listening, or a full backlog: libzmq retries too.
        if (errno != ECONNREFUSED && errno != EAGAIN && errno != EINTR) {
            throw std::runtime_error(label + ": connect " + path + ": " + std::strerror(errno));
        }
        if (std::chrono::steady_clock::now() >= deadline) {
            throw std::runtime_error(label + ": connect " + path + ": " + std::strerror(errno) +
                                     " until the deadline");
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
}

}  // namespace cellblock
