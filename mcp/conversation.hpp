// One MCP connection (stdio) or MCP session (Streamable HTTP): its
// lifecycle, its requests in flight, and the cellblock sessions it owns.
// Transports hand it parsed messages and an Outbox; it never touches a
// socket of theirs.
#pragma once

#include <atomic>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include <zmq.hpp>

#include "json_rpc.hpp"
#include "kernel_channels.hpp"

namespace cellblock {
class ManagerClient;
}

namespace cellblock::mcp {

struct McpOptions {
    std::filesystem::path state_dir;  // the running `cellblock serve`'s
    std::string image;                // create_session's default ("": the server's)
    nlohmann::json limits = nlohmann::json::object();  // defaults under create_session's
    bool close_sessions = true;                        // close a conversation's sessions at its end
    std::uint64_t max_file_bytes = 64u << 20;          // one upload or download through MCP
    std::filesystem::path scratch_dir;                 // private (0700): transfers pass through it
};

// Where a conversation's messages to the client go (responses are returned
// instead). Thread-safe: progress comes from the thread running a tool.
class Outbox {
  public:
    virtual ~Outbox() = default;
    virtual void send(const nlohmann::json& message) = 0;
};

// A failure a tool reports as its result (isError), with a stable name.
struct ToolError {
    std::string ename;
    std::string evalue;
};

class Conversation {
  public:
    Conversation(const McpOptions& options, zmq::context_t& context);
    ~Conversation();
    Conversation(const Conversation&) = delete;
    Conversation& operator=(const Conversation&) = delete;

    // Handles one message. Returns the response to a request, or nothing
    // (a notification, a response, or a request cancelled meanwhile). Safe
    // to call from several threads at once: a cancellation comes while its
    // request runs.
    std::optional<nlohmann::json> handle(const RpcMessage& message, Outbox& out);

    // Cancels what runs (each interrupted) and closes the sessions this
    // conversation created, unless options say to keep them. Idempotent.
    void close();

    // Requests running now (an idle HTTP session may be reaped only at 0).
    int busy() const { return busy_.load(); }
    std::string protocol_version() const;

  private:
    struct Attached;  // a cellblock session this conversation created
    struct InFlight;  // a request running, to be cancelled

    nlohmann::json dispatch(const RpcMessage& message, Outbox& out, InFlight& flight);
    nlohmann::json initialize(const nlohmann::json& params);
    nlohmann::json call_tool(const nlohmann::json& params, Outbox& out, InFlight& flight);
    nlohmann::json list_resources();
    nlohmann::json read_resource(const nlohmann::json& params, InFlight& flight);
    void cancel(const nlohmann::json& params);

    // Tools: each returns its result or throws ToolError.
    nlohmann::json run_code(const nlohmann::json& args, Outbox& out, InFlight& flight);
    nlohmann::json create_session(const nlohmann::json& args);
    nlohmann::json list_sessions(const nlohmann::json& args);
    nlohmann::json close_session(const nlohmann::json& args);
    nlohmann::json interrupt(const nlohmann::json& args);
    nlohmann::json upload_file(const nlohmann::json& args, Outbox& out, InFlight& flight);
    nlohmann::json download_file(const nlohmann::json& args, Outbox& out, InFlight& flight);

    std::unique_ptr<ManagerClient> manager() const;  // throws ToolError
    std::unique_ptr<ManagerClient> manager_or_rpc_failure() const;
    std::shared_ptr<Attached> start_session(const std::string& image, const nlohmann::json& limits);
    // The session named in args["session_id"], else the default one (made if
    // `create` and there is none). Throws ToolError.
    std::shared_ptr<Attached> session_for(const nlohmann::json& args, bool create);
    void forget(const std::string& session_id);
    // A file of /data/output into memory, with its sha256; progress to `out`.
    std::pair<std::string, nlohmann::json> fetch_output(const std::string& session_id,
                                                        const std::string& path, Outbox& out,
                                                        InFlight& flight);

    McpOptions options_;
    zmq::context_t& context_;
    mutable std::mutex mutex_;  // guards what follows
    std::string protocol_version_;
    std::map<std::string, std::shared_ptr<Attached>> sessions_;
    std::string default_session_;
    std::map<std::string, std::shared_ptr<InFlight>> in_flight_;
    bool closed_ = false;
    std::mutex create_mutex_;  // two first run_codes at once make one default session
    std::atomic<int> busy_{0};
};

// "ename: evalue" from a ManagerClient exception, when ename is a name of
// the catalogue (include/cellblock/error_names.hpp); otherwise `fallback`.
ToolError tool_error_from(const std::exception& e, const std::string& fallback);

// A tool result for a failure: the text "ename: evalue", isError.
nlohmann::json tool_error_result(const ToolError& error);

// The resource URI of a session's output file, and back.
std::string output_uri(const std::string& session_id, const std::string& path);
std::optional<std::pair<std::string, std::string>> parse_output_uri(const std::string& uri);

// A MIME type from a file name's extension (application/octet-stream if unknown).
std::string mime_type_of(const std::string& path);
bool is_utf8_text(std::string_view bytes);

}  // namespace cellblock::mcp
