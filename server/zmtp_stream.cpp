#include "zmtp_stream.hpp"

#include <sys/socket.h>

#include <cerrno>
#include <cstring>

#include <spdlog/spdlog.h>

namespace cellblock {

namespace {

// Whole messages decoded ahead of the relay: past this (or the stream's byte
// bound), reading pauses. libzmq's receive high-water mark is 1000 messages
// of any size (up to 64 GiB here).
constexpr std::size_t kMaxInbox = 1000;

}  // namespace

ZmtpStream::ZmtpStream(UniqueFd fd, zmtp::Connection connection, std::string label,
                       std::size_t max_inbox_bytes)
    : fd_(std::move(fd)),
      zmtp_(std::move(connection)),
      label_(std::move(label)),
      max_inbox_bytes_(max_inbox_bytes) {
    flush();  // the greeting
}

bool ZmtpStream::send(const std::vector<std::string_view>& frames, std::size_t max_backlog) {
    if (!fd_ || broken_) return false;
    if (zmtp_.output().size() > max_backlog) return false;
    zmtp_.send(frames);
    flush();
    return true;
}

bool ZmtpStream::send(const std::vector<Frame>& frames, std::size_t max_backlog) {
    std::vector<std::string_view> views;
    views.reserve(frames.size());
    for (const auto& f : frames) views.push_back(f.view());
    return send(views, max_backlog);
}

bool ZmtpStream::receive(Multipart& out, std::size_t max_frames, const std::string* prefix) {
    if (!fd_) return false;
    if (!zmtp_.has_message()) pump();
    if (!zmtp_.has_message()) return false;
    zmtp::Message m = zmtp_.pop();
    out.frames.clear();
    out.dropped_frames = m.dropped_frames;
    out.total_bytes = m.total_bytes;
    if (prefix) {
        out.frames.push_back(Frame::copy_of(*prefix));
        out.total_bytes += prefix->size();
    }
    for (auto& frame : m.frames) {
        if (out.frames.size() < max_frames) {
            // The codec's own string: its bytes move, never copied.
            out.frames.emplace_back(std::move(frame));
        } else {
            ++out.dropped_frames;
        }
    }
    return true;
}

pollfd ZmtpStream::poll_item() const {
    const short events = static_cast<short>((broken_ ? 0 : POLLIN) |
                                            (!broken_ && !zmtp_.output().empty() ? POLLOUT : 0));
    return {fd_.get(), events, 0};
}

void ZmtpStream::watch(EventLoop& loop, EventLoop::Handler on_ready) {
    loop_ = &loop;
    watch_ = loop.watch_fd(
        fd_.get(),
        [this, on_ready = std::move(on_ready)] {
            pump();
            on_ready();
        },
        [this] { return fd_ && zmtp_.has_message(); });
    if (!zmtp_.output().empty()) set_writable(true);
}

void ZmtpStream::stop_watching() {
    if (loop_ && watch_) loop_->unwatch(*watch_);
    watch_.reset();
    writable_ = false;
}

void ZmtpStream::close() {
    stop_watching();
    fd_.reset();
    zmtp_.release();
}

void ZmtpStream::set_writable(bool writable) {
    if (writable == writable_ || !loop_ || !watch_) return;
    loop_->want_writable(*watch_, writable);
    writable_ = writable;
}

void ZmtpStream::broke(const std::string& why) {
    if (broken_) return;
    broken_ = true;
    // A kernel that exits, or a client that leaves, closes its sockets: not
    // worth more than a debug line.
    spdlog::debug("{}: connection ended: {}", label_, why);
    set_writable(false);
}

void ZmtpStream::shutdown_write() {
    if (!fd_ || broken_ || write_shut_) return;
    write_shut_ = true;
    set_writable(false);
    ::shutdown(fd_.get(), SHUT_WR);
}

void ZmtpStream::flush() {
    while (fd_ && !broken_ && !write_shut_ && !zmtp_.output().empty()) {
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

void ZmtpStream::pump() {
    flush();
    for (int reads = 0; fd_ && !broken_ && reads < 64 && zmtp_.queued_messages() < kMaxInbox &&
                        zmtp_.queued_bytes() < max_inbox_bytes_;
         ++reads) {
        const auto span = zmtp_.read_buffer();
        if (span.size == 0) break;
        const ssize_t n = ::recv(fd_.get(), span.data, span.size, MSG_DONTWAIT);
        if (n > 0) {
            const auto skipped = zmtp_.skipped_messages();
            const auto for_frames = zmtp_.skipped_for_frame_size();
            if (!zmtp_.commit(static_cast<std::size_t>(n))) {
                spdlog::warn("{}: {}; closing the connection", label_, zmtp_.error());
                broke(zmtp_.error());
                break;
            }
            // Each kind of skip this read counted, reported once.
            const auto frames_now = zmtp_.skipped_for_frame_size() - for_frames;
            const auto messages_now = zmtp_.skipped_messages() - skipped - frames_now;
            for (const auto& [count, why] : {std::pair{frames_now, "frame too large"},
                                             std::pair{messages_now, "message too large"}}) {
                if (count == 0) continue;
                if (on_skipped_) {
                    on_skipped_(why);
                } else {
                    spdlog::warn("{}: dropped a message over the frame limits ({}; {} this read)",
                                 label_, why, count);
                }
            }
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        broke(n == 0 ? std::string("end of file") : std::string("recv: ") + std::strerror(errno));
    }
    // A handshake step (READY) may have queued output while reading.
    if (!zmtp_.output().empty()) flush();
}

}  // namespace cellblock
