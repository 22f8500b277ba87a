// cellblock: the command line.
#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <iostream>
#include <map>

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <CLI/CLI.hpp>

#include "cellblock/connection_info.hpp"
#include "cellblock/cpu_fairness.hpp"
#include "cellblock/error_names.hpp"
#include "cellblock/oci_bundle.hpp"
#include "client_commands.hpp"
#include "eval_command.hpp"
#include "image_cli.hpp"
#include "keeper.hpp"
#include "kernel_mode.hpp"
#include "manager_client.hpp"
#include "manager_paths.hpp"
#include "mcp_command.hpp"
#include "metrics_http.hpp"
#include "server_mode.hpp"
#include "version.hpp"

namespace {

// The CPUs this process may run on (its affinity, as a cpuset leaves it).
std::vector<int> allowed_cpus() {
    cpu_set_t set;
    CPU_ZERO(&set);
    std::vector<int> cpus;
    if (::sched_getaffinity(0, sizeof set, &set) != 0) return cpus;
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
        if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
    return cpus;
}

namespace fs = std::filesystem;
using nlohmann::json;

void setup_logging(const std::string& level) {
    auto logger = spdlog::stderr_color_st("cellblock");
    logger->set_pattern("[cellblock %Y-%m-%d %H:%M:%S.%e %l] %v");
    spdlog::set_default_logger(logger);
    spdlog::set_level(spdlog::level::from_str(level));
}

// The --egress-* flags (docs/network.md), the same for `serve`, `kernel` and
// `kernelspec install`; --egress-resolve items are parsed after the command line.
void add_egress_options(CLI::App* cmd, cellblock::EgressSettings& egress,
                        std::vector<std::string>& resolve_items) {
    cmd->add_option("--egress-allow", egress.allow,
                    "HOST:PORT pattern sessions may reach through the egress gateway "
                    "(repeatable; '*.example.com:443', 'pypi.org:*'); starts the gateway");
    cmd->add_option("--egress-private", egress.private_ranges,
                    "CIDR of private/loopback addresses the gateway may connect to after "
                    "all (repeatable; refused by default)");
    cmd->add_option("--egress-resolve", resolve_items,
                    "NAME=ADDRESS: the gateway resolves NAME to ADDRESS, not by DNS "
                    "(repeatable)");
    cmd->add_option(
        "--egress-secret", egress.secrets,
        "HOST:HEADER=env:NAME or HOST:HEADER=file:/path: a credential sessions may ask the "
        "gateway to add to their HTTPS requests for HOST (repeatable; never enters the sandbox)");
    cmd->add_option("--egress-ca", egress.ca,
                    "PEM file of CAs the gateway trusts upstream besides the system's");
    cmd->add_flag("--egress-no-dns", egress.no_dns,
                  "the gateway resolves only --egress-resolve names (and IP literals): "
                  "no DNS query ever");
    cmd->add_option("--egress-user", egress.user, "the user the gateway runs as")
        ->capture_default_str();
}

// The same flags as arguments of `cellblock kernel` (kernelspec install).
std::vector<std::string> egress_arguments(const cellblock::EgressSettings& egress) {
    std::vector<std::string> args;
    const auto add = [&](const char* flag, const std::vector<std::string>& values) {
        for (const auto& value : values) args.insert(args.end(), {flag, value});
    };
    add("--egress-allow", egress.allow);
    add("--egress-private", egress.private_ranges);
    add("--egress-secret", egress.secrets);
    for (const auto& [name, address] : egress.resolve) {
        args.insert(args.end(), {"--egress-resolve", name + "=" + address});
    }
    if (!egress.ca.empty()) args.insert(args.end(), {"--egress-ca", egress.ca});
    if (egress.no_dns) args.emplace_back("--egress-no-dns");
    if (egress.user != cellblock::EgressSettings{}.user) {
        args.insert(args.end(), {"--egress-user", egress.user});
    }
    return args;
}

}  // namespace

int main(int argc, char** argv) {
    // `cellblock eval ...` is the Python evaluator (clients/python); its options are its own.
    // A global --log-level before it is accepted (and has nothing to set there).
    int eval_at = 1;
    while (eval_at < argc) {
        const std::string_view arg = argv[eval_at];
        if (arg == "--log-level" && eval_at + 1 < argc) {
            eval_at += 2;
        } else if (arg.rfind("--log-level=", 0) == 0) {
            eval_at += 1;
        } else {
            break;
        }
    }
    if (eval_at < argc && std::string_view(argv[eval_at]) == "eval") {
        return cellblock::exec_eval(argc - eval_at + 1, argv + eval_at - 1);
    }
    CLI::App app{"cellblock: sandboxed Jupyter sessions for untrusted code"};
    app.require_subcommand(1);
    app.set_version_flag("--version", std::string("cellblock ") + cellblock::kVersion);
    // Listed for --help; `cellblock eval` itself is handled above, before parsing.
    app.add_subcommand("eval", "run notebooks as tests, each in a fresh session (eval --help)");
    std::string log_level = "info";
    app.add_option("--log-level", log_level, "trace, debug, info, warn, error")
        ->capture_default_str();

    // kernel
    cellblock::KernelModeOptions kernel;
    kernel.paths = cellblock::ServerPaths::defaults();
    int memory_mb = 0, pids = 0, disk_mb = 0;
    double cpus = 0;
    auto* kernel_cmd =
        app.add_subcommand("kernel", "run one sandboxed kernel on a connection file");
    kernel_cmd
        ->add_option("-f,--connection-file", kernel.connection_file, "Jupyter connection file")
        ->required();
    kernel_cmd->add_option("--image", kernel.image, "image name")->capture_default_str();
    kernel_cmd->add_option("--runtime", kernel.runtime, "OCI runtime: runc, crun or runsc");
    kernel_cmd
        ->add_option("--relay-nice", kernel.relay_nice,
                     "nice value of the relay's threads, above the sandbox's (0: leave it)")
        ->capture_default_str();
    const std::map<std::string, cellblock::RelayTransport> transports{
        {"zmtp", cellblock::RelayTransport::zmtp}, {"libzmq", cellblock::RelayTransport::libzmq}};
    const char* const kernel_transport_help =
        "how the relay speaks to the kernel's sockets: zmtp (in the relay's own thread) or "
        "libzmq (through its I/O thread)";
    const char* const client_transport_help =
        "how the relay speaks to the clients' connections: zmtp (in the relay's own thread) or "
        "libzmq (through its I/O thread)";
    // --kernel-transport and --client-transport, the same for both modes.
    const auto add_transports = [&](CLI::App* cmd, cellblock::RelayTransport& kernel_side,
                                    cellblock::RelayTransport& client_side) {
        cmd->add_option("--kernel-transport", kernel_side, kernel_transport_help)
            ->transform(CLI::CheckedTransformer(transports))
            ->default_str("zmtp");
        cmd->add_option("--client-transport", client_side, client_transport_help)
            ->transform(CLI::CheckedTransformer(transports))
            ->default_str("zmtp");
    };
    add_transports(kernel_cmd, kernel.kernel_transport, kernel.client_transport);
    kernel_cmd->add_option("--image-store", kernel.paths.image_store,
                           "built images (default /var/lib/cellblock/images)");
    kernel_cmd->add_option("--state-dir", kernel.paths.state_dir, "where sandboxes live")
        ->capture_default_str();
    kernel_cmd->add_option("--libexec-dir", kernel.paths.libexec_dir,
                           "directory of cellblock-shim and the kernel launcher");
    kernel_cmd->add_option("--memory-mb", memory_mb, "memory limit of the sandbox");
    kernel_cmd->add_option("--pids", pids, "process limit of the sandbox");
    kernel_cmd->add_option("--disk-mb", disk_mb, "size of each writable tmpfs (/tmp, home)");
    kernel_cmd->add_option("--cpus", cpus, "CPU quota in cores");
    std::vector<std::string> kernel_limit_items;
    kernel_cmd->add_option("--limit", kernel_limit_items,
                           "KEY=VALUE (repeatable): the session limits of `cellblock new`, "
                           "e.g. exec_timeout_s=600, idle_timeout_s, interrupt_grace_s");
    std::vector<std::string> kernel_resolve_items;
    add_egress_options(kernel_cmd, kernel.egress, kernel_resolve_items);

    // kernelspec install
    cellblock::KernelspecOptions spec;
    auto* spec_cmd = app.add_subcommand("kernelspec", "manage the Jupyter kernelspec");
    spec_cmd->require_subcommand(1);
    auto* install_cmd =
        spec_cmd->add_subcommand("install", "write the cellblock-python kernelspec");
    install_cmd->add_flag("--user", spec.user, "install for the current user");
    std::string prefix;
    install_cmd->add_option("--prefix", prefix, "install under PREFIX/share/jupyter/kernels");
    install_cmd->add_option("--name", spec.name, "kernelspec name")->capture_default_str();
    install_cmd->add_option("--kernel-arg", spec.extra_args,
                            "extra argument for `cellblock kernel` (repeatable)");
    std::vector<std::string> spec_limit_items;
    install_cmd->add_option("--limit", spec_limit_items,
                            "KEY=VALUE (repeatable): a session limit the kernel gets");
    install_cmd->add_option("--image", spec.image, "image of the kernel's sandbox");
    install_cmd->add_flag("--provisioner", spec.provisioner,
                          "take kernels from a running `cellblock serve` (cellblock-provisioner)");
    install_cmd->add_option("--server-file", spec.server_file,
                            "with --provisioner: the server's server.json (a copy for a remote "
                            "server)");
    cellblock::EgressSettings spec_egress;
    std::vector<std::string> spec_resolve_items;
    add_egress_options(install_cmd, spec_egress, spec_resolve_items);

    // serve
    cellblock::ServeOptions serve;
    serve.paths = cellblock::ServerPaths::defaults();
    serve.paths.state_dir = cellblock::default_serve_state_dir();
    std::vector<std::string> pool_items;
    auto* serve_cmd =
        app.add_subcommand("serve", "run the session server (manager socket, pool, registry)");
    serve_cmd
        ->add_option("--state-dir", serve.paths.state_dir, "database, sessions and server.json")
        ->capture_default_str();
    serve_cmd->add_option("--manager", serve.manager_endpoint, "manager endpoint")
        ->capture_default_str();
    serve_cmd->add_option("--image", serve.default_image, "default image")->capture_default_str();
    serve_cmd->add_option("--image-store", serve.paths.image_store,
                          "built images (default STATE_DIR/images)");
    serve_cmd->add_option("--pool", pool_items,
                          "IMAGE=N warm sandboxes to keep (repeatable; default host=2)");
    serve_cmd
        ->add_option("--pool-workers", serve.pool_workers,
                     "threads starting and destroying sandboxes")
        ->capture_default_str();
    serve_cmd->add_option("--libexec-dir", serve.paths.libexec_dir,
                          "directory of cellblock-shim and the kernel launcher");
    serve_cmd
        ->add_option("--relay-nice", serve.relay_nice,
                     "nice value of the server's loop and I/O threads, above the sandboxes' (0: "
                     "leave it)")
        ->capture_default_str();
    serve_cmd
        ->add_option_function<std::string>(
            "--sandboxes-weight",
            [&](const std::string& v) { serve.weigh_sandboxes = v == "active"; },
            "the sandboxes' CPU weight on the host: 'active' (what their active sessions "
            "weigh, each as a process; default) or 'fixed' (the host's default: one process's "
            "worth for all of them)")
        ->check(CLI::IsMember({"active", "fixed"}));
    serve_cmd->add_flag(
        "--cpu-idle", serve.cpu_idle,
        "sessions holding the CPU run as idle cgroups, and the sandboxes' parent too while "
        "they hold it and the host's processes do not contend: a waking quiet session or "
        "host process then never waits for a tick behind them (docs/performance.md)");
    std::string loud_cpus = "auto";
    serve_cmd
        ->add_option("--loud-cpus", loud_cpus,
                     "the CPUs the sessions holding the CPU are kept to (when: --loud-cpus-for): "
                     "'auto' (every CPU the server may use but the lowest, on two or more: "
                     "interactive sessions then have a CPU none of them is on), 'all' (no such "
                     "rule), or a list such as 1-3 (docs/performance.md)")
        ->capture_default_str();
    std::string loud_for = "growing";
    serve_cmd
        ->add_option("--loud-cpus-for", loud_for,
                     "when --loud-cpus keeps the sessions holding the CPU to its CPUs: 'growing' "
                     "(while one of them grows its memory as a memory bomb does: its page "
                     "zeroing slows what shares its CPU) or 'holding' (always: the CPU kept "
                     "free then idles whenever interactive work leaves it idle)")
        ->capture_default_str()
        ->check(CLI::IsMember({"growing", "holding"}));
    serve_cmd
        ->add_option("--interactive-slice-us", serve.interactive_slice_us,
                     "EEVDF slice of the server's threads and of interactive sessions' tasks, "
                     "in microseconds (100-100000; sessions holding the CPU get the kernel's "
                     "default; 0: the default for all; docs/performance.md)")
        ->capture_default_str()
        ->check([](const std::string& v) -> std::string {
            const long us = std::strtol(v.c_str(), nullptr, 10);
            return us == 0 || (us >= 100 && us <= 100000)
                       ? ""
                       : "the kernel takes a slice of 100 to 100000 us (0: its default)";
        });
    serve_cmd
        ->add_option("--cpu-demand-dir", serve.cpu_demand_dir,
                     "where the host's servers publish what their sessions ask of the "
                     "sandboxes' shared parent cgroup, whose weight is computed from all of them")
        ->capture_default_str();
    add_transports(serve_cmd, serve.kernel_transport, serve.client_transport);
    serve_cmd->add_flag("--audit-code-hash", serve.audit_code_hash_only,
                        "keep only a SHA-256 of each execution's code");
    serve_cmd
        ->add_option("--max-sessions", serve.policy.max_sessions,
                     "open and starting sessions at once (closed ones do not count)")
        ->capture_default_str();
    serve_cmd
        ->add_option("--max-create-wait", serve.policy.max_create_wait_s,
                     "seconds a session_create may wait for a sandbox before ServerBusy")
        ->capture_default_str();
    serve_cmd
        ->add_option("--snapshot-max-mb", serve.snapshot_max_mb,
                     "the most one hibernated session's snapshot may take on disk; above it "
                     "the session stays awake (StorageFull)")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    serve_cmd
        ->add_option("--snapshots-max-mb", serve.snapshots_max_mb,
                     "the most all hibernated sessions' snapshots may take on disk together")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    serve_cmd
        ->add_option("--key-file", serve.key_file,
                     "the server key (32 bytes, 0600, made on first use): SIGHUP seals the "
                     "sessions it hands to the next start under it (docs/restarts.md)")
        ->capture_default_str();
    serve_cmd
        ->add_option("--takeover-wait", serve.takeover_wait_s,
                     "seconds SIGHUP waits for busy sessions to finish before it execs: one "
                     "still busy is then left running for the next start to adopt, or closed "
                     "if it cannot be adopted (runsc's, or with --adopt-grace 0)")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    serve_cmd
        ->add_option("--adopt-grace", serve.adopt_grace_s,
                     "seconds a session's sandbox outlives a server killed by anything (or "
                     "exec'd by SIGHUP), for the next start on the same state dir to adopt it "
                     "with its state; 0: sandboxes end with the server, and SIGHUP hibernates "
                     "them (docs/restarts.md)")
        ->capture_default_str()
        ->check(CLI::NonNegativeNumber);
    std::vector<std::string> serve_default_limits;
    serve_cmd->add_option("--default-limit", serve_default_limits,
                          "KEY=VALUE (repeatable): the server's default for a session limit, "
                          "under images' and requests' (e.g. hibernate_after_s=300)");
    std::vector<std::string> serve_resolve_items;
    add_egress_options(serve_cmd, serve.egress, serve_resolve_items);
    serve_cmd
        ->add_option("--backend", serve.backend,
                     "where sessions' sandboxes run: runc (this host) or swarm (one Docker "
                     "Swarm service per session; docs/scale-out.md)")
        ->check(CLI::IsMember({"runc", "swarm"}))
        ->capture_default_str();
    std::vector<std::string> swarm_images;
    double swarm_drain_grace_s = 30;
    serve_cmd
        ->add_option("--swarm-drain-grace", swarm_drain_grace_s,
                     "seconds a session's task on a drained node keeps running while the "
                     "session hibernates and wakes on another node (its service's stop grace; "
                     "docs/restarts.md)")
        ->capture_default_str()
        ->check(CLI::Range(1.0, 3600.0));
    serve_cmd->add_flag(
        "--swarm-share-boot-memory", serve.swarm.share_boot_memory,
        "boot every Swarm kernel with a fixed address layout and hash seed and mark its boot "
        "memory mergeable, so a node's KSM keeps one copy of what kernels of one image hold "
        "(the node's engine profile must allow it; docs/scale-out.md, \"Density\")");
    serve_cmd
        ->add_option("--swarm-docker-host", serve.swarm.docker_host,
                     "the engine API of a Swarm manager (unix:///path)")
        ->capture_default_str();
    serve_cmd->add_option("--swarm-connect-host", serve.swarm.connect_host,
                          "reach every node's published kernel ports at this host (default: "
                          "each node's own address)");
    serve_cmd
        ->add_option("--swarm-network", serve.swarm.network,
                     "the network sessions are attached to (deploy/swarm/node-setup.sh)")
        ->capture_default_str();
    serve_cmd->add_option("--swarm-image", swarm_images,
                          "IMAGE=REF: the engine image of a cellblock image (repeatable; default "
                          "cellblock/IMAGE:CONTENT12-SHIM12, as `cellblock image export` tags "
                          "it)");
    serve_cmd
        ->add_option("--metrics", serve.metrics_address,
                     "serve Prometheus metrics (/metrics), /healthz and /readyz over HTTP at "
                     "ADDR:PORT (a PORT alone: 127.0.0.1; docs/operations.md)")
        ->check([](const std::string& address) {
            try {
                cellblock::parse_listen_address(address);
                return std::string();
            } catch (const std::exception& e) {
                return std::string(e.what());
            }
        });
    serve_cmd
        ->add_option("--closed-window", serve.policy.closed_channels_s,
                     "seconds a closed session's channels still answer SessionClosed")
        ->capture_default_str();

    // keep: started by `serve` itself (server/keeper.hpp); not for people.
    cellblock::KeeperOptions keeper;
    std::string keeper_start;
    auto* keep_cmd = app.add_subcommand(
        "keep", "clean up after a crashed server that none follows (started by serve)");
    keep_cmd->group("");  // hidden from --help
    keep_cmd->add_option("--state-dir", keeper.state_dir)->required();
    keep_cmd->add_option("--libexec-dir", keeper.libexec_dir)->required();
    keep_cmd->add_option("--server-pid", keeper.server_pid)->required();
    keep_cmd->add_option("--server-start", keeper.server_start)->required();
    keep_cmd->add_option("--grace-ms", keeper.grace_ms)->required();
    keep_cmd->add_option("--swarm-docker-host", keeper.swarm_docker_host);

    // new | ls | info | close | put | get | history | server-info
    cellblock::ClientCommands client_cli(app);
    bool as_json = false;
    auto* errors_cmd =
        app.add_subcommand("errors", "the enames the server sends, and what each means");
    errors_cmd->add_flag("--json", as_json, "print JSON");

    // The profile every session's sandbox gets, for a Swarm node's engine
    // (dockerd --seccomp-profile: deploy/swarm/README.md, docs/scale-out.md).
    auto* profile_cmd = app.add_subcommand(
        "seccomp-profile",
        "print the seccomp profile every session gets (OCI/Docker JSON), e.g. for a Swarm "
        "node's dockerd --seccomp-profile");

    // image build | ls | rm | import
    cellblock::ImageCommands image_cli(app);

    // mcp (docs/mcp.md)
    cellblock::mcp::McpCommand mcp_cli(app);

    CLI11_PARSE(app, argc, argv);
    setup_logging(log_level);
    // What cellblock makes (image files, bundles, session dirs) is read by
    // the sandboxes' own host uids; what must be private is made with its
    // mode. A caller's umask of 0077 would otherwise leave every sandbox
    // unable to exec its shim. Set once here: umask is the whole process's.
    ::umask(022);

    if (image_cli.parsed()) return image_cli.run();
    if (profile_cmd->parsed()) {
        // The engine's layer lets a kernel join same-page merging; the
        // program the shim installs over it decides per server.
        std::cout << cellblock::make_seccomp_profile(cellblock::RuntimeKind::runc,
                                                     cellblock::SandboxRole::session,
                                                     /*allow_memory_merge=*/true)
                         .dump(2)
                  << "\n";
        return 0;
    }
    if (errors_cmd->parsed()) {
        json names = json::array();
        for (const auto& e : cellblock::kErrorNames) {
            names.push_back({{"ename", e.name},
                             {"channel", cellblock::error_channel_name(e.channel)},
                             {"meaning", e.meaning}});
            if (!as_json) {
                std::printf("%-24s %-8s %s\n", std::string(e.name).c_str(),
                            std::string(cellblock::error_channel_name(e.channel)).c_str(),
                            std::string(e.meaning).c_str());
            }
        }
        if (as_json) std::cout << names.dump(2) << "\n";
        return 0;
    }
    try {
        if (kernel_cmd->parsed()) {
            kernel.limits = cellblock::parse_limits(kernel_limit_items);
            if (memory_mb > 0) kernel.limits["memory_mb"] = memory_mb;
            if (pids > 0) kernel.limits["pids"] = pids;
            if (disk_mb > 0) kernel.limits["disk_mb"] = disk_mb;
            if (cpus > 0) kernel.limits["cpus"] = cpus;
            for (const auto& item : kernel_resolve_items) kernel.egress.add_resolve(item);
            if (::geteuid() != 0) {
                spdlog::error("cellblock kernel needs root to create runc sandboxes");
                return 1;
            }
            return cellblock::run_kernel_mode(kernel);
        }
        if (install_cmd->parsed()) {
            if (!prefix.empty()) spec.prefix = prefix;
            spec.limits = cellblock::parse_limits(spec_limit_items);
            for (const auto& item : spec_resolve_items) spec_egress.add_resolve(item);
            if (spec.provisioner && !spec_egress.allow.empty()) {
                throw std::runtime_error(
                    "--egress-allow with --provisioner: a provisioned kernel's network is "
                    "the serving server's (start it with --egress-allow)");
            }
            // A kernelspec whose kernel would refuse to start is refused now.
            cellblock::ServerPolicy policy;
            spec_egress.apply_to(policy);
            spec_egress.check(policy.maxima.network);
            policy.effective(json::object(), spec.limits);
            for (auto& arg : egress_arguments(spec_egress)) spec.extra_args.push_back(arg);
            const auto file = cellblock::install_kernelspec(spec);
            std::cout << "installed kernelspec " << spec.name << " in "
                      << file.parent_path().string() << "\n";
            return 0;
        }
        if (serve_cmd->parsed()) {
            if (::geteuid() != 0) {
                spdlog::error("cellblock serve needs root to create runc sandboxes");
                return 1;
            }
            serve.pool[serve.default_image] = 2;
            serve.policy.defaults = cellblock::SessionLimits::from_json(
                cellblock::parse_limits(serve_default_limits), serve.policy.defaults);
            for (const auto& item : serve_resolve_items) serve.egress.add_resolve(item);
            serve.egress.apply_to(serve.policy);
            serve.swarm.drain_grace =
                std::chrono::milliseconds(static_cast<long>(swarm_drain_grace_s * 1000));
            for (const auto& item : swarm_images) {
                const auto eq = item.find('=');
                if (eq == std::string::npos || eq == 0 || eq + 1 == item.size())
                    throw std::runtime_error("--swarm-image " + item + ": expected IMAGE=REF");
                serve.swarm.images[item.substr(0, eq)] = item.substr(eq + 1);
            }
            serve.swarm.egress_tunnel = !serve.egress.allow.empty();
            if (serve.swarm.share_boot_memory && serve.backend != "swarm") {
                throw std::runtime_error(
                    "--swarm-share-boot-memory is for --backend swarm (a runc session shares "
                    "its zygote's memory already)");
            }
            for (const auto& item : pool_items) {
                const auto eq = item.find('=');
                if (eq == std::string::npos)
                    throw std::runtime_error("--pool " + item + ": expected IMAGE=N");
                serve.pool[item.substr(0, eq)] = std::stoi(item.substr(eq + 1));
            }
            // SIGHUP runs this program again, from the path it was started
            // from (an upgrade installed over it runs), with these arguments.
            std::error_code ec;
            serve.self_exe = std::filesystem::read_symlink("/proc/self/exe", ec).string();
            try {
                serve.loud_cpus = cellblock::loud_cpu_list(loud_cpus, allowed_cpus());
                serve.loud_cpus_for = cellblock::loud_cpus_for(loud_for);
            } catch (const std::invalid_argument& e) {
                throw std::runtime_error(std::string("--loud-cpus: ") + e.what());
            }
            serve.command_line.assign(argv, argv + argc);
            return cellblock::run_server(serve);
        }

        if (keep_cmd->parsed()) return cellblock::run_keeper(keeper);
        if (client_cli.parsed()) return client_cli.run();
        if (mcp_cli.parsed()) return mcp_cli.run(cellblock::parse_limits(mcp_cli.limit_items()));
    } catch (const std::exception& e) {
        spdlog::error("{}", e.what());
        return 1;
    }
    return 0;
}
