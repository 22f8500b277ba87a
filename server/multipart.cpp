#include "multipart.hpp"

#include "event_loop.hpp"

#include <cstdio>
#include <memory>

namespace cellblock {

Frame from_zmq(zmq::message_t&& message) {
    if (message.size() < Frame::kSharedBytes) {
        return Frame::copy_of({static_cast<const char*>(message.data()), message.size()});
    }
    // A large message's bytes live outside it: they stay put as it moves.
    auto owned = std::make_shared<zmq::message_t>(std::move(message));
    const std::string_view bytes(static_cast<const char*>(owned->data()), owned->size());
    return Frame(std::move(owned), bytes);
}

zmq::message_t to_zmq(Frame&& frame) {
    if (!frame.is_shared()) return zmq::message_t(frame.data(), frame.size());
    // libzmq frees it (on its I/O thread, once sent) through the hint.
    auto* kept = new Frame(std::move(frame));
    return zmq::message_t(
        const_cast<char*>(kept->data()), kept->size(),
        [](void*, void* hint) { delete static_cast<Frame*>(hint); }, kept);
}

bool recv_multipart(zmq::socket_t& socket, Multipart& out, std::size_t max_frames) {
    EventLoop::note_touched(socket.handle());
    out.frames.clear();
    out.dropped_frames = 0;
    out.total_bytes = 0;
    bool more = true;
    bool first = true;
    while (more) {
        zmq::message_t frame;
        const auto received =
            socket.recv(frame, first ? zmq::recv_flags::dontwait : zmq::recv_flags::none);
        if (!received) return false;
        first = false;
        more = frame.more();
        out.total_bytes += frame.size();
        if (out.frames.size() < max_frames) {
            out.frames.push_back(from_zmq(std::move(frame)));
        } else {
            ++out.dropped_frames;
        }
    }
    return true;
}

bool send_multipart(zmq::socket_t& socket, std::vector<Frame>& frames) {
    EventLoop::note_touched(socket.handle());
    for (std::size_t i = 0; i < frames.size(); ++i) {
        auto flags = zmq::send_flags::dontwait;
        if (i + 1 < frames.size()) flags = flags | zmq::send_flags::sndmore;
        try {
            zmq::message_t message = to_zmq(std::move(frames[i]));
            if (!socket.send(message, flags)) return false;
        } catch (const zmq::error_t&) {
            // A ROUTER with an unknown peer identity, or a closed socket.
            return false;
        }
    }
    return true;
}

std::string identity_text(std::string_view identity) {
    std::string out;
    for (unsigned char c : identity.substr(0, 16)) {
        char buf[3];
        std::snprintf(buf, sizeof buf, "%02x", c);
        out += buf;
    }
    return out.empty() ? "-" : out;
}

}  // namespace cellblock
