// Sessions that outlive a crashed server (docs/restarts.md, phase 2). While a
// session's sandbox runs, the registry holds a "live/<session>" row sealed
// under the server key: its client's connection and key, its image, limits
// and the sandbox's record (RuncSandbox::adoption_record). A server killed
// by anything leaves the rows and the sandboxes: each shim waits
// --adopt-grace for a lifeline. The next start on the state dir opens each
// row, takes its sandbox back (RuncSandbox::adopt: the same init, its lock,
// its host ids, a new lifeline), binds the session's five ports with the
// same key and relays again: the kernel never stopped, so nothing of its
// state is lost. What cannot be adopted is reaped as before and closed
// `server_restart: <why>`.
#include <fmt/format.h>

#include <atomic>

#include "carried_frames.hpp"
#include "cellblock/at_once.hpp"
#include "server.hpp"
#include "server_key.hpp"

namespace cellblock {

namespace {

constexpr const char* kLivePrefix = "live/";
constexpr int kLiveVersion = 1;
// How long a start waits for each adopted sandbox's shim to connect again
// (it tries every kAdoptRetryMs).
constexpr std::chrono::milliseconds kAdoptConnectWait{3000};

std::string live_name(const std::string& id) { return kLivePrefix + id; }

}  // namespace

bool Server::live_row(const HandoverRow& row) { return row.name.rfind(kLivePrefix, 0) == 0; }

void Server::on_requests_changed(const std::string& session_id) { live_dirty_.insert(session_id); }

void Server::flush_live() {
    if (live_dirty_.empty()) return;
    for (const auto& id : live_dirty_) record_live(id);
    // Only now what the rows name goes out (ProxyOptions::hold_for_record).
    for (const auto& id : live_dirty_) {
        Session* session = sessions_.find(id);
        if (SessionProxy* relay = session ? session->proxy() : nullptr) relay->release_held();
    }
    live_dirty_.clear();
}

bool Server::record_live(const std::string& id) {
    std::optional<HandoverRow> row;
    try {
        row = live_row_of(id);
    } catch (const std::exception& e) {
        spdlog::warn("session {}: no record to adopt it by after a crash: {}", id, e.what());
        return false;
    }
    return row && put_live_row(*row);
}

bool Server::put_live_row(const HandoverRow& row) {
    const std::string id = row.name.substr(std::string(kLivePrefix).size());
    try {
        store_.put_handover(row);
        live_recorded_.insert(id);
        return true;
    } catch (const std::exception& e) {
        spdlog::warn("session {}: no record to adopt it by after a crash: {}", id, e.what());
        return false;
    }
}

std::optional<HandoverRow> Server::live_row_of(const std::string& id) const {
    if (!server_key_ || settings_.adopt_grace_ms <= 0) return std::nullopt;
    const Session* session = sessions_.find(id);
    const SessionProxy* relay = session ? session->proxy() : nullptr;
    if (!relay || (relay->lifecycle_state() != SessionState::idle &&
                   relay->lifecycle_state() != SessionState::busy)) {
        return std::nullopt;
    }
    const Sandbox* box = relay->sandbox();
    if (!box) return std::nullopt;
    const auto record = box->adoption_record();
    if (!record) return std::nullopt;
    const SessionOrigin& origin = session->origin();
    json body = {{"version", kLiveVersion},
                 {"session_id", id},
                 {"image", session->image()},
                 {"image_id", origin.image.content_id},
                 {"runtime", origin.image.runtime},
                 {"limits", origin.limits.to_json()},
                 {"connection", relay->outer_connection().to_json()},
                 {"sandbox", *record}};
    // What a crash now would leave open: the requests at the kernel (their
    // clients are answered after the adoption) and those queued for it.
    const HandoverState open = relay->in_flight();
    json in_kernel = json::array();
    for (const auto& request : open.in_kernel) {
        in_kernel.push_back({{"channel", channel_name(request.channel)},
                             {"identities", frames_json(request.identities)},
                             {"msg_type", request.msg_type},
                             {"header", request.header}});
    }
    json queued = json::array();
    for (const auto& request : open.requests) {
        queued.push_back(
            {{"channel", channel_name(request.channel)}, {"frames", frames_json(request.frames)}});
    }
    body["in_kernel"] = std::move(in_kernel);
    body["queued"] = std::move(queued);
    body["answered"] = open.answered;
    body["network_bytes"] = relay->network_bytes();
    const auto bytes = json::to_cbor(body);
    return HandoverRow{
        live_name(id),
        seal(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()),
             *server_key_, live_name(id)),
        unix_now()};
}

void Server::forget_live(const std::string& id) {
    if (live_recorded_.erase(id) == 0) return;
    store_.remove_handover(live_name(id));
}

void Server::adopt_sandboxes(std::vector<HandoverRow>& rows) {
    std::vector<HandoverRow> live;
    for (auto it = rows.begin(); it != rows.end();) {
        if (live_row(*it)) {
            live.push_back(std::move(*it));
            it = rows.erase(it);
        } else {
            ++it;
        }
    }
    // The zygotes the forks came from, each adopted once and held by its
    // forks (null: it could not be, with why).
    std::map<std::string, std::pair<std::shared_ptr<RuncSandbox>, std::string>> zygotes;
    // Every sandbox's lifeline listener first, then each shim's connection:
    // the shims, trying every 100 ms, connect meanwhile, so a start waits
    // about one try for all of them rather than one per sandbox.
    struct Begun {
        std::string id;
        json body;
        RuncSandbox::Adoption adoption;
        double created_at = 0;
        std::int64_t executions = 0;
    };
    std::vector<Begun> begun;
    for (const auto& row : live) {
        // Written again once the session relays (record_live).
        store_.remove_handover(row.name);
        const std::string id = row.name.substr(std::string(kLivePrefix).size());
        try {
            if (!server_key_) throw std::runtime_error(server_key_error_);
            json body;
            try {
                body = json::from_cbor(open_sealed(row.sealed, *server_key_, row.name));
            } catch (const std::exception& e) {
                throw std::runtime_error(std::string("its record: ") + e.what());
            }
            if (body.value("version", 0) != kLiveVersion || body.value("session_id", "") != id) {
                throw std::runtime_error("its record is not one this server reads");
            }
            const auto open = store_.session(id);
            if (!open || open->closed_at > 0) throw std::runtime_error("it is not open");
            const auto image = images_.find(body.at("image").get<std::string>());
            if (image == images_.end()) {
                throw std::runtime_error("no image '" + body.at("image").get<std::string>() +
                                         "' any more");
            }
            Image resolved = resolve_image(image->second, image_store_);
            if (resolved.content_id != body.value("image_id", "")) {
                // The sandbox runs the version it started on: hold that one.
                resolved.content_id = body.value("image_id", "");
                resolved.rootfs.clear();
            }
            const SessionLimits limits =
                options_.policy.effective(json::object(), body.at("limits"));
            const json& record = body.at("sandbox");
            if ((record.value("backend", "") == "swarm") != (swarm_ != nullptr)) {
                throw std::runtime_error("its sandbox ran on another backend than this server's (" +
                                         options_.backend + ")");
            }
            if (swarm_) {
                auto box = swarm_->adopt(id, record, resolved, limits.sandbox);
                spdlog::info("session {}: its service adopted ({})", id, box->container_id());
                adopting_.push_back(
                    {id, std::move(body), std::move(box), open->created_at, open->execution_count});
                continue;
            }
            std::shared_ptr<RuncSandbox> zygote;
            if (const json& from = record.value("forked_from", json()); from.is_object()) {
                zygote = adopt_zygote(from, resolved, limits.sandbox, zygotes);
            }
            auto adoption = RuncSandbox::begin_adoption(id, record, resolved, limits.sandbox,
                                                        settings_, zygote);
            begun.push_back({id, std::move(body), std::move(adoption), open->created_at,
                             open->execution_count});
        } catch (const std::exception& e) {
            spdlog::warn("session {}: not adopted: {}; its sandbox is reaped", id, e.what());
            adopt_failures_[id] = e.what();
        }
    }
    for (auto& b : begun) {
        try {
            auto box = RuncSandbox::finish_adoption(std::move(b.adoption), kAdoptConnectWait);
            spdlog::info("session {}: its sandbox adopted (init pid {})", b.id, box->init_pid());
            adopting_.push_back(
                {b.id, std::move(b.body), std::move(box), b.created_at, b.executions});
        } catch (const std::exception& e) {
            spdlog::warn("session {}: not adopted: {}; its sandbox is reaped", b.id, e.what());
            adopt_failures_[b.id] = e.what();
        }
    }
}

std::shared_ptr<RuncSandbox> Server::adopt_zygote(
    const json& from, const Image& image, const SandboxLimits& limits,
    std::map<std::string, std::pair<std::shared_ptr<RuncSandbox>, std::string>>& zygotes) {
    const std::string id = from.at("session_id").get<std::string>();
    auto known = zygotes.find(id);
    if (known == zygotes.end()) {
        std::pair<std::shared_ptr<RuncSandbox>, std::string> adopted;
        try {
            adopted.first = RuncSandbox::adopt(id, from.at("record"), image, limits, settings_,
                                               kAdoptConnectWait);
            spdlog::info("zygote {} adopted for its forks (init pid {})", id,
                         adopted.first->init_pid());
        } catch (const std::exception& e) {
            adopted.second = e.what();
        }
        known = zygotes.emplace(id, std::move(adopted)).first;
    }
    if (!known->second.first) throw std::runtime_error("its zygote: " + known->second.second);
    return known->second.first;
}

namespace {

// Each adopted kernel is asked kernel_info on control (probe_kernel), all at
// once: a round trip each, one after the other, was about 14 ms a session
// (1.4 s of a 100-session restart). The kernels answer on their own cores;
// this waits for the slowest. Results (or why not) by index.
struct AdoptedChannels {
    std::unique_ptr<InnerChannels> channels;
    std::string error;
};

std::vector<AdoptedChannels> probe_adopted(zmq::context_t& context,
                                           const std::vector<Sandbox*>& sandboxes,
                                           RelayTransport transport,
                                           const std::atomic<bool>& stopping) {
    constexpr std::size_t kMaxProbing = 16;
    std::vector<AdoptedChannels> results(sandboxes.size());
    for_each_at_once(sandboxes.size(), kMaxProbing, [&](std::size_t i) {
        if (!sandboxes[i]) {
            results[i].error = "no sandbox to ask";
            return;
        }
        try {
            // On control: the kernel may still run what the last server sent it.
            results[i].channels = probe_kernel(context, *sandboxes[i], kProbeTimeout, 64 << 20,
                                               &stopping, transport, false, true);
        } catch (const std::exception& e) {
            results[i].error = e.what();
        }
    });
    return results;
}

}  // namespace

void Server::take_over_adopted() {
    std::vector<Sandbox*> sandboxes;
    for (const auto& adopted : adopting_) sandboxes.push_back(adopted.sandbox.get());
    auto probed = probe_adopted(context_, sandboxes, options_.kernel_transport, stopping_);
    for (std::size_t i = 0; i < adopting_.size(); ++i) {
        auto& adopted = adopting_[i];
        const std::string& id = adopted.id;
        try {
            const json& body = adopted.body;
            const std::string image_name = body.at("image").get<std::string>();
            const SessionLimits limits =
                options_.policy.effective(json::object(), body.at("limits"));
            const ConnectionInfo outer = ConnectionInfo::from_json(body.at("connection"));
            auto proxy = std::make_unique<SessionProxy>(context_, loop_, id, outer,
                                                        proxy_options(id, limits));
            SessionProxy& relay = *proxy;
            Session& held = sessions_.add(Session(id, image_name, std::move(proxy)));
            Image image_def = images_.at(image_name);
            Image resolved = image_def;
            try {
                resolved = resolve_image(image_def, image_store_);
            } catch (const std::exception&) {
            }
            image_def = resolved;
            image_def.runtime = body.at("runtime").get<std::string>();
            held.origin() = origin_of(image_name, image_def, resolved, limits);
            HandoverState state;
            state.executions = std::max(adopted.executions, executions_recorded(id));
            // Wall-clock lifetime, the outage included; the idle time starts again.
            state.age_s = std::max(0.0, unix_now() - adopted.created_at);
            for (const auto& request : body.value("in_kernel", json::array())) {
                state.in_kernel.push_back({channel_named(request.at("channel").get<std::string>()),
                                           frames_of(request.at("identities")),
                                           request.at("msg_type").get<std::string>(),
                                           request.at("header")});
            }
            for (const auto& request : body.value("queued", json::array())) {
                state.requests.push_back({channel_named(request.at("channel").get<std::string>()),
                                          frames_of(request.at("frames"))});
            }
            for (const auto& id : body.value("answered", json::array())) {
                if (id.is_string()) state.answered.push_back(id.get<std::string>());
            }
            state.network_bytes = body.value("network_bytes", std::uint64_t{0});
            relay.adopt(state);
            if (!probed[i].channels) throw SandboxError(probed[i].error);
            // The gateway is this server's: the session's way out is made
            // again (a new listener in its ipc dir, or a new tunnel to its
            // task). Without it the session goes on with no network, and
            // its history says so.
            std::string egress_lost;
            if (limits.network.gateway()) {
                try {
                    held.egress_tunnel() = open_egress(id, *adopted.sandbox, limits);
                } catch (const std::exception& e) {
                    egress_lost = e.what();
                    spdlog::error(
                        "session {}: its way out through the egress gateway was not "
                        "restored: {}",
                        id, egress_lost);
                }
            }
            // The balancer starts over with the session (CpuFairness{}): its
            // sandbox starts over too, at the interactive level. A weight, cap
            // or slice the crashed server had set (a demoted session's) would
            // otherwise stay for good, no level change left to undo it.
            if (SandboxCpu* cpu = adopted.sandbox->cpu()) {
                bool idled = false;
                apply_cpu_setting(*adopted.sandbox, *cpu, CpuSetting{}, idled);
                // Whatever this start's options: a sandbox an earlier start
                // made an idle group or kept off a CPU (--cpu-idle,
                // --loud-cpus) is back to a group like any other, on every CPU.
                if (!options_.cpu_idle) cpu->set_cpu_idle(false);
                cpu->set_cpus("");
            }
            relay.attach(std::move(adopted.sandbox), std::move(*probed[i].channels));
            relay.replay(state.requests);  // verified again; they wait for the settle
            store_.add_event(
                {id, unix_now(), "adopted",
                 fmt::format("by the server's next start: its sandbox ran on; {} "
                             "execution(s), {} request(s) open at the kernel, {} "
                             "queued",
                             state.executions, state.in_kernel.size(), state.requests.size()) +
                     (egress_lost.empty()
                          ? std::string()
                          : "; its way out through the egress gateway was not restored (" +
                                egress_lost + "): it has no network now")});
            spdlog::info(
                "session {}: adopted (ports {}..{}, {} execution(s), {} request(s) open at the "
                "kernel, {} queued)",
                id, outer.shell_port, outer.hb_port, state.executions, state.in_kernel.size(),
                state.requests.size());
        } catch (const std::exception& e) {
            spdlog::error("session {}: not adopted: {}", id, e.what());
            if (SessionProxy* relay = sessions_.live(id)) {
                relay->close(std::string("server_restart: not adopted: ") + e.what());
            } else {
                adopt_failures_[id] = e.what();
                if (adopted.sandbox) adopted.sandbox->destroy();
                try {
                    store_.close_session(id,
                                         std::string("server_restart: not adopted: ") + e.what(),
                                         unix_now(), 0, 0, 0);
                } catch (const std::exception& f) {
                    spdlog::error("session {}: registry: {}", id, f.what());
                }
            }
        }
    }
    adopting_.clear();
}

std::int64_t Server::executions_recorded(const std::string& id) const {
    std::int64_t most = 0;
    for (const auto& e : store_.executions(id)) most = std::max(most, e.count);
    return most;
}

}  // namespace cellblock
