#include "multipart.hpp"

#include "event_loop.hpp"

#include <cstdio>

namespace cellblock {

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
            out.frames.push_back(std::move(frame));
        } else {
            ++out.dropped_frames;
        }
    }
    return true;
}

bool send_multipart(zmq::socket_t& socket, std::vector<zmq::message_t>& frames) {
    EventLoop::note_touched(socket.handle());
    for (std::size_t i = 0; i < frames.size(); ++i) {
        auto flags = zmq::send_flags::dontwait;
        if (i + 1 < frames.size()) flags = flags | zmq::send_flags::sndmore;
        try {
            if (!socket.send(frames[i], flags)) return false;
        } catch (const zmq::error_t&) {
            // A ROUTER with an unknown peer identity, or a closed socket.
            return false;
        }
    }
    return true;
}

zmq::message_t to_frame(std::string_view bytes) {
    return zmq::message_t(bytes.data(), bytes.size());
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
