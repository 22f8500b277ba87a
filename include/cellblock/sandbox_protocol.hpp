// The words, descriptor positions and command lines the server, the shim
// (kernel-shim/shim.cpp, the sandbox's init) and the zygote
// (kernel-shim/cellblock_zygote.py) exchange across the sandbox's edge,
// defined once. The shim includes this header too: it is built static and
// depends on libc, so nothing here needs more than the standard library.
// Python cannot include it: kernel-shim/cellblock_protocol.py says the same
// under the names of CELLBLOCK_SANDBOX_PROTOCOL below, and
// tests/unit/sandbox_protocol_test.cpp fails when the two differ.
#pragma once

#include <charconv>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

namespace cellblock::sandbox_protocol {

// What the zygote (Python) shares with the server or the shim (C++):
// W(C++ constant, Python name, word) and N(C++ constant, Python name, number).
// The order of a fork request's descriptors is CELLBLOCK_FORK_FDS below.
#define CELLBLOCK_SANDBOX_PROTOCOL(W, N)                                                     \
    /* Paths inside every sandbox. */                                                        \
    W(kShimPath, "SHIM", "/opt/cellblock/cellblock-shim")                                    \
    W(kConnectionFile, "CONNECTION_FILE", "/run/cellblock/kernel.json")                      \
    /* The zygote's command line (after the interpreter and the script). */                  \
    W(kZygoteSocketOption, "SOCKET_OPTION", "--socket")                                      \
    W(kZygotePreloadOption, "PRELOAD_OPTION", "--preload")                                   \
    W(kZygoteWarmImportsOption, "WARM_IMPORTS_OPTION", "--warm-imports")                     \
    /* Server -> zygote on its control socket: "seccomp <BPF program>" once, then fork */    \
    /* requests (JSON, with CELLBLOCK_FORK_FDS attached). Replies are JSON objects with */   \
    /* these keys. */                                                                        \
    W(kSeccompRequest, "SECCOMP", "seccomp")                                                 \
    N(kMaxRequestBytes, "MAX_REQUEST", 65536)                                                \
    W(kReplyPid, "REPLY_PID", "pid")                                                         \
    W(kReplyRefused, "REPLY_REFUSED", "refused")                                             \
    W(kReplySkipped, "REPLY_SKIPPED", "skipped")                                             \
    W(kReplyError, "REPLY_ERROR", "error")                                                   \
    /* A fork's reports on its report socket, and the server's answers, in order: */         \
    /* "userns", "mapped", "init PID", "cgrouped", "ready"; "error WHY" at any step. */      \
    W(kReportUserns, "REPORT_USERNS", "userns")                                              \
    W(kAnswerMapped, "ANSWER_MAPPED", "mapped")                                              \
    W(kReportInit, "REPORT_INIT", "init")                                                    \
    W(kAnswerCgrouped, "ANSWER_CGROUPED", "cgrouped")                                        \
    W(kReportReady, "REPORT_READY", "ready")                                                 \
    W(kReportError, "REPORT_ERROR", "error")                                                 \
    N(kMaxCgroupFds, "MAX_CGROUP_FDS", 32)                                                   \
    /* The shim adopting a forked kernel: `cellblock-shim --adopt KERNEL_PID STDERR_FD`, */  \
    /* with the lifeline at its usual fd and the kernel's stderr pipe at the next one. */    \
    W(kShimAdoptOption, "SHIM_ADOPT_OPTION", "--adopt")                                      \
    N(kLifelineFd, "LIFELINE_FD", 3)                                                         \
    N(kAdoptedStderrFd, "ADOPTED_STDERR_FD", 4)                                              \
    /* A fork request's "adopt_grace_ms" goes to the forked session's shim as this */        \
    /* variable (see "A session's sandbox that outlives its server" below). */               \
    W(kAdoptGraceEnv, "ADOPT_GRACE_ENV", "CELLBLOCK_ADOPT_GRACE_MS")                         \
    W(kAdoptGraceRequest, "ADOPT_GRACE_REQUEST", "adopt_grace_ms")                           \
    /* A Swarm task's egress tunnel (docs/scale-out.md, "Egress"): when its connection */    \
    /* file has EGRESS_TUNNEL_FIELD, the kernel binds a CurveZMQ ROUTER on that port and */  \
    /* the front connects a DEALER. Every message is [verb, connection id, ...]: hello */    \
    /* (front, id "": the trust store, which the kernel writes to CA_BUNDLE, and its */      \
    /* HMAC-SHA256 in hex with the kernel's message key, without which it is refused; the */ \
    /* kernel answers hello and listens on EGRESS_SOCKET), open (kernel: a client came), */  \
    /* data (either: offset, bytes), ack (either: bytes delivered in all), eof (either: */   \
    /* no more data), close (either: gone). At most TUNNEL_WINDOW bytes unacknowledged */    \
    /* per connection and way, TUNNEL_CHUNK per data, TUNNEL_MAX_CONNECTIONS at once. */     \
    W(kEgressTunnelField, "EGRESS_TUNNEL_FIELD", "cellblock_egress_port")                    \
    N(kEgressTunnelPort, "EGRESS_TUNNEL_PORT", 5560)                                         \
    W(kEgressSocket, "EGRESS_SOCKET", "/run/cellblock/egress.sock")                          \
    W(kEgressCaBundle, "CA_BUNDLE", "/run/cellblock/ca-certificates.crt")                    \
    W(kTunnelHello, "TUNNEL_HELLO", "hello")                                                 \
    W(kTunnelOpen, "TUNNEL_OPEN", "open")                                                    \
    W(kTunnelData, "TUNNEL_DATA", "data")                                                    \
    W(kTunnelAck, "TUNNEL_ACK", "ack")                                                       \
    W(kTunnelEof, "TUNNEL_EOF", "eof")                                                       \
    W(kTunnelClose, "TUNNEL_CLOSE", "close")                                                 \
    N(kTunnelChunkBytes, "TUNNEL_CHUNK", 65536)                                              \
    N(kTunnelWindowBytes, "TUNNEL_WINDOW", 262144)                                           \
    N(kTunnelMaxConnections, "TUNNEL_MAX_CONNECTIONS", 128)                                  \
    /* Set (to 1) in the kernel's environment by a shim that bridges its channels */         \
    /* (kBridgeEnv): ipykernel starts without its IOPub pipe, a loopback TCP socket that */  \
    /* `runsc checkpoint` refuses ("endpoint still has waiters upon save"). */               \
    W(kNoIopubPipeEnv, "NO_IOPUB_PIPE_ENV", "CELLBLOCK_NO_IOPUB_PIPE")

// The descriptors attached to a fork request, in this order; then one v1
// cgroup `tasks` file per hierarchy (the request's "cgroups" count).
#define CELLBLOCK_FORK_FDS(X) X(report) X(lifeline) X(log) X(ipc) X(input) X(output)

#define CELLBLOCK_SANDBOX_WORD(constant, python, word) inline constexpr char constant[] = word;
#define CELLBLOCK_SANDBOX_NUMBER(constant, python, number) inline constexpr int constant = number;
CELLBLOCK_SANDBOX_PROTOCOL(CELLBLOCK_SANDBOX_WORD, CELLBLOCK_SANDBOX_NUMBER)
#undef CELLBLOCK_SANDBOX_WORD
#undef CELLBLOCK_SANDBOX_NUMBER

enum class ForkFd {
#define CELLBLOCK_FORK_FD_ENUM(name) name,
    CELLBLOCK_FORK_FDS(CELLBLOCK_FORK_FD_ENUM)
#undef CELLBLOCK_FORK_FD_ENUM
};
inline constexpr std::string_view kForkFdNames[] = {
#define CELLBLOCK_FORK_FD_NAME(name) #name,
    CELLBLOCK_FORK_FDS(CELLBLOCK_FORK_FD_NAME)
#undef CELLBLOCK_FORK_FD_NAME
};
inline constexpr std::size_t kForkFdCount = std::size(kForkFdNames);
inline constexpr std::size_t position(ForkFd fd) { return static_cast<std::size_t>(fd); }

// The catalogue the test compares with cellblock_protocol.py.
struct SharedWord {
    std::string_view python_name;
    std::string_view word;
};
struct SharedNumber {
    std::string_view python_name;
    int number;
};
#define CELLBLOCK_SANDBOX_WORD(constant, python, word) SharedWord{python, constant},
#define CELLBLOCK_SANDBOX_SKIP(constant, python, value)
inline constexpr SharedWord kSharedWords[] = {
    CELLBLOCK_SANDBOX_PROTOCOL(CELLBLOCK_SANDBOX_WORD, CELLBLOCK_SANDBOX_SKIP)};
#undef CELLBLOCK_SANDBOX_WORD
#define CELLBLOCK_SANDBOX_NUMBER(constant, python, number) SharedNumber{python, constant},
inline constexpr SharedNumber kSharedNumbers[] = {
    CELLBLOCK_SANDBOX_PROTOCOL(CELLBLOCK_SANDBOX_SKIP, CELLBLOCK_SANDBOX_NUMBER)};
#undef CELLBLOCK_SANDBOX_NUMBER
#undef CELLBLOCK_SANDBOX_SKIP

// --- Between the server and the shim (both C++: both include this) ---------

// The shim's command line: `cellblock-shim [--engine UID] -- KERNEL [ARGS...]`
// (the adopting form is above).
inline constexpr char kShimEngineOption[] = "--engine";
inline constexpr char kShimArgvEnd[] = "--";
// Under `--engine`, the session's seccomp program (the BPF instructions the
// server compiled from its profile, as lower-case hex): the engine cannot
// install cellblock's profile (Swarm 20.10 has no seccomp field for a
// service), so the shim installs it on top of the engine's own before the
// kernel starts. Required: a shim without it refuses to start.
inline constexpr char kSeccompBpfEnv[] = "CELLBLOCK_SECCOMP_BPF";
// Under `--engine`, set (to 1) by `serve --swarm-share-boot-memory`: the shim
// starts the kernel with a fixed address layout (personality
// ADDR_NO_RANDOMIZE, which the node's engine profile must allow), so the
// kernels of one image on a node build the same boot pages at the same
// addresses and the kernel marks them for the node's KSM
// (kernel-shim/cellblock_dedup.py, docs/scale-out.md "Density").
inline constexpr char kShareBootMemoryEnv[] = "CELLBLOCK_SHARE_BOOT_MEMORY";

// Where the sandbox sees its session's ipc directory, and the zygote's
// control socket in it.
inline constexpr char kIpcDir[] = "/run/cellblock";
inline constexpr char kZygoteSocketName[] = "zygote.sock";

// Between the shim's egress forwarder and the server's egress gateway: the
// forwarder listens on the sandbox's 127.0.0.1 at this port (the kernel's
// HTTP_PROXY) and hands each connection to the gateway's socket of this name
// in the ipc directory: one byte with the connection's socket attached.
inline constexpr int kEgressProxyPort = 3128;
inline constexpr char kEgressSocketName[] = "egress.sock";

// The lifeline: a stream socket, the init's fd kLifelineFd (a socketpair the
// runtime passes), or, where the runtime cannot pass one (runsc), a unix
// socket the shim connects to at the path in this variable before the kernel
// exists. Either way one line at a time, each ended by '\n'.
inline constexpr char kLifelineEnv[] = "CELLBLOCK_LIFELINE";
// A session's sandbox that outlives its server (docs/restarts.md, phase 2):
// where kAdoptGraceEnv holds a number of milliseconds, the shim does not end
// the sandbox when the lifeline ends. It connects, every kAdoptRetryMs and
// without blocking, to the lifeline socket (kLifelineSocketName in the ipc
// dir) that a restarted server listens on. Where the runtime passed the
// lifeline (runc, crun) it takes the first connection whose listener is
// outside the sandbox's PID namespace (SO_PEERCRED pid 0) or root's (a
// zygote's container has no PID namespace): nothing in a sandbox can listen
// so. Under runsc, see the key below. Past the grace, no server: it ends the
// sandbox.
inline constexpr char kLifelineSocketName[] = "lifeline.sock";
inline constexpr int kAdoptRetryMs = 100;
// Under runsc the server sees neither the shim's pid nor its namespace (the
// connection comes through gVisor's gofer), so a server taking a waiting
// runsc sandbox back knows its shim by a key instead: the first server sends
// "adopt-key HEX" (kAdoptKeyHexDigits lower-case hex digits) on the first
// lifeline, which only the shim holds; a shim connecting again writes
// "adopt HEX" first (and takes only a socket file the sandbox's user does
// not own: SO_PEERCRED names the caller itself through the gofer). The key lives in the shim's
// memory (not dumpable) and in the server's sealed record, never where the kernel can read it. The
// adopting server answers the key with kAdoptedLine, and the shim takes the connection only once it
// has (within kAdoptAckMs): a listener that is not the server's and not the sandbox's (another of
// the host's, linked there) does not answer so, and the shim goes on waiting.
inline constexpr char kAdoptKeyLine[] = "adopt-key";
inline constexpr char kAdoptLine[] = "adopt";
inline constexpr char kAdoptedLine[] = "adopted";
inline constexpr int kAdoptAckMs = 2000;
inline constexpr std::size_t kAdoptKeyHexDigits = 32;
// Server -> shim: SIGINT to the kernel (runsc's init pid is the Sentry,
// which the server cannot signal on the kernel's behalf).
inline constexpr char kInterruptLine[] = "interrupt";
// The exact level on runsc (docs/hibernation.md): where kBridgeEnv names a
// directory of the sandbox's own (its tmpfs, not a host mount), the kernel's
// connection file names its sockets there, and the shim listens at the
// paths in kIpcDir the server connects to and pairs each connection with one
// to the kernel's socket (kernel-shim/channel_bridge.hpp). Server -> shim
// kQuiesceLine: the shim closes every host socket it holds, the bridge's,
// then answers kQuietLine and closes the lifeline; the sandbox then holds
// none, and runsc can checkpoint it. It waits for SIGUSR1 (after the
// restore, or after a checkpoint that failed) up to kQuiescedMs, then
// connects the lifeline again as for an adoption (kAdoptLine with its key)
// and listens again. A shim that does not bridge answers kNotQuietLine.
inline constexpr char kBridgeEnv[] = "CELLBLOCK_BRIDGE";
// The bridge's directory in a sandbox of the exact level: its own /tmp (a
// tmpfs of gVisor's, saved in the checkpoint).
inline constexpr char kBridgeDir[] = "/tmp/.cellblock-channels";
inline constexpr char kQuiesceLine[] = "quiesce";
inline constexpr char kQuietLine[] = "quiet";
inline constexpr char kNotQuietLine[] = "not-quiet";
inline constexpr int kQuiescedMs = 10 * 60 * 1000;
// The kernel's sockets, as the server's inner connection file names them:
// "k-1" to "k-5" (shell, iopub, stdin, control, heartbeat), in kIpcDir, or
// in the bridge's directory.
inline constexpr int kKernelPorts = 5;
inline std::string kernel_socket_name(int port) { return "k-" + std::to_string(port); }
// The longest line the shim keeps; anything past it is dropped.
inline constexpr std::size_t kMaxLifelineLine = 64;
static_assert(sizeof kAdoptKeyLine + kAdoptKeyHexDigits <= kMaxLifelineLine);

inline bool well_formed_adopt_key(std::string_view key) {
    return key.size() == kAdoptKeyHexDigits &&
           key.find_first_not_of("0123456789abcdef") == std::string_view::npos;
}
// The lines as written, with their '\n': the server's first (the key), the
// shim's on connecting again, the server's answer.
inline std::string adopt_key_line(std::string_view key) {
    return std::string(kAdoptKeyLine) + " " + std::string(key) + "\n";
}
inline std::string adopt_line(std::string_view key) {
    return std::string(kAdoptLine) + " " + std::string(key) + "\n";
}
inline std::string adopted_line() { return std::string(kAdoptedLine) + "\n"; }
// The key in "adopt-key HEX", if the line is exactly that.
inline std::optional<std::string> adopt_key_of(std::string_view line) {
    const std::string_view head = kAdoptKeyLine;
    if (line.size() <= head.size() || line.substr(0, head.size()) != head ||
        line[head.size()] != ' ' || !well_formed_adopt_key(line.substr(head.size() + 1))) {
        return std::nullopt;
    }
    return std::string(line.substr(head.size() + 1));
}

// Shim -> server, once, as the init ends: how the kernel ended.
//   "kernel-exit status=N"  it exited with status N;
//   "kernel-exit signal=N"  a signal N killed it;
//   "kernel-exit terminated" the init was told to stop (SIGTERM, SIGHUP or
//       SIGQUIT: an operator, `runc kill`, a container engine), passed
//       SIGTERM on, and the kernel had not ended kShimTermGraceMs later: the
//       init ended it with the sandbox.
// Under `--engine` (no lifeline: a Swarm task) the shim writes the same line
// to its stderr, which is the task's log, and before it, if its memory cgroup
// killed a process (oom_kill above 0), kMemoryLimitReached alone on a line:
// the front reads the log's end once the task has ended.
inline constexpr char kKernelExit[] = "kernel-exit";
inline constexpr char kMemoryLimitReached[] = "memory-limit-reached";
// What begins every line the shim writes to its stderr (its log).
inline constexpr char kShimLogPrefix[] = "cellblock-shim: ";
inline constexpr char kExitStatus[] = "status=";
inline constexpr char kExitSignal[] = "signal=";
inline constexpr char kExitTerminated[] = "terminated";
inline constexpr int kShimTermGraceMs = 2000;

struct KernelExit {
    enum class How { unknown, exited, signaled, terminated };
    How how = How::unknown;
    int value = 0;  // the status or the signal
    bool operator==(const KernelExit&) const = default;
};

// The line the shim writes (without its '\n'); empty for How::unknown.
inline std::string kernel_exit_line(KernelExit exit) {
    const std::string head = std::string(kKernelExit) + " ";
    switch (exit.how) {
        case KernelExit::How::exited:
            return head + kExitStatus + std::to_string(exit.value);
        case KernelExit::How::signaled:
            return head + kExitSignal + std::to_string(exit.value);
        case KernelExit::How::terminated:
            return head + kExitTerminated;
        case KernelExit::How::unknown:
            break;
    }
    return {};
}

// What the last "kernel-exit" line in everything the shim wrote says
// (How::unknown: none, or one this server does not know).
inline KernelExit parse_kernel_exit(std::string_view received) {
    while (!received.empty() && received.back() == '\n') received.remove_suffix(1);
    const std::string head = std::string(kKernelExit) + " ";
    const auto at = received.rfind(head);
    if (at == std::string_view::npos || (at > 0 && received[at - 1] != '\n')) return {};
    const std::string_view what = received.substr(at + head.size());
    if (what == kExitTerminated) return {KernelExit::How::terminated, 0};
    const auto number = [](std::string_view digits, KernelExit::How how) -> KernelExit {
        int value = 0;
        const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
        if (ec != std::errc() || end != digits.data() + digits.size() || digits.empty()) return {};
        return {how, value};
    };
    if (what.starts_with(kExitStatus)) {
        return number(what.substr(std::string_view(kExitStatus).size()), KernelExit::How::exited);
    }
    if (what.starts_with(kExitSignal)) {
        return number(what.substr(std::string_view(kExitSignal).size()), KernelExit::How::signaled);
    }
    return {};
}

// The kernel's ports in a Swarm task (the shim's `--engine` start), in
// the connection file's order: shell, iopub, stdin, control, hb.
inline constexpr int kEngineFirstKernelPort = 5555;
inline constexpr int kEngineKernelPortCount = 5;

// Whether a /proc/net/tcp (or tcp6) table lists an established connection
// to one of the kernel's ports: a front is attached to the kernel. The
// `--engine` shim holds the engine's SIGTERM only then (the front moves a
// drained node's session meanwhile, and ends the kernel itself when it
// closes it); with no front (a pool's service the server closed, one a
// crashed server left) SIGTERM ends the kernel at once.
inline bool front_attached(std::string_view table) {
    bool header = true;
    while (!table.empty()) {
        const auto end = table.find('\n');
        std::string_view line = table.substr(0, end);
        table.remove_prefix(end == std::string_view::npos ? table.size() : end + 1);
        if (std::exchange(header, false)) continue;
        // "  sl: LOCAL_ADDR:PORT REMOTE_ADDR:PORT ST ...", hex.
        std::string_view fields[4];
        for (auto& field : fields) {
            const auto start = line.find_first_not_of(' ');
            if (start == std::string_view::npos) break;
            line.remove_prefix(start);
            const auto stop = line.find(' ');
            field = line.substr(0, stop);
            line.remove_prefix(stop == std::string_view::npos ? line.size() : stop);
        }
        const auto colon = fields[1].rfind(':');
        if (colon == std::string_view::npos || fields[3] != "01") continue;  // 01: ESTABLISHED
        int port = 0;
        const std::string_view hex = fields[1].substr(colon + 1);
        if (std::from_chars(hex.data(), hex.data() + hex.size(), port, 16).ec != std::errc{})
            continue;
        if (port >= kEngineFirstKernelPort &&
            port < kEngineFirstKernelPort + kEngineKernelPortCount)
            return true;
    }
    return false;
}

}  // namespace cellblock::sandbox_protocol
