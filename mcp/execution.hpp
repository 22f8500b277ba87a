// What one execute_request produced, collected from its IOPub messages and
// its reply (as clients/python/cellblock/client.py's Execution), and how it
// becomes an MCP tool result. Pure: messages in, values out.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cellblock/wire_message.hpp"

namespace cellblock::mcp {

// One execute_result or display_data: its MIME bundle as sent (images base64).
struct RichOutput {
    nlohmann::json data = nlohmann::json::object();
    bool is_main_result = false;
};

struct ExecutionError {
    std::string ename;
    std::string evalue;
    std::vector<std::string> traceback;
    bool by_server = false;  // the server's policy refused or stopped it; the code never raised
};

class Execution {
  public:
    explicit Execution(std::string msg_id) : msg_id_(std::move(msg_id)) {}

    // Feeds one IOPub message; others' (another parent) are ignored.
    void on_iopub(const WireMessage& msg);
    // Feeds the execute_reply.
    void on_reply(const WireMessage& msg);

    bool replied() const { return replied_; }
    bool idle() const { return idle_; }
    bool done() const { return replied_ && idle_; }
    const std::string& msg_id() const { return msg_id_; }

    std::string status;  // execute_reply's status: "ok", "error", "aborted"
    std::optional<int> execution_count;
    std::string stdout_text;
    std::string stderr_text;
    std::vector<RichOutput> outputs;
    std::optional<ExecutionError> error;
    nlohmann::json budget = nlohmann::json::object();  // execute_reply metadata.cellblock

  private:
    std::string msg_id_;
    bool replied_ = false;
    bool idle_ = false;
};

// The enames the server itself sends on a session's channels.
bool is_policy_ename(const std::string& ename);

// Removes ANSI escape sequences (IPython colours its tracebacks).
std::string strip_ansi(const std::string& text);

// The MIME types returned as MCP image content.
inline constexpr const char* kImageMimeTypes[] = {"image/png", "image/jpeg", "image/svg+xml"};

// The tool result of run_code: text content for streams, values and the
// error, image content for every PNG, JPEG and SVG, `structuredContent`
// matching run_code's output schema, and isError when the execution failed.
nlohmann::json execution_result(const Execution& ex, const std::string& session_id,
                                bool cancelled = false);

}  // namespace cellblock::mcp
