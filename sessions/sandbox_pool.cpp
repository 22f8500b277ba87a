#include "cellblock/sandbox_pool.hpp"
#include "cellblock/sandbox_tuning.hpp"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <optional>

#include <spdlog/spdlog.h>

#include "cellblock/at_once.hpp"
#include "cellblock/signer.hpp"

namespace cellblock {
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

constexpr std::chrono::milliseconds kRefillDelay{250};

}  // namespace

std::string make_session_id() { return make_random_key().substr(0, 16); }

SandboxPool::SandboxPool(std::shared_ptr<SandboxBackend> backend, ReadinessProbe probe,
                         std::vector<PoolImage> images, std::function<void()> notify, int workers)
    : backend_(std::move(backend)), probe_(std::move(probe)), notify_(std::move(notify)) {
    for (auto& image : images) {
        const std::string name = image.image.name;
        slots_[name].config = std::move(image);
    }
    {
        std::lock_guard lock(mutex_);
        schedule_refills_locked();
    }
    for (int i = 0; i < std::max(1, workers); ++i) {
        workers_.emplace_back([this] {
            // Not the relay's priority (server/relay_priority.hpp): a worker
            // starts at nice 0 and sets its own per job.
            ::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 0);
            work();
        });
    }
}

SandboxPool::~SandboxPool() {
    {
        std::lock_guard lock(mutex_);
        stopping_ = true;
    }
    changed_.notify_all();
    backend_->abandon_starts();
    for (auto& t : workers_) t.join();
    // Whatever is still held is destroyed here, all at once: each waits for
    // its killed init to be torn down (about 0.6 s for a booted kernel on a
    // loaded host) and its runtime's delete, which need not wait for each
    // other (with a pool of 2 here the gain was not measurable).
    std::vector<Sandbox*> held;
    for (auto& job : jobs_) {
        if (job.sandbox) held.push_back(job.sandbox.get());
    }
    // Their channels close first: a kernel no front is attached to ends at
    // once when its Swarm task is stopped (sandbox_protocol::front_attached).
    for (auto& [name, slot] : slots_) {
        for (auto& warm : slot.ready) {
            warm.channels.reset();
            held.push_back(warm.sandbox.get());
        }
    }
    for (auto& r : results_) {
        r.warm.channels.reset();
        if (r.warm.sandbox) held.push_back(r.warm.sandbox.get());
    }
    for_each_at_once(held.size(), 8, [&](std::size_t i) { held[i]->destroy(); });
}

void SandboxPool::schedule_refills_locked(std::chrono::milliseconds delay) {
    const auto not_before = Clock::now() + delay;
    for (auto& [name, slot] : slots_) {
        int wanted = slot.config.target - static_cast<int>(slot.ready.size()) - slot.starting;
        for (; wanted > 0; --wanted) {
            Job job{Job::refill, name,    {},         slot.config.image, slot.config.limits,
                    0,           nullptr, not_before, slot.generation};
            jobs_.push_back(std::move(job));
            ++slot.starting;
        }
    }
    changed_.notify_all();
}

WarmSandbox SandboxPool::take(const std::string& image, const SandboxLimits& limits) {
    WarmSandbox warm;
    for (;;) {
        {
            std::lock_guard lock(mutex_);
            auto it = slots_.find(image);
            if (it == slots_.end() || it->second.ready.empty() ||
                !backend_->can_serve(it->second.config.image, it->second.config.limits, limits)) {
                return {};
            }
            warm = std::move(it->second.ready.front());
            it->second.ready.pop_front();
            schedule_refills_locked(kRefillDelay);
        }
        Sandbox& box = *warm.sandbox;
        if (!box.exited() && box.read_lifeline() && !box.moving()) break;
        // Died (or its node is being drained) while waiting in the pool: not
        // handed out, replaced by a refill, and the next one is tried (a
        // drained node may hold several of the pool's).
        warm.channels.reset();
        dispose(std::move(warm.sandbox));
    }
    Sandbox& box = *warm.sandbox;
    try {
        box.apply_limits(limits);
        box.set_limits(limits);
        // A refill booted at a low weight and nice (RuncBackend::start): a
        // session gets the normal ones.
        if (SandboxCpu* cpu = box.cpu()) {
            cpu->set_cpu_weight(tuning::kNormalCpuShares);
            cpu->renice(0);
        }
    } catch (const std::exception& e) {
        spdlog::warn("pool {}: {}; not handed out", image, e.what());
        warm.channels.reset();
        dispose(std::move(warm.sandbox));
        return {};
    }
    return warm;
}

std::uint64_t SandboxPool::start_cold(const std::string& session_id, const Image& image,
                                      const SandboxLimits& limits) {
    std::lock_guard lock(mutex_);
    const std::uint64_t ticket = next_ticket_++;
    // A waiting client goes before refills, and after the clients that came
    // before it: first come, first served.
    const auto first_refill = std::find_if(jobs_.begin(), jobs_.end(),
                                           [](const Job& job) { return job.kind == Job::refill; });
    jobs_.insert(first_refill,
                 Job{Job::cold, image.name, session_id, image, limits, ticket, nullptr});
    changed_.notify_one();
    return ticket;
}

bool SandboxPool::cancel_cold(std::uint64_t ticket) {
    std::lock_guard lock(mutex_);
    const auto job = std::find_if(jobs_.begin(), jobs_.end(), [&](const Job& j) {
        return j.kind == Job::cold && j.ticket == ticket;
    });
    if (job == jobs_.end()) return false;
    jobs_.erase(job);
    return true;
}

std::vector<StartResult> SandboxPool::drain_results() {
    std::lock_guard lock(mutex_);
    std::vector<StartResult> out;
    out.swap(results_);
    return out;
}

void SandboxPool::dispose(std::unique_ptr<Sandbox> sandbox) {
    if (!sandbox) return;
    std::lock_guard lock(mutex_);
    dispose_locked(std::move(sandbox));
}

void SandboxPool::replace_image(PoolImage config) {
    const std::string name = config.image.name;
    // Outside the pool's lock: retiring a zygote waits for a fork under way.
    backend_->image_changed(config.image, config.image.content_id.empty() && config.target == 0);
    std::lock_guard lock(mutex_);
    Slot& slot = slots_[name];
    slot.config = std::move(config);
    ++slot.generation;
    slot.failures = 0;
    slot.last_error.clear();
    for (auto it = jobs_.begin(); it != jobs_.end();) {
        if (it->kind == Job::refill && it->image == name) {
            --slot.starting;
            it = jobs_.erase(it);
        } else {
            ++it;
        }
    }
    while (!slot.ready.empty()) {
        WarmSandbox old = std::move(slot.ready.front());
        slot.ready.pop_front();
        old.channels.reset();
        dispose_locked(std::move(old.sandbox));
    }
    if (!stopping_) schedule_refills_locked();
}

void SandboxPool::dispose_locked(std::unique_ptr<Sandbox> sandbox) {
    if (stopping_) {
        sandbox->destroy();
        return;
    }
    Job job{Job::destroy, sandbox->image_name(), {}, {}, {}, 0, std::move(sandbox)};
    // Destruction first: it frees memory and pids for the rest.
    jobs_.push_front(std::move(job));
    changed_.notify_one();
}

WarmSandbox SandboxPool::start_and_probe(const std::string& session_id, const Image& image,
                                         const SandboxLimits& limits, bool background) {
    WarmSandbox warm;
    warm.sandbox = backend_->start(session_id, image, limits, background);
    warm.channels = probe_(*warm.sandbox, background);
    return warm;
}

nlohmann::json SandboxPool::extras() { return backend_->extras(); }

void SandboxPool::work() {
    for (;;) {
        Job job;
        {
            std::unique_lock lock(mutex_);
            // The first job that is due; delayed refills wait their turn
            // (a cold start or a destruction queued meanwhile goes first).
            auto due = jobs_.end();
            for (;;) {
                if (stopping_) return;
                const auto now = Clock::now();
                std::optional<Clock::time_point> next;
                due = jobs_.end();
                for (auto it = jobs_.begin(); it != jobs_.end(); ++it) {
                    if (it->not_before <= now) {
                        due = it;
                        break;
                    }
                    if (!next || it->not_before < *next) next = it->not_before;
                }
                if (due != jobs_.end()) break;
                if (next) {
                    changed_.wait_until(lock, *next);
                } else {
                    changed_.wait(lock);
                }
            }
            job = std::move(*due);
            jobs_.erase(due);
        }
        if (job.kind == Job::destroy) {
            job.sandbox->destroy();
            continue;
        }
        const auto started = Clock::now();
        StartResult result;
        result.ticket = job.ticket;
        try {
            const std::string id = job.kind == Job::cold ? job.session_id : make_session_id();
            // The host side of a refill (the runtime's processes, mounts,
            // namespace setup) runs at nice 19: a thread's nice value, which
            // the runtime it forks inherits. A cold start runs at 0.
            const bool background = job.kind != Job::cold;
            ::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), background ? 19 : 0);
            result.warm = start_and_probe(id, job.image_def, job.limits, background);
        } catch (const std::exception& e) {
            result.error = e.what();
        }
        result.start_ms = std::chrono::duration<double, std::milli>(Clock::now() - started).count();
        if (job.kind == Job::cold) {
            {
                std::lock_guard lock(mutex_);
                results_.push_back(std::move(result));
            }
            notify_();
            continue;
        }
        std::unique_lock lock(mutex_);
        Slot& slot = slots_[job.image];
        --slot.starting;
        if (job.generation != slot.generation) {
            // Booted from an image version the pool no longer holds.
            if (result.warm) {
                result.warm.channels.reset();
                dispose_locked(std::move(result.warm.sandbox));
            }
        } else if (result.warm) {
            slot.failures = 0;
            slot.ready.push_back(std::move(result.warm));
            spdlog::debug("pool {}: warm sandbox ready in {:.0f} ms", job.image, result.start_ms);
            changed_.notify_all();
            notify_();  // a create may be waiting for it
        } else {
            ++slot.failures;
            slot.last_error = result.error;
            spdlog::warn("pool {}: start failed ({} in a row): {}", job.image, slot.failures,
                         result.error);
            // Back off before trying again, so a broken image does not spin.
            const auto backoff = std::chrono::milliseconds(
                std::min<long>(30000, 250L << std::min(slot.failures, 7)));
            changed_.wait_for(lock, backoff, [&] { return stopping_; });
            if (stopping_) return;
        }
        if (!stopping_) schedule_refills_locked();
    }
}

nlohmann::json SandboxPool::state() const {
    std::lock_guard lock(mutex_);
    nlohmann::json out = nlohmann::json::object();
    for (const auto& [name, slot] : slots_) {
        out[name] = {{"ready", slot.ready.size()},
                     {"starting", slot.starting},
                     {"target", slot.config.target},
                     {"failures", slot.failures},
                     {"last_error", slot.last_error}};
    }
    return out;
}

nlohmann::json SandboxPool::warm_sandboxes() const {
    std::lock_guard lock(mutex_);
    nlohmann::json out = nlohmann::json::array();
    for (const auto& [name, slot] : slots_) {
        for (const auto& warm : slot.ready) {
            out.push_back(
                {{"image", name},
                 {"container_id", warm.sandbox->container_id()},
                 {"init_pid",
                  warm.sandbox->host_process() ? warm.sandbox->host_process()->init_pid() : -1}});
        }
    }
    return out;
}

std::size_t SandboxPool::ready(const std::string& image) const {
    std::lock_guard lock(mutex_);
    auto it = slots_.find(image);
    return it == slots_.end() ? 0 : it->second.ready.size();
}

bool SandboxPool::wait_until_full(std::chrono::milliseconds timeout) const {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, timeout, [&] {
        for (const auto& [name, slot] : slots_) {
            if (static_cast<int>(slot.ready.size()) < slot.config.target) return false;
        }
        return true;
    });
}

}  // namespace cellblock
