// A planned restart (docs/restarts.md, phase 1): on SIGHUP the server stops
// taking new work, hibernates every session (idle ones at once, busy ones
// when their execution ends, bounded by --takeover-wait), writes one sealed
// row per session to the registry and execs its binary again. The new
// process reads the rows, binds each session's five ports with the same key,
// and holds the session hibernated: its client's next request (or the ones
// it sent meanwhile, carried in the row) wakes it, as after
// hibernate_after_s.
//
// With adoption on (--adopt-grace, session_adoption.cpp), SIGHUP hibernates
// only the sessions whose sandboxes cannot be adopted (runsc's): the others,
// busy ones included, are left running with a fresh live row, as a crash
// would leave them, and the exec'd process adopts them within a second or
// two instead of waking each from its snapshot.
//
// A row is CBOR sealed under the server key (server_key.hpp) with the label
// "handover/<session>": the client's key and the snapshot's key never sit
// in the state dir in the clear. Whatever cannot be carried is named: a
// session that could not hibernate is closed `server_restart: <why>`, one
// that cannot be taken back `restore_failed: <why>`.
//
// Why one file of about 550 lines: both halves of a restart are here, the
// leaving process's (begin, settle, write the rows, leave sandboxes running)
// and the new one's (read the rows, take each session back), so that the
// row's fields are written and read side by side; a field added to one half
// and not the other is a restart that silently loses it. The parts that
// stand alone are apart: adoption (session_adoption.cpp), the carried
// requests' frames (carried_frames.hpp), the sealing (server_key.cpp).
#include <fmt/format.h>

#include "carried_frames.hpp"
#include "server.hpp"
#include "server_key.hpp"

namespace cellblock {

namespace {

constexpr const char* kServerRow = "@server";
constexpr int kHandoverVersion = 1;

std::string row_label(const std::string& name) { return "handover/" + name; }

}  // namespace

json frames_json(const std::vector<std::string>& frames) {
    json out = json::array();
    for (const auto& frame : frames) {
        out.push_back(json::binary(std::vector<std::uint8_t>(frame.begin(), frame.end())));
    }
    return out;
}

std::vector<std::string> frames_of(const json& frames) {
    std::vector<std::string> out;
    for (const auto& frame : frames) {
        const auto& bytes = frame.get_binary();
        out.emplace_back(bytes.begin(), bytes.end());
    }
    return out;
}

Channel channel_named(const std::string& name) {
    for (Channel c : {Channel::shell, Channel::control, Channel::stdin_, Channel::iopub}) {
        if (name == channel_name(c)) return c;
    }
    throw std::runtime_error("no channel '" + name + "'");
}

ProxyOptions Server::proxy_options(const std::string& session_id, const SessionLimits& limits) {
    ProxyOptions opts;
    opts.policy = &options_.policy;
    opts.limits = limits;
    opts.observer = this;
    opts.audit_code_hash_only = options_.audit_code_hash_only;
    opts.client_transport = options_.client_transport;
    SandboxPool* pool = pool_.get();
    opts.dispose = [pool](std::unique_ptr<Sandbox> box) { pool->dispose(std::move(box)); };
    opts.on_expired = [this, id = session_id] { expired_.push_back(id); };
    opts.keep_snapshot = [this, id = session_id](Sandbox& box, const json& report,
                                                 SessionIo::Moved done) {
        keep_snapshot(id, box, report, std::move(done));
    };
    opts.saving_snapshot = [this, id = session_id](Sandbox& box) { begin_streamed_keep(id, box); };
    opts.snapshot_unsaved = [this, id = session_id] { drop_streamed_keep(id); };
    opts.wake = [this, id = session_id] { wake_session(id); };
    opts.fetch_snapshot = [this, id = session_id](SessionIo::Moved done) {
        fetch_snapshot(id, std::move(done));
    };
    opts.place_snapshot = [this, id = session_id](SessionIo::Moved done) {
        place_snapshot(id, std::move(done));
    };
    // The exact level, for a sandbox that can (SessionIo::exact_level); not
    // with a way out through the egress gateway, a host socket in the
    // sandbox: such a session hibernates at the namespace level.
    if (snapshots_ && !limits.network.gateway()) {
        opts.checkpoint = [this, id = session_id](std::unique_ptr<Sandbox> box,
                                                  SessionIo::Checkpointed done) {
            checkpoint_session(id, std::move(box), std::move(done));
        };
    }
    opts.snapshot_exact = [this, id = session_id] {
        const auto info = snapshots_ ? snapshots_->info(id) : std::nullopt;
        return info && info->exact;
    };
    opts.hold_for_record = server_key_ && settings_.adopt_grace_ms > 0;
    return opts;
}

bool Server::begin_handover() {
    try {
        server_key_ = load_server_key(options_.key_file, true);
    } catch (const std::exception& e) {
        spdlog::error(
            "cellblock serve: {}: the sessions cannot be handed over ({}); the "
            "server goes on",
            handover_signal_, e.what());
        return false;
    }
    handing_over_ = true;
    handover_deadline_ =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(
                           std::chrono::duration<double>(options_.takeover_wait_s));
    spdlog::info(
        "cellblock serve: {}: handing {} session(s) to the next start (at most {:g} s "
        "for busy ones)",
        handover_signal_, sessions_.live_count(), options_.takeover_wait_s);
    // Creates still waiting for a sandbox are answered: their clients try
    // again, and the next start serves them. Wakes go on (they hibernate again).
    for (auto it = creating_.begin(); it != creating_.end();) {
        if (!it->second.resume_of.empty()) {
            ++it;
            continue;
        }
        fail_create(it->second, ename::ServerRestarting,
                    "the server is restarting (" + handover_signal_ + "); send the create again");
        release_cold_start(it->second.ticket, it->second.kind);
        it = creating_.erase(it);
    }
    leave_running_.clear();
    for (auto& [id, session] : sessions_) {
        if (leaves_running(session)) leave_running_.insert(id);
    }
    settle_handover();
    if (!leave_running_.empty()) {
        spdlog::info("cellblock serve: {}: {} session(s) left running for the next start to adopt",
                     handover_signal_, leave_running_.size());
    }
    return true;
}

bool Server::leaves_running(const Session& session) const {
    if (!exec_after_handover_ || !server_key_ || settings_.adopt_grace_ms <= 0) return false;
    const SessionProxy* relay = session.proxy();
    if (!relay || relay->closed()) return false;
    const SessionState state = relay->lifecycle_state();
    if (state != SessionState::idle && state != SessionState::busy) return false;
    const Sandbox* box = relay->sandbox();
    return box && box->adoption_record().has_value();
}

void Server::settle_handover() {
    // Those left running take no new work either: what comes waits in the
    // session, is named by its row, and is sent again to the kernel by the
    // next start once its clients are back (their outputs reach them).
    for (auto& [id, session] : sessions_) {
        SessionProxy* relay = session.proxy();
        if (relay && !relay->closed() && !relay->handing_over()) {
            relay->hand_over(!leave_running_.count(id));
        }
    }
}

bool Server::handover_ready(Clock::time_point now) const {
    if (now >= handover_deadline_) return true;
    for (const auto& [id, session] : sessions_) {
        const SessionProxy* relay = session.proxy();
        if (relay && !relay->handover_settled()) return false;
    }
    return true;
}

std::size_t Server::put_asleep_row(const std::string& id, Session& session, SessionProxy& relay,
                                   double now_unix, bool durable) {
    const HandoverState state = relay.handover_state();
    const SessionOrigin& origin = session.origin();
    const auto info = snapshots_->info(id);
    json requests = json::array();
    for (const auto& request : state.requests) {
        requests.push_back(
            {{"channel", channel_name(request.channel)}, {"frames", frames_json(request.frames)}});
    }
    const std::string key = snapshots_->key_bytes(id);
    json body = {{"version", kHandoverVersion},
                 {"session_id", id},
                 {"image", session.image()},
                 {"image_id", origin.image.content_id},
                 {"runtime", origin.image.runtime},
                 {"limits", origin.limits.to_json()},
                 {"connection", relay.outer_connection().to_json()},
                 {"executions", state.executions},
                 {"age_s", state.age_s},
                 {"idle_s", state.idle_s},
                 {"cpu_ms", state.cpu_ms},
                 {"memory_peak_bytes", state.memory_peak_bytes},
                 {"network_bytes", state.network_bytes},
                 {"snapshot",
                  {{"key", json::binary(std::vector<std::uint8_t>(key.begin(), key.end()))},
                   {"bytes", info ? info->bytes : 0},
                   {"kept_at", info ? info->kept_at : 0.0}}},
                 {"requests", std::move(requests)}};
    const auto bytes = json::to_cbor(body);
    store_.put_handover(
        {id,
         seal(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()),
              *server_key_, row_label(id)),
         now_unix},
        durable);
    return state.requests.size();
}

void Server::record_asleep(const std::string& id) {
    // Only with a server key: the row holds the client's and the snapshot's keys.
    if (!server_key_ || !snapshots_) return;
    Session* session = sessions_.find(id);
    SessionProxy* relay = session ? session->proxy() : nullptr;
    if (!relay || relay->closed() || !snapshots_->info(id)) return;
    try {
        put_asleep_row(id, *session, *relay, unix_now(), true);
        asleep_recorded_.insert(id);
    } catch (const std::exception& e) {
        spdlog::warn("session {}: no record to take it back by after a crash: {}", id, e.what());
    }
}

void Server::forget_asleep(const std::string& id) {
    if (asleep_recorded_.erase(id) == 0) return;
    try {
        store_.remove_handover(id);
    } catch (const std::exception& e) {
        spdlog::warn("session {}: its hibernation row: {}", id, e.what());
    }
}

void Server::write_handover() {
    const double now_unix = unix_now();
    json server_row = {{"version", kHandoverVersion},
                       {"manager_endpoint", manager_.endpoint()},
                       {"manager_key", manager_.key()}};
    try {
        const auto bytes = json::to_cbor(server_row);
        store_.put_handover(
            {kServerRow,
             seal(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()),
                  *server_key_, row_label(kServerRow)),
             now_unix});
    } catch (const std::exception& e) {
        spdlog::error("cellblock serve: handover: the manager's row: {}", e.what());
    }
    std::vector<std::string> ids, running;
    for (const auto& [id, session] : sessions_) ids.push_back(id);
    std::size_t handed = 0;
    for (const auto& id : ids) {
        Session& session = *sessions_.find(id);
        SessionProxy* relay = session.proxy();
        if (!relay || relay->closed()) continue;
        if (leave_running_.count(id) && leaves_running(session)) {
            running.push_back(id);
            continue;
        }
        if (relay->lifecycle_state() != SessionState::hibernated) {
            const auto refused = handover_refusals_.find(id);
            const std::string why = refused != handover_refusals_.end()
                                        ? "it could not hibernate: " + refused->second
                                        : fmt::format("still {} after --takeover-wait {:g} s",
                                                      relay->state(), options_.takeover_wait_s);
            spdlog::warn("session {}: not handed over: {}", id, why);
            relay->close("server_restart: " + why, ename::ServerShuttingDown,
                         "the server restarted and the session could not be handed over");
            continue;
        }
        try {
            const std::size_t carried = put_asleep_row(id, session, *relay, now_unix);
            store_.add_event(
                {id, now_unix, "handed_over",
                 fmt::format("to the server's next start; {} request(s) carried", carried)});
            ++handed;
            // Gone from this process without a close, its sockets at once
            // (what a client sends from now waits in the client for the
            // next start): the registry's row stays open (hibernated), the
            // snapshot stays on disk.
            sessions_.erase(id);
        } catch (const std::exception& e) {
            spdlog::error("session {}: not handed over: {}", id, e.what());
            store_.remove_handover(id);
            relay->close(std::string("server_restart: the handover failed: ") + e.what(),
                         ename::ServerShuttingDown, "the server restarted");
        }
    }
    const std::size_t left = leave_running(running);
    spdlog::info("cellblock serve: {} session(s) handed over ({} left running, {} hibernated)",
                 handed + left, left, handed);
}

namespace {

// How long a left-running session's clients get to close their half-closed
// connections (libzmq sees the end at once, and connects again).
constexpr std::chrono::milliseconds kClientsCloseWait{1000};

// The sandboxes left running for the next start: held here, never
// destroyed (their destructors would end them). The exec closes their
// descriptors (lifelines, locks, leases: all close-on-exec), as a crash
// would, and the next start adopts them. Reachable, so not a leak to LSan.
std::vector<std::unique_ptr<Sandbox>>& left_for_the_next_start() {
    static auto* kept = new std::vector<std::unique_ptr<Sandbox>>();
    return *kept;
}

}  // namespace

std::size_t Server::leave_running(const std::vector<std::string>& ids) {
    if (ids.empty()) return 0;
    const auto relay_of = [this](const std::string& id) -> SessionProxy* {
        SessionProxy* relay = sessions_.live(id);
        return relay && !relay->closed() ? relay : nullptr;
    };
    // Their rows as they are now; only then does what the relays held for
    // them go out (the rule of ProxyOptions::hold_for_record).
    live_dirty_.insert(ids.begin(), ids.end());
    flush_live();
    // What they owe their clients is written before the sockets close. A
    // turn meanwhile may relay more: its rows are written at its end.
    const auto until = Clock::now() + kShutdownFlush;
    const auto unsent = [&] {
        return std::any_of(ids.begin(), ids.end(), [&](const std::string& id) {
            const SessionProxy* relay = relay_of(id);
            return relay && relay->unsent();
        });
    };
    while (unsent() && Clock::now() < until) {
        loop_.run_once(std::chrono::milliseconds(20));
        audit_.flush();
        flush_live();
    }
    // A request a client writes as its connection closes is lost with it (the
    // client's libzmq counts it sent). So each client of a settled session
    // is told first (its connections half-closed: the ZMTP transport): what
    // it sent before it saw that is read here and waits in the session,
    // until it has closed its end; then nothing more can come on them. A
    // session still busy is not told: its reply may yet be sent.
    std::vector<std::string> told;
    for (const auto& id : ids) {
        SessionProxy* relay = relay_of(id);
        if (relay && relay->handover_settled()) {
            relay->half_close_clients();
            told.push_back(id);
        }
    }
    const auto sending = [&] {
        return std::any_of(told.begin(), told.end(), [&](const std::string& id) {
            const SessionProxy* relay = relay_of(id);
            return relay && relay->clients_sending();
        });
    };
    for (const auto until_closed = Clock::now() + kClientsCloseWait;
         sending() && Clock::now() < until_closed;) {
        loop_.run_once(std::chrono::milliseconds(10));
    }
    std::size_t left = 0;
    for (const auto& id : ids) {
        Session* session = sessions_.find(id);
        SessionProxy* relay = relay_of(id);
        if (!session || !relay) continue;  // closed meanwhile: shut_down finishes it
        live_dirty_.erase(id);
        // What already waits in its sockets waits in the session, and its
        // row names it. The row is made now, the sockets close right after
        // (the session is erased), and the row is written then: for a
        // session whose clients were not told (still busy), a request that
        // reaches a socket between this read and the close is lost with the
        // connection, so the two are kept as close as they can be.
        relay->read_waiting_requests();
        std::optional<HandoverRow> row;
        std::string why;
        const auto make_row = [&] {
            row.reset();
            try {
                row = live_row_of(id);
            } catch (const std::exception& e) {
                why = e.what();
            }
            if (!row && why.empty()) why = "it has no record to be adopted by";
        };
        if (!leaves_running(*session)) {
            why = "it was " + relay->state() + " at the exec";
        } else {
            make_row();
        }
        if (row && relay->unsent()) {
            // Answers it gave meanwhile (is_complete_request): they go out
            // only after the row that names what is open (hold_for_record).
            if (!put_live_row(*row)) why = "its record for the next start could not be written";
            relay->release_held();
            for (const auto until = Clock::now() + kShutdownFlush;
                 relay->unsent() && Clock::now() < until;) {
                loop_.run_once(std::chrono::milliseconds(20));
            }
            relay->read_waiting_requests();
            if (why.empty()) make_row();
        }
        if (!row || !why.empty()) {
            spdlog::warn("session {}: not handed over: {}", id, why);
            relay->close("server_restart: " + why, ename::ServerShuttingDown,
                         "the server restarted and the session could not be handed over");
            continue;
        }
        left_for_the_next_start().push_back(relay->leave_running());
        // Gone from this process without a close, its sockets at once, as a
        // handed-over session's; its row stays for the next start.
        sessions_.erase(id);
        if (put_live_row(*row)) {
            store_.add_event({id, unix_now(), "handed_over",
                              "left running: the server's next start adopts its sandbox"});
            ++left;
        } else {
            // Its sandbox runs on; the next start adopts it by its last row
            // (the requests that came since are not in it), or reaps it.
            spdlog::error(
                "session {}: its record for the next start could not be written: requests "
                "it received since its last record are lost",
                id);
        }
        live_recorded_.erase(id);
    }
    return left;
}

std::set<std::string> Server::handed_over_sessions() const {
    std::set<std::string> names;
    for (const auto& row : store_.handovers()) {
        if (row.name != kServerRow && !live_row(row)) names.insert(row.name);
    }
    return names;
}

std::string Server::take_over_manager(std::vector<HandoverRow>& rows) {
    auto row = std::find_if(rows.begin(), rows.end(),
                            [](const HandoverRow& r) { return r.name == kServerRow; });
    if (row == rows.end()) {
        if (adopting_.empty() && rows.empty()) return {};
        // A crash (no handover): the sessions adopted, and those hibernated
        // at the crash, keep their clients, and those clients the manager's
        // endpoint and key the dead server's server.json still holds
        // (root's, 0600).
        try {
            std::ifstream in(server_file(settings_.state_dir));
            const json last = json::parse(in);
            manager_.set_key(last.at("key").get<std::string>());
            if (options_.manager_endpoint.find('*') != std::string::npos) {
                return last.at("manager").get<std::string>();
            }
        } catch (const std::exception& e) {
            spdlog::warn("the last server's server.json: {}; new manager endpoint and key",
                         e.what());
        }
        return {};
    }
    std::string endpoint;
    try {
        if (!server_key_) throw std::runtime_error(server_key_error_);
        const std::string plain = open_sealed(row->sealed, *server_key_, row_label(kServerRow));
        const json manager = json::from_cbor(plain);
        // The clients hold the last server's manager endpoint and key.
        if (options_.manager_endpoint.find('*') != std::string::npos) {
            endpoint = manager.at("manager_endpoint").get<std::string>();
        }
        manager_.set_key(manager.at("manager_key").get<std::string>());
    } catch (const std::exception& e) {
        spdlog::warn("handover: the manager's row: {}; new manager endpoint and key", e.what());
    }
    store_.remove_handover(kServerRow);
    rows.erase(row);
    return endpoint;
}

void Server::take_over_sessions(const std::vector<HandoverRow>& rows) {
    for (const auto& row : rows) {
        std::string why;
        try {
            take_over_session(row);
        } catch (const std::exception& e) {
            why = e.what();
        }
        if (why.empty()) {
            // Its row stays until it resumes: a crash takes it back too.
            asleep_recorded_.insert(row.name);
            continue;
        }
        store_.remove_handover(row.name);
        spdlog::error("session {}: not taken over: {}", row.name, why);
        if (SessionProxy* relay = sessions_.live(row.name)) {
            relay->close("restore_failed: " + why);  // its clients are told, then it expires
        } else {
            snapshots_->remove(row.name);
            try {
                store_.close_session(row.name, "restore_failed: " + why, unix_now(), 0, 0, 0);
                store_.add_event({row.name, unix_now(), "closed", "restore_failed: " + why});
            } catch (const std::exception& e) {
                spdlog::error("session {}: registry: {}", row.name, e.what());
            }
        }
    }
}

void Server::take_over_session(const HandoverRow& row) {
    if (!server_key_) throw std::runtime_error(server_key_error_);
    json body;
    try {
        body = json::from_cbor(open_sealed(row.sealed, *server_key_, row_label(row.name)));
    } catch (const std::exception& e) {
        throw std::runtime_error(std::string("its handover row: ") + e.what());
    }
    if (body.value("version", 0) != kHandoverVersion || body.value("session_id", "") != row.name) {
        throw std::runtime_error("its handover row is not one this server reads");
    }
    const std::string& id = row.name;
    const std::string image_name = body.at("image").get<std::string>();
    const SessionLimits limits = options_.policy.effective(json::object(), body.at("limits"));
    const ConnectionInfo outer = ConnectionInfo::from_json(body.at("connection"));
    // The same five ports and key: the clients reconnect by themselves. From
    // here a failure closes the session on them (take_over_sessions), so its
    // clients are told why.
    auto proxy =
        std::make_unique<SessionProxy>(context_, loop_, id, outer, proxy_options(id, limits));
    SessionProxy& relay = *proxy;
    Session& held = sessions_.add(Session(id, image_name, std::move(proxy)));
    auto image = images_.find(image_name);
    if (image == images_.end()) throw std::runtime_error("no image '" + image_name + "' any more");
    Image resolved = resolve_image(image->second, image_store_);
    if (resolved.content_id != body.value("image_id", "")) {
        spdlog::warn("session {}: image {} moved from {} to {} meanwhile; it wakes on the new one",
                     id, image_name, body.value("image_id", ""), resolved.content_id);
    }
    Image image_def = resolved;
    image_def.runtime = body.at("runtime").get<std::string>();
    held.origin() = origin_of(image_name, image_def, resolved, limits);
    const json& snapshot = body.at("snapshot");
    const auto& key = snapshot.at("key").get_binary();
    snapshots_->adopt(
        id, std::string(key.begin(), key.end()),
        {snapshot.at("bytes").get<std::uint64_t>(), snapshot.at("kept_at").get<double>()});
    HandoverState state;
    state.executions = body.at("executions").get<std::int64_t>();
    // The lifetime is wall-clock time, the server's downtime included; idle
    // time is not (the client could not reach the session meanwhile).
    state.age_s = body.at("age_s").get<double>() + std::max(0.0, unix_now() - row.made_at);
    state.idle_s = body.at("idle_s").get<double>();
    state.cpu_ms = body.at("cpu_ms").get<std::uint64_t>();
    state.memory_peak_bytes = body.at("memory_peak_bytes").get<std::uint64_t>();
    state.network_bytes = body.at("network_bytes").get<std::uint64_t>();
    for (const auto& request : body.at("requests")) {
        state.requests.push_back({channel_named(request.at("channel").get<std::string>()),
                                  frames_of(request.at("frames"))});
    }
    relay.take_over(state);
    store_.add_event({id, unix_now(), "taken_over",
                      fmt::format("from the server's last start: hibernated, {} execution(s), {} "
                                  "request(s) carried",
                                  state.executions, state.requests.size())});
    spdlog::info("session {}: taken over (hibernated; ports {}, {} request(s) carried)", id,
                 outer.shell_port, state.requests.size());
    relay.replay(state.requests);
}

}  // namespace cellblock
