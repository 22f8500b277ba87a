// The shim's `--engine UID` start (docs/scale-out.md): what runc would have
// set up, done by the shim itself as root under a container engine, before it
// drops to the sandbox's uid for good.
#include <fcntl.h>
#include <grp.h>
#include <linux/filter.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include "cellblock/sandbox_protocol.hpp"
#include "cellblock/unique_fd.hpp"
#include "shim.hpp"

namespace cellblock::shim {
namespace {

// Several default routes (one per gateway) each take a request; past this
// many something else is wrong.
constexpr int kMaxDefaultRoutes = 8;

// `--engine UID`: started as root by a container engine (a Docker Swarm
// task, docs/scale-out.md), with no runtime to set up what runc does. The
// session's network must carry only the server's inbound connections to the
// published kernel ports, which arrive from the node on the local subnet: the
// default routes go, so nothing leaves even where the node forwards.
bool delete_default_route(int family) {
    const UniqueFd netlink(socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_ROUTE));
    if (!netlink) return false;
    const int fd = netlink.get();
    struct {
        nlmsghdr header;
        rtmsg route;
    } request{};
    request.header.nlmsg_len = sizeof request;
    request.header.nlmsg_type = RTM_DELROUTE;
    request.header.nlmsg_flags = NLM_F_REQUEST | NLM_F_ACK;
    request.header.nlmsg_seq = 1;
    request.route.rtm_family = static_cast<unsigned char>(family);
    request.route.rtm_dst_len = 0;
    request.route.rtm_table = RT_TABLE_MAIN;
    request.route.rtm_scope = RT_SCOPE_NOWHERE;
    bool ok = false;
    for (int attempt = 0; attempt < kMaxDefaultRoutes; ++attempt) {
        if (send(fd, &request, sizeof request, 0) != static_cast<ssize_t>(sizeof request)) break;
        char reply[512];
        const ssize_t n = recv(fd, reply, sizeof reply, 0);
        if (n < static_cast<ssize_t>(sizeof(nlmsghdr) + sizeof(nlmsgerr))) break;
        const auto* err = reinterpret_cast<const nlmsgerr*>(NLMSG_DATA(reply));
        if (err->error == 0) continue;  // one deleted; look for another
        // No (more) default route of this family, or no such family here.
        ok = err->error == -ESRCH || err->error == -ENOENT || err->error == -EAFNOSUPPORT;
        break;
    }
    return ok;
}

int hex_digit(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

// The session's seccomp program, given by the server in kSeccompBpfEnv
// (sandbox_protocol.hpp) as the hex of its instructions, installed on top of
// the engine's own profile: a call passes only if both let it. Needs
// no_new_privs (set before) and holds for the kernel and all it starts.
bool install_seccomp_program() {
    const char* hex = getenv(sandbox_protocol::kSeccompBpfEnv);
    const std::size_t digits = hex ? strlen(hex) : 0;
    constexpr std::size_t kDigitsPerInstruction = 2 * sizeof(sock_filter);
    if (digits == 0 || digits % kDigitsPerInstruction != 0 ||
        digits / kDigitsPerInstruction > BPF_MAXINSNS) {
        say("--engine: no seccomp program in %s (the server gives one; refusing to start "
            "without it)",
            sandbox_protocol::kSeccompBpfEnv);
        return false;
    }
    std::vector<sock_filter> program(digits / kDigitsPerInstruction);
    auto* bytes = reinterpret_cast<unsigned char*>(program.data());
    for (std::size_t i = 0; i < digits / 2; ++i) {
        const int high = hex_digit(hex[2 * i]), low = hex_digit(hex[2 * i + 1]);
        if (high < 0 || low < 0) {
            say("--engine: %s is not lower-case hex", sandbox_protocol::kSeccompBpfEnv);
            return false;
        }
        bytes[i] = static_cast<unsigned char>(high << 4 | low);
    }
    const sock_fprog fprog{static_cast<unsigned short>(program.size()), program.data()};
    if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &fprog) != 0) {
        say("--engine: installing the seccomp program failed: %s", strerror(errno));
        return false;
    }
    return true;
}

}  // namespace

bool enter_engine_sandbox(uid_t uid) {
    if (getuid() != 0) {
        say("--engine: the engine must start the shim as root (it drops to the sandbox's uid)");
        return false;
    }
    for (int family : {AF_INET, AF_INET6}) {
        if (!delete_default_route(family)) {
            say("--engine: cannot delete the default route of family %s",
                family == AF_INET ? "inet" : "inet6");
            return false;
        }
    }
    // The engine mounts its tmpfs as root's 0755 (Swarm drops the mode it
    // is given): the kernel's own dirs become its uid's, the shared ones
    // sticky and world-writable, as under runc (oci_bundle.cpp).
    const char* home = getenv("HOME");
    if (home) make_dir(home);
    struct Dir {
        const char* path;
        mode_t mode;
        bool own;
    };
    for (const Dir& dir :
         {Dir{home, 0700, true}, Dir{"/data/output", 0755, true}, Dir{"/data/input", 0755, true},
          Dir{"/tmp", 01777, false}, Dir{"/dev/shm", 01777, false},
          // A session with the egress gateway: the kernel's tunnel writes its
          // trust store and listens for the forwarder here.
          Dir{sandbox_protocol::kIpcDir, 0755, true}}) {
        if (!dir.path || access(dir.path, F_OK) != 0) continue;
        // chmod while root still owns it: no CAP_FOWNER here.
        if (chmod(dir.path, dir.mode) != 0 || (dir.own && chown(dir.path, uid, uid) != 0)) {
            say("--engine: cannot prepare %s", dir.path);
            return false;
        }
    }
    // From root to `uid` with no capability left (no PR_SET_KEEPCAPS), and
    // no way back through a setuid binary or file capabilities.
    if (setgroups(0, nullptr) != 0 || setgid(uid) != 0 || setuid(uid) != 0 || getuid() != uid ||
        geteuid() != uid) {
        say("--engine: cannot drop to the sandbox's uid");
        return false;
    }
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) {
        say("--engine: PR_SET_NO_NEW_PRIVS failed");
        return false;
    }
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);  // setuid made it dumpable again
    return install_seccomp_program();
}

bool front_attached() {
    for (const char* path : {"/proc/net/tcp", "/proc/net/tcp6"}) {
        UniqueFd fd(open(path, O_RDONLY | O_CLOEXEC));
        if (!fd) continue;
        std::string table;
        char buf[4096];
        ssize_t n;
        while ((n = read(fd.get(), buf, sizeof buf)) > 0) table.append(buf, static_cast<size_t>(n));
        if (sandbox_protocol::front_attached(table)) return true;
    }
    return false;
}

}  // namespace cellblock::shim
