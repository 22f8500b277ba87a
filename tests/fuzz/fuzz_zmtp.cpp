// Fuzzes the ZMTP 3.0 codec (protocol/zmtp.cpp): what a sandbox's libzmq
// socket, a client's, or anything pretending to be one, sends the server.
//
// Input: a 5-byte header, the bytes the peer sends, then `ops` bytes saying
// how to cut them into reads.
//   byte 0    bits 0 and 4: our socket type, DEALER, SUB, ROUTER, PUB (bit 0
//             + 2 * bit 4)
//             bits 1-2: limits, with bytes 1-3:
//               0 small:  max_frame_bytes = u16 % 1024, max_frames = byte 3 % 8
//               1 medium: max_frame_bytes = u16 + 65536 * (byte 3 >> 7), every
//                         value up to 128 KiB (around the codec's staging
//                         sizes, whatever they are), max_frames = 1 + byte 3 % 16
//               2 large:  max_frame_bytes = 70000 + 4 * u16, max_frames = 1 + byte 3 % 64
//               3 the defaults, Limits{}
//             and, but for the defaults, max_message_bytes = max_frame_bytes *
//             (1 + bits 4-6 of byte 3)
//             bit 3: we announce an Identity
//   bytes 1-2 u16 little-endian, byte 3: see the limits
//   byte 4    how many bytes at the end of the input are ops (not peer bytes)
// Each op byte: bit 7 chooses read_buffer()/commit() (1) or feed() (0); bits
// 0-6 are v: 0-95 the next 1..96 peer bytes, 96-125 the next (v-95)*512,
// 126 all the rest, 127 a run of zero bytes (2*u16+1 of them, the u16 from
// the next two op bytes) that are not in the input, so a frame over 64 KiB
// is reachable from a short one; at most kMaxZeros of them in all, as the
// reference run feeds every byte on its own. Peer bytes left after the ops
// are fed whole.
//
// Checks: no message keeps more frames than max_frames (it drops frames only
// once it has max_frames), a frame over max_frame_bytes or more bytes than
// max_message_bytes, or is empty, and its total_bytes is the sum of its frames;
// queued_bytes() is what the queued messages hold; failed() is sticky, with a
// non-empty error(), and after it nothing is parsed; the skip count never goes
// down; ready() implies a compatible peer; the output is our greeting, then our
// READY, then the message sent before the handshake (once, only after ready);
// the same bytes fed one at a time give the same messages, failure, error, skip
// count and output; and a model parsing the whole stream at once (below) gives
// the same messages, dropped frames, skip count, failure and readiness.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "cellblock/zmtp.hpp"
#include "fuzz_support.hpp"

namespace cellblock::fuzz {
namespace {

struct Config {
    std::string socket_type;
    std::string identity;
    zmtp::Limits limits;
};

Config config_of(const std::uint8_t* h) {
    Config c;
    static const char* const types[] = {"DEALER", "SUB", "ROUTER", "PUB"};
    c.socket_type = types[(h[0] & 1) | ((h[0] >> 3) & 2)];
    if (h[0] & 8) c.identity = "fuzz-identity";
    const std::size_t u16 = h[1] | (static_cast<std::size_t>(h[2]) << 8);
    switch ((h[0] >> 1) & 3) {
        case 0:
            c.limits = {u16 % 1024, h[3] % 8u};
            break;
        case 1:
            c.limits = {u16 + 65536 * (h[3] >> 7), 1 + h[3] % 16u};
            break;
        case 2:
            c.limits = {70000 + 4 * u16, 1 + h[3] % 64u};
            break;
        default:
            c.limits = {};
            return c;
    }
    // The message cap: 1 to 8 times the frame cap (bits 4-6 of byte 3).
    c.limits.max_message_bytes = c.limits.max_frame_bytes * (1 + ((h[3] >> 4) & 7));
    return c;
}

// The message sent before the handshake, held until the peer's READY.
const std::vector<std::string_view> kHeld = {"held", "", "message"};

std::string frame_bytes(unsigned char flags, std::string_view body) {
    std::string out;
    if (body.size() > 255) {
        out += static_cast<char>(flags | 0x02);
        for (int shift = 56; shift >= 0; shift -= 8) {
            out += static_cast<char>((body.size() >> shift) & 0xff);
        }
    } else {
        out += static_cast<char>(flags);
        out += static_cast<char>(body.size());
    }
    return out + std::string(body);
}

// What we must write: the greeting, our READY, the held message.
struct ExpectedOutput {
    std::string greeting, with_ready, with_held;
};

ExpectedOutput expected_output(const Config& c) {
    ExpectedOutput e;
    e.greeting.assign(64, '\0');
    e.greeting[0] = '\xff';
    e.greeting[9] = '\x7f';
    e.greeting[10] = 3;
    e.greeting.replace(12, 4, "NULL");
    auto property = [](std::string& out, std::string_view name, std::string_view value) {
        out += static_cast<char>(name.size());
        out += name;
        for (int shift = 24; shift >= 0; shift -= 8) {
            out += static_cast<char>((value.size() >> shift) & 0xff);
        }
        out += value;
    };
    std::string ready = "\x05READY";
    property(ready, "Socket-Type", c.socket_type);
    if (!c.identity.empty()) property(ready, "Identity", c.identity);
    e.with_ready = e.greeting + frame_bytes(0x04, ready);
    e.with_held = e.with_ready;
    for (std::size_t i = 0; i < kHeld.size(); ++i) {
        e.with_held += frame_bytes(i + 1 < kHeld.size() ? 0x01 : 0x00, kHeld[i]);
    }
    return e;
}

// RFC 23's valid combinations for our four types.
bool compatible(std::string_view ours, std::string_view peer) {
    if (ours == "DEALER") return peer == "ROUTER" || peer == "DEALER" || peer == "REP";
    if (ours == "ROUTER") return peer == "DEALER" || peer == "REQ" || peer == "ROUTER";
    if (ours == "SUB") return peer == "PUB" || peer == "XPUB";
    return peer == "SUB" || peer == "XSUB";
}

// A model of what the codec must make of the whole stream, written from RFC
// 23 and the header's rules rather than from the codec: parsed in one pass
// over all the bytes, frame by frame. Where the codec has a choice, the model
// makes the same one: a frame is judged once its 2- or 9-byte header is in,
// property names match case-insensitively and the last Socket-Type counts,
// an Identity over 255 bytes (longer than any routing id) is refused, and
// commands after READY other than ERROR are ignored (also between the frames
// of a message). How large a command the codec takes is its own business: at
// a command over kSureCommandBytes the model stops (`open`), and only what
// came before is compared.
constexpr std::size_t kSureCommandBytes = 1024;

struct Model {
    bool failed = false, ready = false, open = false;
    std::string peer_type;
    std::vector<zmtp::Message> messages;
    std::uint64_t skipped = 0;
};

bool equal_ignoring_case(std::string_view a, std::string_view b) {
    if (a.size() != b.size()) return false;
    for (std::size_t i = 0; i < a.size(); ++i) {
        const auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? char(c - 'A' + 'a') : c; };
        if (lower(a[i]) != lower(b[i])) return false;
    }
    return true;
}

std::uint64_t big_endian(std::string_view bytes) {
    std::uint64_t v = 0;
    for (const unsigned char c : bytes) v = (v << 8) | c;
    return v;
}

Model model(const Config& config, std::string_view in) {
    Model m;
    if (in.size() < 64) return m;
    const auto u = [](char c) { return static_cast<unsigned char>(c); };
    if (u(in[0]) != 0xff || u(in[9]) != 0x7f || u(in[10]) < 3 ||
        in.substr(12, 20) != std::string_view("NULL\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0", 20)) {
        m.failed = true;
        return m;
    }
    in.remove_prefix(64);
    zmtp::Message partial;  // the message being read
    bool oversize = false;  // ... has a frame over the frame cap or is over the message cap
    while (in.size() >= 2) {
        const unsigned flags = u(in[0]);
        if (flags & 0xf8) return m.failed = true, m;
        const std::size_t header = (flags & 0x02) ? 9 : 2;
        if (in.size() < header) break;
        const std::uint64_t size = big_endian(in.substr(1, header - 1));
        const bool more = flags & 0x01;
        if (flags & 0x04) {
            if (more) return m.failed = true, m;
            if (size > kSureCommandBytes) return m.open = true, m;
            if (in.size() - header < size) break;
            std::string_view body = in.substr(header, size);
            in.remove_prefix(header + size);
            if (body.empty() || body.size() < 1u + u(body[0])) return m.failed = true, m;
            const std::string_view name = body.substr(1, u(body[0]));
            body.remove_prefix(1 + name.size());
            if (name == "ERROR") return m.failed = true, m;
            if (m.ready) continue;
            if (name != "READY") return m.failed = true, m;
            while (!body.empty()) {
                const std::size_t name_len = u(body[0]);
                if (body.size() < 1 + name_len + 4) return m.failed = true, m;
                const std::uint64_t value_len = big_endian(body.substr(1 + name_len, 4));
                if (body.size() - (1 + name_len + 4) < value_len) return m.failed = true, m;
                const std::string_view prop = body.substr(1, name_len);
                if (equal_ignoring_case(prop, "Socket-Type")) {
                    m.peer_type = std::string(body.substr(1 + name_len + 4, value_len));
                } else if (equal_ignoring_case(prop, "Identity") && value_len > 255) {
                    return m.failed = true, m;
                }
                body.remove_prefix(1 + name_len + 4 + value_len);
            }
            if (m.peer_type.empty() || !compatible(config.socket_type, m.peer_type)) {
                return m.failed = true, m;
            }
            m.ready = true;
            continue;
        }
        if (!m.ready) return m.failed = true, m;
        // Frames past max_frames are dropped (counted, not kept, not
        // weighed); a kept frame over the frame cap, or one taking the kept
        // bytes over the message cap, skips the whole message.
        const bool drop = !oversize && partial.frames.size() >= config.limits.max_frames;
        if (!drop && (size > config.limits.max_frame_bytes ||
                      partial.total_bytes + size > config.limits.max_message_bytes)) {
            oversize = true;
        }
        if (in.size() - header < size) break;
        if (drop) {
            ++partial.dropped_frames;
        } else {
            partial.frames.emplace_back(in.substr(header, size));
            partial.total_bytes += size;
        }
        in.remove_prefix(header + size);
        if (!more) {
            if (oversize) {
                ++m.skipped;
            } else {
                m.messages.push_back(std::move(partial));
            }
            partial = {};
            oversize = false;
        }
    }
    return m;
}

// A connection under test with the invariants checked after every step.
class Checked {
  public:
    explicit Checked(const Config& config)
        : config_(config), conn_(config.socket_type, config.identity, config.limits) {
        conn_.send(kHeld);
    }

    void feed(std::string_view bytes) {
        const bool ok = conn_.feed(bytes);
        after_step(ok);
    }

    void read_into(std::string_view bytes) {
        const bool was_failed = conn_.failed();
        bool ok = !was_failed;
        while (!bytes.empty()) {
            const zmtp::Connection::Span span = conn_.read_buffer();
            if (conn_.failed()) {
                FUZZ_CHECK(span.size == 0, "read_buffer offers %zu bytes after failing", span.size);
                ok = false;
                break;
            }
            FUZZ_CHECK(span.size > 0 && span.data != nullptr, "read_buffer offers no room");
            const std::size_t n = std::min(span.size, bytes.size());
            std::memcpy(span.data, bytes.data(), n);
            bytes.remove_prefix(n);
            ok = conn_.commit(n);
            FUZZ_CHECK(ok == !conn_.failed(), "commit returned %d but failed() is %d", ok,
                       conn_.failed());
            if (!ok) break;
        }
        if (was_failed) FUZZ_CHECK(!conn_.commit(1), "commit accepted bytes after failing");
        after_step(ok);
    }

    void finish(std::vector<zmtp::Message>& out) {
        drain();
        out = std::move(messages_);
    }
    const zmtp::Connection& conn() const { return conn_; }

  private:
    void after_step(bool ok) {
        FUZZ_CHECK(ok == !conn_.failed(), "a step returned %d but failed() is %d", ok,
                   conn_.failed());
        const bool was_failed = failed_;
        if (was_failed) {
            FUZZ_CHECK(conn_.failed(), "failed() went back to false");
            FUZZ_CHECK(conn_.error() == error_, "error() changed after failing");
        } else if (conn_.failed()) {
            failed_ = true;
            error_ = conn_.error();
        }
        if (conn_.failed()) {
            FUZZ_CHECK(!conn_.error().empty(), "failed with an empty error()");
            FUZZ_CHECK(!conn_.ready(), "both failed() and ready()");
            FUZZ_CHECK(conn_.read_buffer().size == 0, "room to read after failing");
        } else {
            FUZZ_CHECK(conn_.error().empty(), "an error() without failing: %s",
                       conn_.error().c_str());
        }
        if (was_ready_ && !conn_.failed()) FUZZ_CHECK(conn_.ready(), "ready() went back to false");
        if (conn_.ready()) {
            was_ready_ = true;
            FUZZ_CHECK(compatible(config_.socket_type, conn_.peer_socket_type()),
                       "ready with a %s peer", conn_.peer_socket_type().c_str());
        }
        FUZZ_CHECK(conn_.skipped_messages() >= skipped_, "skipped_messages() went down");
        skipped_ = conn_.skipped_messages();
        // Messages are drained after every step, so none may be waiting now.
        if (was_failed) FUZZ_CHECK(!conn_.has_message(), "a message parsed after failing");
        drain();
    }

    void drain() {
        const std::size_t queued_bytes = conn_.queued_bytes();
        std::size_t popped_bytes = 0;
        while (conn_.has_message()) {
            zmtp::Message m = conn_.pop();
            popped_bytes += m.total_bytes;
            FUZZ_CHECK(!m.frames.empty() || m.dropped_frames > 0, "a message without frames");
            FUZZ_CHECK(m.dropped_frames == 0 || m.frames.size() == config_.limits.max_frames,
                       "%zu frames dropped with only %zu kept", m.dropped_frames, m.frames.size());
            FUZZ_CHECK(m.frames.size() <= config_.limits.max_frames,
                       "a message of %zu frames (max_frames %zu)", m.frames.size(),
                       config_.limits.max_frames);
            std::size_t sum = 0;
            for (const auto& f : m.frames) {
                FUZZ_CHECK(f.size() <= config_.limits.max_frame_bytes,
                           "a frame of %zu bytes (max_frame_bytes %zu)", f.size(),
                           config_.limits.max_frame_bytes);
                sum += f.size();
            }
            FUZZ_CHECK(m.total_bytes == sum, "total_bytes %zu, frames hold %zu", m.total_bytes,
                       sum);
            FUZZ_CHECK(sum <= config_.limits.max_message_bytes,
                       "a message of %zu bytes (max_message_bytes %zu)", sum,
                       config_.limits.max_message_bytes);
            messages_.push_back(std::move(m));
        }
        FUZZ_CHECK(queued_bytes == popped_bytes, "queued_bytes() %zu, the messages hold %zu",
                   queued_bytes, popped_bytes);
        FUZZ_CHECK(conn_.queued_bytes() == 0, "queued_bytes() %zu with nothing queued",
                   conn_.queued_bytes());
    }

    Config config_;
    zmtp::Connection conn_;
    std::vector<zmtp::Message> messages_;
    std::uint64_t skipped_ = 0;
    bool failed_ = false;
    std::string error_;  // the first error()
    bool was_ready_ = false;
};

void check_output(const Config& config, const zmtp::Connection& c) {
    const ExpectedOutput e = expected_output(config);
    const std::string_view out = c.output();
    FUZZ_CHECK(out == e.greeting || out == e.with_ready || out == e.with_held,
               "unexpected output (%zu bytes)", out.size());
    if (c.ready()) FUZZ_CHECK(out == e.with_held, "ready but the held message is not out");
    if (out == e.with_held) FUZZ_CHECK(!c.peer_socket_type().empty(), "held message out early");
}

void fuzz(const std::uint8_t* data, std::size_t size) {
    constexpr std::size_t kHeader = 5;
    constexpr std::size_t kMaxZeros = 160 * 1024;  // two frames over 64 KiB, or one over 128
    if (size < kHeader) return;
    const Config config = config_of(data);
    const std::size_t n_ops = std::min<std::size_t>(data[4], size - kHeader);
    const std::string_view peer(reinterpret_cast<const char*>(data + kHeader),
                                size - kHeader - n_ops);
    const std::uint8_t* ops = data + size - n_ops;

    // The chunked run; `stream` collects every byte fed, for the reference.
    Checked chunked(config);
    std::string stream;
    std::size_t at = 0, zeros = 0;
    for (std::size_t i = 0; i < n_ops && at <= peer.size(); ++i) {
        const bool via_commit = ops[i] & 0x80;
        const unsigned v = ops[i] & 0x7f;
        std::string piece;
        if (v == 127) {
            std::size_t count = 0;
            if (i + 2 < n_ops) count = ops[i + 1] | (static_cast<std::size_t>(ops[i + 2]) << 8);
            i += 2;
            count = std::min(2 * count + 1, kMaxZeros - zeros);
            zeros += count;
            piece.assign(count, '\0');
        } else {
            std::size_t want = v < 96 ? v + 1 : v < 126 ? (v - 95) * 512 : peer.size() - at;
            want = std::min(want, peer.size() - at);
            piece.assign(peer.substr(at, want));
            at += want;
        }
        if (piece.empty()) continue;
        stream += piece;
        if (via_commit) {
            chunked.read_into(piece);
        } else {
            chunked.feed(piece);
        }
    }
    if (at < peer.size()) {
        stream += peer.substr(at);
        chunked.feed(peer.substr(at));
    }
    check_output(config, chunked.conn());
    std::vector<zmtp::Message> chunked_messages;
    chunked.finish(chunked_messages);

    // The reference: the same bytes, one at a time.
    // Once it failed, one byte more shows nothing else is parsed (the chunked
    // run fed everything), and the rest would only take time.
    Checked bytewise(config);
    for (std::size_t i = 0; i < stream.size(); ++i) {
        bytewise.feed(std::string_view(stream).substr(i, 1));
        if (bytewise.conn().failed() && i + 1 < stream.size()) {
            bytewise.feed(std::string_view(stream).substr(i + 1, 1));
            break;
        }
    }
    check_output(config, bytewise.conn());
    std::vector<zmtp::Message> bytewise_messages;
    bytewise.finish(bytewise_messages);

    const zmtp::Connection& a = chunked.conn();
    const zmtp::Connection& b = bytewise.conn();
    FUZZ_CHECK(a.failed() == b.failed(), "chunked failed=%d, byte at a time failed=%d", a.failed(),
               b.failed());
    FUZZ_CHECK(a.error() == b.error(), "errors differ: '%s' vs '%s'", a.error().c_str(),
               b.error().c_str());
    FUZZ_CHECK(a.ready() == b.ready(), "ready differs");
    FUZZ_CHECK(a.peer_socket_type() == b.peer_socket_type(), "peer socket types differ");
    FUZZ_CHECK(a.skipped_messages() == b.skipped_messages(),
               "chunked skipped %llu, byte at a time %llu",
               static_cast<unsigned long long>(a.skipped_messages()),
               static_cast<unsigned long long>(b.skipped_messages()));
    FUZZ_CHECK(a.output() == b.output(), "outputs differ");
    FUZZ_CHECK(chunked_messages.size() == bytewise_messages.size(),
               "chunked gave %zu messages, byte at a time %zu", chunked_messages.size(),
               bytewise_messages.size());
    for (std::size_t i = 0; i < chunked_messages.size(); ++i) {
        FUZZ_CHECK(chunked_messages[i].frames == bytewise_messages[i].frames &&
                       chunked_messages[i].dropped_frames == bytewise_messages[i].dropped_frames,
                   "message %zu differs", i);
    }

    const Model want = model(config, stream);
    if (want.open) {
        // Up to the large command: the same messages and skips.
        FUZZ_CHECK(chunked_messages.size() >= want.messages.size(),
                   "%zu messages, the model says at least %zu", chunked_messages.size(),
                   want.messages.size());
        for (std::size_t i = 0; i < want.messages.size(); ++i) {
            FUZZ_CHECK(chunked_messages[i].frames == want.messages[i].frames &&
                           chunked_messages[i].dropped_frames == want.messages[i].dropped_frames,
                       "message %zu differs from the model's", i);
        }
        FUZZ_CHECK(a.skipped_messages() >= want.skipped, "skipped %llu, the model at least %llu",
                   static_cast<unsigned long long>(a.skipped_messages()),
                   static_cast<unsigned long long>(want.skipped));
        return;
    }
    FUZZ_CHECK(a.failed() == want.failed, "failed=%d, the model says %d (%s)", a.failed(),
               want.failed, a.error().c_str());
    // ready() is false once failed, even if the handshake had completed.
    FUZZ_CHECK(a.ready() == (want.ready && !want.failed), "ready=%d, the model says %d", a.ready(),
               want.ready && !want.failed);
    if (want.ready) FUZZ_CHECK(a.peer_socket_type() == want.peer_type, "peer socket type differs");
    FUZZ_CHECK(a.skipped_messages() == want.skipped, "skipped %llu, the model says %llu",
               static_cast<unsigned long long>(a.skipped_messages()),
               static_cast<unsigned long long>(want.skipped));
    FUZZ_CHECK(chunked_messages.size() == want.messages.size(), "%zu messages, the model says %zu",
               chunked_messages.size(), want.messages.size());
    for (std::size_t i = 0; i < chunked_messages.size(); ++i) {
        FUZZ_CHECK(chunked_messages[i].frames == want.messages[i].frames &&
                       chunked_messages[i].dropped_frames == want.messages[i].dropped_frames,
                   "message %zu differs from the model's", i);
    }
}

}  // namespace
}  // namespace cellblock::fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    cellblock::fuzz::fuzz(data, size);
    return 0;
}
