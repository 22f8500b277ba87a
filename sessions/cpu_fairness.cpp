#include "cellblock/cpu_fairness.hpp"

#include <spdlog/fmt/fmt.h>

#include <algorithm>
#include <stdexcept>

namespace cellblock {

namespace {

using Seconds = CpuFairnessPolicy::Seconds;

double seconds(std::chrono::steady_clock::duration d) { return Seconds(d).count(); }

std::string describe(const CpuSetting& s) {
    return s.cpus > 0 ? fmt::format("cpu.shares {}, quota {:g} CPU", s.weight, s.cpus)
                      : fmt::format("cpu.shares {}, its own quota", s.weight);
}

const char* level_name(CpuSetting::Level level) {
    switch (level) {
        case CpuSetting::Level::normal:
            return "normal";
        case CpuSetting::Level::yielding:
            return "yielding";
        case CpuSetting::Level::demoted:
            return "demoted";
    }
    return "?";
}

}  // namespace

CpuFairness::CpuFairness(CpuFairnessPolicy policy) : policy_(std::move(policy)) {
    setting_.weight = policy_.normal_weight;
    // A weight of 2 is the kernel's floor; a quota under 1 ms per 100 ms period
    // is refused. Either way a demoted session must keep making progress.
    policy_.demoted_weight = std::max(policy_.demoted_weight, 2);
    policy_.demoted_cpus = std::max(policy_.demoted_cpus, 0.01);
    policy_.storm_cpus = std::max(policy_.storm_cpus, 0.01);
    for (auto& step : policy_.long_steps) step.weight = std::max(step.weight, 2);
}

std::optional<std::vector<const CpuFairness::Interval*>> CpuFairness::window(Seconds span) const {
    std::vector<const Interval*> out;
    if (history_.empty()) return std::nullopt;
    const auto end = history_.back().end;
    for (auto it = history_.rbegin(); it != history_.rend(); ++it) {
        out.push_back(&*it);
        if (Seconds(end - it->start) >= span) return out;
    }
    return std::nullopt;
}

std::optional<CpuFairness::Abuse> CpuFairness::abuse() const {
    if (const auto w = window(policy_.storm_after)) {
        const bool storm =
            std::all_of(w->begin(), w->end(), [&](const Interval* i) { return i->storm(policy_); });
        if (storm) {
            return Abuse{fmt::format("a fork or thread storm: {} tasks in the cgroup "
                                     "(pids.current) for {:.1f} s",
                                     history_.back().tasks, policy_.storm_after.count()),
                         true};
        }
    }
    if (auto creep = creeping()) return Abuse{std::move(*creep), true, true};
    if (const auto w = window(policy_.background_after)) {
        // Loud through (nearly) the whole window, not on average: the tail of
        // a cell that just ended (threads winding down) is no abuse.
        double cpu = 0, loud = 0;
        bool executed = false;
        for (const Interval* i : *w) {
            const double dt = seconds(i->end - i->start);
            cpu += i->cpu_s;
            if (i->cpu_s > policy_.busy_share * dt) loud += dt;
            executed = executed || i->executed;
        }
        const double span = seconds(history_.back().end - w->back()->start);
        if (!executed && loud >= 0.8 * span) {
            return Abuse{
                fmt::format("work left running with no execution: {:.2f} of a core "
                            "for {:.1f} s",
                            cpu / span, span)};
        }
    }
    return std::nullopt;
}

std::optional<CpuFairness::MemoryRise> CpuFairness::memory_rise() const {
    const auto w = window(policy_.growing_after);
    if (!w) return std::nullopt;
    // Newest first: each reading at most a slack below the one after it.
    MemoryRise rise;
    std::int64_t later = -1;
    for (const Interval* i : *w) {
        if (i->memory < 0) return std::nullopt;
        if (later >= 0 && i->memory > later + policy_.growing_slack) return MemoryRise{};
        later = i->memory;
        rise.cpu_s += i->cpu_s;
    }
    rise.bytes = w->front()->memory - w->back()->memory;
    return rise;
}

std::optional<CpuFairness::Growth> CpuFairness::growth() const {
    const auto w = window(policy_.creep_after);
    if (!w) return std::nullopt;
    Growth g;
    g.samples = w->size();
    for (const Interval* i : *w) {
        g.added += i->added;
        g.rising += i->added > 0 ? 1 : 0;
    }
    return g;
}

std::optional<std::string> CpuFairness::creeping() const {
    const auto g = growth();
    if (!g || g->added < policy_.creep_tasks ||
        static_cast<double>(g->rising) < policy_.creep_rising * static_cast<double>(g->samples))
        return std::nullopt;
    return fmt::format(
        "a fork or thread storm: {} tasks in the cgroup (pids.current), {} more than "
        "{:.1f} s before, rising in {} of {} samples",
        history_.back().tasks, g->added, policy_.creep_after.count(), g->rising, g->samples);
}

bool CpuFairness::shrinking() const {
    const auto g = growth();
    return g && g->added <= -policy_.creep_tasks;
}

bool CpuFairness::calm(bool held) const {
    const auto w = window(policy_.calm_after);
    if (!w || creeping()) return false;
    double cpu = 0, span = 0, wanting = 0, held_span = 0, held_wanting = 0;
    for (const Interval* i : *w) {
        if (i->storm(policy_)) return false;
        const double dt = seconds(i->end - i->start);
        if (i->executed) {
            // An execution's CPU is its own business, but while held one task
            // wanting CPU is its loop, more a storm's processes waiting to fork.
            held_span += held ? dt : 0;
            held_wanting += held && i->runnable > 1 ? dt : 0;
            continue;
        }
        cpu += i->cpu_s;
        span += dt;
        if (i->runnable > 0) wanting += dt;
    }
    if (held_wanting > policy_.calm_runnable * held_span) return false;
    return span <= 0 ||
           (cpu <= policy_.calm_share * span && wanting <= policy_.calm_runnable * span);
}

bool CpuFairness::storm_execution_running(const CpuSample& sample) const {
    return storm_execution_ && sample.running_for &&
           sample.at - *sample.running_for == *storm_execution_;
}

bool CpuFairness::active() const {
    if (history_.empty()) return false;
    const auto end = history_.back().end;
    double cpu = 0;
    for (auto it = history_.rbegin(); it != history_.rend(); ++it) {
        if (Seconds(end - it->end) >= policy_.active_span) break;
        cpu += it->cpu_s;
    }
    return cpu > policy_.active_share * policy_.active_span.count();
}

bool CpuFairness::interactive() const {
    return setting_.level == CpuSetting::Level::normal && active() && last_ &&
           !(last_->running_for && Seconds(*last_->running_for) >= policy_.interactive_run);
}

int sandboxes_weight(std::size_t interactive, std::size_t hogging,
                     const CpuFairnessPolicy& policy) {
    const std::size_t processes = hogging > 0 ? hogging : interactive;
    const double weight = static_cast<double>(processes) * policy.normal_weight;
    return static_cast<int>(std::clamp<double>(weight, policy.normal_weight, kMaxCpuShares));
}

namespace {

// "1-3,6" -> {1, 2, 3, 6}; std::invalid_argument when it is not such a list.
std::vector<int> parse_cpu_list(const std::string& text) {
    std::vector<int> cpus;
    std::size_t at = 0;
    auto number = [&](std::size_t& i) {
        const std::size_t start = i;
        while (i < text.size() && text[i] >= '0' && text[i] <= '9') ++i;
        if (i == start || i - start > 4)
            throw std::invalid_argument("'" + text + "' is not a list of CPUs such as 1-3,6");
        return std::stoi(text.substr(start, i - start));
    };
    if (!text.empty() && text.back() == ',')
        throw std::invalid_argument("'" + text + "' is not a list of CPUs such as 1-3,6");
    while (at < text.size()) {
        const int first = number(at);
        int last = first;
        if (at < text.size() && text[at] == '-') last = number(++at);
        if (last < first) throw std::invalid_argument("'" + text + "': a range runs upwards");
        for (int cpu = first; cpu <= last; ++cpu) cpus.push_back(cpu);
        if (at < text.size() && text[at++] != ',')
            throw std::invalid_argument("'" + text + "' is not a list of CPUs such as 1-3,6");
    }
    if (cpus.empty()) throw std::invalid_argument("an empty list of CPUs");
    return cpus;
}

}  // namespace

std::string loud_cpu_list(const std::string& option, const std::vector<int>& online) {
    if (option == "all") return "";
    if (option == "auto") {
        if (online.size() < 2) return "";
        std::vector<int> rest(online);
        std::sort(rest.begin(), rest.end());
        rest.erase(rest.begin());
        std::string list;
        for (const int cpu : rest) list += (list.empty() ? "" : ",") + std::to_string(cpu);
        return list;
    }
    for (const int cpu : parse_cpu_list(option)) {
        if (std::find(online.begin(), online.end(), cpu) == online.end())
            throw std::invalid_argument("CPU " + std::to_string(cpu) +
                                        " is not one this server may run on");
    }
    return option;
}

LoudCpusFor loud_cpus_for(const std::string& option) {
    if (option == "growing") return LoudCpusFor::growing;
    if (option == "holding") return LoudCpusFor::holding;
    throw std::invalid_argument("'" + option + "': expected growing or holding");
}

bool loud_on_cpus(const CpuSetting& setting, LoudCpusFor rule, bool any_growing) {
    if (setting.level == CpuSetting::Level::normal) return false;
    return rule == LoudCpusFor::holding || any_growing;
}

CpuSetting CpuFairness::yielding_setting(const CpuSample& sample) const {
    CpuSetting normal{CpuSetting::Level::normal, policy_.normal_weight, 0};
    if (!sample.running_for) return normal;
    const CpuFairnessPolicy::LongStep* step = nullptr;
    for (const auto& s : policy_.long_steps)
        if (Seconds(*sample.running_for) >= s.after && (!step || s.weight < step->weight))
            step = &s;
    if (!step) return normal;
    const CpuSetting yielding{CpuSetting::Level::yielding,
                              std::min(step->weight, policy_.normal_weight), 0};
    // Once yielding, it stays so until the execution ends: what it used says
    // nothing when a crowded host starves it, and a lower weight costs a cell
    // that waits on I/O nothing. Entering needs it busy over a whole window.
    if (setting_.level == CpuSetting::Level::yielding) return yielding;
    const auto w = window(policy_.long_after);
    if (!w) return normal;
    double cpu = 0;
    bool all_executing = true;
    for (const Interval* i : *w) {
        cpu += i->cpu_s;
        all_executing = all_executing && i->executed;
    }
    const double span = seconds(history_.back().end - w->back()->start);
    return all_executing && cpu > policy_.busy_share * span ? yielding : normal;
}

CpuChange CpuFairness::change_to(CpuSetting next, std::string event, std::string why) {
    const auto now = history_.back().end;
    std::string detail = describe(next) + ": " + why;
    if (setting_.level != CpuSetting::Level::normal)
        detail += fmt::format("; {} for {:.1f} s before", level_name(setting_.level),
                              seconds(now - since_));
    setting_ = next;
    since_ = now;
    return {next, std::move(event), std::move(detail)};
}

std::optional<CpuChange> CpuFairness::observe(const CpuSample& sample) {
    const bool was_growing = setting_.growing;
    auto change = observe_level(sample);
    if (history_.empty() || history_.back().end != sample.at) return change;  // not taken
    if (const auto rise = memory_rise();
        rise && rise->bytes >= policy_.growing_bytes &&
        double(rise->bytes) >= policy_.growing_per_cpu_s * rise->cpu_s) {
        grew_at_ = sample.at;
        last_rise_ = rise->bytes;
        last_rise_cpu_ = rise->cpu_s;
    }
    const bool growing = setting_.level != CpuSetting::Level::normal && grew_at_ &&
                         Seconds(sample.at - *grew_at_) < policy_.calm_after;
    setting_.growing = growing;
    const std::string grows = fmt::format(
        "its memory grows while it holds the CPU ({:.0f} MB more in {:.1f} s, "
        "over {:.2f} s of CPU)",
        double(last_rise_) / 1e6, policy_.growing_after.count(), last_rise_cpu_);
    if (change) {
        change->setting.growing = growing;
        if (growing) change->detail += "; " + grows;
        return change;
    }
    if (growing == was_growing) return std::nullopt;
    return CpuChange{setting_, growing ? "cpu_memory_growing" : "cpu_memory_steady",
                     describe(setting_) + ": " +
                         (growing ? grows
                                  : fmt::format("its memory has not grown for {:.1f} s",
                                                policy_.calm_after.count()))};
}

std::optional<CpuChange> CpuFairness::observe_level(const CpuSample& sample) {
    if (!last_) {
        last_ = sample;
        since_ = sample.at;
        return std::nullopt;
    }
    if (sample.at <= last_->at) return std::nullopt;
    Interval i;
    i.start = last_->at;
    i.end = sample.at;
    // A counter that went back (a reset) counts as no CPU used.
    i.cpu_s = sample.cpu_ns >= last_->cpu_ns ? double(sample.cpu_ns - last_->cpu_ns) / 1e9 : 0.0;
    i.tasks = sample.tasks;
    if (sample.tasks >= 0 && last_->tasks >= 0) i.added = sample.tasks - last_->tasks;
    i.executed = sample.executed;
    i.runnable = sample.runnable;
    i.memory = sample.memory_bytes;
    history_.push_back(i);
    last_ = sample;
    const Seconds keep =
        std::max({policy_.storm_after, policy_.creep_after, policy_.background_after,
                  policy_.calm_after, policy_.active_span, policy_.growing_after});
    while (history_.size() > 1 && Seconds(sample.at - history_.front().end) >= keep)
        history_.pop_front();

    if (setting_.level == CpuSetting::Level::demoted) {
        const Seconds demoted_for = sample.at - since_;
        const bool storm_running = storm_execution_running(sample);
        const Seconds hold = policy_.storm_hold * (1 << std::clamp(storm_holds_ - 1, 0, 10));
        const bool holding = storm_running && demoted_for < hold && !shrinking();
        if (demoted_for < policy_.calm_after || !calm(holding)) return std::nullopt;
        CpuSetting next = yielding_setting(sample);
        const std::string why = storm_running && demoted_for >= hold
                                    ? fmt::format("held {:.0f} s (its cell still running) after {}",
                                                  demoted_for.count(), demoted_why_)
                                    : fmt::format("calm for {:.1f} s after {}",
                                                  policy_.calm_after.count(), demoted_why_);
        return change_to(
            next, next.level == CpuSetting::Level::yielding ? "cpu_yielding" : "cpu_restored", why);
    }
    if (auto abusing = abuse()) {
        demoted_why_ = abusing->why;
        storm_holds_ = abusing->storm && storm_execution_running(sample) ? storm_holds_ + 1 : 1;
        storm_execution_.reset();
        if (abusing->storm && sample.running_for)
            storm_execution_ = sample.at - *sample.running_for;
        const double cpus = abusing->creeping ? policy_.storm_cpus : policy_.demoted_cpus;
        return change_to({CpuSetting::Level::demoted, policy_.demoted_weight, cpus}, "cpu_demoted",
                         abusing->why);
    }
    CpuSetting next = yielding_setting(sample);
    next.growing = setting_.growing;  // observe() decides that
    if (next == setting_) return std::nullopt;
    if (next.level == CpuSetting::Level::yielding) {
        return change_to(next, "cpu_yielding",
                         fmt::format("one execution has been busy for {:.0f} s (a long "
                                     "computation is never demoted; it gives way to newer work)",
                                     seconds(*sample.running_for)));
    }
    return change_to(next, "cpu_restored", "the long execution ended");
}

}  // namespace cellblock
