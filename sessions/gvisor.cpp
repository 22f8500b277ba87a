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

namespace {

// A child of this process, as /proc/<pid>/stat tells it.
struct ChildProcess {
    pid_t pid;
    std::string state;  // R, S, Z, ...
    std::string comm;
    fs::path dir;  // /proc/<pid>
};

// Calls visit(child) for every process whose parent is this one.
template <typename Visit>
void for_each_child(Visit&& visit) {
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
        if (ppid != self) continue;
        if (!visit(ChildProcess{static_cast<pid_t>(std::stoi(name)), state,
                                stat.substr(open + 1, close - open - 1), entry.path()})) {
            return;
        }
    }
}

}  // namespace

// Reaps zombie children that gVisor left: comm "exe" (gVisor re-executes
// /proc/self/exe for the Sentry, the gofer and the stubs forked from the
// Sentry) and no live Sandbox's own pid. Skipped while a runsc start is between
// run and registration, when its pids are not known yet; a later sweep takes them.
void reap_runsc_orphans() {
    auto& children = runsc_children();
    std::lock_guard lock(children.mutex);
    if (children.starting > 0) return;
    for_each_child([&](const ChildProcess& child) {
        if (child.state == "Z" && child.comm == "exe" && !children.owned.count(child.pid)) {
            ::waitpid(child.pid, nullptr, WNOHANG);
        }
        return true;
    });
}

// runsc run --detach leaves its gofer to the nearest subreaper (us) too:
// found here so that it can be reaped with the sandbox.
pid_t find_child_gofer(const fs::path& bundle) {
    pid_t gofer = -1;
    for_each_child([&](const ChildProcess& child) {
        const std::string cmdline = read_text(child.dir / "cmdline");
        if (cmdline.rfind(std::string("runsc-gofer") + '\0', 0) == 0 &&
            cmdline.find('\0' + bundle.string() + '\0') != std::string::npos) {
            gofer = child.pid;
            return false;
        }
        return true;
    });
    return gofer;
}
}  // namespace cellblock::sandbox_detail
