// The manager's requests that read or close a session, move its files, or
// describe the server: one Server method each, registered on the ManagerApi
// (manager_api.hpp) in server_startup.cpp.
#include "server.hpp"

namespace cellblock {

std::string Server::session_id_of(const json& content) const {
    auto it = content.find("session_id");
    if (it == content.end() || !it->is_string() || it->get<std::string>().empty()) {
        throw RequestError{ename::InvalidRequest, "session_id (a string) is required"};
    }
    return it->get<std::string>();
}

SessionProxy& Server::live_session(const json& content) {
    const std::string id = session_id_of(content);
    Session* session = sessions_.find(id);
    if (!session || !session->proxy()) {
        if (auto record = store_.session(id)) {
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

json Server::session_list(Request& r, std::vector<std::string>&) {
    const bool open_only = r.message.content.value("open_only", false);
    json list = json::array();
    for (const auto& s : store_.sessions(open_only, 1000)) {
        json entry = {{"session_id", s.id},
                      {"image", s.image},
                      {"state", s.state},
                      {"created_at", s.created_at},
                      {"executions", s.execution_count},
                      {"close_reason", s.close_reason}};
        if (Session* held = sessions_.find(s.id); held && held->proxy()) {
            entry["state"] = held->proxy()->state();
            if (const auto* g = held->proxy()->governor()) entry["executions"] = g->executions();
            if (held->proxy()->lifecycle_state() == SessionState::hibernated) {
                entry["snapshot"] = snapshot_json(s.id);
            }
            if (const Sandbox* box = held->sandbox()) {
                entry["container_id"] = box->container_id();
                entry["pids"] = sandbox_pids(box->container_id());
            }
        }
        list.push_back(entry);
    }
    // Every sandbox on the host that this server runs: the sessions' above,
    // and the warm ones waiting in the pool (`runc --root RUNTIME_ROOT list`).
    json warm = pool_->warm_sandboxes();
    for (auto& box : warm) box["pids"] = sandbox_pids(box["container_id"].get<std::string>());
    // And what the backend runs besides: the zygotes sessions are forked
    // from (docs/zygote.md), or the Swarm's nodes (docs/scale-out.md).
    json zygotes = json::array(), nodes = json::array(), refused = json::array();
    for (auto& extra : pool_->extras()) {
        if (extra.value("kind", "") == "zygote") {
            extra["pids"] = sandbox_pids(extra.value("container_id", ""));
            zygotes.push_back(std::move(extra));
        } else if (extra.value("kind", "") == "zygote_refused") {
            refused.push_back({{"image", extra["image"]}, {"why", extra["why"]}});
        } else {
            nodes.push_back(std::move(extra));
        }
    }
    json reply = {{"status", "ok"},
                  {"sessions", list},
                  {"warm_sandboxes", warm},
                  {"zygotes", zygotes},
                  {"backend", pool_->backend().name()},
                  {"runtime_root", settings_.runtime_root().string()}};
    if (!nodes.empty()) reply["nodes"] = nodes;
    // Zygote images whose sessions boot, because this host refuses forking.
    if (!refused.empty()) reply["zygotes_refused"] = refused;
    return reply;
}

json Server::session_info(Request& r, std::vector<std::string>&) {
    const std::string id = session_id_of(r.message.content);
    const auto record = store_.session(id);
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
    if (SessionProxy* live = sessions_.live(id)) {
        SessionProxy& s = *live;
        info["state"] = s.state();
        if (const auto* g = s.governor()) {
            info["executions"] = g->executions();
            info["executions_left"] = g->executions_left();
        }
        if (s.lifecycle_state() == SessionState::hibernated) {
            info["snapshot_bytes"] = snapshots_->bytes(id);
            info["snapshot"] = snapshot_json(id);
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

json Server::session_close(Request& r, std::vector<std::string>&) {
    SessionProxy& s = live_session(r.message.content);
    s.close("closed_by_request");
    return {{"status", "ok"}, {"session_id", s.session_id()}};
}

json Server::session_history(Request& r, std::vector<std::string>&) {
    const std::string id = session_id_of(r.message.content);
    const auto record = store_.session(id);
    if (!record) throw RequestError{ename::NoSuchSession, "no session " + id};
    json executions = json::array();
    for (const auto& e : store_.executions(id)) {
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
    for (const auto& e : store_.events(id)) {
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

json Server::file_request(Request& r, std::vector<std::string>& buffers) {
    SessionProxy& s = live_session(r.message.content);
    const std::string type = r.message.msg_type();
    const bool in_kernel = files_in_kernel(s);
    if (in_kernel && (type == "file_list_request" || type == "file_get_request" ||
                      type == "file_get_begin_request")) {
        kernel_file_request(r.message);
        return nullptr;  // answered once the kernel's file is here
    }
    auto done =
        transfers_.handle(type, r.message.content, r.buffers, session_files(s), Clock::now());
    if (metrics_) {
        std::uint64_t in = 0, out = 0;
        for (const auto& b : r.buffers) in += b.size();
        for (const auto& b : done.buffers) out += b.size();
        if (in > 0) metrics_->file_bytes("in", "manager", in);
        if (out > 0) metrics_->file_bytes("out", "manager", out);
    }
    if (in_kernel && done.event) {
        // A put landed in the front's copy: answered once the kernel has it.
        put_in_kernel(
            s.session_id(), std::move(done),
            [this, request = r.message](FileTransfers::Reply* put, const FileRequestError* error) {
                if (error) return reply_error(request, error->ename(), error->what());
                reply(request, std::move(put->content));
            });
        return nullptr;
    }
    if (done.event) on_event(s.session_id(), done.event->first, done.event->second);
    buffers = std::move(done.buffers);
    return std::move(done.content);
}

json Server::server_info(Request&, std::vector<std::string>&) {
    // {name: {rootfs, runtime, content_id, size_bytes, built, pool}}: a built
    // image's current version, and the one its pool holds.
    const json pools = pool_->state();
    json images = json::object();
    for (const auto& [name, image] : images_) {
        json entry = {{"rootfs", image.rootfs == "store" ? "store" : image.rootfs},
                      {"runtime", image.runtime},
                      {"preload", image.preload},
                      {"pool", pools.contains(name) ? pools[name] : json(nullptr)}};
        if (image.rootfs == "store") {
            const auto current = image_store_.current(name);
            entry["built"] = current.has_value();
            entry["content_id"] = current ? current->content_id : "";
            entry["size_bytes"] = current ? current->size_bytes() : 0;
            entry["source"] = current ? current->manifest.value("source", "") : "";
            const auto pool_id = pool_image_ids_.find(name);
            entry["pool_content_id"] = pool_id != pool_image_ids_.end() ? pool_id->second : "";
        }
        images[name] = entry;
    }
    const std::size_t open = sessions_.live_count();
    return {
        {"status", "ok"},
        {"implementation", "cellblock"},
        {"version", kVersion},
        {"protocol_version", std::string(kProtocolVersion)},
        {"images", images},
        {"default_image", options_.default_image},
        {"pool", pools},
        {"sessions",
         {{"open", open}, {"starting", creating_.size()}, {"max", options_.policy.max_sessions}}},
        {"policy", options_.policy.to_json()},
        // What the sandboxes' parent cgroup weighs on the host (cpu_fairness.hpp):
        // null until this server has set it.
        {"cpu",
         {{"interactive_sessions", interactive_sessions_},
          {"hogging_sessions", hogging_sessions_},
          {"sandboxes_weight", sandboxes_weight_set_ ? json(sandboxes_weight_) : json(nullptr)},
          // Every server's on the host (cpu_demand.hpp), which the weight follows.
          {"host",
           {{"interactive_sessions", host_demand_.interactive},
            {"hogging_sessions", host_demand_.hogging},
            {"servers", host_demand_.servers}}}}},
        {"state_dir", settings_.state_dir.string()}};
}

}  // namespace cellblock
