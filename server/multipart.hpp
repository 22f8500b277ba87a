// Receiving and sending multipart messages on a libzmq socket: the edge
// where libzmq's frames become cellblock::Frame and back, without copying
// large payloads.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <zmq.hpp>

#include "cellblock/frame.hpp"

namespace cellblock {

// Receives one whole multipart message if one is waiting. Frames past
// `max_frames` are received (ZMQ delivers messages whole) but not kept.
bool recv_multipart(zmq::socket_t& socket, Multipart& out, std::size_t max_frames);

// Sends the frames in order (taking them); a full peer queue drops the
// message rather than blocking.
bool send_multipart(zmq::socket_t& socket, std::vector<Frame>& frames);

// A libzmq message as a frame (a large one adopted, not copied), and back.
Frame from_zmq(zmq::message_t&& message);
zmq::message_t to_zmq(Frame&& frame);

// Printable form of a routing identity for log lines.
std::string identity_text(std::string_view identity);

}  // namespace cellblock
