// Hibernation, the server's part (docs/hibernation.md): the manager's
// hibernate and resume requests, keeping the snapshot a session's kernel
// wrote before its sandbox goes, and waking it in a new sandbox of the same
// kind (from the pool, or started cold, in the queue of creates).
#include "server.hpp"

namespace cellblock {

json Server::session_hibernate(Request& r, std::vector<std::string>&) {
    SessionProxy& relay = live_session(r.message.content);
    std::string why;
    if (!relay.hibernate(why)) throw RequestError{ename::HibernateFailed, why};
    Session& session = *sessions_.find(relay.session_id());
    if (relay.lifecycle_state() == SessionState::hibernated) {
        return {{"status", "ok"},
                {"session_id", relay.session_id()},
                {"state", "hibernated"},
                {"snapshot_bytes", snapshots_->bytes(relay.session_id())},
                {"snapshot", snapshot_json(relay.session_id())}};
    }
    session.waiting_sleep().push_back(r.message);
    return nullptr;  // answered when the snapshot is kept, or not
}

json Server::session_resume(Request& r, std::vector<std::string>&) {
    SessionProxy& relay = live_session(r.message.content);
    const SessionState state = relay.lifecycle_state();
    if (state == SessionState::idle || state == SessionState::busy) {
        return {{"status", "ok"}, {"session_id", relay.session_id()}, {"state", relay.state()}};
    }
    if (handing_over_) {
        throw RequestError{ename::ServerRestarting,
                           "the server is restarting; the session wakes at its next "
                           "start: send the request again"};
    }
    std::string why;
    if (!relay.resume(why)) throw RequestError{ename::SessionClosed, why};
    sessions_.find(relay.session_id())->waiting_wake().push_back(r.message);
    return nullptr;  // answered when it is awake
}

void Server::keep_snapshot(const std::string& session_id, Sandbox& box, const json& report,
                           SessionIo::Moved done) {
    if (const auto found = streamed_.find(session_id); found != streamed_.end()) {
        const auto streamed = found->second;
        streamed->keeping->written = true;  // the kernel answered: its file is whole
        streamed->done = std::move(done);
        streamed->report = report;
        if (streamed->ended) streamed_keep_ended(streamed);
        return;
    }
    // A swarm task's snapshot was fetched into the front's copy of its files,
    // beside the inputs put there (fetch_snapshot).
    const SandboxFiles* files = box.files();
    const fs::path output = files ? files->output_dir() : remote_files_dir(session_id) / "output";
    const fs::path input = files ? files->input_dir() : remote_files_dir(session_id) / "input";
    std::shared_ptr<SnapshotKeeping> keeping;
    try {
        keeping = snapshots_->begin_keep(session_id, output, input);
    } catch (const std::exception& e) {
        const std::string why = why_not_kept(e);
        return done(&why);
    }
    const auto started = Clock::now();
    background_->run(
        [keeping] { keeping->seal(); },
        [this, keeping, started, report, done = std::move(done)](const std::string& error) {
            kept_or_not(keeping, started, report, error, done);
        });
}

void Server::kept_or_not(const std::shared_ptr<SnapshotKeeping>& keeping, Clock::time_point started,
                         const json& report, const std::string& error,
                         const SessionIo::Moved& done) {
    const Session* session = sessions_.find(keeping->session_id);
    if (!session || !session->live()) {
        snapshots_->abandon(*keeping);  // closed meanwhile: nobody waits
        return;
    }
    std::string why = error;
    if (why.empty()) {
        try {
            log_kept(keeping->session_id, snapshots_->finish_keep(*keeping), report,
                     std::chrono::duration<double, std::milli>(Clock::now() - started).count());
        } catch (const std::exception& e) {
            why = why_not_kept(e);
        }
    } else {
        snapshots_->abandon(*keeping);
    }
    if (!why.empty()) return done(&why);
    close_egress(keeping->session_id);  // its way out was the old sandbox's
    trim_due_ = true;
    done(nullptr);
}

void Server::begin_streamed_keep(const std::string& session_id, Sandbox& box) {
    const SandboxFiles* files = box.files();
    if (!files || !snapshots_) return;  // a swarm task's comes through its kernel
    drop_streamed_keep(session_id);
    auto streamed = std::make_shared<StreamedKeep>();
    try {
        // Its wait is bounded by the session's own: the save's timeout drops it.
        streamed->keeping = snapshots_->begin_streamed_keep(
            session_id, files->output_dir(), files->input_dir(), std::chrono::hours(1));
    } catch (const std::exception& e) {
        // Ended at once: keep_snapshot() answers with why.
        streamed->ended = true;
        streamed->error = why_not_kept(e);
        streamed_[session_id] = streamed;
        return;
    }
    streamed->started = Clock::now();
    streamed_[session_id] = streamed;
    background_->run(
        [keeping = streamed->keeping] {
            try {
                keeping->seal();
            } catch (const std::exception& e) {
                throw std::runtime_error(why_not_kept(e));  // StorageFull named as such
            }
        },
        [this, streamed](const std::string& error) {
            streamed->ended = true;
            streamed->error = error;
            streamed_keep_ended(streamed);
        });
}

void Server::streamed_keep_ended(const std::shared_ptr<StreamedKeep>& streamed) {
    if (streamed->dropped) {
        if (streamed->keeping) snapshots_->abandon(*streamed->keeping);
        return;
    }
    if (!streamed->done) return;  // the kernel has not answered yet
    for (auto it = streamed_.begin(); it != streamed_.end(); ++it) {
        if (it->second == streamed) {
            streamed_.erase(it);
            break;
        }
    }
    if (!streamed->keeping) return (*streamed->done)(&streamed->error);
    kept_or_not(streamed->keeping, streamed->started, streamed->report, streamed->error,
                *streamed->done);
}

void Server::drop_streamed_keep(const std::string& session_id) {
    const auto found = streamed_.find(session_id);
    if (found == streamed_.end()) return;
    const auto streamed = found->second;
    streamed_.erase(found);
    streamed->dropped = true;
    if (!streamed->keeping) return;
    streamed->keeping->cancelled = true;
    if (streamed->ended) snapshots_->abandon(*streamed->keeping);
}

json Server::snapshot_json(const std::string& session_id) const {
    const auto info = snapshots_->info(session_id);
    if (!info) return nullptr;
    return {{"bytes", info->bytes},
            {"kept_at", info->kept_at},
            {"age_s", std::max(0.0, unix_now() - info->kept_at)},
            {"level", info->exact ? "exact" : "namespace"}};
}

void Server::wake_session(const std::string& session_id) {
    Session* session = sessions_.find(session_id);
    if (!session || !session->live()) return;
    if (const auto info = snapshots_ ? snapshots_->info(session_id) : std::nullopt;
        info && info->exact) {
        return wake_exact(session_id);
    }
    const SessionOrigin& origin = session->origin();
    PendingCreate pending;
    pending.resume_of = session_id;
    pending.session_id = session_id;
    pending.image = session->image();
    pending.limits = origin.limits;
    pending.image_id = origin.image.content_id;
    pending.kind = origin.kind;
    pending.poolable = origin.poolable;
    pending.started = Clock::now();
    pending.deadline =
        pending.started + std::chrono::duration_cast<Clock::duration>(
                              std::chrono::duration<double>(options_.policy.max_create_wait_s));
    // A wake goes before creates: its client already waits on a request.
    if (pending.poolable) {
        if (WarmSandbox warm = pool_->take(pending.image, pending.limits.sandbox)) {
            finish_resume(pending, std::move(warm));
            return;
        }
    }
    pending.ticket = pool_->start_cold(make_session_id(), origin.image, origin.limits.sandbox);
    creating_.emplace(next_create_++, std::move(pending));
}

void Server::finish_resume(PendingCreate& pending, WarmSandbox warm) {
    Session* session = sessions_.find(pending.resume_of);
    SessionProxy* relay = session ? session->proxy() : nullptr;
    if (!relay || relay->closed() || relay->lifecycle_state() != SessionState::resuming) {
        pool_->dispose(std::move(warm.sandbox));  // closed meanwhile
        return;
    }
    // A swarm task's snapshot goes through its kernel once it is attached
    // (place_snapshot); here, into its sandbox's directory, off the loop.
    const SandboxFiles* files = warm.sandbox->files();
    if (!files) return attach_resumed(pending.resume_of, pending.limits, std::move(warm), "");
    std::shared_ptr<SnapshotPlacing> placing;
    std::optional<std::uint64_t> followed;
    try {
        placing = snapshots_->begin_place(pending.resume_of, files->input_dir());
        followed = placing->follow();
    } catch (const std::exception& e) {
        return attach_resumed(pending.resume_of, pending.limits, std::move(warm), e.what());
    }
    if (followed) {
        // The kernel reads the snapshot while it is opened (its first bytes
        // hold the namespace): the opening no longer comes before the
        // kernel's restore (35-50 ms of a 100 MB wake, docs/hibernation.md).
        background_->run([placing] { placing->open(); },
                         [this, id = pending.resume_of](const std::string& error) {
                             if (SessionProxy* woken = sessions_.live(id)) {
                                 woken->snapshot_placed(error);
                             }
                         });
        relay->placing_snapshot(*followed);
        return attach_resumed(pending.resume_of, pending.limits, std::move(warm), "");
    }
    auto held = std::make_shared<WarmSandbox>(std::move(warm));
    background_->run(
        [placing] { placing->open(); },
        [this, held, id = pending.resume_of, limits = pending.limits](const std::string& error) {
            attach_resumed(id, limits, std::move(*held), error);
        });
}

void Server::attach_resumed(const std::string& session_id, const SessionLimits& limits,
                            WarmSandbox warm, const std::string& failed) {
    Session* session = sessions_.find(session_id);
    SessionProxy* relay = session ? session->proxy() : nullptr;
    if (!relay || relay->closed() || relay->lifecycle_state() != SessionState::resuming) {
        pool_->dispose(std::move(warm.sandbox));  // closed meanwhile
        return;
    }
    try {
        if (!failed.empty()) throw std::runtime_error(failed);
        if (limits.network.gateway()) {
            session->egress_tunnel() = open_egress(session_id, *warm.sandbox, limits);
        }
    } catch (const std::exception& e) {
        pool_->dispose(std::move(warm.sandbox));
        relay->close(std::string("resume_failed: ") + e.what());
        return;
    }
    spdlog::info("session {}: waking in sandbox {}", session_id, warm.sandbox->container_id());
    // A new sandbox at the pool's setting: the balancer starts over with it
    // (a demotion of the old one is not carried to a sandbox without it).
    session->fairness() = CpuFairness{};
    std::shared_ptr<InnerChannels> channels = warm.channels;
    relay->attach(std::move(warm.sandbox), std::move(*channels));
}

void Server::fail_create(PendingCreate& pending, const std::string& ename,
                         const std::string& evalue) {
    if (pending.resume_of.empty()) {
        reply(pending.request, {{"status", "error"}, {"ename", ename}, {"evalue", evalue}});
        return;
    }
    if (SessionProxy* relay = sessions_.live(pending.resume_of)) {
        relay->close("resume_failed: " + evalue);
    }
}

void Server::on_sleep_event(Session& session, const std::string& kind, const std::string& detail) {
    const std::string& id = session.id();
    if (kind == "hibernated") {
        record_asleep(id);  // before anyone hears of it: a crash now takes it back
        for (const auto& request : session.waiting_sleep()) {
            reply(request, {{"status", "ok"},
                            {"session_id", id},
                            {"state", "hibernated"},
                            {"snapshot_bytes", snapshots_->bytes(id)},
                            {"snapshot", snapshot_json(id)},
                            {"detail", detail}});
        }
        session.waiting_sleep().clear();
    } else if (kind == "hibernate_failed") {
        if (handing_over_) handover_refusals_[id] = detail;  // write_handover closes it with why
        for (const auto& request : session.waiting_sleep()) {
            // A cap or the disk's room: StorageFull, with the numbers.
            const std::string full = std::string(ename::StorageFull) + ": ";
            const bool storage = detail.starts_with(full);
            reply_error(request, storage ? ename::StorageFull : ename::HibernateFailed,
                        (storage ? detail.substr(full.size()) : detail) +
                            "; the session stays awake with everything");
        }
        session.waiting_sleep().clear();
    } else if (kind == "resumed") {
        // The snapshot was read into the new kernel: it leaves the store and
        // the new sandbox's /data/input, off the loop (a 100 MB one's two
        // files took 30 ms, and the requests that woke it waited on them).
        // Here, only renames: out of the session's sight (its first cell may
        // list /data/input) and out of the store's names.
        Sandbox* box = session.sandbox();
        fs::path placed = remote_files_dir(id) / "input" / kSnapshotFile;
        if (box && box->files()) {
            const fs::path staged = box->files()->staging_dir() / kSnapshotFile;
            placed = box->files()->input_dir() / kSnapshotFile;
            if (::rename(placed.c_str(), staged.c_str()) == 0) placed = staged;
        }
        const std::optional<fs::path> kept = snapshots_->remove_later(id);
        background_->run(
            [placed, kept] {
                ::unlink(placed.c_str());
                std::error_code ec;
                if (kept) fs::remove_all(*kept, ec);
            },
            [](const std::string&) {});
        forget_asleep(id);  // its live row from now (record_live)
        for (const auto& request : session.waiting_wake()) {
            reply(request,
                  {{"status", "ok"}, {"session_id", id}, {"state", "idle"}, {"detail", detail}});
        }
        session.waiting_wake().clear();
    }
}

}  // namespace cellblock
