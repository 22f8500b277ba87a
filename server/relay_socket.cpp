#include "relay_socket.hpp"

#include "multipart.hpp"

namespace cellblock {

const char* relay_transport_name(RelayTransport transport) {
    return transport == RelayTransport::zmtp ? "zmtp" : "libzmq";
}

namespace {

class ZmqRelaySocket final : public RelaySocket {
  public:
    explicit ZmqRelaySocket(zmq::socket_t socket) : socket_(std::move(socket)) {}
    ~ZmqRelaySocket() override { close(); }

    bool send(std::vector<Frame>& frames) override {
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
    bool unsent() const override { return false; }

  private:
    zmq::socket_t socket_;
    EventLoop* loop_ = nullptr;
    std::optional<EventLoop::WatchId> watch_;
};

}  // namespace

std::unique_ptr<RelaySocket> make_zmq_relay_socket(zmq::socket_t socket) {
    return std::make_unique<ZmqRelaySocket>(std::move(socket));
}

}  // namespace cellblock
