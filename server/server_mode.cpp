#include "server_mode.hpp"

#include "cellblock/runc_sandbox.hpp"
#include "keeper.hpp"
#include "relay_priority.hpp"
#include "server.hpp"
#include "signal_name.hpp"

namespace cellblock {

SessionTag Server::tag_of(const std::string& session_id) const {
    static const std::string unknown;
    const Session* session = sessions_.find(session_id);
    return {session_id, session ? session->image() : unknown};
}

void Server::on_execution(const ExecutionRecord& record) {
    const SessionTag tag = tag_of(record.session_id);
    for (auto* o : observers_) o->execution(tag, record);
}

void Server::on_rejected(std::string_view where, std::string_view why) {
    for (auto* o : observers_) o->dropped(where, why);
}

void Server::follow_image_version(const std::string& name) {
    const auto image = images_.find(name);
    if (image == images_.end() || image->second.rootfs != "store") return;
    const auto pooled = pool_image_ids_.find(name);
    const auto same = [&](const std::string& id) {
        return pooled != pool_image_ids_.end() ? pooled->second == id : id.empty();
    };
    if (same(image_store_.current_id(name))) return;  // the cheap check, every 2 s
    const auto current = image_store_.current(name);
    const std::string current_id = current ? current->content_id : "";
    if (same(current_id)) return;  // moved back meanwhile
    PoolImage p;
    const auto target = options_.pool.find(name);
    p.target = target != options_.pool.end() ? target->second : 0;
    try {
        p.image = current ? image_store_.image(*current) : image->second;
        p.limits = options_.policy.effective(image->second.limits_json, json::object()).sandbox;
    } catch (const std::exception& e) {
        spdlog::warn("image {}: version {} unusable: {}", name, current_id.substr(0, 12), e.what());
        return;
    }
    if (!current) {
        p.target = 0;  // the name is gone: the pool empties
        p.image.name = name;
    }
    const std::string old_id = pooled != pool_image_ids_.end() ? pooled->second : "";
    spdlog::info("image {}: current version {} (pool held {}); the pool follows", name,
                 current_id.empty() ? "none" : current_id.substr(0, 12),
                 old_id.empty() ? "none" : old_id.substr(0, 12));
    pool_image_ids_[name] = current_id;
    pool_->replace_image(std::move(p));
}

void Server::balance_cpu(Clock::time_point now) {
    std::size_t active = 0, hogging = 0;  // interactive sessions, and those holding the CPU
    for (auto& [id, session] : sessions_) {
        Sandbox* box = session.sandbox();
        if (!box) continue;  // closed, or no sandbox in this process
        SandboxCpu* cpu = box->cpu();
        if (!cpu) continue;  // a backend without CPU controls: nothing to balance
        CpuFairness& fairness = session.fairness();
        const SessionProxy& relay = *session.proxy();
        CpuSample sample;
        sample.at = now;
        const SandboxUsage usage = box->usage();
        sample.cpu_ns = usage.cpu_ns;
        if (usage.memory_bytes > 0) sample.memory_bytes = std::int64_t(usage.memory_bytes);
        sample.tasks = cpu->task_count();
        // Only a demoted session needs it (to tell calm from starved): /proc
        // reads per task, up to the second runnable one (CpuSample::runnable).
        if (fairness.demoted()) sample.runnable = cpu->runnable_tasks(2);
        if (const auto running = relay.running_since()) sample.running_for = now - *running;
        sample.executed = sample.running_for || relay.idle_since() > fairness.last_sample();
        const auto change = fairness.observe(sample);
        if (fairness.interactive()) ++active;
        if (fairness.hogging()) ++hogging;
        if (!change) continue;
        bool idled = false;
        if (!apply_cpu_setting(*box, *cpu, change->setting, idled)) continue;
        const std::string detail = change->detail + (idled ? "; an idle cgroup" : "");
        spdlog::info("session {}: {}: {}", id, change->event, detail);
        on_event(id, change->event, detail);
    }
    keep_loud_sessions_apart();
    interactive_sessions_ = active;
    hogging_sessions_ = hogging;
    if (options_.weigh_sandboxes) weigh_sandboxes(active, hogging);
    next_balance_ = now + CpuFairnessPolicy{}.interval;
}

bool Server::apply_cpu_setting(Sandbox& box, SandboxCpu& cpu, const CpuSetting& setting,
                               bool& idled) {
    // A cap of 0 is the session's own quota (its limits, as the pool applied them).
    const double own = box.limits().cpus;
    const double cpus = setting.cpus <= 0 ? own
                        : own > 0         ? std::min(setting.cpus, own)
                                          : setting.cpus;
    // --cpu-idle: what holds the CPU runs only when nothing else wants
    // it. The weight cannot be written while idle: leave first, enter last.
    const bool idle = options_.cpu_idle && setting.level != CpuSetting::Level::normal;
    if (options_.cpu_idle && !idle) cpu.set_cpu_idle(false);
    const bool weighted = cpu.set_cpu_weight(setting.weight);
    const bool capped = cpu.set_cpu_quota(cpus);
    if (!weighted && !capped) return false;  // no CPU controller for this sandbox
    idled = idle && cpu.set_cpu_idle(true);
    // The short slice is the interactive path's: a session holding the
    // CPU waits out its default slice, so a waking quiet one preempts it.
    if (options_.interactive_slice_us)
        cpu.set_slice(setting.level == CpuSetting::Level::normal ? options_.interactive_slice_us
                                                                 : 0);
    return true;
}

void Server::keep_loud_sessions_apart() {
    if (options_.loud_cpus.empty()) return;
    // The sessions holding the CPU are kept off one CPU at least, where an
    // interactive session, the server and its clients then find none, while
    // a memory bomb is among them (--loud-cpus-for growing; always with
    // holding): its page zeroing and cache misses cost its CPU's other tasks
    // what no weight governs.
    bool growing = false;
    for (auto& [id, session] : sessions_)
        growing = growing || (session.sandbox() && session.fairness().setting().growing);
    for (auto& [id, session] : sessions_) {
        Sandbox* box = session.sandbox();
        SandboxCpu* cpu = box ? box->cpu() : nullptr;
        if (!cpu) continue;
        const bool loud =
            loud_on_cpus(session.fairness().setting(), options_.loud_cpus_for, growing);
        if (loud == session.on_loud_cpus()) continue;
        if (!cpu->set_cpus(loud ? options_.loud_cpus : "")) continue;
        session.on_loud_cpus() = loud;
        spdlog::info("session {}: {}", id,
                     loud ? "kept to CPUs " + options_.loud_cpus +
                                (growing ? " (a memory bomb holds the CPU)" : "")
                          : std::string("on every CPU again"));
    }
}

void Server::weigh_sandboxes(std::size_t interactive, std::size_t hogging) {
    host_demand_ = {interactive, hogging, 1};
    if (cpu_demand_) {
        cpu_demand_->publish(interactive, hogging);
        host_demand_ = cpu_demand_->totals();
    }
    // The hogs weigh a process each only while the host's processes contend
    // for the CPU; else one together, so that an interactive process of the
    // host is not kept waiting behind them (host_contention.hpp).
    const bool counted = host_contention_.observe(
        host_demand_.hogging > 0 ? read_host_cpu() : std::nullopt, host_demand_.hogging > 0);
    if (host_contention_.changed())
        spdlog::log(counted ? spdlog::level::info : spdlog::level::debug,
                    "the host's processes and the {} sessions holding the CPU: {}",
                    host_demand_.hogging,
                    host_demand_.hogging ? host_contention_.why() : "none hog");
    const std::size_t counted_hogs =
        counted ? host_demand_.hogging : std::min<std::size_t>(host_demand_.hogging, 1);
    const int weight = sandboxes_weight(host_demand_.interactive, counted_hogs);
    // --cpu-idle: while sessions hold the CPU and the host's processes were
    // judged not to contend, the parent is idle, so that a waking host
    // process (a client, a shell) or this server never waits behind the
    // sandboxes. Not while a window is being judged (the first, or a
    // re-check every 15 s): an idle parent beside a host that does contend
    // would starve the interactive sessions in it for that second.
    const bool idle = options_.cpu_idle && host_demand_.hogging > 0 && host_contention_.calm();
    // Written when the sum changes: every server publishing in the same
    // directory computes the same sum and writes the same figure, and an
    // idle host's parent is left alone. (Not when the parent merely holds
    // another figure: a server publishing elsewhere would then rewrite it
    // against this one four times a second.) Not retried each tick when
    // refused (no such cgroup: no local sandboxes).
    if (weight == sandboxes_weight_ && idle == sandboxes_idle_) return;
    // A weight cannot be written while idle: leave first, enter last.
    if (sandboxes_idle_) sandboxes_idle_ = !set_sandboxes_cpu_idle(false);
    const bool set = set_sandboxes_cpu_weight(weight);
    set_servers_cpu_weight(weight);
    if (idle) sandboxes_idle_ = set_sandboxes_cpu_idle(true);
    spdlog::debug(
        "sandboxes' CPU weight {}{}{} (on the host: {} interactive sessions, {} hogging, "
        "{} servers)",
        weight, set ? "" : " not set", sandboxes_idle_ ? ", idle" : "", host_demand_.interactive,
        host_demand_.hogging, host_demand_.servers);
    sandboxes_weight_ = weight;
    sandboxes_weight_set_ = set;
}

void Server::on_state(const std::string& session_id, const std::string& state) {
    const SessionTag tag = tag_of(session_id);
    for (auto* o : observers_) o->state(tag, state);
    // The record a restarted server adopts the sandbox by: written once the
    // sandbox relays (after this turn: a new session is not registered yet),
    // gone with it.
    if (state == "idle") {
        live_dirty_.insert(session_id);
    } else if (state == "hibernating" || state == "closing" || state == "closed") {
        forget_live(session_id);
    }
}

void Server::on_event(const std::string& session_id, const std::string& kind,
                      const std::string& detail) {
    const SessionTag tag = tag_of(session_id);
    for (auto* o : observers_) o->event(tag, kind, detail);
    if (kind == "hibernated" || kind == "hibernate_failed" || kind == "resumed") {
        if (Session* session = sessions_.find(session_id)) on_sleep_event(*session, kind, detail);
    }
}

void Server::on_egress(const EgressEvent& event) {
    if (!event.allowed) {
        spdlog::info("session {}: egress {} {}:{} refused: {}", event.session_id,
                     event.detail.value("method", ""), event.detail.value("host", ""),
                     event.detail.value("port", 0), event.detail.value("reason", ""));
    }
    if (SessionProxy* relay = sessions_.live(event.session_id))
        relay->add_network_bytes(event.bytes);
    const SessionTag tag = tag_of(event.session_id);
    for (auto* o : observers_) o->egress(tag, event);
}

void Server::on_closed(const std::string& session_id, const std::string& reason) {
    trim_due_ = true;
    close_egress(session_id);
    cancel_local_copies(session_id);
    transfers_.session_closed(session_id);
    remove_remote_files(session_id);
    Session* session = sessions_.find(session_id);
    const SessionEnd end = session ? session->end(reason) : SessionEnd{session_id, "", reason};
    for (auto* o : observers_) o->closed(end);
    drop_streamed_keep(session_id);
    if (snapshots_) snapshots_->remove(session_id);
    forget_asleep(session_id);
    if (session) {
        for (auto* waiting : {&session->waiting_sleep(), &session->waiting_wake()}) {
            for (const auto& request : *waiting) {
                reply_error(request, ename::SessionClosed,
                            "session " + session_id + " is closed: " + reason);
            }
            waiting->clear();
        }
    }
}

int Server::run() {
    spdlog::info("cellblock serve: manager on {}, state in {}, {} image(s)", manager_.endpoint(),
                 settings_.state_dir.string(), images_.size());
    remove_stale_remote_files();
    // Sandboxes outlive this process: something must clean up after them if
    // no server comes back (server/keeper.hpp).
    if (settings_.adopt_grace_ms > 0) {
        KeeperOptions keeper;
        keeper.state_dir = settings_.state_dir;
        keeper.libexec_dir = settings_.libexec_dir;
        keeper.grace_ms = settings_.adopt_grace_ms;
        if (options_.backend == "swarm") keeper.swarm_docker_host = options_.swarm.docker_host;
        spawn_keeper(keeper);
    }
    bool signalled = false;
    loop_.watch(manager_.socket(), [this] {
        audit_.flush();  // history read in this turn sees the executions that ended in it
        manager_.on_readable();
    });
    loop_.watch_fd(wake_fd_.get(), [this] { on_pool_results(); });
    if (egress_) {
        egress_events_ = std::make_unique<EgressEvents>(
            loop_, *egress_, [this](const EgressEvent& event) { on_egress(event); });
    }
    std::string signal_name;
    loop_.watch_fd(signal_fd_.get(), [&] {
        signalfd_siginfo info;
        [[maybe_unused]] auto n = ::read(signal_fd_.get(), &info, sizeof info);
        if ((info.ssi_signo == SIGHUP || info.ssi_signo == SIGUSR2) && !signalled) {
            // A planned restart: the sessions go to the next start
            // (session_handover.cpp), this program again (SIGHUP) or
            // whichever server starts next on the state dir (SIGUSR2).
            if (!handing_over_) {
                exec_after_handover_ = info.ssi_signo == SIGHUP;
                handover_signal_ = cellblock::signal_name(static_cast<int>(info.ssi_signo));
                begin_handover();
            }
            return;
        }
        signal_name = cellblock::signal_name(static_cast<int>(info.ssi_signo));
        spdlog::info("cellblock serve: {}; closing {} session(s)", signal_name, sessions_.size());
        signalled = true;
        handing_over_ = false;  // a stop during a handover stops
    });
    // The server's own clock: CPU fairness, image versions, creates waiting.
    loop_.add_deadline(
        [this]() -> std::optional<Clock::time_point> {
            Clock::time_point next = next_version_check_;
            if (!sessions_.empty()) next = std::min(next, next_balance_);
            for (const auto& [order, pending] : creating_) next = std::min(next, pending.deadline);
            if (trim_due_) next = std::min(next, next_trim_);  // run() trims
            // Handing over: run() checks each turn whether every session settled.
            if (handing_over_) next = std::min(next, next_handover_check_);
            return next;
        },
        [this](Clock::time_point now) {
            expire_creates(now);
            if (handing_over_ && now >= next_handover_check_) {
                next_handover_check_ = now + std::chrono::milliseconds(100);
            }
            if (!sessions_.empty() && now >= next_balance_) balance_cpu(now);
            if (now >= next_version_check_) {
                for (const auto& [name, image] : images_) follow_image_version(name);
                next_version_check_ = now + kPoolVersionCheck;
            }
        });
    // --metrics: sessions by state, and the proof that the loop turns (/healthz).
    auto next_tick = Clock::now();
    std::optional<EventLoop::WatchId> metrics_tick;
    if (metrics_) {
        // Alive from here: a client answered in the first turn may ask
        // /healthz before that turn's deadlines run (seen under ASan).
        tick_metrics(Clock::now(), false);
        metrics_tick = loop_.add_deadline(
            [&next_tick]() -> std::optional<Clock::time_point> { return next_tick; },
            [&, this](Clock::time_point now) {
                tick_metrics(now, signalled || handing_over_);
                next_tick = now + ServerMetrics::kTick;
            });
    }
    while (!signalled && !(handing_over_ && handover_ready(Clock::now()))) {
        loop_.run_once();
        audit_.flush();
        flush_live();  // the requests open in each session, for a crash
        const auto now = Clock::now();
        transfers_.expire(now);
        for (const auto& id : expired_) sessions_.erase(id);
        if (!expired_.empty()) trim_due_ = true;
        expired_.clear();
        // A session's buffers are freed by now (a closed one's at its close,
        // an expired one's here); without a trim glibc keeps the pages (a
        // 300-session soak left the RSS 16 MB above its start; closed
        // sessions held ~20 kB each in freed pages). At most once a second.
        if (trim_due_ && now >= next_trim_) {
            ::malloc_trim(0);
            trim_due_ = false;
            next_trim_ = now + std::chrono::seconds(1);
        }
    }
    // /readyz: shutting down; the flush below turns the loop without the tick.
    if (metrics_tick) loop_.remove_deadline(*metrics_tick);
    if (metrics_) tick_metrics(Clock::now(), true);
    if (handing_over_) {
        write_handover();
        handed_over_ = exec_after_handover_;
        signal_name = handover_signal_;
    }
    shut_down(signal_name);
    // Sandboxes whose processes were slow to die: their cgroups go before we do.
    if (!await_cgroup_removals(kShutdownCgroupWait)) {
        spdlog::warn(
            "cellblock serve: some closed sandboxes' cgroups still hold processes "
            "after {} s; the next start removes them",
            kShutdownCgroupWait.count() / 1000);
    }
    // What is left on the host without this server's sessions.
    if (options_.weigh_sandboxes) weigh_sandboxes(0, 0);
    return 0;
}

void Server::shut_down(const std::string& signal) {
    const std::string why = "the server is shutting down (" + signal + ")";
    for (auto& [order, pending] : creating_) {
        fail_create(pending, ename::ServerShuttingDown, why + "; the session was not created");
        release_cold_start(pending.ticket, pending.kind);
    }
    creating_.clear();
    // Local copies: those with a request are answered; a connection that
    // sent none yet is only closed.
    std::vector<std::uint64_t> local;
    for (const auto& [id, client] : local_clients_) local.push_back(id);
    for (const auto id : local) {
        if (local_clients_.at(id)->request && !local_clients_.at(id)->gone) {
            refuse_local(id, ename::ServerShuttingDown, why);
        } else {
            close_local_client(id);
        }
    }
    for (auto& [id, session] : sessions_) {
        if (SessionProxy* relay = session.proxy()) {
            relay->close("server_shutdown", ename::ServerShuttingDown, why);
        }
    }
    audit_.flush();
    // The answers wait in the client sockets' queues: write them before the
    // sockets go (a client that stopped reading is not waited for past the bound).
    const auto until = Clock::now() + kShutdownFlush;
    const auto unsent = [this] {
        return std::any_of(sessions_.begin(), sessions_.end(),
                           [](auto& s) { return s.second.proxy() && s.second.proxy()->unsent(); });
    };
    while (unsent() && Clock::now() < until) {
        loop_.run_once(std::chrono::milliseconds(20));
        flush_live();
    }
}

int run_server(const ServeOptions& options) {
    sigset_t set;
    sigemptyset(&set);
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGUSR2}) sigaddset(&set, sig);
    pthread_sigmask(SIG_BLOCK, &set, nullptr);
    ::signal(SIGPIPE, SIG_IGN);
    give_relay_priority(options.relay_nice);
    give_interactive_slice(options.interactive_slice_us);
    bool again = false;
    int code = 0;
    {
        Server server(options);
        code = server.run();
        again = server.handed_over();
    }
    if (!again) return code;
    // Every descriptor but the standard ones is close-on-exec, and the server
    // lock went with the Server: the next start takes it.
    spdlog::info("cellblock serve: starting again: {}", options.self_exe);
    std::vector<char*> args;
    for (const auto& arg : options.command_line) args.push_back(const_cast<char*>(arg.c_str()));
    args.push_back(nullptr);
    // SIGINT, SIGTERM, SIGHUP and SIGUSR2 stay blocked: one that comes meanwhile
    // waits for the next start's signalfd.
    ::execv(options.self_exe.c_str(), args.data());
    spdlog::critical(
        "cellblock serve: exec {}: {}; the sessions handed over wait for the next "
        "start on this state dir",
        options.self_exe, std::strerror(errno));
    return 1;
}

}  // namespace cellblock
