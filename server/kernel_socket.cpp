#include "kernel_socket.hpp"

#include <sys/socket.h>
#include <sys/un.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "unix_address.hpp"
#include "zmtp_stream.hpp"

namespace cellblock {

namespace {

// A kernel that does not read its shell is not queued for without end (what
// libzmq's send high-water mark does for the other transport).
constexpr std::size_t kMaxBacklogBytes = 96 << 20;
// What the relay reads ahead of a kernel. A kernel's iopub PUB drops what
// its reader cannot take at its high-water mark (1000 messages), the final
// idle status included, and a busy host can slow the relay for a moment: a
// read-ahead of this size (libzmq's I/O thread read up to 1000 messages of
// any size) lets a 1 GiB flood of 1 MiB writes pass with nothing dropped.
constexpr std::size_t kKernelReadAheadBytes = 256 << 20;

// A kernel's socket, one connection.
class ZmtpKernelSocket final : public RelaySocket {
  public:
    ZmtpKernelSocket(UniqueFd fd, zmtp::Connection connection, std::string label)
        : stream_(std::move(fd), std::move(connection), std::move(label), kKernelReadAheadBytes) {}

    bool send(std::vector<Frame>& frames) override {
        return stream_.send(frames, kMaxBacklogBytes);
    }
    bool receive(Multipart& out, std::size_t max_frames) override {
        return stream_.receive(out, max_frames);
    }
    pollfd poll_item() override { return stream_.poll_item(); }
    void watch(EventLoop& loop, EventLoop::Handler on_readable) override {
        stream_.watch(loop, [this, on_readable = std::move(on_readable)] {
            if (stream_.zmtp().has_message()) on_readable();
            // The kernel is gone and what it sent is relayed: the fd stays
            // readable (end of file), so stop watching it.
            if (stream_.is_open() && stream_.broken() && !stream_.zmtp().has_message()) {
                stream_.stop_watching();
            }
        });
    }
    void close() override { stream_.close(); }
    bool is_open() const override { return stream_.is_open(); }
    bool unsent() const override { return stream_.unsent(); }

  private:
    ZmtpStream stream_;
};

}  // namespace

std::unique_ptr<RelaySocket> connect_zmtp_kernel_socket(
    const std::string& path, const std::string& socket_type, const std::string& identity,
    zmtp::Limits limits, std::string label, std::chrono::steady_clock::time_point deadline) {
    const auto addr = unix_address(path);
    if (!addr) throw std::runtime_error(label + ": socket path too long: " + path);
    while (true) {
        UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
        if (!fd) throw std::runtime_error(label + ": socket: " + std::strerror(errno));
        if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof *addr) == 0) {
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
