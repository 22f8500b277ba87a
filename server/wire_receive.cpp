#include "wire_receive.hpp"

namespace cellblock {
using nlohmann::json;

std::vector<std::string> InboundMessage::identities() const {
    std::vector<std::string> ids;
    ids.reserve(layout.delimiter);
    for (std::size_t i = 0; i < layout.delimiter; ++i) ids.emplace_back(frame(i));
    return ids;
}

std::optional<json> InboundMessage::parsed_content(std::size_t max_depth) const {
    if (content.is_object()) return content;
    auto parsed = parse_json_frame(frame(layout.content()), max_depth);
    if (!parsed || !parsed->is_object()) return std::nullopt;
    return parsed;
}

bool verify_frames(Multipart& in, const ReceiveRules& rules, InboundMessage& out,
                   std::string& why) {
    if (in.dropped_frames > 0) {
        why = "too many frames";
        return false;
    }
    const auto views = in.views();
    // The replay guard is written only once the whole message is accepted.
    WireCheck check = check_wire(views, *rules.signer, nullptr, rules.limits);
    if (!check.ok) {
        why = std::move(check.error);
        return false;
    }
    const WireLayout& at = check.layout;
    const std::string_view signature = views[at.signature()];
    if (rules.replay && rules.replay->contains(signature)) {
        why = "replayed message";
        return false;
    }
    const std::size_t last = rules.parse_all ? at.content() : at.parent();
    json parsed[4];
    for (std::size_t i = at.header(); i <= last; ++i) {
        auto frame = parse_json_frame(views[i], rules.limits.max_json_depth);
        if (!frame || !frame->is_object()) {
            why = "frame " + std::to_string(i - at.delimiter) + " is not a JSON object";
            return false;
        }
        parsed[i - at.header()] = std::move(*frame);
    }
    out.msg_id = json_string(parsed[0], "msg_id");
    out.msg_type = json_string(parsed[0], "msg_type");
    if (rules.parse_all && (out.msg_id.empty() || out.msg_type.empty())) {
        why = "header lacks msg_id or msg_type";
        return false;
    }
    if (rules.replay && !rules.replay->check_and_remember(signature)) {
        why = "replayed message";
        return false;
    }
    out.parent_id = json_string(parsed[1], "msg_id");
    out.header = std::move(parsed[0]);
    out.parent = std::move(parsed[1]);
    out.metadata = std::move(parsed[2]);
    out.content = std::move(parsed[3]);
    out.layout = at;
    out.total_bytes = in.total_bytes;
    out.frames = std::move(in.frames);
    in.frames.clear();
    return true;
}

Received receive_verified(RelaySocket& socket, Multipart& scratch, const ReceiveRules& rules,
                          InboundMessage& out, std::string& why, std::string& sender) {
    if (!socket.receive(scratch, rules.limits.max_frames)) return Received::nothing;
    // A ROUTER's first frame is the identity libzmq put there.
    sender = scratch.frames.empty() ? std::string() : std::string(scratch.view(0));
    return verify_frames(scratch, rules, out, why) ? Received::message : Received::rejected;
}

}  // namespace cellblock
