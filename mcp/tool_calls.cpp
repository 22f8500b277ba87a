// The tools of tool_catalog.cpp, as Conversation's methods: each takes its
// arguments, drives the manager socket or the session's channels, and
// returns a tool result or throws ToolError.
#include <fcntl.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "base64.hpp"
#include "cellblock/error_names.hpp"
#include "cellblock/sha256.hpp"
#include "cellblock/unique_fd.hpp"
#include "conversation_internal.hpp"
#include "manager_client.hpp"

namespace cellblock::mcp {
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

// A bad argument is the tool's error (the model can fix it), not a JSON-RPC one.
[[noreturn]] void bad_argument(const std::string& why) {
    throw ToolError{ename::InvalidRequest, why};
}

std::string string_arg(const json& args, const char* name, bool required) {
    const auto it = args.find(name);
    if (it == args.end() || it->is_null()) {
        if (required) bad_argument(std::string(name) + " (a string) is required");
        return {};
    }
    if (!it->is_string()) bad_argument(std::string(name) + " must be a string");
    return it->get<std::string>();
}

json ok_content(const WireMessage& reply) {
    if (reply.content.value("status", "") != "ok") {
        throw ToolError{reply.content.value("ename", std::string(ename::ServerError)),
                        reply.content.value("evalue", reply.content.dump())};
    }
    return reply.content;
}

json tool_result(std::string text, json structured) {
    return {{"content", json::array({{{"type", "text"}, {"text", std::move(text)}}})},
            {"structuredContent", std::move(structured)},
            {"isError", false}};
}

// The enames after which a session is closed for good.
bool closes_session(const std::string& name) {
    return name == ename::SessionClosed || name == ename::KernelDied ||
           name == ename::MemoryLimitExceeded || name == ename::ExecutionTimeout ||
           name == ename::InterruptIgnored || name == ename::ServerShuttingDown;
}

// A private file in the scratch directory, removed when it goes out of scope.
class ScratchFile {
  public:
    explicit ScratchFile(const fs::path& dir) {
        std::string name = (dir / "transfer-XXXXXX").string();
        UniqueFd fd(::mkstemp(name.data()));
        if (!fd) throw ToolError{ename::FileError, "cannot create a file in " + dir.string()};
        path_ = name;
    }
    ~ScratchFile() {
        std::error_code ignored;
        fs::remove(path_, ignored);
        fs::remove(path_.string() + ".part", ignored);
    }
    ScratchFile(const ScratchFile&) = delete;
    ScratchFile& operator=(const ScratchFile&) = delete;
    const fs::path& path() const { return path_; }

  private:
    fs::path path_;
};

}  // namespace

std::shared_ptr<Conversation::Attached> Conversation::start_session(const std::string& image,
                                                                    const json& limits) {
    json request = {{"timeout_s", 120}, {"metadata", {{"client", "cellblock-mcp"}}}};
    const std::string chosen = image.empty() ? options_.image : image;
    if (!chosen.empty()) request["image"] = chosen;
    json merged = options_.limits;
    for (const auto& [key, value] : limits.items()) merged[key] = value;
    if (!merged.empty()) request["limits"] = merged;
    const auto client = manager();
    const json reply = ok_content(client->call("session_create_request", request));
    const std::string id = reply.value("session_id", "");
    try {
        auto session = std::make_shared<Attached>(
            context_, id, ConnectionInfo::from_json(reply.at("connection")));
        session->image = reply.value("image", chosen);
        session->runtime = reply.value("runtime", "");
        session->warm = reply.value("warm", false);
        session->limits = reply.value("limits", json::object());
        if (session->limits.contains("exec_timeout_s") &&
            session->limits["exec_timeout_s"].is_number())
            session->exec_timeout_s = session->limits["exec_timeout_s"].get<double>();
        session->channels.wait_ready(std::chrono::seconds(60));
        const std::lock_guard lock(mutex_);
        if (closed_) throw ToolError{ename::SessionClosed, "the MCP connection is closing"};
        sessions_[id] = session;
        if (default_session_.empty()) default_session_ = id;
        return session;
    } catch (...) {
        client->call("session_close_request", {{"session_id", id}}, {}, std::chrono::seconds(10));
        throw;
    }
}

std::shared_ptr<Conversation::Attached> Conversation::session_for(const json& args, bool create) {
    const std::string named = string_arg(args, "session_id", false);
    const auto lookup = [&]() -> std::shared_ptr<Attached> {
        const std::lock_guard lock(mutex_);
        const std::string id = named.empty() ? default_session_ : named;
        if (const auto it = sessions_.find(id); it != sessions_.end()) return it->second;
        if (!named.empty()) {
            throw ToolError{ename::NoSuchSession,
                            "session " + named +
                                " is not one of this MCP connection's (closed, or created "
                                "elsewhere); use create_session, or omit session_id"};
        }
        if (!create) {
            throw ToolError{ename::NoSuchSession,
                            "this MCP connection has no session yet (run_code or "
                            "create_session makes one)"};
        }
        return nullptr;
    };
    if (auto session = lookup()) return session;
    // Two first calls at once make one default session: the second finds the first's.
    const std::lock_guard creating(create_mutex_);
    if (auto session = lookup()) return session;
    return start_session("", json::object());
}

void Conversation::forget(const std::string& session_id) {
    const std::lock_guard lock(mutex_);
    sessions_.erase(session_id);
    if (default_session_ == session_id) default_session_.clear();
}

json Conversation::run_code(const json& args, Outbox& out, InFlight& flight) {
    const std::string code = string_arg(args, "code", true);
    double timeout_s = 0;
    if (args.contains("timeout_s")) {
        if (!args["timeout_s"].is_number() || args["timeout_s"].get<double>() <= 0)
            bad_argument("timeout_s must be a positive number");
        timeout_s = args["timeout_s"].get<double>();
    }
    const auto session = session_for(args, true);
    if (flight.cancelled) return tool_error_result({"Cancelled", "cancelled before it ran"});
    ProgressReporter progress(out, flight.progress_token);
    bool interrupted = false;
    KernelChannels::Hooks hooks;
    hooks.tick = std::chrono::milliseconds(250);
    hooks.on_tick = [&](std::chrono::milliseconds elapsed) {
        // notifications/cancelled: the cell is interrupted, as a notebook's stop button does.
        if (flight.cancelled && !interrupted) {
            interrupted = true;
            try {
                session->channels.interrupt(std::chrono::seconds(5));
            } catch (const std::exception&) {
                // The server kills the kernel at its deadline anyway.
            }
        }
        const auto seconds = static_cast<double>(elapsed.count() / 1000);
        progress.report(seconds, std::nullopt,
                        "running for " + std::to_string(elapsed.count() / 1000) + " s");
    };
    Execution ex = [&] {
        try {
            return session->channels.execute(code, timeout_s, session->exec_timeout_s, hooks);
        } catch (const ToolError&) {
            throw;
        } catch (const std::exception& e) {
            throw ToolError{"ClientTimeout", "session " + session->id + ": " + e.what()};
        }
    }();
    json result = execution_result(ex, session->id, interrupted);
    if (ex.error && ex.error->by_server && closes_session(ex.error->ename)) {
        forget(session->id);
        result["content"].push_back(
            {{"type", "text"},
             {"text", "session " + session->id +
                          " is closed; the next run_code without session_id starts a new one"}});
    }
    return result;
}

json Conversation::create_session(const json& args) {
    const std::string image = string_arg(args, "image", false);
    json limits = json::object();
    if (args.contains("limits")) {
        if (!args["limits"].is_object()) bad_argument("limits must be an object");
        limits = args["limits"];
    }
    const auto session = [&] {
        const std::lock_guard creating(create_mutex_);
        return start_session(image, limits);
    }();
    bool is_default;
    {
        const std::lock_guard lock(mutex_);
        is_default = default_session_ == session->id;
    }
    json structured = {{"session_id", session->id},   {"image", session->image},
                       {"runtime", session->runtime}, {"warm", session->warm},
                       {"default", is_default},       {"limits", session->limits}};
    return tool_result("session " + session->id + " (image " + session->image + ") is ready" +
                           (is_default ? "; run_code uses it by default" : ""),
                       std::move(structured));
}

json Conversation::list_sessions(const json& args) {
    bool all = false;
    if (args.contains("all")) {
        if (!args["all"].is_boolean()) bad_argument("all must be a boolean");
        all = args["all"].get<bool>();
    }
    const json reply = ok_content(manager()->call("session_list_request", {{"open_only", !all}}));
    json sessions = json::array();
    std::string text;
    std::string default_session;
    {
        const std::lock_guard lock(mutex_);
        default_session = default_session_;
        for (const auto& s : reply.value("sessions", json::array())) {
            const std::string id = s.value("session_id", "");
            const bool attached = sessions_.contains(id);
            json entry = {{"session_id", id},
                          {"image", s.value("image", "")},
                          {"state", s.value("state", "")},
                          {"attached", attached}};
            if (s.contains("created_at") && s["created_at"].is_number())
                entry["created_at"] = s["created_at"];
            if (s.contains("executions") && s["executions"].is_number_integer())
                entry["executions"] = s["executions"];
            if (s.contains("close_reason") && s["close_reason"].is_string() &&
                !s["close_reason"].get<std::string>().empty())
                entry["close_reason"] = s["close_reason"];
            text += id + "  " + entry["state"].get<std::string>() + "  " +
                    entry["image"].get<std::string>() +
                    (id == default_session ? "  (default)"
                     : attached            ? "  (this connection)"
                                           : "") +
                    "\n";
            sessions.push_back(std::move(entry));
        }
    }
    if (text.empty()) text = "no sessions\n";
    json structured = {{"sessions", std::move(sessions)}};
    if (!default_session.empty()) structured["default_session"] = default_session;
    return tool_result(text, std::move(structured));
}

json Conversation::close_session(const json& args) {
    std::string id = string_arg(args, "session_id", false);
    if (id.empty()) {
        const std::lock_guard lock(mutex_);
        id = default_session_;
    }
    if (id.empty()) throw ToolError{ename::NoSuchSession, "this MCP connection has no session"};
    ok_content(manager()->call("session_close_request", {{"session_id", id}}));
    forget(id);
    return tool_result("session " + id + " is closed", {{"session_id", id}, {"closed", true}});
}

json Conversation::interrupt(const json& args) {
    const auto session = session_for(args, false);
    json reply;
    try {
        reply = session->channels.interrupt(std::chrono::seconds(10));
    } catch (const std::exception& e) {
        throw ToolError{"ClientTimeout", "session " + session->id + ": " + e.what()};
    }
    if (reply.value("status", "") != "ok") {
        throw ToolError{reply.value("ename", std::string(ename::ServerError)),
                        reply.value("evalue", reply.dump())};
    }
    return tool_result("interrupted session " + session->id,
                       {{"session_id", session->id}, {"status", "ok"}});
}

json Conversation::upload_file(const json& args, Outbox& out, InFlight& flight) {
    const std::string path = string_arg(args, "path", true);
    const bool has_text = args.contains("content"), has_b64 = args.contains("content_base64");
    if (has_text == has_b64) bad_argument("give exactly one of content and content_base64");
    std::string bytes;
    if (has_text) {
        bytes = string_arg(args, "content", true);
    } else {
        auto decoded = base64_decode(string_arg(args, "content_base64", true));
        if (!decoded) bad_argument("content_base64 is not base64");
        bytes = std::move(*decoded);
    }
    if (bytes.size() > options_.max_file_bytes) {
        throw ToolError{ename::FileTooLarge,
                        path + " is " + std::to_string(bytes.size()) + " bytes, over the " +
                            std::to_string(options_.max_file_bytes) +
                            " bytes one file may be through MCP (cellblock mcp --max-file-mb)"};
    }
    const auto session = session_for(args, true);
    ScratchFile scratch(options_.scratch_dir);
    {
        std::ofstream file(scratch.path(), std::ios::binary | std::ios::trunc);
        file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
        if (!file.flush())
            throw ToolError{ename::FileError, "cannot write " + scratch.path().string()};
    }
    ProgressReporter progress(out, flight.progress_token);
    json reply;
    try {
        reply = manager()->put_file(
            session->id, scratch.path(), path, [&](std::uint64_t done, std::uint64_t total) {
                if (flight.cancelled) throw ToolError{"Cancelled", "the upload was cancelled"};
                progress.report(
                    static_cast<double>(done), static_cast<double>(total),
                    "uploaded " + std::to_string(done) + " of " + std::to_string(total) + " bytes");
            });
    } catch (const ToolError&) {
        throw;
    } catch (const std::exception& e) {
        throw tool_error_from(e, ename::FileError);
    }
    const std::string where = reply.value("path", "/data/input/" + path);
    const std::string sha = reply.value("sha256", [&] {
        Sha256 hash;
        hash.update(bytes);
        return hash.hex();
    }());
    return tool_result("wrote " + where + " (" + std::to_string(bytes.size()) + " bytes)",
                       {{"session_id", session->id},
                        {"path", where},
                        {"size", reply.value("size", bytes.size())},
                        {"sha256", sha}});
}

std::pair<std::string, json> Conversation::fetch_output(const std::string& session_id,
                                                        const std::string& path, Outbox& out,
                                                        InFlight& flight) {
    ScratchFile scratch(options_.scratch_dir);
    ProgressReporter progress(out, flight.progress_token);
    json reply;
    try {
        reply = manager()->get_file(
            session_id, path, scratch.path(), [&](std::uint64_t done, std::uint64_t total) {
                if (flight.cancelled) throw ToolError{"Cancelled", "the download was cancelled"};
                if (total > options_.max_file_bytes) {
                    throw ToolError{ename::FileTooLarge,
                                    path + " is " + std::to_string(total) + " bytes, over the " +
                                        std::to_string(options_.max_file_bytes) +
                                        " bytes one file may be through MCP (cellblock mcp "
                                        "--max-file-mb)"};
                }
                progress.report(static_cast<double>(done), static_cast<double>(total),
                                "downloaded " + std::to_string(done) + " of " +
                                    std::to_string(total) + " bytes");
            });
    } catch (const ToolError&) {
        throw;
    } catch (const std::exception& e) {
        throw tool_error_from(e, ename::FileError);
    }
    std::ifstream file(scratch.path(), std::ios::binary);
    std::ostringstream bytes;
    bytes << file.rdbuf();
    return {bytes.str(), reply};
}

json Conversation::download_file(const json& args, Outbox& out, InFlight& flight) {
    const std::string path = string_arg(args, "path", true);
    const auto session = session_for(args, false);
    auto [bytes, reply] = fetch_output(session->id, path, out, flight);
    const std::string mime = mime_type_of(path);
    const std::string uri = output_uri(session->id, path);
    const std::string where = reply.value("path", "/data/output/" + path);
    json content =
        json::array({{{"type", "text"},
                      {"text", where + ": " + std::to_string(bytes.size()) + " bytes, " + mime}}});
    if (mime.starts_with("image/")) {
        content.push_back({{"type", "image"}, {"data", base64_encode(bytes)}, {"mimeType", mime}});
    } else if ((mime.starts_with("text/") || mime == "application/json" ||
                mime == "application/octet-stream") &&
               is_utf8_text(bytes)) {
        content.push_back({{"type", "resource"},
                           {"resource",
                            {{"uri", uri},
                             {"mimeType", mime == "application/octet-stream" ? "text/plain" : mime},
                             {"text", bytes}}}});
    } else {
        content.push_back(
            {{"type", "resource"},
             {"resource", {{"uri", uri}, {"mimeType", mime}, {"blob", base64_encode(bytes)}}}});
    }
    json structured = {{"session_id", session->id}, {"path", where},
                       {"size", bytes.size()},      {"sha256", reply.value("sha256", "")},
                       {"mime_type", mime},         {"uri", uri}};
    return {{"content", std::move(content)},
            {"structuredContent", std::move(structured)},
            {"isError", false}};
}

}  // namespace cellblock::mcp
