// gVisor (runsc) bookkeeping: the Sentry's and gofer's pids and the stubs
// orphaned to this process.
#include "sandbox_internal.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include <spdlog/spdlog.h>

#include "cellblock/image_builder.hpp"
#include "cellblock/signer.hpp"
#include "process.hpp"

namespace cellblock::sandbox_detail {
namespace fs = std::filesystem;
using nlohmann::json;

RunscChildren& runsc_children() {
    static RunscChildren children;
    return children;
}

// Reaps zombie children that gVisor left: comm "exe" (gVisor re-executes
// /proc/self/exe for the Sentry, the gofer and the stubs forked from the
// Sentry) and no live Sandbox's own pid. Skipped while a runsc start is between
// run and registration, when its pids are not known yet; a later sweep takes them.
void reap_runsc_orphans() {
    auto& children = runsc_children();
    std::lock_guard lock(children.mutex);
    if (children.starting > 0) return;
    const std::string self = std::to_string(::getpid());
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator("/proc", ec)) {
        const std::string name = entry.path().filename().string();
        if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
        const std::string stat = read_text(entry.path() / "stat");
        const auto open = stat.find('(');
        const auto close = stat.rfind(')');
        if (open == std::string::npos || close == std::string::npos) continue;
        std::istringstream rest(stat.substr(close + 1));
        std::string state, ppid;
        rest >> state >> ppid;
        if (state != "Z" || ppid != self || stat.substr(open + 1, close - open - 1) != "exe")
            continue;
        const pid_t pid = static_cast<pid_t>(std::stoi(name));
        if (children.owned.count(pid)) continue;
        ::waitpid(pid, nullptr, WNOHANG);
    }
}

// runsc run --detach leaves its gofer to the nearest subreaper (us) too:
// found here so that it can be reaped with the sandbox.
pid_t find_child_gofer(const fs::path& bundle) {
    const std::string self = std::to_string(::getpid());
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator("/proc", ec)) {
        const std::string name = entry.path().filename().string();
        if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
        const std::string stat = read_text(entry.path() / "stat");
        const auto paren = stat.rfind(')');
        if (paren == std::string::npos) continue;
        std::istringstream rest(stat.substr(paren + 1));
        std::string state, ppid;
        rest >> state >> ppid;
        if (ppid != self) continue;
        const std::string cmdline = read_text(entry.path() / "cmdline");
        if (cmdline.rfind(std::string("runsc-gofer") + '\0', 0) == 0 &&
            cmdline.find('\0' + bundle.string() + '\0') != std::string::npos) {
            return static_cast<pid_t>(std::stoi(name));
        }
    }
    return -1;
}
}  // namespace cellblock::sandbox_detail
