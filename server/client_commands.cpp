// `cellblock new | ls | info | close | put | get | history | server-info`
// (client_commands.hpp).
#include "client_commands.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <ctime>
#include <iostream>

#include "cellblock/connection_info.hpp"
#include "manager_client.hpp"
#include "manager_paths.hpp"

namespace cellblock {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// The reply's content, or an exception carrying ename: evalue.
json ok_content(const WireMessage& reply) {
    if (reply.content.value("status", "") != "ok") {
        throw std::runtime_error(reply.content.value("ename", "Error") + ": " +
                                 reply.content.value("evalue", reply.content.dump()));
    }
    return reply.content;
}

std::string when(double unix_seconds) {
    if (unix_seconds <= 0) return "-";
    const std::time_t t = static_cast<std::time_t>(unix_seconds);
    char buf[32];
    std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", std::localtime(&t));
    return buf;
}

// A progress bar on stderr when it is a terminal; nothing otherwise (logs
// and pipes get the one summary line).
ManagerClient::Progress progress_bar(const std::string& label) {
    if (!::isatty(STDERR_FILENO)) return {};
    const auto start = std::chrono::steady_clock::now();
    return [label, start](std::uint64_t done, std::uint64_t total) {
        constexpr int kWidth = 30;
        const double part = total ? static_cast<double>(done) / static_cast<double>(total) : 1.0;
        const int filled = static_cast<int>(part * kWidth);
        const double seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        std::fprintf(stderr, "\r%s [%s%s] %3d%% %.1f/%.1f MiB %.0f MiB/s", label.c_str(),
                     std::string(static_cast<std::size_t>(filled), '#').c_str(),
                     std::string(static_cast<std::size_t>(kWidth - filled), '.').c_str(),
                     static_cast<int>(part * 100), static_cast<double>(done) / (1 << 20),
                     static_cast<double>(total) / (1 << 20),
                     seconds > 0 ? static_cast<double>(done) / (1 << 20) / seconds : 0.0);
        if (done >= total) std::fputc('\n', stderr);
        std::fflush(stderr);
    };
}

}  // namespace

// "key=value" limit options: numbers stay numbers.
json parse_limits(const std::vector<std::string>& items) {
    json limits = json::object();
    for (const auto& item : items) {
        const auto eq = item.find('=');
        if (eq == std::string::npos)
            throw std::runtime_error("--limit " + item + ": expected KEY=VALUE");
        const std::string key = item.substr(0, eq), value = item.substr(eq + 1);
        json parsed = json::parse(value, nullptr, false);
        limits[key] = parsed.is_discarded() ? json(value) : parsed;
    }
    return limits;
}

ClientCommands::ClientCommands(CLI::App& app) : state_dir_(default_serve_state_dir()) {
    auto add_client = [&, this](const char* name, const char* help) {
        auto* cmd = app.add_subcommand(name, help);
        cmd->add_option("--state-dir", state_dir_, "the server's state dir")->capture_default_str();
        return cmd;
    };
    new_cmd_ = add_client("new", "create a session; writes its connection file");
    new_cmd_->add_option("--image", image_, "image name");
    new_cmd_->add_option("--limit", limit_items_,
                         "KEY=VALUE (repeatable): max_executions, idle_timeout_s, ...");
    new_cmd_->add_option("--metadata", metadata_text_, "JSON object kept with the session");
    new_cmd_->add_option("-o,--output", output_file_,
                         "connection file to write (default ./cellblock-<id>.json)");
    ls_cmd_ = add_client("ls", "list sessions");
    ls_cmd_->add_flag("--all", all_, "include closed sessions");
    ls_cmd_->add_flag("--json", as_json_, "print JSON");
    info_cmd_ = add_client("info", "show a session");
    info_cmd_->add_option("session", session_id_)->required();
    close_cmd_ = add_client("close", "close a session");
    close_cmd_->add_option("session", session_id_)->required();
    hibernate_cmd_ = add_client(
        "hibernate", "save an idle session to disk and free its sandbox (docs/hibernation.md)");
    hibernate_cmd_->add_option("session", session_id_)->required();
    resume_cmd_ = add_client("resume", "wake a hibernated session now (its next request would)");
    resume_cmd_->add_option("session", session_id_)->required();
    put_cmd_ = add_client("put", "copy a file to the session's /data/input");
    put_cmd_->add_option("session", session_id_)->required();
    put_cmd_->add_option("local", local_, "local file")->required();
    put_cmd_->add_option("remote", remote_, "path under /data/input (default: the file's name)");
    get_cmd_ = add_client("get", "copy a file from the session's /data/output");
    get_cmd_->add_option("session", session_id_)->required();
    get_cmd_->add_option("remote", remote_, "path under /data/output")->required();
    get_cmd_->add_option("local", local_, "local file (default: the file's name)");
    // By default a file moves by descriptor over the server's local file
    // socket when this process can reach it, else it is streamed.
    for (auto* cmd : {put_cmd_, get_cmd_}) {
        auto* stream = cmd->add_flag("--stream", stream_only_,
                                     "stream the bytes through the manager socket in chunks");
        cmd->add_flag("--local", local_only_,
                      "pass the file's descriptor over the server's local file socket, or fail")
            ->excludes(stream);
    }
    history_cmd_ = add_client("history", "a session's executions and events");
    history_cmd_->add_option("session", session_id_)->required();
    history_cmd_->add_flag("--json", as_json_, "print JSON");
    server_info_cmd_ = add_client("server-info", "the server's version, images, pool and limits");
}

bool ClientCommands::parsed() const {
    for (const CLI::App* cmd : {new_cmd_, ls_cmd_, info_cmd_, close_cmd_, hibernate_cmd_,
                                resume_cmd_, put_cmd_, get_cmd_, history_cmd_, server_info_cmd_})
        if (cmd->parsed()) return true;
    return false;
}

int ClientCommands::run() {
    ManagerClient client(state_dir_);
    if (new_cmd_->parsed()) {
        const auto create_timeout = std::chrono::seconds(120);
        // The server never hands out a session after we stopped waiting.
        json content = {{"limits", parse_limits(limit_items_)},
                        {"timeout_s", static_cast<double>(create_timeout.count())}};
        if (!image_.empty()) content["image"] = image_;
        if (!metadata_text_.empty()) content["metadata"] = json::parse(metadata_text_);
        const json reply =
            ok_content(client.call("session_create_request", content, {}, create_timeout));
        const std::string id = reply["session_id"];
        const fs::path file =
            output_file_.empty() ? fs::path("cellblock-" + id + ".json") : fs::path(output_file_);
        ConnectionInfo::from_json(reply["connection"]).write(file);
        std::cout << "session " << id << (reply.value("warm", false) ? " (warm)" : " (cold start)")
                  << "\n"
                  << "connection file: " << fs::absolute(file).string() << "\n"
                  << "  jupyter console --existing " << fs::absolute(file).string() << "\n";
        return 0;
    }
    if (ls_cmd_->parsed()) {
        const json reply = ok_content(client.call("session_list_request", {{"open_only", !all_}}));
        if (as_json_) {
            std::cout << reply["sessions"].dump(2) << "\n";
            return 0;
        }
        const auto pid_list = [](const json& entry) {
            std::string pids;
            for (const auto& pid : entry.value("pids", json::array())) {
                pids += (pids.empty() ? "" : ",") + std::to_string(pid.get<long>());
            }
            return pids.empty() ? std::string("-") : pids;
        };
        std::printf("%-18s %-8s %-10s %-20s %5s  %-16s %s\n", "SESSION", "IMAGE", "STATE",
                    "CREATED", "EXECS", "PIDS", "CLOSED BECAUSE / SNAPSHOT");
        for (const auto& s : reply["sessions"]) {
            // A hibernated session has no processes: its snapshot's size and age instead.
            std::string note = s["close_reason"].get<std::string>();
            if (const auto snap = s.find("snapshot"); snap != s.end() && snap->is_object()) {
                note =
                    fmt::format("snapshot {:.1f} MB, kept {:.0f} s ago",
                                snap->value("bytes", 0.0) / (1 << 20), snap->value("age_s", 0.0));
            }
            std::printf(
                "%-18s %-8s %-10s %-20s %5lld  %-16s %s\n",
                s["session_id"].get<std::string>().c_str(), s["image"].get<std::string>().c_str(),
                s["state"].get<std::string>().c_str(), when(s["created_at"].get<double>()).c_str(),
                s["executions"].get<long long>(), pid_list(s).c_str(), note.c_str());
        }
        // The pool's warm sandboxes are live too: an operator counting
        // containers (`runc --root RUNTIME_ROOT list`) sees them.
        for (const auto& box : reply.value("warm_sandboxes", json::array())) {
            std::printf("%-18s %-8s %-10s %-20s %5s  %-16s %s\n", "(pool)",
                        box["image"].get<std::string>().c_str(), "warm", "-", "-",
                        pid_list(box).c_str(), box["container_id"].get<std::string>().c_str());
        }
        for (const auto& z : reply.value("zygotes", json::array())) {
            std::printf("%-18s %-8s %-10s %-20s %5s  %-16s %s\n", "(zygote)",
                        z["image"].get<std::string>().c_str(), "zygote", "-", "-",
                        pid_list(z).c_str(), z["container_id"].get<std::string>().c_str());
        }
        for (const auto& z : reply.value("zygotes_refused", json::array())) {
            std::printf("(zygote of %s refused: its sessions boot) %s\n",
                        z.value("image", "").c_str(), z.value("why", "").c_str());
        }
        if (reply.value("backend", "runc") == "swarm") {
            // Sandboxes are Swarm services on the nodes: the engine lists them.
            std::printf("\n%-28s %-8s %-12s %s\n", "NODE", "STATE", "AVAILABILITY", "SANDBOXES");
            for (const auto& n : reply.value("nodes", json::array())) {
                if (n.value("kind", "") != "node") {
                    std::printf("(the engine did not answer: %s)\n",
                                n.value("message", "").c_str());
                    continue;
                }
                std::printf("%-28s %-8s %-12s %d\n", n.value("hostname", "").c_str(),
                            n.value("state", "").c_str(), n.value("availability", "").c_str(),
                            n.value("sandboxes", 0));
            }
            std::printf("\nsandboxes: docker service ls --filter label=cellblock.server\n");
        } else if (reply.contains("runtime_root")) {
            std::printf("\nsandboxes: runc --root %s list\n",
                        reply["runtime_root"].get<std::string>().c_str());
        }
        return 0;
    }
    if (info_cmd_->parsed()) {
        std::cout << ok_content(client.call("session_info_request", {{"session_id", session_id_}}))
                         .dump(2)
                  << "\n";
        return 0;
    }
    if (close_cmd_->parsed()) {
        ok_content(client.call("session_close_request", {{"session_id", session_id_}}));
        std::cout << "session " << session_id_ << " closed\n";
        return 0;
    }
    if (hibernate_cmd_->parsed() || resume_cmd_->parsed()) {
        const bool sleep = hibernate_cmd_->parsed();
        const json reply =
            ok_content(client.call(sleep ? "session_hibernate_request" : "session_resume_request",
                                   {{"session_id", session_id_}}, {}, std::chrono::seconds(600)));
        std::cout << "session " << session_id_ << " " << reply.value("state", "")
                  << (reply.contains("snapshot_bytes")
                          ? " (snapshot " + reply["snapshot_bytes"].dump() + " bytes)"
                          : std::string())
                  << (reply.contains("detail") ? ": " + reply.value("detail", "") : std::string())
                  << "\n";
        return 0;
    }
    const auto route = stream_only_  ? ManagerClient::Route::Stream
                       : local_only_ ? ManagerClient::Route::Local
                                     : ManagerClient::Route::Auto;
    if (put_cmd_->parsed()) {
        const std::string name = remote_.empty() ? fs::path(local_).filename().string() : remote_;
        const json reply = client.put_file(session_id_, local_, name, progress_bar(name), route);
        std::cout << local_ << " -> " << reply["path"].get<std::string>() << " (" << reply["size"]
                  << " bytes) sha256 " << reply["sha256"].get<std::string>() << "\n";
        return 0;
    }
    if (get_cmd_->parsed()) {
        const fs::path out = local_.empty() ? fs::path(remote_).filename() : fs::path(local_);
        const json reply = client.get_file(session_id_, remote_, out, progress_bar(remote_), route);
        std::cout << reply["path"].get<std::string>() << " -> " << out.string() << " ("
                  << reply["size"] << " bytes) sha256 " << reply["sha256"].get<std::string>()
                  << "\n";
        return 0;
    }
    if (history_cmd_->parsed()) {
        const json reply =
            ok_content(client.call("session_history_request", {{"session_id", session_id_}}));
        if (as_json_) {
            std::cout << reply.dump(2) << "\n";
            return 0;
        }
        std::cout << "session " << session_id_ << ": " << reply["state"].get<std::string>();
        if (!reply["close_reason"].get<std::string>().empty()) {
            std::cout << " (" << reply["close_reason"].get<std::string>() << ")";
            // Kept at the close, over the session's whole life.
            std::printf("; peak memory %.1f MB, CPU %llu ms",
                        static_cast<double>(reply.value("memory_peak_bytes", 0ULL)) / (1 << 20),
                        reply.value("cpu_ms", 0ULL));
        }
        std::cout << "\n\nexecutions:\n";
        for (const auto& e : reply["executions"]) {
            std::string code = e["code"].get<std::string>();
            for (auto& ch : code) {
                if (ch == '\n') ch = ' ';
            }
            if (code.size() > 50) code = code.substr(0, 47) + "...";
            std::printf(
                "  %3lld %-8s %-22s %8.0f ms %6llu cpu ms %7.1f MB%s  %s\n",
                e["count"].get<long long>(), e["status"].get<std::string>().c_str(),
                e["ename"].get<std::string>().c_str(), e["wall_ms"].get<double>(),
                e["cpu_ms"].get<unsigned long long>(),
                static_cast<double>(e["memory_peak_bytes"].get<unsigned long long>()) / (1 << 20),
                e["truncated"].get<bool>() ? " truncated" : "", code.c_str());
        }
        std::cout << "\nevents:\n";
        for (const auto& e : reply["events"]) {
            std::string detail = e["detail"].get<std::string>();
            if (e["kind"] == "egress") {
                // One line per connection: what, where, how it ended.
                const json c = json::parse(detail, nullptr, false);
                if (c.is_object()) {
                    detail = c.value("method", "-") + " " + c.value("host", "-") + ":" +
                             std::to_string(c.value("port", 0)) + " " + c.value("verdict", "") +
                             " " + std::to_string(c.value("status", 0)) + " up " +
                             std::to_string(c.value("bytes_up", 0)) + " B down " +
                             std::to_string(c.value("bytes_down", 0)) + " B " +
                             std::to_string(c.value("duration_ms", 0)) + " ms" +
                             (c.value("reason", "").empty() ? "" : ": " + c.value("reason", ""));
                }
            }
            std::printf("  %s %-12s %s\n", when(e["at"].get<double>()).c_str(),
                        e["kind"].get<std::string>().c_str(), detail.c_str());
        }
        return 0;
    }
    if (server_info_cmd_->parsed()) {
        std::cout << ok_content(client.call("server_info_request", json::object())).dump(2) << "\n";
        return 0;
    }
    return 0;
}

}  // namespace cellblock
