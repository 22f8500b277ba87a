#include "cellblock/host_contention.hpp"

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <sstream>

#include "cellblock/oci_bundle.hpp"
#include "cellblock/runc_sandbox.hpp"
#include "sandbox_internal.hpp"

namespace cellblock {
namespace fs = std::filesystem;

namespace {

using Seconds = HostContentionPolicy::Seconds;

std::string cores(double c) {
    char text[32];
    std::snprintf(text, sizeof text, "%.2f", c);
    return text;
}

}  // namespace

HostContention::HostContention(HostContentionPolicy policy) : policy_(policy) {}

bool HostContention::observe(const std::optional<HostCpuReading>& reading, bool hogs) {
    const bool before = counted_;
    if (!hogs) {
        // Nothing holds the CPU: judged afresh, at one process's weight, when
        // something does.
        window_.clear();
        counted_ = false;
        calm_ = false;
        why_ = "no session holds the CPU";
    } else if (!reading) {
        window_.clear();
        counted_ = true;
        calm_ = false;
        why_ = "the host's CPU time could not be read";
    } else if (counted_) {
        if (reading->at - counted_since_ >= policy_.recheck_every) {
            // Tried again at one process's weight, judged over a window from now.
            counted_ = false;
            window_.assign(1, *reading);
            why_ = "checking again whether the host's processes contend";
        }
    } else {
        window_.push_back(*reading);
        while (window_.size() > 2 && reading->at - window_[1].at >= policy_.window)
            window_.pop_front();
        judge();
    }
    changed_ = counted_ != before;
    return counted_;
}

void HostContention::judge() {
    const HostCpuReading& first = window_.front();
    const HostCpuReading& last = window_.back();
    const double span = Seconds(last.at - first.at).count();
    if (span < policy_.window.count() || span <= 0) return;
    auto delta = [&](std::uint64_t a, std::uint64_t b) {
        return b > a ? static_cast<double>(b - a) / 1e9 / span : 0.0;
    };
    const double sandboxes = delta(first.sandboxes_ns, last.sandboxes_ns);
    const double servers = delta(first.servers_ns, last.servers_ns);
    const double host =
        std::max(0.0, delta(first.host_busy_ns, last.host_busy_ns) - sandboxes - servers);
    const std::string figures = "the host's processes used " + cores(host) +
                                " of a core, the sandboxes " + cores(sandboxes) + ", over " +
                                cores(span) + " s";
    if (host >= policy_.min_host_cores && host >= policy_.host_share * sandboxes) {
        counted_ = true;
        calm_ = false;
        counted_since_ = last.at;
        window_.clear();
        why_ = "they contend: " + figures;
    } else {
        calm_ = true;
        why_ = "they do not contend: " + figures;
    }
}

namespace {

using sandbox_detail::read_text;  // "" when the file cannot be read

// Every CPU's busy time (user, nice, system, irq, softirq; guest time is in
// user already, idle, iowait and steal are not busy), in nanoseconds.
std::optional<std::uint64_t> host_busy_ns() {
    const std::string text = read_text("/proc/stat");
    if (text.rfind("cpu ", 0) != 0) return std::nullopt;
    std::istringstream in(text.substr(4, text.find('\n') - 4));
    std::uint64_t user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0;
    if (!(in >> user >> nice >> system >> idle >> iowait >> irq >> softirq)) return std::nullopt;
    const long hz = ::sysconf(_SC_CLK_TCK);
    if (hz <= 0) return std::nullopt;
    return (user + nice + system + irq + softirq) *
           (1'000'000'000ULL / static_cast<std::uint64_t>(hz));
}

// A top-level cgroup's CPU time: v1 cpuacct.usage (ns) in whichever mount
// holds cpuacct, v2 cpu.stat's usage_usec.
std::optional<std::uint64_t> group_cpu_ns(const char* group) {
    const fs::path root = kCgroupRoot;
    if (cgroup_v2()) {
        const std::string text = read_text(root / group / "cpu.stat");
        const auto at = text.find("usage_usec ");
        if (at == std::string::npos) return std::nullopt;
        return std::stoull(text.substr(at + 11)) * 1000;
    }
    for (const char* controller : {"cpuacct", "cpu,cpuacct", "cpuacct,cpu"})
        if (const std::string text = read_text(root / controller / group / "cpuacct.usage");
            !text.empty())
            return std::stoull(text);
    return std::nullopt;
}

}  // namespace

std::optional<HostCpuReading> read_host_cpu() try {
    HostCpuReading r;
    r.at = std::chrono::steady_clock::now();
    const auto busy = host_busy_ns();
    const auto sandboxes = group_cpu_ns(kSandboxesCgroup);
    if (!busy || !sandboxes) return std::nullopt;
    r.host_busy_ns = *busy;
    r.sandboxes_ns = *sandboxes;
    r.servers_ns = group_cpu_ns(kServersCgroup).value_or(0);
    return r;
} catch (const std::exception&) {  // a figure that is not a number
    return std::nullopt;
}

}  // namespace cellblock
