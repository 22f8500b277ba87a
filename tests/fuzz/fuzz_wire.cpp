// Fuzzes the Jupyter wire parser and verifier: check_wire, decode, the replay
// guard, parse_json_frame, and the Signer with a fixed key and an empty one.
//
// Input: one flags byte, then frames (see split_frames). Flags:
//   bits 0-1  the key: 0 the fixtures' key, 1 their binary key, 2 their
//             200-byte key, 3 empty (signing disabled)
//   bit 2     re-sign: replace the signature with the right HMAC of the four
//             JSON frames, so mutated JSON gets past the signature check
//   bit 3     small WireLimits, so frame, identity, size and depth caps are
//             reachable with short inputs
//   bits 5-7  capacity - 1 of the replay guard checked against a model
#include <algorithm>
#include <cstdint>
#include <deque>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cellblock/replay_guard.hpp"
#include "cellblock/signer.hpp"
#include "cellblock/wire_message.hpp"
#include "fuzz_support.hpp"

namespace cellblock::fuzz {
namespace {

using json = nlohmann::json;
using namespace std::string_literals;

// The keys of tests/fixtures/jupyter_client_vectors.json.
const std::string& key(unsigned index) {
    static const std::string keys[] = {
        "5f9e1c2a-vector-key-0123456789abcdef"s,
        "\x00\xff"
        "binary\x80key\x00"s,
        std::string(200, 'k'),
        ""s,
    };
    return keys[index & 3];
}

const Signer& signer(unsigned index) {
    static const Signer signers[] = {Signer(key(0)), Signer(key(1)), Signer(key(2)),
                                     Signer(key(3))};
    return signers[index & 3];
}

WireLimits small_limits() {
    WireLimits l;
    l.max_frames = 12;
    l.max_identities = 2;
    l.max_json_frame_bytes = 96;
    l.max_total_bytes = 512;
    l.max_json_depth = 4;
    return l;
}

// What parse_json_frame must answer: nlohmann's own parse, refused when the
// text holds a NUL (never valid JSON) or nests deeper than the cap.
std::optional<json> reference_parse(std::string_view bytes, std::size_t max_depth) {
    if (bytes.find('\0') != std::string_view::npos) return std::nullopt;
    json j = json::parse(bytes.begin(), bytes.end(), nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || json_depth(j) > max_depth) return std::nullopt;
    return j;
}

void check_parse_json_frame(std::string_view bytes, std::size_t max_depth) {
    const auto got = parse_json_frame(bytes, max_depth);
    const auto want = reference_parse(bytes, max_depth);
    FUZZ_CHECK(got.has_value() == want.has_value(), "parse_json_frame %s a frame the reference %s",
               got ? "accepted" : "refused", want ? "accepts" : "refuses");
    if (got) FUZZ_CHECK(*got == *want, "parse_json_frame and the reference disagree on the value");
}

bool is_hex64(std::string_view s) {
    return s.size() == 64 && std::all_of(s.begin(), s.end(), [](char c) {
               return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
           });
}

// The replay guard against a straightforward model of its contract.
void check_replay_guard_model(const std::vector<std::string>& frames, std::size_t capacity) {
    ReplayGuard guard(capacity);
    std::set<std::string> seen;
    std::deque<std::string> order;
    for (const std::string& sig : frames) {
        std::string lower = sig;
        std::transform(lower.begin(), lower.end(), lower.begin(),
                       [](char c) { return c >= 'A' && c <= 'F' ? char(c - 'A' + 'a') : c; });
        const bool remembered = is_hex64(sig) && seen.count(lower) != 0;
        FUZZ_CHECK(guard.contains(sig) == remembered, "contains() disagrees with the model");
        bool accept = true;
        if (!sig.empty()) {
            accept = is_hex64(sig) && !remembered;
            if (accept) {
                seen.insert(lower);
                order.push_back(lower);
                if (order.size() > capacity) {
                    seen.erase(order.front());
                    order.pop_front();
                }
            }
        }
        FUZZ_CHECK(guard.check_and_remember(sig) == accept,
                   "check_and_remember disagrees with the model (size %zu)", sig.size());
        FUZZ_CHECK(guard.size() == order.size(), "guard holds %zu, model %zu", guard.size(),
                   order.size());
        FUZZ_CHECK(guard.size() <= capacity, "guard grew past its capacity");
    }
}

void check_layout(const WireCheck& c, std::span<const std::string_view> frames,
                  const WireLimits& limits) {
    const WireLayout& at = c.layout;
    FUZZ_CHECK(at.delimiter < frames.size(), "delimiter index out of range");
    FUZZ_CHECK(frames[at.delimiter] == kDelimiter, "layout does not point at the delimiter");
    FUZZ_CHECK(std::find(frames.begin(), frames.begin() + static_cast<std::ptrdiff_t>(at.delimiter),
                         kDelimiter) == frames.begin() + static_cast<std::ptrdiff_t>(at.delimiter),
               "a delimiter appears before the one found");
    FUZZ_CHECK(frames.size() >= at.first_buffer(), "accepted with too few frames");
    FUZZ_CHECK(frames.size() <= limits.max_frames, "accepted past max_frames");
    FUZZ_CHECK(at.delimiter <= limits.max_identities, "accepted past max_identities");
    std::size_t total = 0;
    for (const auto f : frames) total += f.size();
    FUZZ_CHECK(total <= limits.max_total_bytes, "accepted past max_total_bytes");
    for (std::size_t i = at.header(); i <= at.content(); ++i) {
        FUZZ_CHECK(frames[i].size() <= limits.max_json_frame_bytes,
                   "accepted a JSON frame too big");
    }
}

void fuzz(const std::uint8_t* data, std::size_t size) {
    if (size < 1) return;
    const unsigned flags = data[0];
    const Signer& sig = signer(flags & 3);
    const bool resign = (flags & 4) != 0;
    const WireLimits limits = (flags & 8) != 0 ? small_limits() : WireLimits{};
    const std::size_t guard_capacity = 1 + (flags >> 5);

    std::vector<std::string> frames = split_frames(data + 1, size - 1);
    const auto delim = std::find(frames.begin(), frames.end(), kDelimiter);
    const std::size_t d = static_cast<std::size_t>(delim - frames.begin());
    if (resign && d + 5 < frames.size()) {
        frames[d + 1] = sig.sign(frames[d + 2], frames[d + 3], frames[d + 4], frames[d + 5]);
    }
    const std::vector<std::string_view> views(frames.begin(), frames.end());

    // The Signer: what it signs it verifies, lowercase only, nothing else.
    if (d + 5 < frames.size()) {
        const std::string good =
            sig.sign(frames[d + 2], frames[d + 3], frames[d + 4], frames[d + 5]);
        FUZZ_CHECK(sig.enabled() ? is_hex64(good) : good.empty(), "bad signature shape");
        FUZZ_CHECK(sig.verify(good, frames[d + 2], frames[d + 3], frames[d + 4], frames[d + 5]),
                   "a signature the Signer made does not verify");
        const bool claimed_ok =
            sig.verify(frames[d + 1], frames[d + 2], frames[d + 3], frames[d + 4], frames[d + 5]);
        FUZZ_CHECK(claimed_ok == (frames[d + 1] == good),
                   "verify() accepted a signature that is "
                   "not the lowercase HMAC");
    }

    // check_wire alone, then with a guard: same verdict, remembered once.
    const WireCheck plain = check_wire(views, sig, nullptr, limits);
    FUZZ_CHECK(plain.ok == plain.error.empty(), "ok=%d with error '%s'", plain.ok,
               plain.error.c_str());
    if (plain.ok) check_layout(plain, views, limits);

    ReplayGuard guard;
    const WireCheck guarded = check_wire(views, sig, &guard, limits);
    FUZZ_CHECK(guarded.ok == plain.ok, "the replay guard changed a first verdict");
    const bool signed_message = plain.ok && !views[plain.layout.signature()].empty();
    FUZZ_CHECK(guard.size() == (signed_message ? 1u : 0u), "guard holds %zu after one message",
               guard.size());
    const WireCheck again = check_wire(views, sig, &guard, limits);
    if (signed_message) {
        FUZZ_CHECK(!again.ok && again.error == "replayed message", "replay not refused: '%s'",
                   again.error.c_str());
    } else {
        FUZZ_CHECK(again.ok == plain.ok, "an unsigned or refused message changed verdict");
    }

    // decode: refuses whatever check_wire refuses, with the same reason, and
    // remembers nothing for a message it refuses.
    ReplayGuard decode_guard;
    const WireDecode decoded = decode(views, sig, &decode_guard, limits);
    FUZZ_CHECK(decoded.message.has_value() == decoded.error.empty(), "decode: message and error");
    if (!plain.ok) {
        FUZZ_CHECK(!decoded.message && decoded.error == plain.error,
                   "decode said '%s' where check_wire said '%s'", decoded.error.c_str(),
                   plain.error.c_str());
    }
    if (!decoded.message) {
        FUZZ_CHECK(decode_guard.size() == 0, "decode remembered a refused message");
    } else {
        const WireMessage& msg = *decoded.message;
        FUZZ_CHECK(decode_guard.size() == (signed_message ? 1u : 0u), "decode guard size");
        FUZZ_CHECK(msg.header.at("msg_id").is_string() && msg.header.at("msg_type").is_string(),
                   "decoded header lacks string msg_id/msg_type");
        FUZZ_CHECK(msg.msg_id() == msg.header["msg_id"].get<std::string>(), "msg_id()");
        FUZZ_CHECK(msg.msg_type() == msg.header["msg_type"].get<std::string>(), "msg_type()");
        FUZZ_CHECK(
            msg.parent_header.is_object() && msg.metadata.is_object() && msg.content.is_object(),
            "decoded a frame that is not an object");
        FUZZ_CHECK(msg.identities.size() == plain.layout.delimiter, "identities lost");
        FUZZ_CHECK(msg.buffers.size() == frames.size() - plain.layout.first_buffer(),
                   "buffers lost");
        if (signed_message) {
            const WireDecode replay = decode(views, sig, &decode_guard, limits);
            FUZZ_CHECK(!replay.message && replay.error == "replayed message",
                       "decode accepted a replay");
        }
        // What the server builds from a decoded message decodes to the same message.
        const std::vector<std::string> encoded = encode(msg, sig);
        const std::vector<std::string_view> encoded_views(encoded.begin(), encoded.end());
        const WireDecode round = decode(encoded_views, sig, nullptr);
        FUZZ_CHECK(round.message.has_value(), "re-encoded message refused: %s",
                   round.error.c_str());
        FUZZ_CHECK(round.message->header == msg.header &&
                       round.message->parent_header == msg.parent_header &&
                       round.message->metadata == msg.metadata &&
                       round.message->content == msg.content &&
                       round.message->identities == msg.identities &&
                       round.message->buffers == msg.buffers,
                   "encode/decode round trip changed the message");
    }

    // An empty key: only an empty signature passes, and nothing is remembered.
    ReplayGuard unsigned_guard;
    const WireCheck open = check_wire(views, signer(3), &unsigned_guard, limits);
    if (open.ok) {
        FUZZ_CHECK(views[open.layout.signature()].empty(),
                   "signing disabled but a non-empty signature passed");
    }
    FUZZ_CHECK(unsigned_guard.size() == 0, "an unsigned message was remembered");

    for (const auto frame : views) check_parse_json_frame(frame, limits.max_json_depth);
    check_parse_json_frame({reinterpret_cast<const char*>(data), size},
                           WireLimits{}.max_json_depth);

    check_replay_guard_model(frames, guard_capacity);
}

}  // namespace
}  // namespace cellblock::fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    cellblock::fuzz::fuzz(data, size);
    return 0;
}
