#include "kernel_mode.hpp"

#include <signal.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <functional>
#include <optional>

#include <spdlog/spdlog.h>
#include <zmq.hpp>

#include "cellblock/connection_info.hpp"
#include "cellblock/image_builder.hpp"
#include "cellblock/runc_sandbox.hpp"
#include "cellblock/session_dir.hpp"
#include "cellblock/signer.hpp"
#include "cellblock/unique_fd.hpp"
#include "inner_channels.hpp"
#include "kernel_sleep.hpp"
#include "manager_paths.hpp"
#include "relay_priority.hpp"
#include "session_proxy.hpp"
#include "signal_name.hpp"

#ifndef CELLBLOCK_SOURCE_DIR
#define CELLBLOCK_SOURCE_DIR ""
#endif

namespace cellblock {
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

fs::path executable_dir() {
    std::error_code ec;
    const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
    return ec ? fs::current_path() : exe.parent_path();
}

// Blocks the signals the server handles itself and returns a signalfd for
// them. Called before any thread starts, so every thread inherits the mask.
UniqueFd block_server_signals() {
    sigset_t set;
    sigemptyset(&set);
    for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&set, sig);
    pthread_sigmask(SIG_BLOCK, &set, nullptr);
    ::signal(SIGPIPE, SIG_IGN);
    return UniqueFd(signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK));
}

// The kernel died or the policy killed it: the frontend should start another.
bool kernel_was_lost(const std::string& close_reason) {
    for (const char* reason :
         {"kernel_died", "memory_limit", "exec_timeout", "interrupt_ignored"}) {
        if (close_reason.rfind(reason, 0) == 0) return true;
    }
    return false;
}

}  // namespace

ServerPaths ServerPaths::defaults() {
    ServerPaths p;
    p.state_dir = "/run/cellblock";
    const fs::path exe_dir = executable_dir();
    p.libexec_dir = exe_dir.parent_path() / "libexec" / "cellblock";
    p.egress_gateway = exe_dir / "cellblock-gateway";
    if (const char* dir = std::getenv("CELLBLOCK_IMAGES_DIR"); dir && *dir) {
        p.image_dirs.emplace_back(dir);
    }
    p.image_dirs.push_back(exe_dir.parent_path() / "share" / "cellblock" / "images");
    if (std::string(CELLBLOCK_SOURCE_DIR).size() > 0) {
        p.image_dirs.push_back(fs::path(CELLBLOCK_SOURCE_DIR) / "images");
    }
    return p;
}

int run_kernel_mode(const KernelModeOptions& options) {
    const UniqueFd signal_fd = block_server_signals();
    give_relay_priority(options.relay_nice);
    const ConnectionInfo outer = ConnectionInfo::read(options.connection_file);

    Image image;
    try {
        const ImageStore store(options.paths.image_store.empty()
                                   ? default_serve_state_dir() / "images"
                                   : options.paths.image_store);
        const auto imported = store.current(options.image);
        try {
            image = resolve_image(find_image(options.image, options.paths.image_dirs), store);
        } catch (const std::exception&) {
            if (!imported) throw;
            image = store.image(*imported);  // imported, with no definition of its own
        }
    } catch (const std::exception& e) {
        spdlog::error("{}", e.what());
        return 1;
    }
    RuntimeSettings settings;
    settings.runtime = options.runtime.empty() ? image.runtime : options.runtime;
    if (!runtime_installed(settings.runtime)) {
        spdlog::error("OCI runtime '{}' is not installed on this host", settings.runtime);
        return 1;
    }
    settings.state_dir = options.paths.state_dir / "kernels";
    settings.libexec_dir = options.paths.libexec_dir;
    if (!fs::exists(settings.libexec_dir / "cellblock-shim")) {
        spdlog::error("kernel-shim: {} does not exist (build it, or pass --libexec-dir)",
                      (settings.libexec_dir / "cellblock-shim").string());
        return 1;
    }
    for (const auto& id : reap_abandoned_sessions(settings)) {
        spdlog::info("reaped session {} left by an earlier cellblock process", id);
    }
    // The same policy a `serve` session gets: server defaults < image < these
    // limits, within the maxima (which --egress-allow opens to the gateway).
    ServerPolicy policy;
    SessionLimits limits;
    std::unique_ptr<EgressGateway> egress;
    try {
        options.egress.apply_to(policy);
        options.egress.check(policy.maxima.network);
        limits = policy.effective(image.limits_json, options.limits);
        // Only a kernel that asks for the network gets a gateway process.
        if (limits.network.gateway()) {
            egress = start_egress_gateway(options.egress, policy.maxima.network,
                                          options.paths.egress_gateway);
        }
    } catch (const PolicyError& e) {
        spdlog::error("{}: {}", e.ename(), e.what());
        return 1;
    } catch (const std::exception& e) {
        spdlog::error("{}", e.what());
        return 1;
    }

    zmq::context_t context(1);
    const std::string session_id = make_random_key().substr(0, 16);
    ProxyOptions proxy_options;
    proxy_options.policy = &policy;
    proxy_options.limits = limits;
    proxy_options.client_transport = options.client_transport;
    EventLoop loop;
    // hibernate_after_s holds here too: the snapshot is kept beside the
    // kernels' state, and the wake starts a sandbox of the same image.
    KernelSleep sleep(loop, context, session_id, image, limits.sandbox, settings,
                      options.kernel_transport, options.paths.state_dir / "kernel-snapshots");
    proxy_options.observer = &sleep;
    // One session per process: sealed as the kernel writes it, and what is
    // left once it answered, here, on the loop's thread.
    proxy_options.keep_snapshot = [&](Sandbox& box, const nlohmann::json& report,
                                      SessionIo::Moved done) {
        std::string why;
        if (!sleep.keep(box, report, why)) return done(&why);
        if (egress) egress->remove_session(session_id);  // its listener was in the old ipc dir
        done(nullptr);
    };
    proxy_options.saving_snapshot = [&](Sandbox& box) { sleep.saving(box); };
    proxy_options.snapshot_unsaved = [&] { sleep.unsaved(); };
    proxy_options.wake = [&] { sleep.wake(); };
    auto proxy = std::make_unique<SessionProxy>(context, loop, session_id, outer, proxy_options);
    sleep.on_woken(
        [&](std::unique_ptr<RuncSandbox> sandbox, std::unique_ptr<InnerChannels> channels) {
            if (proxy->closed()) return;  // the sandbox goes with it
            if (egress) {
                egress->add_session(
                    session_id, sandbox->session_dir().ipc(), limits.network,
                    std::chrono::seconds(static_cast<std::int64_t>(limits.lifetime_s) + 3600));
            }
            proxy->attach(std::move(sandbox), std::move(*channels));
        },
        [&](const std::string& why) {
            if (!proxy->closed()) proxy->close("resume_failed: " + why);
        });
    try {
        // One kernel per process: a zygote image's kernel boots here too
        // (docs/zygote.md, "Kernel mode").
        auto sandbox = RuncSandbox::start(session_id, image, limits.sandbox, settings);
        auto channels = probe_kernel(context, *sandbox, std::chrono::seconds(60), 64 << 20, nullptr,
                                     options.kernel_transport);
        if (egress) {
            // As in serve: the session's way out is a listener in its ipc dir
            // (/run/cellblock/egress.sock inside), handed to the gateway.
            egress->add_session(
                session_id, sandbox->session_dir().ipc(), limits.network,
                std::chrono::seconds(static_cast<std::int64_t>(limits.lifetime_s) + 3600));
        }
        proxy->attach(std::move(sandbox), std::move(*channels));
    } catch (const std::exception& e) {
        spdlog::error("session {}: the sandbox did not start: {}", session_id, e.what());
        return 1;
    }
    spdlog::info("session {}: image {} on {}, limits {}", session_id, image.name, settings.runtime,
                 limits.to_json().dump());

    loop.watch_fd(signal_fd.get(), [&] {
        signalfd_siginfo info;
        if (::read(signal_fd.get(), &info, sizeof info) == static_cast<ssize_t>(sizeof info)) {
            const std::string why = "the server is shutting down (" +
                                    signal_name(static_cast<int>(info.ssi_signo)) + ")";
            proxy->close("server_shutdown", ename::ServerShuttingDown, why);
        }
    });
    // The gateway's per-connection events: the kernel's log (there is no
    // audit database in kernel mode) and the bytes metadata.cellblock reports.
    std::optional<EgressEvents> egress_events;
    if (egress) {
        egress_events.emplace(loop, *egress, [&](const EgressEvent& event) {
            proxy->add_network_bytes(event.bytes);
            spdlog::info("session {}: egress {}", session_id, event.detail.dump());
        });
    }
    while (!proxy->closed()) loop.run_once();
    // The answers the close owes its client, written before the sockets go.
    for (const auto until = Clock::now() + kShutdownFlush;
         proxy->unsent() && Clock::now() < until;) {
        loop.run_once(std::chrono::milliseconds(20));
    }
    egress_events.reset();
    const int exit_code = kernel_was_lost(proxy->close_reason()) ? 1 : 0;
    proxy.reset();
    await_cgroup_removals(kShutdownCgroupWait);  // a slow-dying sandbox's cgroups
    return exit_code;
}

fs::path install_kernelspec(const KernelspecOptions& options) {
    fs::path base;
    if (options.prefix) {
        base = *options.prefix / "share" / "jupyter" / "kernels";
    } else if (options.user) {
        const char* home = std::getenv("HOME");
        if (!home) throw std::runtime_error("kernelspec install --user: HOME is not set");
        base = fs::path(home) / ".local" / "share" / "jupyter" / "kernels";
    } else {
        base = "/usr/local/share/jupyter/kernels";
    }
    const fs::path dir = base / options.name;
    fs::create_directories(dir);
    std::error_code ec;
    fs::path exe = fs::read_symlink("/proc/self/exe", ec);
    nlohmann::json spec = {
        {"display_name", "Python 3 (cellblock sandbox)"},
        {"language", "python"},
        // Signals would reach the server, not the sandboxed kernel: interrupt by message.
        {"interrupt_mode", "message"},
        {"metadata", {{"cellblock", {{"sandboxed", true}}}}}};
    if (options.provisioner) {
        nlohmann::json config = {{"limits", options.limits}};
        if (!options.server_file.empty()) config["server_file"] = options.server_file;
        if (!options.image.empty()) config["image"] = options.image;
        // jupyter_client needs an argv; the provisioner never runs it.
        spec["argv"] = {exe.string()};
        spec["display_name"] = "Python 3 (cellblock server)";
        spec["metadata"]["kernel_provisioner"] = {{"provisioner_name", "cellblock-provisioner"},
                                                  {"config", config}};
    } else {
        nlohmann::json argv = {exe.string(), "kernel", "-f", "{connection_file}"};
        if (!options.image.empty()) argv.insert(argv.end(), {"--image", options.image});
        for (const auto& [key, value] : options.limits.items()) {
            argv.push_back("--limit");
            argv.push_back(key + "=" +
                           (value.is_string() ? value.get<std::string>() : value.dump()));
        }
        for (const auto& arg : options.extra_args) argv.push_back(arg);
        spec["argv"] = argv;
    }
    const fs::path file = dir / "kernel.json";
    std::ofstream out(file);
    out << spec.dump(2) << "\n";
    if (!out) throw std::runtime_error("kernelspec: cannot write " + file.string());
    return file;
}

}  // namespace cellblock
