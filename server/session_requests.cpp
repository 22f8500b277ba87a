// session_list, session_info, session_close and session_history over the
// SessionService (session_requests.hpp).
#include "session_requests.hpp"

#include <algorithm>
#include <fstream>

#include "cellblock/error_names.hpp"
#include "cellblock/runc_sandbox.hpp"
#include "session_proxy.hpp"

namespace cellblock {

using nlohmann::json;

std::vector<pid_t> sandbox_pids(const std::string& container_id) {
    std::vector<pid_t> pids;
    for (const auto& dir : sandbox_cgroup_dirs(container_id)) {
        std::ifstream procs(dir / "cgroup.procs");
        if (!procs) continue;
        for (pid_t pid; procs >> pid;) pids.push_back(pid);
        if (!pids.empty()) break;
    }
    std::sort(pids.begin(), pids.end());
    return pids;
}

std::string SessionRequests::session_id_of(const json& content) {
    auto it = content.find("session_id");
    if (it == content.end() || !it->is_string() || it->get<std::string>().empty()) {
        throw RequestError{ename::InvalidRequest, "session_id (a string) is required"};
    }
    return it->get<std::string>();
}

SessionProxy& SessionRequests::live(const json& content) {
    const std::string id = session_id_of(content);
    Session* session = service_.sessions().find(id);
    if (!session || !session->proxy()) {
        if (auto record = service_.registry().session(id)) {
            throw RequestError{ename::SessionClosed,
                               "session " + id + " is closed: " + record->close_reason};
        }
        throw RequestError{ename::NoSuchSession, "no session " + id};
    }
    SessionProxy& relay = *session->proxy();
    if (relay.closed()) {
        throw RequestError{ename::SessionClosed,
                           "session " + id + " is closed: " + relay.close_reason()};
    }
    return relay;
}

json SessionRequests::list(const json& content) {
    const bool open_only = content.value("open_only", false);
    json list = json::array();
    for (const auto& s : service_.registry().sessions(open_only, 1000)) {
        json entry = {{"session_id", s.id},
                      {"image", s.image},
                      {"state", s.state},
                      {"created_at", s.created_at},
                      {"executions", s.execution_count},
                      {"close_reason", s.close_reason}};
        if (Session* held = service_.sessions().find(s.id); held && held->proxy()) {
            entry["state"] = held->proxy()->state();
            if (const auto* g = held->proxy()->governor()) entry["executions"] = g->executions();
            if (held->proxy()->lifecycle_state() == SessionState::hibernated) {
                entry["snapshot"] = service_.snapshot(s.id);
            }
            if (const Sandbox* box = held->sandbox()) {
                entry["container_id"] = box->container_id();
                entry["pids"] = sandbox_pids(box->container_id());
            }
        }
        list.push_back(entry);
    }
    json reply = service_.backend_inventory();
    reply["status"] = "ok";
    reply["sessions"] = std::move(list);
    return reply;
}

json SessionRequests::info(const json& content) {
    const std::string id = session_id_of(content);
    const auto record = service_.registry().session(id);
    if (!record) throw RequestError{ename::NoSuchSession, "no session " + id};
    json info = {{"status", "ok"},
                 {"session_id", id},
                 {"image", record->image},
                 {"image_id", record->image_id},
                 {"state", record->state},
                 {"created_at", record->created_at},
                 {"closed_at", record->closed_at},
                 {"close_reason", record->close_reason},
                 {"limits", record->limits},
                 {"metadata", record->metadata},
                 {"executions", record->execution_count},
                 {"host_ids", {{"base", record->host_id_base}, {"count", record->host_id_count}}}};
    if (record->state == "closed") {
        // What the session used over its life, kept at the close.
        info["usage"] = {{"memory_peak_bytes", record->memory_peak_bytes},
                         {"cpu_ms", record->cpu_ms}};
    }
    if (SessionProxy* live = service_.sessions().live(id)) {
        SessionProxy& s = *live;
        info["state"] = s.state();
        if (const auto* g = s.governor()) {
            info["executions"] = g->executions();
            info["executions_left"] = g->executions_left();
        }
        if (s.lifecycle_state() == SessionState::hibernated) {
            const json snapshot = service_.snapshot(id);
            info["snapshot_bytes"] = snapshot.is_object() ? snapshot["bytes"] : json(0);
            info["snapshot"] = snapshot;
        }
        if (Sandbox* box = s.sandbox()) {
            const auto u = box->usage();
            info["usage"] = {{"memory_bytes", u.memory_bytes},
                             {"memory_peak_bytes", u.memory_peak_bytes},
                             {"cpu_ms", u.cpu_ns / 1000000}};
        }
    }
    return info;
}

json SessionRequests::close(const json& content) {
    SessionProxy& s = live(content);
    s.close("closed_by_request");
    return {{"status", "ok"}, {"session_id", s.session_id()}};
}

json SessionRequests::history(const json& content) {
    const std::string id = session_id_of(content);
    const SessionStore& registry = service_.registry();
    const auto record = registry.session(id);
    if (!record) throw RequestError{ename::NoSuchSession, "no session " + id};
    json executions = json::array();
    for (const auto& e : registry.executions(id)) {
        executions.push_back({{"count", e.count},
                              {"msg_id", e.msg_id},
                              {"code", e.code},
                              {"status", e.status},
                              {"ename", e.ename},
                              {"started_at", e.started_at},
                              {"wall_ms", e.wall_ms},
                              {"cpu_ms", e.cpu_ms},
                              {"memory_peak_bytes", e.memory_peak_bytes},
                              {"output_bytes", e.output_bytes},
                              {"truncated", e.truncated}});
    }
    json events = json::array();
    for (const auto& e : registry.events(id)) {
        events.push_back({{"at", e.at}, {"kind", e.kind}, {"detail", e.detail}});
    }
    return {{"status", "ok"},
            {"session_id", id},
            {"image", record->image},
            {"image_id", record->image_id},
            {"state", record->state},
            {"close_reason", record->close_reason},
            {"memory_peak_bytes", record->memory_peak_bytes},
            {"cpu_ms", record->cpu_ms},
            {"executions", executions},
            {"events", events}};
}

}  // namespace cellblock
