// session_create: creates wait in order for a warm or cold sandbox, bounded by
// --max-create-wait; the sandbox goes to a SessionProxy on the server's loop.
#include "server.hpp"

namespace cellblock {

SessionOrigin Server::origin_of(const std::string& image_name, const Image& image_def,
                                const Image& resolved, const SessionLimits& limits) const {
    SessionOrigin origin{image_def, limits, {}, false};
    origin.kind = image_name + "@" + image_def.content_id + " on " + image_def.runtime + " " +
                  limits.sandbox.to_json().dump();
    // The pool holds sandboxes of the image's own runtime and pool version only.
    const auto pool_id = pool_image_ids_.find(image_name);
    origin.poolable = image_def.runtime == resolved.runtime && pool_id != pool_image_ids_.end() &&
                      pool_id->second == image_def.content_id;
    return origin;
}

json Server::session_create(Request& r, std::vector<std::string>&) {
    if (handing_over_) {
        throw RequestError{ename::ServerRestarting,
                           "the server is restarting; send the create again"};
    }
    const json& c = r.message.content;
    const std::string image_name = c.contains("image") && c["image"].is_string()
                                       ? c["image"].get<std::string>()
                                       : options_.default_image;
    auto image = images_.find(image_name);
    if (image == images_.end()) {
        std::string known;
        for (const auto& [name, def] : images_) known += (known.empty() ? "" : ", ") + name;
        throw RequestError{ename::UnknownImage,
                           "no image '" + image_name + "'; known images: " + known};
    }
    // A built image runs on its current version (a rebuild moves the name).
    follow_image_version(image_name);
    Image resolved;
    try {
        resolved = resolve_image(image->second, image_store_);
    } catch (const std::exception& e) {
        throw RequestError{ename::ImageNotBuilt, e.what()};
    }
    const json requested = c.contains("limits") ? c["limits"] : json::object();
    if (!requested.is_object() && !requested.is_null()) {
        throw RequestError{ename::InvalidLimits, "limits must be an object"};
    }
    const SessionLimits limits = options_.policy.effective(resolved.limits_json, requested);
    const json metadata = c.contains("metadata") ? c["metadata"] : json::object();
    if (!metadata.is_object())
        throw RequestError{ename::InvalidRequest, "metadata must be an object"};
    // The client's own timeout: past it nobody waits for the session.
    std::optional<double> client_timeout_s;
    if (c.contains("timeout_s") && !c["timeout_s"].is_null()) {
        if (!c["timeout_s"].is_number() || !(c["timeout_s"].get<double>() > 0)) {
            throw RequestError{ename::InvalidRequest,
                               "timeout_s must be a positive number of seconds"};
        }
        client_timeout_s = c["timeout_s"].get<double>();
    }
    // Closed sessions do not count: they hold no sandbox, and their
    // channels are released closed_channels_s after the close.
    const std::size_t open = sessions_.live_count();
    // Wakes of hibernated sessions wait in the same queue; they are counted open.
    const auto creates = static_cast<std::size_t>(
        std::count_if(creating_.begin(), creating_.end(),
                      [](const auto& c) { return c.second.resume_of.empty(); }));
    if (open + creates >= static_cast<std::size_t>(options_.policy.max_sessions)) {
        throw RequestError{ename::TooManySessions,
                           std::to_string(open) + " sessions open and " + std::to_string(creates) +
                               " starting: the server's maximum is " +
                               std::to_string(options_.policy.max_sessions) + " (--max-sessions)"};
    }
    // The image's runtime, or the one the request names (allowlisted, installed).
    Image image_def = resolved;
    if (c.contains("runtime") && !c["runtime"].is_null()) {
        if (!c["runtime"].is_string() || !runtime_allowed(c["runtime"].get<std::string>())) {
            throw RequestError{ename::UnknownRuntime, "runtime must be one of runc, runsc, crun"};
        }
        image_def.runtime = c["runtime"].get<std::string>();
    }
    if (auto refusal = pool_->backend().refuse(image_def)) {
        throw RequestError{std::string(refusal->ename), std::move(refusal->message)};
    }
    PendingCreate pending;
    pending.request = r.message;
    pending.image = image_name;
    pending.limits = limits;
    pending.metadata = metadata;
    pending.started = Clock::now();
    pending.image_id = image_def.content_id;
    pending.image_def = image_def;
    const SessionOrigin origin = origin_of(image_name, image_def, resolved, limits);
    pending.kind = origin.kind;
    pending.client_timeout_s = client_timeout_s;
    const auto wait_bound = std::chrono::duration<double>(options_.policy.max_create_wait_s);
    pending.deadline = pending.started + std::chrono::duration_cast<Clock::duration>(wait_bound);
    if (client_timeout_s) {
        // Leave the reply time to travel before the client gives up.
        const double margin = std::min(1.0, *client_timeout_s / 10);
        const auto client_wait = std::chrono::duration_cast<Clock::duration>(
            std::chrono::duration<double>(*client_timeout_s - margin));
        pending.deadline = std::min(pending.deadline, pending.started + client_wait);
    }
    pending.poolable = origin.poolable;
    // First come, first served: a warm sandbox goes to this create only if
    // no earlier one still waits.
    if (pending.poolable && creating_.empty()) {
        if (WarmSandbox warm = pool_->take(image_name, limits.sandbox)) {
            pending.session_id = warm.sandbox->session_id();
            finish_create(pending, std::move(warm), 0, true);
            return nullptr;
        }
    }
    pending.session_id = make_session_id();
    pending.ticket = pool_->start_cold(pending.session_id, image_def, limits.sandbox);
    creating_.emplace(next_create_++, std::move(pending));
    serve_from_pool();
    return nullptr;  // answered when a sandbox is up
}

void Server::serve_from_pool() {
    for (auto it = creating_.begin(); it != creating_.end();) {
        PendingCreate& pending = it->second;
        WarmSandbox warm;
        if (pending.poolable) warm = pool_->take(pending.image, pending.limits.sandbox);
        if (!warm) {
            ++it;
            continue;
        }
        PendingCreate served = std::move(pending);
        it = creating_.erase(it);
        release_cold_start(served.ticket, served.kind);
        if (served.resume_of.empty()) served.session_id = warm.sandbox->session_id();
        try {
            finish_create(served, std::move(warm), 0, true);
        } catch (const std::exception& e) {
            fail_create(served, ename::ServerError, e.what());
        }
    }
}

void Server::release_cold_start(std::uint64_t ticket, const std::string& kind) {
    if (!pool_->cancel_cold(ticket)) orphan_starts_.emplace(ticket, kind);
}

void Server::hand_out(std::uint64_t ticket, const std::string& kind, StartResult result) {
    // The oldest create of this kind gets the sandbox, whichever create's
    // start it was: starts run side by side and finish in any order.
    auto oldest = std::find_if(creating_.begin(), creating_.end(),
                               [&](const auto& entry) { return entry.second.kind == kind; });
    if (oldest == creating_.end()) {
        spdlog::info("sandbox {}: started for a create that no longer waits; destroyed",
                     result.warm.sandbox->container_id());
        result.warm.channels.reset();
        pool_->dispose(std::move(result.warm.sandbox));
        return;
    }
    PendingCreate served = std::move(oldest->second);
    creating_.erase(oldest);
    if (served.ticket != ticket) {
        // The served create's own start is still under way: the create this
        // sandbox was started for (if it still waits) waits for that one.
        auto mine = std::find_if(creating_.begin(), creating_.end(),
                                 [&](const auto& entry) { return entry.second.ticket == ticket; });
        if (mine != creating_.end()) {
            mine->second.ticket = served.ticket;
        } else {
            release_cold_start(served.ticket, kind);
        }
    }
    if (served.resume_of.empty()) served.session_id = result.warm.sandbox->session_id();
    try {
        finish_create(served, std::move(result.warm), result.start_ms, false);
    } catch (const std::exception& e) {
        fail_create(served, ename::ServerError, e.what());
    }
}

void Server::expire_creates(Clock::time_point now) {
    std::size_t ahead = 0;
    for (auto it = creating_.begin(); it != creating_.end();) {
        PendingCreate& pending = it->second;
        if (pending.deadline > now) {
            ++it;
            ++ahead;
            continue;
        }
        const double waited = std::chrono::duration<double>(now - pending.started).count();
        const std::string queue = std::to_string(creating_.size()) + " creates waiting, " +
                                  std::to_string(ahead) + " ahead of this one";
        std::string evalue;
        if (pending.client_timeout_s && waited < options_.policy.max_create_wait_s) {
            evalue = fmt::format(
                "no sandbox within the client's timeout_s {:g} (waited {:.1f} s; {}); the "
                "session is not created",
                *pending.client_timeout_s, waited, queue);
            spdlog::warn(
                "session_create abandoned: its client gives up after {:g} s ({}); the "
                "sandbox started for it goes to the next create",
                *pending.client_timeout_s, queue);
        } else {
            evalue = fmt::format(
                "no sandbox after {:.1f} s (the server's max_create_wait_s is "
                "{:g}; {})",
                waited, options_.policy.max_create_wait_s, queue);
            spdlog::warn("session_create refused: {}", evalue);
        }
        fail_create(pending, ename::ServerBusy, evalue);
        const std::uint64_t ticket = pending.ticket;
        const std::string kind = pending.kind;
        it = creating_.erase(it);
        release_cold_start(ticket, kind);
    }
}

void Server::finish_create(PendingCreate& pending, WarmSandbox warm, double start_ms,
                           bool warm_start) {
    if (!pending.resume_of.empty()) {
        finish_resume(pending, std::move(warm));
        return;
    }
    std::unique_ptr<EgressTunnel> egress_tunnel;
    if (pending.limits.network.gateway()) {
        // The session's way out (session_egress.cpp).
        try {
            egress_tunnel = open_egress(pending.session_id, *warm.sandbox, pending.limits);
        } catch (const std::exception& e) {
            spdlog::error("session {}: egress gateway: {}", pending.session_id, e.what());
            reply_error(pending.request, ename::ServerError,
                        std::string("the session's egress gateway did not start: ") + e.what());
            pool_->dispose(std::move(warm.sandbox));
            return;
        }
    }
    ConnectionInfo outer;
    outer.transport = "tcp";
    outer.ip = "127.0.0.1";
    outer.key = make_random_key();
    outer.kernel_name = "cellblock-" + pending.image;
    std::shared_ptr<InnerChannels> channels = warm.channels;
    const std::string runtime = warm.sandbox->runtime();
    const HostProcess* host = warm.sandbox->host_process();
    const IdMapping host_ids = host ? host->host_ids() : IdMapping{0, 0};
    auto proxy = std::make_unique<SessionProxy>(context_, loop_, pending.session_id, outer,
                                                proxy_options(pending.session_id, pending.limits));
    proxy->attach(std::move(warm.sandbox), std::move(*channels));

    SessionRecord record;
    record.id = pending.session_id;
    record.image = pending.image;
    record.image_id = pending.image_id;
    record.host_id_base = host_ids.host_base;
    record.host_id_count = host_ids.size;
    record.state = "idle";
    record.created_at = unix_now();
    record.limits = pending.limits.to_json();
    record.metadata = pending.metadata;
    json connection = proxy->outer_connection().to_json();
    spdlog::info("session {}: created ({}, image {}, {})", pending.session_id,
                 warm_start ? "warm" : "cold", pending.image, runtime);
    SessionProxy& session = *proxy;
    Session& held = sessions_.add(Session(pending.session_id, pending.image, std::move(proxy)));
    held.origin() = {pending.image_def, pending.limits, pending.kind, pending.poolable};
    held.egress_tunnel() = std::move(egress_tunnel);
    const double seconds = std::chrono::duration<double>(Clock::now() - pending.started).count();
    const SessionTag tag = tag_of(pending.session_id);
    for (auto* o : observers_) o->created(tag, warm_start, seconds);
    reply(pending.request, {{"status", "ok"},
                            {"session_id", pending.session_id},
                            {"connection", connection},
                            {"limits", pending.limits.to_json()},
                            {"runtime", runtime},
                            {"image", pending.image},
                            {"image_id", pending.image_id},
                            {"warm", warm_start}});
    // The registry is written once the client has its reply (the session
    // is live either way); a session the registry cannot record is closed.
    try {
        store_.add_session(record);
        store_.add_event(
            {pending.session_id, record.created_at, "created",
             (warm_start ? "warm sandbox from the pool"
                         : "cold start in " + std::to_string(static_cast<int>(start_ms)) + " ms") +
                 " on " + runtime +
                 (pending.image_id.empty() ? ""
                                           : ", image " + pending.image + "@" + pending.image_id)});
    } catch (const std::exception& e) {
        spdlog::error("session {}: registry: {}; closing it", pending.session_id, e.what());
        session.close("server_error");
    }
}

void Server::on_pool_results() {
    std::uint64_t count;
    [[maybe_unused]] auto n = ::read(wake_fd_.get(), &count, sizeof count);
    for (auto& result : pool_->drain_results()) {
        auto it = std::find_if(creating_.begin(), creating_.end(), [&](const auto& entry) {
            return entry.second.ticket == result.ticket;
        });
        std::string kind;
        if (it != creating_.end()) {
            kind = it->second.kind;
        } else if (auto orphan = orphan_starts_.find(result.ticket);
                   orphan != orphan_starts_.end()) {
            kind = std::move(orphan->second);
            orphan_starts_.erase(orphan);
        }
        if (!result.warm) {
            if (it == creating_.end()) continue;
            PendingCreate pending = std::move(it->second);
            creating_.erase(it);
            spdlog::error("session {}: the sandbox did not start: {}", pending.session_id,
                          result.error);
            fail_create(pending, ename::SandboxStartFailed, result.error);
            continue;
        }
        hand_out(result.ticket, kind, std::move(result));
    }
    serve_from_pool();  // a refill may have come in
}

}  // namespace cellblock
