// ZMTP 3.0 (rfc.zeromq.org/spec/23), one side of one connection with the
// NULL mechanism (symmetric: either side may have connected), as a pure codec: bytes in, messages
// out, messages in, bytes out. No sockets, no clock; server/zmtp_socket.cpp does the I/O.
//
// It speaks what the server needs: towards a kernel's libzmq sockets, DEALER
// (to a ROUTER) and SUB (to a PUB or XPUB); towards clients, ROUTER (to
// DEALER, REQ, ROUTER) and PUB (to SUB, XSUB; a subscription arrives as a
// message "\x01" + prefix, a cancel as "\x00" + prefix, ZMTP 3.0's form,
// which libzmq uses with a 3.0 peer). The peer is a sandbox or any local
// process, so every byte it sends is untrusted: the greeting and READY are
// checked field by field; a message with a frame over the frame cap, or more
// bytes than the message cap, is skipped (its bytes read and discarded, the
// stream stays in step) and counted, never held; frames past the frame-count
// cap are read past and counted in the message delivered
// (Message::dropped_frames), so its receiver can say why it refuses it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <string_view>
#include <vector>

namespace cellblock::zmtp {

struct Limits {
    std::size_t max_frame_bytes = 64 << 20;
    std::size_t max_frames = 64;
    // The frames of one message together.
    std::size_t max_message_bytes = std::size_t{128} << 20;
};

struct Message {
    std::vector<std::string> frames;
    std::size_t total_bytes = 0;     // of the frames kept
    std::size_t dropped_frames = 0;  // past Limits::max_frames, read and not kept
};

class Connection {
  public:
    // `socket_type` is ours ("DEALER", "SUB", "ROUTER" or "PUB"); `identity`
    // the routing id a DEALER announces (empty: the peer picks one). The greeting is queued
    // at once: write output() as soon as the transport is connected.
    Connection(std::string socket_type, std::string identity, Limits limits = {});

    // Where the next read should put bytes (at most `size` of them): inside
    // a large frame's own storage, so its body is copied once. That storage
    // grows with the bytes that arrive (past 1 MiB, doubling), so a peer that
    // announces a large frame and sends little makes the server hold little.
    struct Span {
        char* data;
        std::size_t size;
    };
    Span read_buffer();
    // `n` bytes were read into read_buffer(). Parses what is complete. False
    // once the peer broke the protocol: error() says how; nothing more is
    // parsed and the connection must be closed.
    bool commit(std::size_t n);
    // The same for bytes held elsewhere (tests, the fuzzer).
    bool feed(std::string_view bytes);

    bool ready() const { return state_ == State::ready; }
    bool failed() const { return state_ == State::failed; }
    const std::string& error() const { return error_; }
    const std::string& peer_socket_type() const { return peer_type_; }
    // The Identity the peer's READY announced (empty if none).
    const std::string& peer_identity() const { return peer_identity_; }

    // Whole messages received, oldest first.
    bool has_message() const { return !inbox_.empty(); }
    std::size_t queued_messages() const { return inbox_.size(); }
    std::size_t queued_bytes() const { return inbox_bytes_; }
    Message pop();
    // Messages skipped for a frame or the message over the byte caps.
    std::uint64_t skipped_messages() const { return skipped_; }
    // Of those, for a frame over the frame cap ("frame too large"); the rest
    // were for the message over the byte cap ("message too large").
    std::uint64_t skipped_for_frame_size() const { return skipped_frame_size_; }
    // Why the last one counted was skipped.
    const char* last_skip_reason() const { return last_skip_reason_; }

    // Queues a message (sent once the handshake is done). For SUB, a
    // subscription is the message "\x01" + prefix (ZMTP 3.0).
    void send(const std::vector<std::string_view>& frames);
    // Bytes waiting to be written, and how many were written.
    std::string_view output() const { return std::string_view(out_).substr(out_sent_); }
    void consumed(std::size_t n);
    // The transport closed: frees every buffer (a closed session keeps its
    // connection objects for the rest of its SessionClosed window, not their
    // 16 KiB of staging each). Nothing is read or written afterwards.
    void release();
    // Bytes of memory its buffers hold (staging, a large frame's body, output,
    // whole messages waiting).
    std::size_t held_bytes() const;

  private:
    enum class State { greeting, handshake, ready, failed };
    bool fail(std::string why);
    bool parse();
    bool parse_greeting();
    void finish_message();
    bool on_command(std::string_view body);
    void encode(const std::vector<std::string_view>& frames);
    void encode_frame(unsigned char flags, std::string_view body);

    std::string socket_type_, identity_, peer_type_, peer_identity_;
    Limits limits_;
    State state_ = State::greeting;
    std::string error_;

    // Input: staged bytes not yet parsed, or the body of one large frame.
    std::string in_;
    std::size_t in_pos_ = 0, in_end_ = 0;
    // A frame whose body is read straight into `body_` (or skipped).
    bool in_body_ = false;
    bool body_more_ = false, body_skip_ = false;
    std::string body_;
    std::size_t body_have_ = 0, body_size_ = 0;
    // The message being assembled.
    Message partial_;
    bool partial_skip_ = false;
    const char* skip_reason_ = "";  // of the message being skipped
    const char* last_skip_reason_ = "";
    std::uint64_t skipped_frame_size_ = 0;
    std::deque<Message> inbox_;
    std::size_t inbox_bytes_ = 0;
    std::uint64_t skipped_ = 0;

    std::string out_;
    std::size_t out_sent_ = 0;
    std::vector<std::string> queued_;  // encoded messages waiting for the handshake
};

}  // namespace cellblock::zmtp
