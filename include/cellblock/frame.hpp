// One frame of a message, as the relay holds it between a receive and a send:
// immutable bytes it owns, whichever transport read them. Small frames hold
// their bytes inline; a large one keeps them in shared storage (a buffer the
// ZMTP codec read into, a libzmq message adopted at the socket's edge), so
// moving it, sharing it with another thread or handing it to a zero-copy send
// never copies its payload. No ZMQ here: the sockets convert at their edge.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace cellblock {

class Frame {
  public:
    // From this size up, bytes live in shared storage.
    static constexpr std::size_t kSharedBytes = 4096;

    Frame() = default;
    // Takes `bytes` without copying them.
    explicit Frame(std::string bytes);
    // Views `bytes`, which `owner` keeps alive and unchanged (adopted storage).
    Frame(std::shared_ptr<const void> owner, std::string_view bytes)
        : owner_(std::move(owner)), shared_(bytes) {}
    static Frame copy_of(std::string_view bytes) { return Frame(std::string(bytes)); }

    std::string_view view() const { return owner_ ? shared_ : std::string_view(inline_); }
    const char* data() const { return view().data(); }
    std::size_t size() const { return view().size(); }
    bool empty() const { return size() == 0; }
    // The bytes stay where they are while any frame sharing them lives.
    bool is_shared() const { return owner_ != nullptr; }
    // Another frame of the same bytes: shared storage is shared, small bytes copied.
    Frame share() const;

  private:
    std::string inline_;
    std::shared_ptr<const void> owner_;
    std::string_view shared_;
};

// Encoded frames (encode()'s) as frames, each string taken without a copy.
std::vector<Frame> to_frames(std::vector<std::string> frames);

// The frames of one message as a transport received it.
struct Multipart {
    std::vector<Frame> frames;
    std::size_t dropped_frames = 0;  // frames past the cap, received and discarded
    std::size_t total_bytes = 0;

    std::vector<std::string_view> views() const;
    std::string_view view(std::size_t i) const { return frames[i].view(); }
};

}  // namespace cellblock
