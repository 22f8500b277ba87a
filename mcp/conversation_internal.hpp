// What conversation.cpp and tool_calls.cpp share. Private to mcp/.
#pragma once

#include "conversation.hpp"

namespace cellblock::mcp {

// A JSON-RPC error a method answers with (not a tool result).
struct RpcFailure {
    int code;
    std::string message;
};

struct Conversation::Attached {
    Attached(zmq::context_t& context, std::string id, const ConnectionInfo& info)
        : id(std::move(id)), channels(context, info) {}
    std::string id;
    std::string image;
    std::string runtime;
    bool warm = false;
    nlohmann::json limits = nlohmann::json::object();
    double exec_timeout_s = 30;
    KernelChannels channels;
};

struct Conversation::InFlight {
    std::atomic<bool> cancelled{false};
    nlohmann::json progress_token;  // null: the client asked for no progress
};

class NullOutbox : public Outbox {
  public:
    void send(const nlohmann::json&) override {}
};

// Sends notifications/progress for a token, each with a larger progress value.
class ProgressReporter {
  public:
    ProgressReporter(Outbox& out, const nlohmann::json& token) : out_(out), token_(token) {}
    void report(double progress, std::optional<double> total, const std::string& message) {
        if (token_.is_null() || progress <= last_) return;
        last_ = progress;
        nlohmann::json params = {
            {"progressToken", token_}, {"progress", progress}, {"message", message}};
        if (total) params["total"] = *total;
        out_.send(make_notification("notifications/progress", std::move(params)));
    }

  private:
    Outbox& out_;
    nlohmann::json token_;
    double last_ = -1;
};

}  // namespace cellblock::mcp
