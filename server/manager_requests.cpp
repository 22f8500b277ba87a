// The manager's requests that move a session's files or describe the server
// (Server methods, registered on the ManagerApi in server_startup.cpp), and
// what the server gives SessionRequests (session_requests.hpp) of the
// backend.
#include "server.hpp"

namespace cellblock {

json Server::backend_inventory() const {
    // Every sandbox on the host that this server runs besides the sessions':
    // the warm ones waiting in the pool (`runc --root RUNTIME_ROOT list`).
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
    json inventory = {{"warm_sandboxes", warm},
                      {"zygotes", zygotes},
                      {"backend", pool_->backend().name()},
                      {"runtime_root", settings_.runtime_root().string()}};
    if (!nodes.empty()) inventory["nodes"] = nodes;
    // Zygote images whose sessions boot, because this host refuses forking.
    if (!refused.empty()) inventory["zygotes_refused"] = refused;
    return inventory;
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
                      {"warm_imports", image.warm_imports},
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
          {"sandboxes_idle", sandboxes_idle_},
          // Where the sessions holding the CPU are kept (--loud-cpus; null:
          // on every CPU, as the others), and when (--loud-cpus-for).
          {"loud_cpus", options_.loud_cpus.empty() ? json(nullptr) : json(options_.loud_cpus)},
          {"loud_cpus_for", options_.loud_cpus_for == LoudCpusFor::holding ? "holding" : "growing"},
          // Whether the hogging sessions weigh a process each: only while the
          // host's own processes contend (host_contention.hpp), with the last
          // judgement's figures.
          {"host_contended", host_contention_.counted()},
          {"host_contention", host_contention_.why()},
          // Every server's on the host (cpu_demand.hpp), which the weight follows.
          {"host",
           {{"interactive_sessions", host_demand_.interactive},
            {"hogging_sessions", host_demand_.hogging},
            {"servers", host_demand_.servers}}}}},
        {"state_dir", settings_.state_dir.string()}};
}

}  // namespace cellblock
