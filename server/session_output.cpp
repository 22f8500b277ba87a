// The iopub rules of SessionCore: what a kernel's output may be, by what it
// is (a msg_type table) and whose it is (the running execution, the last one
// late, or none: background output with a budget of its own).
#include "session_core.hpp"

namespace cellblock {
using nlohmann::json;

namespace {

// What the relay does with a kernel's iopub message, by msg_type.
enum class IopubKind {
    status,       // busy/idle: idle releases the held reply
    stream,       // text, cut to the output budget with a marker
    rich,         // display data: replaced by a notice past max_message_bytes
    bookkeeping,  // execute_input, clear_output: free passes outside executions
    other,        // counted against the budget, forwarded as is
};

IopubKind iopub_kind(const std::string& msg_type) {
    static const std::unordered_map<std::string_view, IopubKind> table = {
        {"status", IopubKind::status},
        {"stream", IopubKind::stream},
        {"display_data", IopubKind::rich},
        {"execute_result", IopubKind::rich},
        {"update_display_data", IopubKind::rich},
        {"execute_input", IopubKind::bookkeeping},
        {"clear_output", IopubKind::bookkeeping},
    };
    auto it = table.find(msg_type);
    return it == table.end() ? IopubKind::other : it->second;
}

}  // namespace

void SessionCore::on_kernel_iopub(Clock::time_point now, InboundMessage msg) {
    if (!kernel_live()) return;
    if (!idle_owed_.empty() || !fence_status_id_.empty()) note_owed_idle(msg);
    // The kernel's own "starting" status, and the readiness probe's late
    // statuses: no client asked for them.
    if (msg.parent_id.empty() || probe_ids_.count(msg.parent_id)) return;
    if (!known_parent(msg.parent_id)) {
        io_.rejected("kernel iopub", "",
                     "parent is not a request of this session: '" + msg.parent_id + "'");
        return;
    }
    if (!governor_) {
        io_.forward_output(msg, nullptr);
        return;
    }
    const bool late_output_of_last = !execution_ && msg.parent_id == last_execution_id_;
    if ((!execution_ || execution_->msg_id != msg.parent_id) && !late_output_of_last) {
        shape_outside_execution(msg);
    } else {
        shape_execution_output(now, msg);
    }
}

void SessionCore::shape_outside_execution(InboundMessage& msg) {
    // Output no running execution accounts for: status and other bookkeeping
    // pass, everything else shares one capped budget.
    const IopubKind kind = iopub_kind(msg.msg_type);
    if ((kind == IopubKind::status || kind == IopubKind::bookkeeping) &&
        msg.total_bytes <= options_.free_pass_bytes &&
        free_passes_[msg.parent_id] < options_.free_passes) {
        ++free_passes_[msg.parent_id];
        io_.forward_output(msg, nullptr);
        return;
    }
    const auto cap = static_cast<std::uint64_t>(governor_->limits().output_bytes);
    if (background_bytes_ + msg.total_bytes <= cap) {
        background_bytes_ += msg.total_bytes;
        io_.forward_output(msg, nullptr);
        return;
    }
    if (background_marker_sent_) return;
    background_marker_sent_ = true;
    io_.log("background output past " + std::to_string(cap) +
            " bytes; dropping until the next execution");
    publish(
        msg.parent, "stream",
        {{"name", "stderr"},
         {"text", "\n[cellblock: output outside a running execution passed " + std::to_string(cap) +
                      " bytes; more is dropped until the next execution]\n"}});
}

void SessionCore::shape_execution_output(Clock::time_point now, InboundMessage& msg) {
    if (execution_) execution_->output_bytes += msg.total_bytes;
    switch (iopub_kind(msg.msg_type)) {
        case IopubKind::status: {
            const auto content = msg.parsed_content(8);
            const std::string state = content ? json_string(*content, "execution_state") : "";
            if (state == "idle") {
                if (held_reply_) {
                    release_held_reply(now);
                } else if (execution_) {
                    execution_->idle_seen = true;  // iopub outran shell: the reply goes on arrival
                }
            }
            io_.forward_output(msg, nullptr);
            if (state == "busy" && execution_) tell_lost(msg.parent);
            return;
        }
        case IopubKind::stream: {
            if (governor_->truncated()) {
                // Cut already: this message is dropped whatever it says, so
                // only its text's size is read (a flood costs a scan per
                // message, not a parse, and the relay keeps up with it).
                const auto size = json_string_member_size(msg.frame(msg.layout.content()), "text",
                                                          options_.max_json_depth);
                if (size) {
                    governor_->on_stream(*size);
                    return;
                }
            }
            auto content = msg.parsed_content(options_.max_json_depth);
            if (!content || !(*content)["text"].is_string()) {
                io_.rejected("kernel iopub", "", "stream without text");
                return;
            }
            const std::string& text = (*content)["text"].get_ref<const std::string&>();
            const auto decision = governor_->on_stream(text.size());
            if (decision.keep >= text.size() && !decision.add_marker) {
                io_.forward_output(msg, nullptr);
                return;
            }
            if (decision.keep == 0 && !decision.add_marker) return;  // dropped, marker sent
            std::string kept = text.substr(0, utf8_safe_prefix(text, decision.keep));
            if (decision.add_marker) kept += decision.marker;
            (*content)["text"] = kept;
            const std::string new_content = content->dump();
            io_.forward_output(msg, &new_content);
            return;
        }
        case IopubKind::rich: {
            // Display data shares the execution's output budget with the
            // streams (a display() loop is a flood too), whole or not at all.
            const auto budget = governor_->on_display(msg.total_bytes);
            if (!budget.keep) {
                if (budget.add_notice) {
                    replace_with_notice(
                        msg, "a " + msg.msg_type + " message of " +
                                 std::to_string(msg.total_bytes) +
                                 " bytes was dropped: this execution's output passed its "
                                 "output_bytes budget of " +
                                 std::to_string(governor_->limits().output_bytes) +
                                 "; the rest of its output is dropped");
                }
                return;
            }
            const auto limit = static_cast<std::size_t>(options_.policy->max_message_bytes);
            if (msg.total_bytes <= limit) break;
            replace_with_notice(
                msg, "a " + msg.msg_type + " message of " + std::to_string(msg.total_bytes) +
                         " bytes was replaced: the limit is " + std::to_string(limit) + " bytes");
            return;
        }
        case IopubKind::bookkeeping:
        case IopubKind::other:
            break;
    }
    io_.forward_output(msg, nullptr);
}

void SessionCore::replace_with_notice(InboundMessage& msg, const std::string& what) {
    json notice = {{"data", {{"text/plain", "[cellblock: " + what + "]"}}},
                   {"metadata", json::object()}};
    if (msg.msg_type == "execute_result") {
        notice["execution_count"] = execution_ ? execution_->count : governor_->executions();
    }
    const std::string new_content = notice.dump();
    // Buffers go too: the notice replaces the whole message.
    msg.frames.resize(msg.layout.first_buffer());
    io_.forward_output(msg, &new_content);
}

}  // namespace cellblock
