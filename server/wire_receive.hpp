// The relay's one receive-and-verify step. Every JSON channel, the client's
// and the kernel's, goes through it: frames past the transport's cap refused,
// then protocol's verify() (bounded frames, the signature, the JSON frames
// parsed and required to be objects, and only then, client side, the
// signature remembered against replay, so a message that fails to parse can
// be sent again once fixed). No ZMQ here: frames are cellblock::Frame.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "cellblock/frame.hpp"
#include "cellblock/replay_guard.hpp"
#include "cellblock/signer.hpp"
#include "cellblock/wire_message.hpp"

namespace cellblock {

class RelaySocket;

// A string field of a JSON object, or "" (absent, or not a string).
inline std::string json_string(const nlohmann::json& j, const char* key) {
    auto it = j.find(key);
    return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
}

// A verified message: its frames (kept, to be forwarded without a copy) and
// what the relay reads of it, parsed once.
struct InboundMessage {
    std::vector<Frame> frames;
    WireLayout layout;
    std::size_t total_bytes = 0;
    nlohmann::json header;  // always an object
    nlohmann::json parent;  // always an object
    // Parsed only where ReceiveRules::parse_all (objects then), else null.
    nlohmann::json metadata;
    nlohmann::json content;
    std::string msg_id, msg_type, parent_id;

    std::string_view frame(std::size_t i) const { return frames[i].view(); }
    // The routing frames in front of the delimiter.
    std::vector<std::string> identities() const;
    // The content frame parsed (content itself if parse_all); nullopt if it
    // is not a JSON object within `max_depth`.
    std::optional<nlohmann::json> parsed_content(std::size_t max_depth) const;
};

// The decoded size in bytes (UTF-8) of the string member `key` of the JSON
// object `json`, found without building the document: what output shaping
// needs of a stream message it will drop whole (a flood past its cap costs a
// scan, not a parse). nullopt if `json` is not an object of this shape (no
// such member, not a string, malformed, a lone surrogate escape): the caller
// parses it then, and the parser says what is wrong. Nesting is bounded by
// `max_depth`.
std::optional<std::size_t> json_string_member_size(std::string_view json, std::string_view key,
                                                   std::size_t max_depth = 64);

struct ReceiveRules {
    const Signer* signer = nullptr;
    ReplayGuard* replay = nullptr;  // the client's channels: replays are refused
    WireLimits limits;
    // The client's messages: metadata and content must be objects too, and the
    // header must carry msg_id and msg_type. The kernel's: header and parent.
    bool parse_all = false;
};

// Checks the multipart in `in` (its frames are moved into `out` on success).
// On failure returns false with a short, loggable reason in `why`
// ("bad signature", "frame 5 is not a JSON object", ...).
bool verify_frames(Multipart& in, const ReceiveRules& rules, InboundMessage& out, std::string& why);

enum class Received { nothing, message, rejected };

// Receives one waiting multipart from a ROUTER `socket` (the client's
// channels; through `scratch`) and verifies it. `rejected`: `why` says why
// and `sender` who sent it (the routing identity). The kernel's side calls
// recv_multipart and verify_frames itself, to start the client's signature
// of a large message in between (SessionProxy::sign_early).
Received receive_verified(RelaySocket& socket, Multipart& scratch, const ReceiveRules& rules,
                          InboundMessage& out, std::string& why, std::string& sender);

}  // namespace cellblock
