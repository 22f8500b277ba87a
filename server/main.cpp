// cellblock: the command line.
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <iostream>
#include <map>

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <CLI/CLI.hpp>

#include "cellblock/connection_info.hpp"
#include "cellblock/error_names.hpp"
#include "eval_command.hpp"
#include "image_cli.hpp"
#include "kernel_mode.hpp"
#include "manager_client.hpp"
#include "manager_paths.hpp"
#include "server_mode.hpp"

namespace {
namespace fs = std::filesystem;
using nlohmann::json;

void setup_logging(const std::string& level) {
    auto logger = spdlog::stderr_color_st("cellblock");
    logger->set_pattern("[cellblock %Y-%m-%d %H:%M:%S.%e %l] %v");
    spdlog::set_default_logger(logger);
    spdlog::set_level(spdlog::level::from_str(level));
}

// The reply's content, or an exception carrying ename: evalue.
json ok_content(const cellblock::WireMessage& reply) {
    if (reply.content.value("status", "") != "ok") {
        throw std::runtime_error(reply.content.value("ename", "Error") + ": " +
                                 reply.content.value("evalue", reply.content.dump()));
    }
    return reply.content;
}

std::string when(double unix_seconds) {
    if (unix_seconds <= 0) return "-";
    const std::time_t t = static_cast<std::time_t>(unix_seconds);
    char buf[32];
    std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", std::localtime(&t));
    return buf;
}

// A progress bar on stderr when it is a terminal; nothing otherwise (logs
// and pipes get the one summary line).
cellblock::ManagerClient::Progress progress_bar(const std::string& label) {
    if (!::isatty(STDERR_FILENO)) return {};
    const auto start = std::chrono::steady_clock::now();
    return [label, start](std::uint64_t done, std::uint64_t total) {
        constexpr int kWidth = 30;
        const double part = total ? static_cast<double>(done) / static_cast<double>(total) : 1.0;
        const int filled = static_cast<int>(part * kWidth);
        const double seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        std::fprintf(stderr, "\r%s [%s%s] %3d%% %.1f/%.1f MiB %.0f MiB/s", label.c_str(),
                     std::string(static_cast<std::size_t>(filled), '#').c_str(),
                     std::string(static_cast<std::size_t>(kWidth - filled), '.').c_str(),
                     static_cast<int>(part * 100), static_cast<double>(done) / (1 << 20),
                     static_cast<double>(total) / (1 << 20),
                     seconds > 0 ? static_cast<double>(done) / (1 << 20) / seconds : 0.0);
        if (done >= total) std::fputc('\n', stderr);
        std::fflush(stderr);
    };
}

// "key=value" limit options: numbers stay numbers.
json parse_limits(const std::vector<std::string>& items) {
    json limits = json::object();
    for (const auto& item : items) {
        const auto eq = item.find('=');
        if (eq == std::string::npos)
            throw std::runtime_error("--limit " + item + ": expected KEY=VALUE");
        const std::string key = item.substr(0, eq), value = item.substr(eq + 1);
        json parsed = json::parse(value, nullptr, false);
        limits[key] = parsed.is_discarded() ? json(value) : parsed;
    }
    return limits;
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
    std::vector<std::string> serve_resolve_items;
    add_egress_options(serve_cmd, serve.egress, serve_resolve_items);
    serve_cmd
        ->add_option("--backend", serve.backend,
                     "where sessions' sandboxes run: runc (this host) or swarm (one Docker "
                     "Swarm service per session; docs/scale-out.md)")
        ->check(CLI::IsMember({"runc", "swarm"}))
        ->capture_default_str();
    std::vector<std::string> swarm_images;
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
        ->add_option("--closed-window", serve.policy.closed_channels_s,
                     "seconds a closed session's channels still answer SessionClosed")
        ->capture_default_str();

    // clients of a running server
    fs::path state_dir = cellblock::default_serve_state_dir();
    auto add_client = [&](const char* name, const char* help) {
        auto* cmd = app.add_subcommand(name, help);
        cmd->add_option("--state-dir", state_dir, "the server's state dir")->capture_default_str();
        return cmd;
    };
    std::string image, metadata_text, output_file, session_id, local, remote;
    std::vector<std::string> limit_items;
    bool all = false, as_json = false;
    auto* new_cmd = add_client("new", "create a session; writes its connection file");
    new_cmd->add_option("--image", image, "image name");
    new_cmd->add_option("--limit", limit_items,
                        "KEY=VALUE (repeatable): max_executions, idle_timeout_s, ...");
    new_cmd->add_option("--metadata", metadata_text, "JSON object kept with the session");
    new_cmd->add_option("-o,--output", output_file,
                        "connection file to write (default ./cellblock-<id>.json)");
    auto* ls_cmd = add_client("ls", "list sessions");
    ls_cmd->add_flag("--all", all, "include closed sessions");
    ls_cmd->add_flag("--json", as_json, "print JSON");
    auto* info_cmd = add_client("info", "show a session");
    info_cmd->add_option("session", session_id)->required();
    auto* close_cmd = add_client("close", "close a session");
    close_cmd->add_option("session", session_id)->required();
    auto* put_cmd = add_client("put", "copy a file to the session's /data/input");
    put_cmd->add_option("session", session_id)->required();
    put_cmd->add_option("local", local, "local file")->required();
    put_cmd->add_option("remote", remote, "path under /data/input (default: the file's name)");
    auto* get_cmd = add_client("get", "copy a file from the session's /data/output");
    get_cmd->add_option("session", session_id)->required();
    get_cmd->add_option("remote", remote, "path under /data/output")->required();
    get_cmd->add_option("local", local, "local file (default: the file's name)");
    // By default a file moves by descriptor over the server's local file
    // socket when this process can reach it, else it is streamed.
    bool stream_only = false, local_only = false;
    for (auto* cmd : {put_cmd, get_cmd}) {
        auto* stream = cmd->add_flag("--stream", stream_only,
                                     "stream the bytes through the manager socket in chunks");
        cmd->add_flag("--local", local_only,
                      "pass the file's descriptor over the server's local file socket, or fail")
            ->excludes(stream);
    }
    auto* history_cmd = add_client("history", "a session's executions and events");
    history_cmd->add_option("session", session_id)->required();
    history_cmd->add_flag("--json", as_json, "print JSON");
    auto* server_info_cmd =
        add_client("server-info", "the server's version, images, pool and limits");
    auto* errors_cmd =
        app.add_subcommand("errors", "the enames the server sends, and what each means");
    errors_cmd->add_flag("--json", as_json, "print JSON");

    // image build | ls | rm | import
    cellblock::ImageCommands image_cli(app);

    CLI11_PARSE(app, argc, argv);
    setup_logging(log_level);

    if (image_cli.parsed()) return image_cli.run();
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
            kernel.limits = parse_limits(kernel_limit_items);
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
            spec.limits = parse_limits(spec_limit_items);
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
            for (const auto& item : serve_resolve_items) serve.egress.add_resolve(item);
            serve.egress.apply_to(serve.policy);
            for (const auto& item : swarm_images) {
                const auto eq = item.find('=');
                if (eq == std::string::npos || eq == 0 || eq + 1 == item.size())
                    throw std::runtime_error("--swarm-image " + item + ": expected IMAGE=REF");
                serve.swarm.images[item.substr(0, eq)] = item.substr(eq + 1);
            }
            if (serve.backend == "swarm" && !serve.egress.allow.empty()) {
                throw std::runtime_error(
                    "--egress-allow: the egress gateway serves runc sessions only; sessions "
                    "on the swarm backend have no network (docs/scale-out.md)");
            }
            for (const auto& item : pool_items) {
                const auto eq = item.find('=');
                if (eq == std::string::npos)
                    throw std::runtime_error("--pool " + item + ": expected IMAGE=N");
                serve.pool[item.substr(0, eq)] = std::stoi(item.substr(eq + 1));
            }
            return cellblock::run_server(serve);
        }

        cellblock::ManagerClient client(state_dir);
        if (new_cmd->parsed()) {
            const auto create_timeout = std::chrono::seconds(120);
            // The server never hands out a session after we stopped waiting.
            json content = {{"limits", parse_limits(limit_items)},
                            {"timeout_s", static_cast<double>(create_timeout.count())}};
            if (!image.empty()) content["image"] = image;
            if (!metadata_text.empty()) content["metadata"] = json::parse(metadata_text);
            const json reply =
                ok_content(client.call("session_create_request", content, {}, create_timeout));
            const std::string id = reply["session_id"];
            const fs::path file =
                output_file.empty() ? fs::path("cellblock-" + id + ".json") : fs::path(output_file);
            cellblock::ConnectionInfo::from_json(reply["connection"]).write(file);
            std::cout << "session " << id
                      << (reply.value("warm", false) ? " (warm)" : " (cold start)") << "\n"
                      << "connection file: " << fs::absolute(file).string() << "\n"
                      << "  jupyter console --existing " << fs::absolute(file).string() << "\n";
            return 0;
        }
        if (ls_cmd->parsed()) {
            const json reply =
                ok_content(client.call("session_list_request", {{"open_only", !all}}));
            if (as_json) {
                std::cout << reply["sessions"].dump(2) << "\n";
                return 0;
            }
            const auto pid_list = [](const json& entry) {
                std::string pids;
                for (const auto& pid : entry.value("pids", json::array())) {
                    pids += (pids.empty() ? "" : ",") + std::to_string(pid.get<long>());
                }
                return pids.empty() ? std::string("-") : pids;
            };
            std::printf("%-18s %-8s %-8s %-20s %5s  %-16s %s\n", "SESSION", "IMAGE", "STATE",
                        "CREATED", "EXECS", "PIDS", "CLOSED BECAUSE");
            for (const auto& s : reply["sessions"]) {
                std::printf(
                    "%-18s %-8s %-8s %-20s %5lld  %-16s %s\n",
                    s["session_id"].get<std::string>().c_str(),
                    s["image"].get<std::string>().c_str(), s["state"].get<std::string>().c_str(),
                    when(s["created_at"].get<double>()).c_str(), s["executions"].get<long long>(),
                    pid_list(s).c_str(), s["close_reason"].get<std::string>().c_str());
            }
            // The pool's warm sandboxes are live too: an operator counting
            // containers (`runc --root RUNTIME_ROOT list`) sees them.
            for (const auto& box : reply.value("warm_sandboxes", json::array())) {
                std::printf("%-18s %-8s %-8s %-20s %5s  %-16s %s\n", "(pool)",
                            box["image"].get<std::string>().c_str(), "warm", "-", "-",
                            pid_list(box).c_str(), box["container_id"].get<std::string>().c_str());
            }
            for (const auto& z : reply.value("zygotes", json::array())) {
                std::printf("%-18s %-8s %-8s %-20s %5s  %-16s %s\n", "(zygote)",
                            z["image"].get<std::string>().c_str(), "zygote", "-", "-",
                            pid_list(z).c_str(), z["container_id"].get<std::string>().c_str());
            }
            if (reply.value("backend", "runc") == "swarm") {
                // Sandboxes are Swarm services on the nodes: the engine lists them.
                std::printf("\n%-28s %-8s %-12s %s\n", "NODE", "STATE", "AVAILABILITY",
                            "SANDBOXES");
                for (const auto& n : reply.value("nodes", json::array())) {
                    if (n.value("kind", "") != "node") {
                        std::printf("(the engine did not answer: %s)\n",
                                    n.value("message", "").c_str());
                        continue;
                    }
                    std::printf("%-28s %-8s %-12s %d\n", n.value("hostname", "").c_str(),
                                n.value("state", "").c_str(), n.value("availability", "").c_str(),
                                n.value("sandboxes", 0));
                }
                std::printf("\nsandboxes: docker service ls --filter label=cellblock.server\n");
            } else if (reply.contains("runtime_root")) {
                std::printf("\nsandboxes: runc --root %s list\n",
                            reply["runtime_root"].get<std::string>().c_str());
            }
            return 0;
        }
        if (info_cmd->parsed()) {
            std::cout << ok_content(
                             client.call("session_info_request", {{"session_id", session_id}}))
                             .dump(2)
                      << "\n";
            return 0;
        }
        if (close_cmd->parsed()) {
            ok_content(client.call("session_close_request", {{"session_id", session_id}}));
            std::cout << "session " << session_id << " closed\n";
            return 0;
        }
        const auto route = stream_only  ? cellblock::ManagerClient::Route::Stream
                           : local_only ? cellblock::ManagerClient::Route::Local
                                        : cellblock::ManagerClient::Route::Auto;
        if (put_cmd->parsed()) {
            const std::string name = remote.empty() ? fs::path(local).filename().string() : remote;
            const json reply = client.put_file(session_id, local, name, progress_bar(name), route);
            std::cout << local << " -> " << reply["path"].get<std::string>() << " ("
                      << reply["size"] << " bytes) sha256 " << reply["sha256"].get<std::string>()
                      << "\n";
            return 0;
        }
        if (get_cmd->parsed()) {
            const fs::path out = local.empty() ? fs::path(remote).filename() : fs::path(local);
            const json reply =
                client.get_file(session_id, remote, out, progress_bar(remote), route);
            std::cout << reply["path"].get<std::string>() << " -> " << out.string() << " ("
                      << reply["size"] << " bytes) sha256 " << reply["sha256"].get<std::string>()
                      << "\n";
            return 0;
        }
        if (history_cmd->parsed()) {
            const json reply =
                ok_content(client.call("session_history_request", {{"session_id", session_id}}));
            if (as_json) {
                std::cout << reply.dump(2) << "\n";
                return 0;
            }
            std::cout << "session " << session_id << ": " << reply["state"].get<std::string>();
            if (!reply["close_reason"].get<std::string>().empty()) {
                std::cout << " (" << reply["close_reason"].get<std::string>() << ")";
                // Kept at the close, over the session's whole life.
                std::printf("; peak memory %.1f MB, CPU %llu ms",
                            static_cast<double>(reply.value("memory_peak_bytes", 0ULL)) / (1 << 20),
                            reply.value("cpu_ms", 0ULL));
            }
            std::cout << "\n\nexecutions:\n";
            for (const auto& e : reply["executions"]) {
                std::string code = e["code"].get<std::string>();
                for (auto& ch : code) {
                    if (ch == '\n') ch = ' ';
                }
                if (code.size() > 50) code = code.substr(0, 47) + "...";
                std::printf("  %3lld %-8s %-22s %8.0f ms %6llu cpu ms %7.1f MB%s  %s\n",
                            e["count"].get<long long>(), e["status"].get<std::string>().c_str(),
                            e["ename"].get<std::string>().c_str(), e["wall_ms"].get<double>(),
                            e["cpu_ms"].get<unsigned long long>(),
                            static_cast<double>(e["memory_peak_bytes"].get<unsigned long long>()) /
                                (1 << 20),
                            e["truncated"].get<bool>() ? " truncated" : "", code.c_str());
            }
            std::cout << "\nevents:\n";
            for (const auto& e : reply["events"]) {
                std::string detail = e["detail"].get<std::string>();
                if (e["kind"] == "egress") {
                    // One line per connection: what, where, how it ended.
                    const json c = json::parse(detail, nullptr, false);
                    if (c.is_object()) {
                        detail =
                            c.value("method", "-") + " " + c.value("host", "-") + ":" +
                            std::to_string(c.value("port", 0)) + " " + c.value("verdict", "") +
                            " " + std::to_string(c.value("status", 0)) + " up " +
                            std::to_string(c.value("bytes_up", 0)) + " B down " +
                            std::to_string(c.value("bytes_down", 0)) + " B " +
                            std::to_string(c.value("duration_ms", 0)) + " ms" +
                            (c.value("reason", "").empty() ? "" : ": " + c.value("reason", ""));
                    }
                }
                std::printf("  %s %-12s %s\n", when(e["at"].get<double>()).c_str(),
                            e["kind"].get<std::string>().c_str(), detail.c_str());
            }
            return 0;
        }
        if (server_info_cmd->parsed()) {
            std::cout << ok_content(client.call("server_info_request", json::object())).dump(2)
                      << "\n";
            return 0;
        }
    } catch (const std::exception& e) {
        spdlog::error("{}", e.what());
        return 1;
    }
    return 0;
}
