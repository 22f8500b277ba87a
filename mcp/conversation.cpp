#include "conversation.hpp"

#include <algorithm>
#include <array>

#include "base64.hpp"
#include "cellblock/error_names.hpp"
#include "conversation_internal.hpp"
#include "manager_client.hpp"
#include "protocol_version.hpp"
#include "tool_catalog.hpp"

namespace cellblock::mcp {
using nlohmann::json;

namespace {

constexpr const char* kInstructions =
    "cellblock runs Python in sandboxed Jupyter kernels. Call run_code with Python source: "
    "state persists between calls in this connection's session (created on first use, closed "
    "when the connection ends). Figures (matplotlib, ...) come back as images. Put files in with "
    "upload_file (the code reads /data/input); have the code write to /data/output and fetch "
    "with download_file or as resources. Errors carry the Python traceback, or the server's "
    "ename (ExecutionLimitExceeded, ExecutionTimeout, MemoryLimitExceeded, ...).";

constexpr std::string_view kUriPrefix = "cellblock://sessions/";
constexpr std::string_view kUriOutput = "/output/";

}  // namespace

ToolError tool_error_from(const std::exception& e, const std::string& fallback) {
    const std::string what = e.what();
    const auto colon = what.find(": ");
    if (colon != std::string::npos) {
        const std::string name = what.substr(0, colon);
        for (const auto& known : kErrorNames) {
            if (known.name == name) return {name, what.substr(colon + 2)};
        }
    }
    return {fallback, what};
}

json tool_error_result(const ToolError& error) {
    return {
        {"content", json::array({{{"type", "text"}, {"text", error.ename + ": " + error.evalue}}})},
        {"isError", true}};
}

std::string output_uri(const std::string& session_id, const std::string& path) {
    return std::string(kUriPrefix) + session_id + std::string(kUriOutput) + path;
}

std::optional<std::pair<std::string, std::string>> parse_output_uri(const std::string& uri) {
    if (!uri.starts_with(kUriPrefix)) return std::nullopt;
    const std::string rest = uri.substr(kUriPrefix.size());
    const auto at = rest.find(kUriOutput);
    if (at == std::string::npos || at == 0) return std::nullopt;
    std::string session = rest.substr(0, at), path = rest.substr(at + kUriOutput.size());
    if (path.empty() || session.find('/') != std::string::npos) return std::nullopt;
    return std::make_pair(std::move(session), std::move(path));
}

std::string mime_type_of(const std::string& path) {
    static const std::array<std::pair<std::string_view, std::string_view>, 18> types = {{
        {".png", "image/png"},
        {".jpg", "image/jpeg"},
        {".jpeg", "image/jpeg"},
        {".gif", "image/gif"},
        {".webp", "image/webp"},
        {".svg", "image/svg+xml"},
        {".txt", "text/plain"},
        {".log", "text/plain"},
        {".csv", "text/csv"},
        {".tsv", "text/tab-separated-values"},
        {".json", "application/json"},
        {".html", "text/html"},
        {".md", "text/markdown"},
        {".py", "text/x-python"},
        {".xml", "application/xml"},
        {".pdf", "application/pdf"},
        {".yaml", "application/yaml"},
        {".zip", "application/zip"},
    }};
    const auto dot = path.rfind('.');
    if (dot != std::string::npos && path.find('/', dot) == std::string::npos) {
        std::string ext = path.substr(dot);
        std::transform(ext.begin(), ext.end(), ext.begin(),
                       [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
        for (const auto& [e, type] : types) {
            if (e == ext) return std::string(type);
        }
    }
    return "application/octet-stream";
}

bool is_utf8_text(std::string_view bytes) {
    std::size_t i = 0;
    while (i < bytes.size()) {
        const auto c = static_cast<unsigned char>(bytes[i]);
        if (c == 0) return false;
        std::size_t extra = 0;
        std::uint32_t cp = 0;
        if (c < 0x80) {
            ++i;
            continue;
        } else if ((c & 0xE0) == 0xC0) {
            extra = 1, cp = c & 0x1F;
        } else if ((c & 0xF0) == 0xE0) {
            extra = 2, cp = c & 0x0F;
        } else if ((c & 0xF8) == 0xF0) {
            extra = 3, cp = c & 0x07;
        } else {
            return false;
        }
        if (i + extra >= bytes.size()) return false;
        for (std::size_t k = 1; k <= extra; ++k) {
            const auto d = static_cast<unsigned char>(bytes[i + k]);
            if ((d & 0xC0) != 0x80) return false;
            cp = cp << 6 | (d & 0x3F);
        }
        // Overlong forms, surrogates and code points past U+10FFFF.
        if ((extra == 1 && cp < 0x80) || (extra == 2 && cp < 0x800) ||
            (extra == 3 && cp < 0x10000) || (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF)
            return false;
        i += extra + 1;
    }
    return true;
}

Conversation::Conversation(const McpOptions& options, zmq::context_t& context)
    : options_(options), context_(context) {}

Conversation::~Conversation() { close(); }

std::string Conversation::protocol_version() const {
    const std::lock_guard lock(mutex_);
    return protocol_version_;
}

std::unique_ptr<ManagerClient> Conversation::manager() const {
    try {
        return std::make_unique<ManagerClient>(options_.state_dir);
    } catch (const std::exception& e) {
        throw ToolError{"ServerNotFound", e.what()};
    }
}

std::optional<json> Conversation::handle(const RpcMessage& message, Outbox& out) {
    using Kind = RpcMessage::Kind;
    if (message.kind == Kind::invalid) return message.error_response;
    if (message.kind == Kind::response) return std::nullopt;  // we send no requests
    if (message.kind == Kind::notification) {
        if (message.method == "notifications/cancelled") cancel(message.params);
        // notifications/initialized, roots/list_changed, ...: nothing to do.
        return std::nullopt;
    }
    auto flight = std::make_shared<InFlight>();
    const std::string key = message.id_key();
    {
        const std::lock_guard lock(mutex_);
        if (closed_) {
            return make_error(message.id, rpc_error::kInternalError, "the connection is closing");
        }
        in_flight_[key] = flight;
    }
    ++busy_;
    json response;
    try {
        response = make_result(message.id, dispatch(message, out, *flight));
    } catch (const RpcFailure& f) {
        response = make_error(message.id, f.code, f.message);
    } catch (const ToolError& e) {
        response = make_error(message.id, rpc_error::kInternalError, e.ename + ": " + e.evalue);
    } catch (const std::exception& e) {
        // Never a crash: whatever escaped a method is an internal error.
        response = make_error(message.id, rpc_error::kInternalError, e.what());
    } catch (...) {
        response = make_error(message.id, rpc_error::kInternalError, "an unknown failure");
    }
    --busy_;
    {
        const std::lock_guard lock(mutex_);
        if (auto it = in_flight_.find(key); it != in_flight_.end() && it->second == flight)
            in_flight_.erase(it);
    }
    // A cancelled request gets no response (cancellation spec).
    if (flight->cancelled) return std::nullopt;
    return response;
}

json Conversation::dispatch(const RpcMessage& message, Outbox& out, InFlight& flight) {
    const std::string& m = message.method;
    const json& params = message.params;
    if (m == "initialize") return initialize(params);
    if (m == "ping") return json::object();
    if (m == "tools/list") return {{"tools", tool_catalog()}};
    if (m == "tools/call") return call_tool(params, out, flight);
    if (m == "resources/list") return list_resources();
    if (m == "resources/templates/list") {
        return {
            {"resourceTemplates",
             json::array({{{"uriTemplate", std::string(kUriPrefix) + "{session_id}/output/{path}"},
                           {"name", "session-output"},
                           {"title", "A session's output file"},
                           {"description",
                            "A file the code wrote to /data/output in a session of this "
                            "connection"}}})}};
    }
    if (m == "resources/read") return read_resource(params, flight);
    if (m == "prompts/list") return {{"prompts", json::array()}};
    if (m == "logging/setLevel") return json::object();
    throw RpcFailure{rpc_error::kMethodNotFound, "Method not found: " + m};
}

json Conversation::initialize(const json& params) {
    const auto it = params.find("protocolVersion");
    if (it == params.end() || !it->is_string()) {
        throw RpcFailure{rpc_error::kInvalidParams,
                         "initialize: protocolVersion (a string) is required"};
    }
    const std::string version = negotiate_protocol_version(it->get<std::string>());
    {
        const std::lock_guard lock(mutex_);
        protocol_version_ = version;
    }
    return {
        {"protocolVersion", version},
        {"capabilities",
         {{"tools", {{"listChanged", false}}},
          {"resources", {{"listChanged", false}, {"subscribe", false}}}}},
        {"serverInfo",
         {{"name", "cellblock"}, {"title", "cellblock: sandboxed Python"}, {"version", "0.1.0"}}},
        {"instructions", kInstructions}};
}

void Conversation::cancel(const json& params) {
    const auto it = params.find("requestId");
    if (it == params.end() || !(it->is_string() || it->is_number_integer())) return;
    const std::lock_guard lock(mutex_);
    const auto flight = in_flight_.find(it->dump());
    // An unknown or finished request: ignored, as the spec says. A running
    // execution is interrupted by its own thread at its next tick.
    if (flight != in_flight_.end()) flight->second->cancelled = true;
}

json Conversation::call_tool(const json& params, Outbox& out, InFlight& flight) {
    const auto name = params.find("name");
    if (name == params.end() || !name->is_string())
        throw RpcFailure{rpc_error::kInvalidParams, "tools/call: name (a string) is required"};
    if (!find_tool(name->get<std::string>()))
        throw RpcFailure{rpc_error::kInvalidParams, "Unknown tool: " + name->get<std::string>()};
    json args = params.value("arguments", json::object());
    if (!args.is_object())
        throw RpcFailure{rpc_error::kInvalidParams, "tools/call: arguments must be an object"};
    flight.progress_token = params.contains("_meta") && params["_meta"].is_object()
                                ? params["_meta"].value("progressToken", json())
                                : json();
    const std::string tool = name->get<std::string>();
    try {
        if (tool == "run_code") return run_code(args, out, flight);
        if (tool == "create_session") return create_session(args);
        if (tool == "list_sessions") return list_sessions(args);
        if (tool == "close_session") return close_session(args);
        if (tool == "interrupt") return interrupt(args);
        if (tool == "upload_file") return upload_file(args, out, flight);
        if (tool == "download_file") return download_file(args, out, flight);
    } catch (const ToolError& e) {
        return tool_error_result(e);
    } catch (const std::exception& e) {
        return tool_error_result(tool_error_from(e, "ServerError"));
    }
    throw RpcFailure{rpc_error::kInvalidParams, "Unknown tool: " + tool};
}

json Conversation::list_resources() {
    std::vector<std::string> ids;
    {
        const std::lock_guard lock(mutex_);
        for (const auto& [id, session] : sessions_) ids.push_back(id);
    }
    json resources = json::array();
    if (ids.empty()) return {{"resources", resources}};
    const auto client = manager_or_rpc_failure();
    for (const auto& id : ids) {
        const WireMessage reply = client->call("file_list_request", {{"session_id", id}});
        if (reply.content.value("status", "") != "ok") continue;  // closed meanwhile
        for (const auto& file : reply.content.value("files", json::array())) {
            const std::string path = file.value("path", "");
            if (path.empty()) continue;
            resources.push_back({{"uri", output_uri(id, path)},
                                 {"name", path},
                                 {"title", path + " (session " + id + ")"},
                                 {"mimeType", mime_type_of(path)},
                                 {"size", file.value("size", std::uint64_t{0})}});
        }
    }
    return {{"resources", resources}};
}

json Conversation::read_resource(const json& params, InFlight& flight) {
    const auto uri = params.find("uri");
    if (uri == params.end() || !uri->is_string())
        throw RpcFailure{rpc_error::kInvalidParams, "resources/read: uri (a string) is required"};
    const auto parsed = parse_output_uri(uri->get<std::string>());
    if (!parsed)
        throw RpcFailure{rpc_error::kResourceNotFound,
                         "Resource not found: " + uri->get<std::string>()};
    {
        const std::lock_guard lock(mutex_);
        if (!sessions_.contains(parsed->first))
            throw RpcFailure{rpc_error::kResourceNotFound, "Resource not found: session " +
                                                               parsed->first +
                                                               " is not one of this connection's"};
    }
    NullOutbox quiet;
    std::pair<std::string, json> fetched;
    try {
        fetched = fetch_output(parsed->first, parsed->second, quiet, flight);
    } catch (const ToolError& e) {
        const int code = e.ename == ename::FileNotFound || e.ename == ename::InvalidPath
                             ? rpc_error::kResourceNotFound
                             : rpc_error::kInternalError;
        throw RpcFailure{code, e.ename + ": " + e.evalue};
    }
    const std::string mime = mime_type_of(parsed->second);
    json item = {{"uri", *uri}, {"mimeType", mime}};
    if (mime.starts_with("text/") || mime == "application/json") {
        if (is_utf8_text(fetched.first)) {
            item["text"] = std::move(fetched.first);
            return {{"contents", json::array({item})}};
        }
    }
    item["blob"] = base64_encode(fetched.first);
    return {{"contents", json::array({item})}};
}

std::unique_ptr<ManagerClient> Conversation::manager_or_rpc_failure() const {
    try {
        return manager();
    } catch (const ToolError& e) {
        throw RpcFailure{rpc_error::kInternalError, e.ename + ": " + e.evalue};
    }
}

void Conversation::close() {
    std::map<std::string, std::shared_ptr<Attached>> sessions;
    {
        const std::lock_guard lock(mutex_);
        if (closed_) return;
        closed_ = true;
        for (auto& [key, flight] : in_flight_) flight->cancelled = true;
        sessions.swap(sessions_);
        default_session_.clear();
    }
    if (!options_.close_sessions || sessions.empty()) return;
    try {
        const auto client = manager();
        for (const auto& [id, session] : sessions) {
            // Best effort: a session already closed answers SessionClosed.
            client->call("session_close_request", {{"session_id", id}}, {},
                         std::chrono::seconds(10));
        }
    } catch (...) {
        // The server is gone: its sessions went with it.
    }
}

}  // namespace cellblock::mcp
