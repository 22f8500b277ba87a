#include "cellblock/zmtp.hpp"

#include <algorithm>
#include <cctype>
#include <cstring>

namespace cellblock::zmtp {

namespace {

constexpr std::size_t kGreetingBytes = 64;
constexpr unsigned char kMore = 0x01, kLong = 0x02, kCommand = 0x04;
// Staging for frame headers and small frames; larger bodies are read into
// their own string.
// Small, because every connection has one (five per session, one per client
// of a session): 16 KiB holds a whole ordinary Jupyter message.
constexpr std::size_t kStageBytes = 16 << 10;
constexpr std::size_t kStagedFrameBytes = 4 << 10;
// A large frame's storage at first; it doubles as bytes arrive.
constexpr std::size_t kEagerBodyBytes = 1 << 20;
// READY, ERROR and anything else a peer says outside messages.
constexpr std::size_t kMaxCommandBytes = kStageBytes - 16;

std::string greeting() {
    std::string g(kGreetingBytes, '\0');
    g[0] = static_cast<char>(0xff);
    g[9] = 0x7f;
    g[10] = 3;  // ZMTP 3.0: a 3.1 peer speaks 3.0 with us
    g[11] = 0;
    std::memcpy(&g[12], "NULL", 4);
    g[32] = 0;  // as-server: no (the NULL mechanism ignores it)
    return g;
}

void put_u32(std::string& out, std::uint32_t v) {
    for (int shift = 24; shift >= 0; shift -= 8) out += static_cast<char>((v >> shift) & 0xff);
}

std::uint64_t get_be(std::string_view bytes) {
    std::uint64_t v = 0;
    for (unsigned char c : bytes) v = (v << 8) | c;
    return v;
}

void put_property(std::string& out, std::string_view name, std::string_view value) {
    out += static_cast<char>(name.size());
    out += name;
    put_u32(out, static_cast<std::uint32_t>(value.size()));
    out += value;
}

// RFC 23's table of valid socket combinations, for the types spoken here.
bool compatible(std::string_view ours, std::string_view peer) {
    if (ours == "DEALER") return peer == "ROUTER" || peer == "DEALER" || peer == "REP";
    if (ours == "ROUTER") return peer == "DEALER" || peer == "REQ" || peer == "ROUTER";
    if (ours == "SUB") return peer == "PUB" || peer == "XPUB";
    if (ours == "PUB") return peer == "SUB" || peer == "XSUB";
    return false;
}

bool same_name(std::string_view a, std::string_view b) {
    return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
               return std::tolower(static_cast<unsigned char>(x)) ==
                      std::tolower(static_cast<unsigned char>(y));
           });
}

std::string printable(std::string_view bytes) {
    std::string out;
    for (unsigned char c : bytes.substr(0, 32)) out += (c >= 0x20 && c < 0x7f) ? char(c) : '?';
    return out;
}

}  // namespace

Connection::Connection(std::string socket_type, std::string identity, Limits limits)
    : socket_type_(std::move(socket_type)),
      identity_(std::move(identity)),
      limits_(limits),
      in_(kStageBytes, '\0'),
      out_(greeting()) {
    if (identity_.size() > 255) identity_.resize(255);
}

bool Connection::fail(std::string why) {
    if (state_ != State::failed) error_ = std::move(why);
    state_ = State::failed;
    return false;
}

Connection::Span Connection::read_buffer() {
    if (state_ == State::failed) return {nullptr, 0};
    if (in_body_ && !body_skip_) {
        if (body_have_ == body_.size()) body_.resize(std::min(body_size_, 2 * body_.size()));
        return {body_.data() + body_have_, body_.size() - body_have_};
    }
    if (in_pos_ == in_end_) {
        in_pos_ = in_end_ = 0;
    } else if (in_pos_ > 0 && in_.size() - in_end_ < kStagedFrameBytes + 16) {
        std::memmove(in_.data(), in_.data() + in_pos_, in_end_ - in_pos_);
        in_end_ -= in_pos_;
        in_pos_ = 0;
    }
    return {in_.data() + in_end_, in_.size() - in_end_};
}

bool Connection::commit(std::size_t n) {
    if (state_ == State::failed) return false;
    if (in_body_ && !body_skip_) {
        body_have_ += n;
        if (body_have_ < body_size_) return true;
        in_body_ = false;
        partial_.total_bytes += body_.size();
        partial_.frames.push_back(std::move(body_));
        body_.clear();
        if (!body_more_) finish_message();
        return parse();
    }
    in_end_ += n;
    return parse();
}

bool Connection::feed(std::string_view bytes) {
    while (!bytes.empty()) {
        const Span span = read_buffer();
        if (span.size == 0) return false;
        const std::size_t n = std::min(span.size, bytes.size());
        std::memcpy(span.data, bytes.data(), n);
        bytes.remove_prefix(n);
        if (!commit(n)) return false;
    }
    return state_ != State::failed;
}

void Connection::release() {
    state_ = State::failed;
    if (error_.empty()) error_ = "closed";
    std::string().swap(in_);
    std::string().swap(body_);
    std::string().swap(out_);
    in_pos_ = in_end_ = body_have_ = body_size_ = out_sent_ = 0;
    in_body_ = false;
    partial_ = Message{};
    std::deque<Message>().swap(inbox_);
    inbox_bytes_ = 0;
    std::vector<std::string>().swap(queued_);
}

std::size_t Connection::held_bytes() const {
    std::size_t held = in_.capacity() + body_.capacity() + out_.capacity() + inbox_bytes_;
    for (const auto& q : queued_) held += q.capacity();
    return held;
}

Message Connection::pop() {
    Message m = std::move(inbox_.front());
    inbox_.pop_front();
    inbox_bytes_ -= m.total_bytes;
    return m;
}

bool Connection::parse_greeting() {
    if (in_end_ - in_pos_ < kGreetingBytes) return true;
    const std::string_view g(in_.data() + in_pos_, kGreetingBytes);
    if (static_cast<unsigned char>(g[0]) != 0xff || g[9] != 0x7f) {
        return fail("not a ZMTP peer (bad greeting signature)");
    }
    if (static_cast<unsigned char>(g[10]) < 3) {
        // Revision 1 is ZMTP 2.0 (RFC 15), 0 is 1.0 with a version byte.
        return fail("peer speaks an older ZMTP (revision " +
                    std::to_string(static_cast<unsigned char>(g[10])) + "), not 3.x");
    }
    const std::string_view mechanism = g.substr(12, 20);
    if (mechanism != std::string_view("NULL\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0", 20)) {
        return fail("peer's security mechanism is " + printable(mechanism) + ", not NULL");
    }
    in_pos_ += kGreetingBytes;
    state_ = State::handshake;
    std::string ready = "\x05READY";
    put_property(ready, "Socket-Type", socket_type_);
    if (!identity_.empty()) put_property(ready, "Identity", identity_);
    encode_frame(kCommand, ready);
    return true;
}

bool Connection::on_command(std::string_view body) {
    if (body.empty() || body.size() < 1u + static_cast<unsigned char>(body[0])) {
        return fail("malformed command");
    }
    const std::string_view name = body.substr(1, static_cast<unsigned char>(body[0]));
    std::string_view data = body.substr(1 + name.size());
    if (name == "ERROR") {
        const std::size_t len = data.empty() ? 0 : static_cast<unsigned char>(data[0]);
        return fail("peer sent ERROR: " + printable(data.substr(data.empty() ? 0 : 1, len)));
    }
    if (state_ == State::ready) return true;  // PING and the like from a newer peer
    if (name != "READY") return fail("expected READY, got command " + printable(name));
    while (!data.empty()) {
        const std::size_t name_len = static_cast<unsigned char>(data[0]);
        if (data.size() < 1 + name_len + 4) return fail("malformed READY property");
        const std::string_view prop = data.substr(1, name_len);
        const std::uint64_t value_len = get_be(data.substr(1 + name_len, 4));
        if (data.size() - 1 - name_len - 4 < value_len) return fail("malformed READY property");
        const std::string_view value = data.substr(1 + name_len + 4, value_len);
        if (same_name(prop, "Socket-Type")) {
            peer_type_ = std::string(value);
        } else if (same_name(prop, "Identity")) {
            if (value.size() > 255) return fail("peer's Identity is longer than 255 bytes");
            peer_identity_ = std::string(value);
        }
        data.remove_prefix(1 + name_len + 4 + value_len);
    }
    if (peer_type_.empty()) return fail("peer's READY has no Socket-Type");
    if (!compatible(socket_type_, peer_type_)) {
        return fail("a " + socket_type_ + " cannot talk to a " + printable(peer_type_));
    }
    state_ = State::ready;
    for (auto& m : queued_) out_ += m;
    queued_.clear();
    return true;
}

bool Connection::parse() {
    if (state_ == State::greeting && !parse_greeting()) return false;
    if (state_ == State::greeting) return true;
    while (state_ != State::failed) {
        if (in_body_) {  // skipping a frame (over a cap, or past max_frames)
            const std::size_t take = std::min(in_end_ - in_pos_, body_size_ - body_have_);
            in_pos_ += take;
            body_have_ += take;
            if (body_have_ < body_size_) return true;
            in_body_ = false;
            if (!body_more_) finish_message();
            continue;
        }
        const std::size_t avail = in_end_ - in_pos_;
        if (avail < 2) return true;
        const auto flags = static_cast<unsigned char>(in_[in_pos_]);
        if (flags & ~(kMore | kLong | kCommand)) return fail("reserved frame flag bits set");
        const std::size_t header = (flags & kLong) ? 9 : 2;
        if (avail < header) return true;
        const std::uint64_t size = get_be(std::string_view(in_.data() + in_pos_ + 1, header - 1));
        const bool command = flags & kCommand;
        if (command) {
            if (flags & kMore) return fail("command frame with MORE set");
            if (size > kMaxCommandBytes) return fail("command frame too large");
            if (avail < header + size) return true;
            const std::string_view body(in_.data() + in_pos_ + header, size);
            in_pos_ += header + size;
            if (!on_command(body)) return false;
            continue;
        }
        if (state_ != State::ready) return fail("message before the handshake ended");
        const bool more = flags & kMore;
        // Frames past max_frames are read past and counted: the message is
        // still delivered, so its receiver can say why it refuses it.
        const bool drop_frame = !partial_skip_ && partial_.frames.size() >= limits_.max_frames;
        if (drop_frame) ++partial_.dropped_frames;
        if (!drop_frame && !partial_skip_ &&
            (size > limits_.max_frame_bytes ||
             partial_.total_bytes + size > limits_.max_message_bytes)) {
            partial_skip_ = true;
            skip_reason_ = size > limits_.max_frame_bytes ? "frame too large" : "message too large";
            partial_.frames.clear();
        }
        if (partial_skip_ || drop_frame || size > kStagedFrameBytes) {
            // Read straight into the frame's own storage, or past it.
            in_pos_ += header;
            in_body_ = true;
            body_skip_ = partial_skip_ || drop_frame;
            body_more_ = more;
            body_size_ = size;
            const std::size_t take = std::min<std::size_t>(in_end_ - in_pos_, size);
            if (!body_skip_) {
                body_.resize(
                    std::max<std::size_t>(take, std::min<std::size_t>(size, kEagerBodyBytes)));
                std::memcpy(body_.data(), in_.data() + in_pos_, take);
            }
            body_have_ = take;
            in_pos_ += take;
            if (body_have_ < body_size_) return true;
            if (body_skip_) continue;
            in_body_ = false;
            partial_.total_bytes += size;
            partial_.frames.push_back(std::move(body_));
            body_.clear();
        } else {
            if (avail < header + size) return true;
            partial_.frames.emplace_back(in_.data() + in_pos_ + header, size);
            partial_.total_bytes += size;
            in_pos_ += header + size;
        }
        if (!more) finish_message();
    }
    return false;
}

void Connection::finish_message() {
    if (partial_skip_) {
        ++skipped_;
        if (std::string_view(skip_reason_) == "frame too large") ++skipped_frame_size_;
        last_skip_reason_ = skip_reason_;
    } else {
        inbox_bytes_ += partial_.total_bytes;
        inbox_.push_back(std::move(partial_));
    }
    partial_ = {};
    partial_skip_ = false;
}

void Connection::encode_frame(unsigned char flags, std::string_view body) {
    if (body.size() > 255) flags |= kLong;
    out_ += static_cast<char>(flags);
    if (flags & kLong) {
        const std::uint64_t size = body.size();
        for (int shift = 56; shift >= 0; shift -= 8)
            out_ += static_cast<char>((size >> shift) & 0xff);
    } else {
        out_ += static_cast<char>(body.size());
    }
    out_ += body;
}

void Connection::encode(const std::vector<std::string_view>& frames) {
    for (std::size_t i = 0; i < frames.size(); ++i) {
        encode_frame(i + 1 < frames.size() ? kMore : 0, frames[i]);
    }
}

void Connection::send(const std::vector<std::string_view>& frames) {
    if (frames.empty() || state_ == State::failed) return;
    if (state_ == State::ready) {
        encode(frames);
        return;
    }
    // Encoded now, appended once READY came.
    std::string saved;
    saved.swap(out_);
    encode(frames);
    queued_.push_back(std::move(out_));
    out_.swap(saved);
}

void Connection::consumed(std::size_t n) {
    out_sent_ += std::min(n, out_.size() - out_sent_);
    if (out_sent_ == out_.size()) {
        out_.clear();
        out_sent_ = 0;
    } else if (out_sent_ > (1u << 20)) {
        out_.erase(0, out_sent_);
        out_sent_ = 0;
    }
}

}  // namespace cellblock::zmtp
