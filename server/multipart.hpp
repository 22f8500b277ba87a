// Receiving and sending multipart ZMQ messages without copying frames.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <zmq.hpp>

namespace cellblock {

struct Multipart {
    std::vector<zmq::message_t> frames;
    std::size_t dropped_frames = 0;  // frames past the cap, received and discarded
    std::size_t total_bytes = 0;

    std::vector<std::string_view> views() const {
        std::vector<std::string_view> v;
        v.reserve(frames.size());
        for (const auto& f : frames) v.emplace_back(static_cast<const char*>(f.data()), f.size());
        return v;
    }
    std::string_view view(std::size_t i) const {
        return {static_cast<const char*>(frames[i].data()), frames[i].size()};
    }
};

// Receives one whole multipart message if one is waiting. Frames past
// `max_frames` are received (ZMQ delivers messages whole) but not kept.
bool recv_multipart(zmq::socket_t& socket, Multipart& out, std::size_t max_frames);

// Sends the frames in order; a full peer queue drops the message rather than blocking.
bool send_multipart(zmq::socket_t& socket, std::vector<zmq::message_t>& frames);

zmq::message_t to_frame(std::string_view bytes);

// Printable form of a routing identity for log lines.
std::string identity_text(std::string_view identity);

}  // namespace cellblock
