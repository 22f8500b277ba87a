// The Jupyter wire format: [identities..., "<IDS|MSG>", signature, header,
// parent_header, metadata, content, buffers...]. No ZMQ here: frames are
// byte strings or views of them.
#pragma once

#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace cellblock {

class Signer;
class ReplayGuard;

inline constexpr std::string_view kDelimiter = "<IDS|MSG>";
inline constexpr std::string_view kProtocolVersion = "5.3";

// Caps applied before any parsing; libzmq's ZMQ_MAXMSGSIZE limits one frame,
// not a multipart message, so these are counted here.
struct WireLimits {
    std::size_t max_frames = 1024;  // whole multipart, identities and buffers included
    std::size_t max_identities = 16;
    std::size_t max_json_frame_bytes = 16u << 20;  // each of header/parent/metadata/content
    std::size_t max_total_bytes = 128u << 20;      // all frames together
    std::size_t max_json_depth = 64;
};

// Where the parts of a received multipart are. Indices into the frame list.
struct WireLayout {
    std::size_t delimiter = 0;  // frames [0, delimiter) are routing identities
    std::size_t signature() const { return delimiter + 1; }
    std::size_t header() const { return delimiter + 2; }
    std::size_t parent() const { return delimiter + 3; }
    std::size_t metadata() const { return delimiter + 4; }
    std::size_t content() const { return delimiter + 5; }
    std::size_t first_buffer() const { return delimiter + 6; }
};

// Outcome of checking a received multipart. `error` is a short, stable,
// loggable reason ("missing delimiter", "bad signature", "replayed message",
// "header is not a JSON object", ...) when !ok.
struct WireCheck {
    bool ok = false;
    WireLayout layout;
    std::string error;
};

// Finds the delimiter and checks frame counts and sizes against `limits`,
// then verifies the signature with `signer`, then (only if verified)
// records it in `replay` (if not null) and rejects a replay. Does not parse
// JSON. Nothing is remembered for a message that fails.
WireCheck check_wire(std::span<const std::string_view> frames, const Signer& signer,
                     ReplayGuard* replay, const WireLimits& limits = {});

// What verify() checks beyond the layout, the caps and the signature.
struct VerifyRules {
    WireLimits limits;
    // All four JSON frames parsed, or the header and parent only (the
    // kernel's messages, which the relay forwards as they are).
    bool parse_all = true;
    // What the header must carry: nothing, string msg_id and msg_type, or
    // non-empty ones (the relay keys its ledger of requests by them).
    enum class Ids { any, strings, non_empty };
    Ids ids = Ids::strings;
    // How a refusal of the JSON frames reads: by the frame's name ("header
    // is not valid JSON", decode's), or by its place after the delimiter
    // ("frame 2 is not a JSON object", the relay's log lines and metrics).
    enum class Wording { names, places };
    Wording wording = Wording::names;
};

// The outcome of verify(): on success, the layout and the JSON frames parsed
// (objects; metadata and content null unless VerifyRules::parse_all).
struct WireVerify {
    bool ok = false;
    WireLayout layout;
    std::string error;  // a short, stable, loggable reason when !ok
    nlohmann::json header, parent, metadata, content;
};

// The one verification of a received message, the relay's and decode's:
// check_wire (delimiter, caps, signature), a replay looked up in `replay`,
// the JSON frames parsed within max_json_depth and required to be objects,
// the header's ids; only then is the signature remembered in `replay` (if
// not null), so a message that fails to parse can be sent again once fixed.
WireVerify verify(std::span<const std::string_view> frames, const Signer& signer,
                  ReplayGuard* replay, const VerifyRules& rules);

// A decoded message, used where the server reads or builds messages itself.
struct WireMessage {
    std::vector<std::string> identities;
    nlohmann::json header = nlohmann::json::object();
    nlohmann::json parent_header = nlohmann::json::object();
    nlohmann::json metadata = nlohmann::json::object();
    nlohmann::json content = nlohmann::json::object();
    std::vector<std::string> buffers;

    std::string msg_type() const;  // header["msg_type"] or ""
    std::string msg_id() const;    // header["msg_id"] or ""
    std::string parent_msg_id() const;
};

struct WireDecode {
    std::optional<WireMessage> message;
    std::string error;  // set when !message
};

// verify() with the default rules (the four JSON frames objects, the header's
// msg_id and msg_type strings), then the message as a value.
WireDecode decode(std::span<const std::string_view> frames, const Signer& signer,
                  ReplayGuard* replay, const WireLimits& limits = {});

// Parses one JSON frame with the depth cap; nullopt on any error.
std::optional<nlohmann::json> parse_json_frame(std::string_view bytes, std::size_t max_depth);

// Serializes and signs: identities, delimiter, signature, 4 JSON frames, buffers.
std::vector<std::string> encode(const WireMessage& msg, const Signer& signer);

// A header as the spec and jupyter_client write it: uuid4 msg_id, ISO-8601
// UTC date with microseconds, version "5.3".
nlohmann::json make_header(std::string_view msg_type, std::string_view session,
                           std::string_view username = "cellblock");

// "x_request" -> "x_reply"; anything else -> "error_reply" (the manager's
// answer to a message that is not a request).
std::string reply_type(std::string_view request_type);

// A reply or broadcast whose parent is `parent`.
WireMessage make_reply(const WireMessage& parent, std::string_view msg_type, nlohmann::json content,
                       std::string_view session);

std::string make_uuid();    // uuid4, canonical 36-character form
std::string iso8601_now();  // e.g. 2026-11-22T12:00:00.123456Z

// One message in one datagram (the local file socket, docs/manager-api.md):
// its frames, the delimiter first, packed as [u32 count][u32 size, bytes]...,
// little-endian. unpack_frames returns views into `datagram`, or nullopt when
// it is not exactly a packing of at most `max_frames` frames.
std::string pack_frames(const std::vector<std::string>& frames);
std::optional<std::vector<std::string_view>> unpack_frames(std::string_view datagram,
                                                           std::size_t max_frames);

}  // namespace cellblock
