#include "execution.hpp"

#include <algorithm>
#include <array>

#include "base64.hpp"
#include "cellblock/error_names.hpp"

namespace cellblock::mcp {
using nlohmann::json;

namespace {

std::string string_of(const json& c, const char* key) {
    const auto it = c.find(key);
    return it != c.end() && it->is_string() ? it->get<std::string>() : std::string();
}

std::vector<std::string> strings_of(const json& c, const char* key) {
    std::vector<std::string> out;
    const auto it = c.find(key);
    if (it == c.end() || !it->is_array()) return out;
    for (const auto& line : *it) {
        if (line.is_string()) out.push_back(line.get<std::string>());
    }
    return out;
}

std::string joined(const std::vector<std::string>& lines) {
    std::string out;
    for (const auto& line : lines) {
        if (!out.empty()) out += '\n';
        out += strip_ansi(line);
    }
    return out;
}

// A MIME bundle's value as text: Jupyter sends some as lists of lines.
std::string mime_text(const json& value) {
    if (value.is_string()) return value.get<std::string>();
    if (value.is_array()) {
        std::string out;
        for (const auto& line : value) {
            if (line.is_string()) out += line.get<std::string>();
        }
        return out;
    }
    return value.dump();
}

bool is_image(const std::string& mime) {
    return std::any_of(std::begin(kImageMimeTypes), std::end(kImageMimeTypes),
                       [&](const char* m) { return mime == m; });
}

}  // namespace

bool is_policy_ename(const std::string& name) {
    // clients/python/cellblock/errors.py's POLICY_ENAMES.
    static const std::array<std::string_view, 10> names = {ename::ExecutionLimitExceeded,
                                                           ename::ExecutionTimeout,
                                                           ename::InterruptIgnored,
                                                           ename::SessionClosed,
                                                           ename::MemoryLimitExceeded,
                                                           ename::KernelDied,
                                                           ename::SessionBusy,
                                                           ename::InvalidLimits,
                                                           ename::LimitAboveMaximum,
                                                           ename::ServerShuttingDown};
    return std::find(names.begin(), names.end(), name) != names.end();
}

std::string strip_ansi(const std::string& text) {
    std::string out;
    out.reserve(text.size());
    for (std::size_t i = 0; i < text.size(); ++i) {
        if (text[i] != '\x1b') {
            out += text[i];
            continue;
        }
        // CSI: ESC [ parameters... final byte in @..~
        if (i + 1 < text.size() && text[i + 1] == '[') {
            std::size_t j = i + 2;
            while (j < text.size() && !(text[j] >= '@' && text[j] <= '~')) ++j;
            i = j;
        } else {
            ++i;  // a two-byte escape
        }
    }
    return out;
}

void Execution::on_iopub(const WireMessage& msg) {
    if (msg.parent_msg_id() != msg_id_) return;
    const std::string kind = msg.msg_type();
    const json& c = msg.content;
    if (kind == "status") {
        if (string_of(c, "execution_state") == "idle") idle_ = true;
    } else if (kind == "stream") {
        (string_of(c, "name") == "stderr" ? stderr_text : stdout_text) += string_of(c, "text");
    } else if (kind == "execute_result" || kind == "display_data") {
        RichOutput out;
        if (c.contains("data") && c["data"].is_object()) out.data = c["data"];
        out.is_main_result = kind == "execute_result";
        if (out.is_main_result && c.contains("execution_count") &&
            c["execution_count"].is_number_integer())
            execution_count = c["execution_count"].get<int>();
        outputs.push_back(std::move(out));
    } else if (kind == "error") {
        // The reply may have come first (two sockets): what it said of the error stays.
        const std::string name = string_of(c, "ename");
        const bool by_server = error && error->ename == name && error->by_server;
        error = ExecutionError{name, string_of(c, "evalue"), strings_of(c, "traceback"), by_server};
    } else if (kind == "clear_output") {
        outputs.clear();
        stdout_text.clear();
        stderr_text.clear();
    }
}

void Execution::on_reply(const WireMessage& msg) {
    if (msg.parent_msg_id() != msg_id_) return;
    replied_ = true;
    const json& c = msg.content;
    status = string_of(c, "status");
    if (c.contains("execution_count") && c["execution_count"].is_number_integer())
        execution_count = c["execution_count"].get<int>();
    // The server's own refusals carry theirs in the content.
    if (msg.metadata.contains("cellblock") && msg.metadata["cellblock"].is_object()) {
        budget = msg.metadata["cellblock"];
    } else if (c.contains("cellblock") && c["cellblock"].is_object()) {
        budget = c["cellblock"];
    }
    if (status == "ok") return;
    const std::string ename = status == "aborted" ? "Aborted" : string_of(c, "ename");
    // The server's own replies carry no wall_ms: the kernel never answered them.
    const bool by_server = is_policy_ename(ename) && !budget.contains("wall_ms");
    if (!error || error->ename != ename) {
        error = ExecutionError{ename, string_of(c, "evalue"), strings_of(c, "traceback"), false};
    }
    error->by_server = by_server;
}

json execution_result(const Execution& ex, const std::string& session_id, bool cancelled) {
    json content = json::array();
    json results = json::array();
    int images = 0;
    if (!ex.stdout_text.empty()) content.push_back({{"type", "text"}, {"text", ex.stdout_text}});
    if (!ex.stderr_text.empty())
        content.push_back({{"type", "text"}, {"text", "[stderr]\n" + ex.stderr_text}});
    for (const auto& out : ex.outputs) {
        json entry = {{"is_main_result", out.is_main_result}, {"mime_types", json::array()}};
        for (const auto& [mime, value] : out.data.items()) entry["mime_types"].push_back(mime);
        if (out.data.contains("text/plain"))
            entry["text_plain"] = mime_text(out.data["text/plain"]);
        if (out.data.contains("text/html")) entry["text_html"] = mime_text(out.data["text/html"]);
        bool had_image = false;
        for (const auto& [mime, value] : out.data.items()) {
            if (!is_image(mime)) continue;
            const std::string text = mime_text(value);
            // PNG and JPEG come base64 (maybe wrapped); SVG comes as its text.
            const std::string data =
                mime == "image/svg+xml" ? base64_encode(text) : strip_whitespace(text);
            content.push_back({{"type", "image"}, {"data", data}, {"mimeType", mime}});
            had_image = true;
            ++images;
        }
        // A figure's text/plain ("<Figure size ...>") says nothing the image does not.
        if (entry.contains("text_plain") && !had_image) {
            content.push_back({{"type", "text"}, {"text", entry["text_plain"]}});
        } else if (entry.contains("text_html") && !had_image) {
            content.push_back({{"type", "text"}, {"text", entry["text_html"]}});
        }
        results.push_back(std::move(entry));
    }
    json error;  // null: no error, and then absent from the result
    if (ex.error) {
        const auto& e = *ex.error;
        std::string text = e.ename + ": " + e.evalue;
        if (!e.traceback.empty()) text = joined(e.traceback);
        if (e.by_server) text = e.ename + ": " + e.evalue + " (stopped by the cellblock server)";
        content.push_back({{"type", "text"}, {"text", text}});
        json traceback = json::array();
        for (const auto& line : e.traceback) traceback.push_back(strip_ansi(line));
        error = {{"ename", e.ename},
                 {"evalue", e.evalue},
                 {"traceback", std::move(traceback)},
                 {"by_server", e.by_server}};
    }
    if (cancelled) {
        content.push_back(
            {{"type", "text"}, {"text", "(cancelled: the execution was interrupted)"}});
    }
    if (content.empty()) content.push_back({{"type", "text"}, {"text", "(no output)"}});
    // Absent rather than null: a nullable type is not portable across model providers'
    // schema dialects (the Inspector's --strict says so).
    json structured = {{"session_id", session_id},
                       {"status", ex.status.empty() ? "unknown" : ex.status},
                       {"stdout", ex.stdout_text},
                       {"stderr", ex.stderr_text},
                       {"results", std::move(results)},
                       {"images", images},
                       {"budget", ex.budget}};
    if (ex.execution_count) structured["execution_count"] = *ex.execution_count;
    if (!error.is_null()) structured["error"] = std::move(error);
    return {{"content", std::move(content)},
            {"structuredContent", std::move(structured)},
            {"isError", ex.error.has_value()}};
}

}  // namespace cellblock::mcp
