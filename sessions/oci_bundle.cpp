#include "cellblock/oci_bundle.hpp"
#include "cellblock/sandbox_tuning.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <stdexcept>
#include <system_error>

namespace cellblock {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

json tmpfs_mount(const std::string& destination, std::vector<std::string> options) {
    return {{"destination", destination},
            {"type", "tmpfs"},
            {"source", "tmpfs"},
            {"options", std::move(options)}};
}

json bind_mount(const std::string& source, const std::string& destination, bool read_only,
                bool exec = false) {
    std::vector<std::string> options{"rbind", read_only ? "ro" : "rw", "nosuid", "nodev"};
    if (!exec) options.push_back("noexec");
    return {{"destination", destination},
            {"type", "bind"},
            {"source", source},
            {"options", std::move(options)}};
}

std::string size_mb(int mb) { return "size=" + std::to_string(mb) + "m"; }

json rlimit(const char* type, std::uint64_t value) {
    return {{"type", type}, {"hard", value}, {"soft", value}};
}

json id_mapping(const IdMapping& ids) {
    return json::array({{{"containerID", 0}, {"hostID", ids.host_base}, {"size", ids.size}}});
}

}  // namespace

RuntimeKind runtime_kind(const std::string& runtime) {
    const std::string base = fs::path(runtime).filename().string();
    if (base == "runsc") return RuntimeKind::runsc;
    if (base == "crun") return RuntimeKind::crun;
    return RuntimeKind::runc;
}

bool runtime_passes_fds(RuntimeKind kind) { return kind != RuntimeKind::runsc; }

int host_pids_limit(RuntimeKind kind, int pids) {
    return kind == RuntimeKind::runsc
               ? pids * tuning::kRunscHostPidsFactor + tuning::kRunscHostPidsBase
               : pids;
}

std::vector<std::string> kernel_command(const Image& image) {
    std::vector<std::string> argv;
    for (const auto& arg : image.kernel_argv) {
        argv.push_back(arg == "{connection_file}" ? std::string(kSandboxConnectionFile) : arg);
    }
    return argv;
}

std::vector<std::string> sandbox_environment(const Image& image) {
    std::map<std::string, std::string> env{
        {"PATH", "/usr/sbin:/usr/bin:/sbin:/bin"},
        {"HOME", kSandboxHome},
        {"USER", "sandbox"},
        {"LANG", "C.UTF-8"},
        {"TMPDIR", "/tmp"},
        {"IPYTHONDIR", std::string(kSandboxHome) + "/.ipython"},
        {"MPLCONFIGDIR", std::string(kSandboxHome) + "/.config/matplotlib"},
        {"XDG_CACHE_HOME", std::string(kSandboxHome) + "/.cache"},
    };
    // The egress forwarder of the shim (docs/network.md): HTTP clients, pip and
    // curl go through it; a session without a gateway gets a 403 saying so.
    for (const char* name : {"HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"}) {
        env[name] = kSandboxEgressProxy;
    }
    for (const char* name : {"NO_PROXY", "no_proxy"}) env[name] = "localhost,127.0.0.1,::1";
    // Packages a session installs (pip through the gateway) go to its own
    // capped home, never the image: pip --target (which Debian's PEP 668
    // guard allows) on the import path, read again after each cell.
    env["PIP_TARGET"] = kSandboxPackages;
    env["PYTHONPATH"] = kSandboxPackages;
    env["PIP_NO_CACHE_DIR"] = "1";
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1";
    // The trust store the server writes for a gateway session: the host's
    // CAs, plus the session's own when the gateway adds secrets for a host.
    for (const char* name : {"SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT"}) {
        env[name] = std::string(kSandboxIpcDir) + "/ca-certificates.crt";
    }
    for (const auto& [name, value] : image.env) env[name] = value;
    std::vector<std::string> out;
    for (const auto& [name, value] : env) out.push_back(name + "=" + value);
    return out;
}

json make_oci_config(const SandboxSpec& spec) {
    const SandboxLimits& lim = spec.limits;
    const RuntimeKind kind = runtime_kind(spec.runtime);
    const bool zygote = spec.role == SandboxRole::zygote;
    // Without a user namespace (the zygote) the ids are the host's own.
    const std::uint32_t uid_value = zygote ? spec.ids.host_uid(kSandboxUid) : kSandboxUid;
    const std::string uid = std::to_string(uid_value);

    json mounts = json::array();
    mounts.push_back({{"destination", "/proc"},
                      {"type", "proc"},
                      {"source", "proc"},
                      {"options", {"nosuid", "noexec", "nodev"}}});
    mounts.push_back(tmpfs_mount("/dev", {"nosuid", "strictatime", "mode=755", "size=64k"}));
    mounts.push_back(
        {{"destination", "/dev/pts"},
         {"type", "devpts"},
         {"source", "devpts"},
         {"options", {"nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"}}});
    mounts.push_back(
        tmpfs_mount("/dev/shm", {"nosuid", "noexec", "nodev", "mode=1777", size_mb(lim.shm_mb)}));
    mounts.push_back({{"destination", "/dev/mqueue"},
                      {"type", "mqueue"},
                      {"source", "mqueue"},
                      {"options", {"nosuid", "noexec", "nodev"}}});
    mounts.push_back({{"destination", "/sys"},
                      {"type", "sysfs"},
                      {"source", "sysfs"},
                      {"options", {"nosuid", "noexec", "nodev", "ro"}}});
    if (spec.image.rootfs == "host") {
        mounts.push_back(bind_mount("/usr", "/usr", true, /*exec=*/true));
    } else if (!spec.image.rootfs.empty() && spec.image.rootfs[0] == '/') {
        // A built or unpacked root: its own /usr again, nosuid like the host's
        // (the root itself is mounted without nosuid by the runtime).
        mounts.push_back(bind_mount((spec.rootfs / "usr").string(), "/usr", true, /*exec=*/true));
    }
    for (const auto& path : spec.image.host_binds) {
        mounts.push_back(bind_mount(path, path, true));
    }
    for (const auto& path : spec.image.hidden_paths) {
        mounts.push_back(
            tmpfs_mount(path, {"ro", "nosuid", "nodev", "noexec", "size=4k", "mode=755"}));
    }
    mounts.push_back(tmpfs_mount("/tmp", {"nosuid", "nodev", "mode=1777", size_mb(lim.disk_mb)}));
    mounts.push_back(tmpfs_mount(kSandboxHome, {"nosuid", "nodev", "mode=700", "uid=" + uid,
                                                "gid=" + uid, size_mb(lim.disk_mb)}));
    mounts.push_back(bind_mount(spec.ipc_dir.string(), kSandboxIpcDir, false));
    mounts.push_back(bind_mount(spec.input_dir.string(), kSandboxInputDir, true));
    mounts.push_back(bind_mount(spec.output_dir.string(), kSandboxOutputDir, false));
    mounts.push_back(bind_mount(spec.libexec_dir.string(), kSandboxLibexec, true, /*exec=*/true));

    std::vector<std::string> args{kSandboxShim, sandbox_protocol::kShimArgvEnd};
    if (zygote) {
        // The image's interpreter runs the zygote instead of the kernel launcher.
        args.push_back(spec.image.kernel_argv.at(0));
        args.push_back(std::string(kSandboxLibexec) + "/cellblock_zygote.py");
        args.push_back(sandbox_protocol::kZygoteSocketOption);
        args.push_back(kSandboxZygoteSocket);
        const auto option = [&args](const char* name, const std::vector<std::string>& modules) {
            std::string list;
            for (const auto& module : modules) list += (list.empty() ? "" : ",") + module;
            if (!list.empty()) args.insert(args.end(), {name, list});
        };
        option(sandbox_protocol::kZygotePreloadOption, spec.image.preload);
        option(sandbox_protocol::kZygoteWarmImportsOption, spec.image.warm_imports);
    } else {
        for (auto& arg : kernel_command(spec.image)) args.push_back(arg);
    }

    std::vector<std::string> env = sandbox_environment(spec.image);
    if (!runtime_passes_fds(kind)) {
        // The shim connects here instead of inheriting fd 3, and strips every
        // CELLBLOCK_ variable from the kernel's environment.
        env.push_back(std::string(kLifelineEnv) + "=" + kSandboxLifelineSocket);
    }
    if (spec.image.hibernate_level == "exact") {
        // The kernel's channels inside, the shim's bridge outside: the
        // sandbox then holds no host socket once quiesced (runsc checkpoint).
        env.push_back(std::string(sandbox_protocol::kBridgeEnv) + "=" +
                      sandbox_protocol::kBridgeDir);
    }
    if (spec.adopt_grace_ms > 0) {
        // A zygote waits too: its forks' mounts are its own (docs/zygote.md).
        env.push_back(std::string(sandbox_protocol::kAdoptGraceEnv) + "=" +
                      std::to_string(spec.adopt_grace_ms));
    }

    const json no_caps = json::array();
    json process = {
        {"terminal", false},
        {"user", {{"uid", uid_value}, {"gid", uid_value}}},
        {"args", args},
        {"env", env},
        {"cwd", kSandboxHome},
        {"noNewPrivileges", true},
        {"oomScoreAdj", 1000},
        {"capabilities",
         {{"bounding", no_caps},
          {"effective", no_caps},
          {"inheritable", no_caps},
          {"permitted", no_caps},
          {"ambient", no_caps}}},
        {"rlimits",
         {rlimit("RLIMIT_NOFILE", static_cast<std::uint64_t>(lim.nofile)), rlimit("RLIMIT_CORE", 0),
          // Under runc RLIMIT_NPROC counts the host uid, which every sandbox
          // shares: only a loose bound. gVisor counts the sandbox's own tasks.
          rlimit("RLIMIT_NPROC",
                 spec.nproc ? spec.nproc
                            : static_cast<std::uint64_t>(lim.pids) *
                                  (kind == RuntimeKind::runsc ? 1 : tuning::kRuncNprocFactor))}}};

    const std::int64_t memory = static_cast<std::int64_t>(lim.memory_mb) << 20;
    const std::int64_t period = tuning::kCpuPeriodUs;
    json resources = {
        {"memory", {{"limit", memory}, {"swap", memory}}},
        {"pids", {{"limit", host_pids_limit(kind, lim.pids)}}},
        {"cpu", {{"period", period}, {"quota", static_cast<std::int64_t>(lim.cpus * period)}}},
        {"devices", json::array({{{"allow", false}, {"access", "rwm"}}})}};

    json namespaces = json::array();
    for (const char* ns : {"pid", "network", "ipc", "uts", "mount", "user", "cgroup"}) {
        // The zygote's forks become sessions that must outlive it: no PID
        // namespace whose end would end them; and no user namespace, so that
        // each fork's own one can map the session's own host ids.
        if (zygote && (std::string(ns) == "pid" || std::string(ns) == "user")) continue;
        namespaces.push_back({{"type", ns}});
    }
    json masked = {"/proc/acpi",        "/proc/asound",  "/proc/interrupts",
                   "/proc/kcore",       "/proc/keys",    "/proc/latency_stats",
                   "/proc/sched_debug", "/proc/scsi",    "/proc/timer_list",
                   "/proc/timer_stats", "/sys/firmware", "/sys/devices/virtual/powercap"};
    json read_only = {"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"};
    if (zygote) {
        // Each fork mounts its own /proc and /sys and masks them itself.
        masked = json::array();
        read_only = json::array();
    }
    json linux_section = {{"namespaces", namespaces},
                          {"cgroupsPath", "/" + spec.cgroup_parent + "/" + spec.container_id},
                          {"resources", resources},
                          {"seccomp", make_seccomp_profile(kind, spec.role)},
                          {"maskedPaths", masked},
                          {"readonlyPaths", read_only}};
    if (!zygote) {
        linux_section["uidMappings"] = id_mapping(spec.ids);
        linux_section["gidMappings"] = id_mapping(spec.ids);
    }

    return {{"ociVersion", "1.0.2"},
            {"process", process},
            {"root", {{"path", spec.rootfs.string()}, {"readonly", true}}},
            {"hostname", "sandbox"},
            {"mounts", mounts},
            {"linux", linux_section}};
}

namespace {

void write_file(const fs::path& path, const std::string& text) {
    std::ofstream out(path, std::ios::trunc);
    out << text;
    if (!out) throw std::runtime_error("rootfs: cannot write " + path.string());
}

void make_dirs(const fs::path& path) {
    std::error_code ec;
    fs::create_directories(path, ec);
    if (ec) throw std::runtime_error("rootfs: mkdir " + path.string() + ": " + ec.message());
}

}  // namespace

void prepare_host_rootfs(const SandboxSpec& spec, const json& oci_config) {
    const fs::path& root = spec.rootfs;
    make_dirs(root);
    for (const char* dir : {"usr", "etc", "proc", "dev", "sys", "run", "opt", "data"}) {
        make_dirs(root / dir);
    }
    for (const char* link : {"bin", "lib", "lib64", "sbin"}) {
        std::error_code ec;
        fs::create_directory_symlink(std::string("usr/") + link, root / link, ec);
    }
    // The runtime maps container root to an unprivileged host id, which cannot
    // create mount points in a root-owned tree: create each one here.
    for (const auto& mount : oci_config.at("mounts")) {
        const std::string destination = mount.at("destination");
        const fs::path target = root / destination.substr(1);
        const bool is_file_bind = mount.at("type") == "bind" &&
                                  fs::is_regular_file(mount.at("source").get<std::string>());
        if (is_file_bind) {
            make_dirs(target.parent_path());
            if (!fs::exists(target)) write_file(target, "");
        } else {
            make_dirs(target);
        }
    }
    // tmpfs takes the mode of its mount point under runc (seen with runc 1.1.5).
    ::chmod((root / "tmp").c_str(), 01777);
    ::chmod((root / "dev/shm").c_str(), 01777);

    const std::string uid = std::to_string(kSandboxUid);
    write_file(root / "etc/passwd",
               "root:x:0:0:root:/root:/usr/sbin/nologin\n"
               "sandbox:x:" +
                   uid + ":" + uid + ":sandbox:" + kSandboxHome +
                   ":/bin/sh\n"
                   "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n");
    write_file(root / "etc/group", "root:x:0:\nsandbox:x:" + uid + ":\nnogroup:x:65534:\n");
    write_file(root / "etc/hosts", "127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost\n");
    write_file(root / "etc/hostname", "sandbox\n");
    write_file(root / "etc/nsswitch.conf", "passwd: files\ngroup: files\nhosts: files\n");
}

}  // namespace cellblock
