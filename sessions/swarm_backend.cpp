// The Docker Swarm backend (swarm_backend.hpp, docs/scale-out.md). Over 500
// lines with a reason: the service spec it builds and the task states it
// watches are the two halves of one contract with the engine, and read best
// side by side; the HTTP client is docker_api.cpp.
#include "cellblock/swarm_backend.hpp"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>
#include <utility>

#include <spdlog/spdlog.h>
#include <zmq.h>

#include "cellblock/error_names.hpp"
#include "cellblock/image_builder.hpp"
#include "cellblock/oci_bundle.hpp"
#include "cellblock/runc_sandbox.hpp"
#include "cellblock/sandbox_protocol.hpp"
#include "cellblock/sha256.hpp"
#include "cellblock/signer.hpp"
#include "cellblock/unique_fd.hpp"
#include "cellblock/zygote.hpp"
#include "docker_api.hpp"

namespace cellblock {
namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

// The kernel's ports inside every session's container, in Channel order
// of the connection file: shell, iopub, stdin, control, hb.
constexpr int kFirstKernelPort = sandbox_protocol::kEngineFirstKernelPort;
// The connection file, a Swarm secret: a file only the sandbox's uid reads.
constexpr const char* kSecretFile = "cellblock-connection.json";
constexpr const char* kSecretPath = "/run/secrets/cellblock-connection.json";
// A gateway session's ipc dir in its task: a trust store and a socket.
constexpr int kIpcDirMb = 4;
constexpr std::int64_t kNanoPerCore = 1000000000;
// New tasks a start gives a service whose task's container did not start.
constexpr std::size_t kStartRetries = 2;
// The connection file's ports, in the order of the container's ports from kFirstKernelPort.
constexpr int ConnectionInfo::*kKernelPorts[] = {
    &ConnectionInfo::shell_port, &ConnectionInfo::iopub_port, &ConnectionInfo::stdin_port,
    &ConnectionInfo::control_port, &ConnectionInfo::hb_port};
constexpr int kKernelPortCount = std::size(kKernelPorts);
static_assert(kKernelPortCount == sandbox_protocol::kEngineKernelPortCount);

// A field of the engine's node JSON, e.g. ("Status", "State"), ("Description",
// "Hostname"), ("Spec", "Availability"); `fallback` where it is absent.
std::string node_field(const json& node, const char* object, const char* field,
                       const std::string& fallback = "") {
    auto it = node.find(object);
    if (it == node.end() || !it->is_object()) return fallback;
    auto value = it->find(field);
    return value != it->end() && value->is_string() ? value->get<std::string>() : fallback;
}

std::string base64(const std::string& in) {
    static const char* table = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::string out;
    std::size_t i = 0;
    for (; i + 2 < in.size(); i += 3) {
        const unsigned v = (static_cast<unsigned char>(in[i]) << 16) |
                           (static_cast<unsigned char>(in[i + 1]) << 8) |
                           static_cast<unsigned char>(in[i + 2]);
        for (int shift : {18, 12, 6, 0}) out += table[(v >> shift) & 63];
    }
    if (i < in.size()) {
        unsigned v = static_cast<unsigned char>(in[i]) << 16;
        if (i + 1 < in.size()) v |= static_cast<unsigned char>(in[i + 1]) << 8;
        out += table[(v >> 18) & 63];
        out += table[(v >> 12) & 63];
        out += i + 1 < in.size() ? table[(v >> 6) & 63] : '=';
        out += '=';
    }
    return out;
}

json tmpfs(const std::string& target, int size_mb, int mode) {
    return {{"Type", "tmpfs"},
            {"Target", target},
            {"TmpfsOptions",
             {{"SizeBytes", static_cast<std::int64_t>(size_mb) << 20}, {"Mode", mode}}}};
}

json bind_ro(const std::string& path) {
    return {{"Type", "bind"}, {"Source", path}, {"Target", path}, {"ReadOnly", true}};
}

// A new task for `service_id` (its spec's ForceUpdate counter raised): what
// the engine does for a task whose container it failed to start.
void force_new_task(const DockerApi& api, const std::string& service_id) {
    const json service = api.expect("GET", "/services/" + service_id);
    json spec = service.value("Spec", json::object());
    json& task = spec["TaskTemplate"];
    task["ForceUpdate"] = task.value("ForceUpdate", 0) + 1;
    const auto version = service.value("Version", json::object()).value("Index", std::uint64_t{0});
    api.expect("POST", "/services/" + service_id + "/update?version=" + std::to_string(version),
               &spec);
}

// The end of a service's stdout and stderr, from the engine's log stream
// (8-byte frame headers: stream, 0, 0, 0, big-endian length).
std::string service_log_tail(const DockerApi& api, const std::string& service_id) {
    try {
        const DockerResponse r =
            api.call("GET", "/services/" + service_id + "/logs?stdout=1&stderr=1&tail=40");
        if (r.status != 200) return {};
        std::string out;
        std::string_view in(r.text);
        while (in.size() >= 8) {
            const std::size_t size = (static_cast<unsigned char>(in[4]) << 24) |
                                     (static_cast<unsigned char>(in[5]) << 16) |
                                     (static_cast<unsigned char>(in[6]) << 8) |
                                     static_cast<unsigned char>(in[7]);
            in.remove_prefix(8);
            out.append(in.substr(0, size));
            in.remove_prefix(std::min(size, in.size()));
        }
        return out.size() > 2000 ? out.substr(out.size() - 2000) : out;
    } catch (const std::exception& e) {
        return std::string("(its log could not be read: ") + e.what() + ")";
    }
}

fs::path server_id_file(const fs::path& state_dir) { return state_dir / "swarm" / "server-id"; }

// The server's Swarm identity kept in `state_dir`, or "" when it has none.
std::string read_server_id(const fs::path& state_dir) {
    std::string id;
    if (std::ifstream in(server_id_file(state_dir)); in) in >> id;
    return id.size() == 16 ? id : std::string();
}

std::string read_or_create_server_id(const fs::path& state_dir) {
    const fs::path dir = server_id_file(state_dir).parent_path();
    fs::create_directories(dir);
    fs::permissions(dir, fs::perms::owner_all, fs::perm_options::replace);
    std::string id = read_server_id(state_dir);
    if (!id.empty()) return id;
    id = make_random_key().substr(0, 16);
    std::ofstream(server_id_file(state_dir)) << id << "\n";
    return id;
}

}  // namespace

class SwarmSandbox;

// What a session's sandbox and the backend's watcher share: the engine and
// the register of live services. Sandboxes hold it, so that one destroyed
// after the backend still removes its service.
struct SwarmState {
    explicit SwarmState(const std::string& host)
        : api(host), quick_api(host, std::chrono::seconds(2)) {}
    DockerApi api;
    // For what runs on the server's loop (a kill): a hung engine must not
    // hold the loop for long. What fails there is done again by destroy().
    DockerApi quick_api;
    // The nodes as the watcher last saw them (`cellblock ls` reads this,
    // never the engine, from the loop), and why the last look failed.
    json nodes = json::array();
    std::string watch_error;
    std::mutex mutex;
    std::map<std::string, SwarmSandbox*> live;  // service id → sandbox
    // The kernel uids of the services started or adopted and not yet
    // destroyed (swarm_uid_block_start), and where the next search starts:
    // a uid just given back is the last taken again, not the first.
    std::set<std::uint32_t> uids;
    std::uint32_t next_uid_slot = 0;

    // A uid of the block starting at `first` that no live service of this
    // server has. Throws SandboxError when all kSwarmUidBlock are taken.
    std::uint32_t take_uid(std::uint32_t first) {
        std::lock_guard lock(mutex);
        for (std::uint32_t n = 0; n < kSwarmUidBlock; ++n) {
            const std::uint32_t uid = first + (next_uid_slot + n) % kSwarmUidBlock;
            if (uids.insert(uid).second) {
                next_uid_slot = (uid - first + 1) % kSwarmUidBlock;
                return uid;
            }
        }
        throw SandboxError("swarm: every one of the server's " + std::to_string(kSwarmUidBlock) +
                           " session uids is in use");
    }
    void give_back_uid(std::uint32_t uid) {
        std::lock_guard lock(mutex);
        uids.erase(uid);
    }

    void remove(const std::string& service_id, const std::string& secret_id,
                bool quick = false) noexcept {
        try {
            if (!service_id.empty()) {
                (quick ? quick_api : api).expect("DELETE", "/services/" + service_id, nullptr, 404);
            }
        } catch (const std::exception& e) {
            spdlog::warn("swarm: removing service {}: {}", service_id, e.what());
        }
        // The service's removal releases the secret; the engine may take a
        // moment to see it.
        for (int attempt = 0; !secret_id.empty() && attempt < 20; ++attempt) {
            try {
                api.expect("DELETE", "/secrets/" + secret_id, nullptr, 404);
                return;
            } catch (const std::exception& e) {
                if (attempt == 19)
                    spdlog::warn("swarm: removing secret {}: {}", secret_id, e.what());
                ::usleep(100000);
            }
        }
    }

    // The names of the services labelled with `server_id`, but those in
    // `keep`; `remove`: removes them, and the secrets so labelled but
    // those in `keep_secrets`.
    std::vector<std::string> labelled(const std::string& server_id, bool remove,
                                      const std::set<std::string>& keep = {},
                                      const std::set<std::string>& keep_secrets = {}) {
        const std::string mine =
            "?filters=" + docker_filters({{"label", {"cellblock.server=" + server_id}}});
        std::vector<std::string> names;
        for (const auto& service : api.expect("GET", "/services" + mine)) {
            const std::string id = service.value("ID", "");
            if (keep.count(id)) continue;
            if (remove) this->remove(id, "");
            names.push_back(service.value("Spec", json::object()).value("Name", id));
        }
        if (remove) {
            for (const auto& secret : api.expect("GET", "/secrets" + mine)) {
                const std::string id = secret.value("ID", "");
                if (!keep_secrets.count(id)) this->remove("", id);
            }
        }
        return names;
    }
};

SwarmTaskEnd read_task_end(std::string_view log_tail) {
    // The shim's lines, without its prefix (shim.cpp's say()).
    constexpr std::string_view kShimPrefix = sandbox_protocol::kShimLogPrefix;
    std::vector<std::string_view> lines;
    while (!log_tail.empty()) {
        const auto end = log_tail.find('\n');
        std::string_view line = log_tail.substr(0, end);
        log_tail.remove_prefix(end == std::string_view::npos ? log_tail.size() : end + 1);
        if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
        if (line.starts_with(kShimPrefix)) lines.push_back(line.substr(kShimPrefix.size()));
    }
    SwarmTaskEnd out;
    if (lines.empty() || sandbox_protocol::parse_kernel_exit(lines.back()).how ==
                             sandbox_protocol::KernelExit::How::unknown) {
        return out;
    }
    out.kernel_exit = describe_kernel_exit(lines.back());
    out.memory_limit_reached =
        lines.size() >= 2 && lines[lines.size() - 2] == sandbox_protocol::kMemoryLimitReached;
    return out;
}

class SwarmSandbox final : public Sandbox {
  public:
    SwarmSandbox(std::shared_ptr<SwarmState> state, std::string service_id, std::string secret_id,
                 std::string task_id, std::string node_id, std::string node_name, std::uint32_t uid)
        : state_(std::move(state)),
          uid_(uid),
          secret_id_(std::move(secret_id)),
          task_id_(std::move(task_id)),
          node_id_(std::move(node_id)),
          node_name_(std::move(node_name)),
          event_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
        container_id_ = std::move(service_id);
        if (!event_) throw SandboxError("eventfd for service " + container_id_ + " failed");
    }
    ~SwarmSandbox() override { destroy(); }

    const std::string& runtime() const override {
        static const std::string name = "swarm";
        return name;
    }
    int lifeline_fd() const override { return event_.get(); }
    bool read_lifeline() override {
        std::uint64_t n;
        [[maybe_unused]] auto r = ::read(event_.get(), &n, sizeof n);
        std::lock_guard lock(mutex_);
        if (!lost_.empty()) exited_ = true;
        return !exited_;
    }
    bool exited() const override {
        std::lock_guard lock(mutex_);
        return exited_;
    }
    std::string exit_description() const override {
        std::lock_guard lock(mutex_);
        return lost_.empty() ? "the service was removed" : lost_;
    }
    std::string log_tail() const override { return service_log_tail(state_->api, container_id_); }
    bool node_lost() const override {
        std::lock_guard lock(mutex_);
        return node_lost_;
    }
    bool moving() const override {
        std::lock_guard lock(mutex_);
        return moving_ && lost_.empty();
    }
    // Removing the service stops the task with its stop grace, which the
    // shim holds (it waits out a drain): the kernel exits sooner if asked.
    bool kill_is_slow() const override { return true; }
    // The engine's per-task figures cannot be read from a manager: the usage
    // is what the kernel last reported of its task's cgroup (zeros until its
    // first reply), and whether the memory limit ended it is what its shim
    // wrote to the task's log (read_task_end).
    bool memory_limit_hit() const override {
        std::lock_guard lock(mutex_);
        return memory_limit_hit_;
    }
    SandboxUsage usage() const override {
        std::lock_guard lock(mutex_);
        return reported_;
    }
    bool take_reported_usage(const SandboxUsage& usage) override {
        std::lock_guard lock(mutex_);
        reported_ = usage;
        return true;
    }
    // No capability: its files, cgroups and processes are on another node
    // (files(), cpu() and host_process() are null).

    // The engine has no way to signal a task's process from the manager:
    // the relay asks the kernel on its control channel.
    bool interrupt() override { return false; }
    void kill() override {
        {
            std::lock_guard lock(mutex_);
            if (killed_) return;
            killed_ = true;
        }
        state_->remove(container_id_, "", /*quick=*/true);
    }
    void destroy() override {
        {
            std::lock_guard lock(mutex_);
            if (destroyed_) return;
            destroyed_ = true;
            exited_ = true;
        }
        {
            std::lock_guard lock(state_->mutex);
            state_->live.erase(container_id_);
        }
        state_->remove(container_id_, secret_id_);
        state_->give_back_uid(uid_);  // once its task is gone
    }
    void apply_limits(const SandboxLimits& limits) override {
        const SandboxLimits& a = limits_;
        if (a.memory_mb != limits.memory_mb || a.pids != limits.pids || a.cpus != limits.cpus) {
            throw SandboxError("service " + container_id_ +
                               ": its limits are fixed at its creation");
        }
    }

    bool is_lost() const {
        std::lock_guard lock(mutex_);
        return !lost_.empty() || destroyed_;
    }
    // From the watcher, under the state's lock: its node is being drained.
    // Said once.
    void drained() {
        {
            std::lock_guard lock(mutex_);
            if (moving_ || !lost_.empty() || destroyed_) return;
            moving_ = true;
        }
        const std::uint64_t one = 1;
        [[maybe_unused]] auto r = ::write(event_.get(), &one, sizeof one);
    }
    // From the watcher, under the state's lock.
    void lost(const std::string& why, bool node, const SwarmTaskEnd& end = {}) {
        {
            std::lock_guard lock(mutex_);
            if (!lost_.empty() || destroyed_) return;
            lost_ = why;
            if (moving_) lost_ += " (its node was drained before the session could move)";
            if (!end.kernel_exit.empty()) lost_ += " (" + end.kernel_exit + ")";
            if (end.memory_limit_reached) {
                lost_ += " (memory limit of " + std::to_string(limits_.memory_mb) + " MB reached)";
            }
            node_lost_ = node;
            memory_limit_hit_ = end.memory_limit_reached;
        }
        const std::uint64_t one = 1;
        [[maybe_unused]] auto r = ::write(event_.get(), &one, sizeof one);
    }
    // Everything adopt() checks against the engine, and the inner connection
    // with its key (the service's secret cannot be read back).
    std::optional<json> adoption_record() const override {
        return json{{"backend", "swarm"},  {"service_id", container_id_}, {"secret_id", secret_id_},
                    {"task_id", task_id_}, {"node_id", node_id_},         {"node_name", node_name_},
                    {"uid", uid_},         {"kernel", inner_.to_json()}};
    }
    const std::string& secret_id() const { return secret_id_; }
    const std::string& task_id() const { return task_id_; }
    const std::string& node_id() const { return node_id_; }
    const std::string& node_name() const { return node_name_; }

    void set_identity(const std::string& session_id, const ConnectionInfo& inner,
                      const Image& image, const SandboxLimits& limits) {
        session_id_ = session_id;
        inner_ = inner;
        image_name_ = image.name;
        preload_ = image.preload;
        limits_ = limits;
    }

  private:
    std::shared_ptr<SwarmState> state_;
    std::uint32_t uid_;  // its kernel's, reserved in state_->uids until destroy()
    std::string secret_id_, task_id_, node_id_, node_name_;
    UniqueFd event_;
    mutable std::mutex mutex_;
    std::string lost_;
    SandboxUsage reported_;
    bool node_lost_ = false;
    bool moving_ = false;
    bool memory_limit_hit_ = false;
    bool exited_ = false;
    bool killed_ = false;
    bool destroyed_ = false;
};

std::string swarm_image_ref(const SwarmSettings& settings, const Image& image) {
    if (auto it = settings.images.find(image.name); it != settings.images.end()) return it->second;
    std::string tag = image.rootfs == "host" || image.content_id.empty()
                          ? std::string("host")
                          : image.content_id.substr(0, 12);
    if (!settings.libexec_tag.empty()) tag += "-" + settings.libexec_tag;
    return "cellblock/" + image.name + ":" + tag;
}

std::string libexec_digest(const fs::path& libexec_dir) {
    // Every file `image export` puts at /opt/cellblock (the whole directory,
    // kernel-shim/CMakeLists.txt): one more module of the launcher is covered
    // without a list to keep. The shim and the launcher must be there.
    for (const char* needed : {"cellblock-shim", "cellblock_ipykernel.py"}) {
        if (!fs::is_regular_file(libexec_dir / needed)) {
            throw SandboxError("no " + (libexec_dir / needed).string());
        }
    }
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(libexec_dir)) {
        if (entry.is_regular_file()) names.push_back(entry.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    std::string all;
    for (const auto& name : names) {
        std::ifstream in(libexec_dir / name, std::ios::binary);
        if (!in) throw SandboxError("cannot read " + (libexec_dir / name).string());
        std::stringstream bytes;
        bytes << in.rdbuf();
        all += name + '\0' + std::to_string(bytes.str().size()) + '\0' + bytes.str();
    }
    return sha256_hex(all).substr(0, 12);
}

std::uint32_t swarm_uid_block_start(const std::string& server_id) {
    const std::uint32_t block =
        static_cast<std::uint32_t>(std::stoul(sha256_hex(server_id).substr(0, 8), nullptr, 16)) %
        kSwarmUidBlocks;
    return kSwarmFirstUid + block * kSwarmUidBlock;
}

json swarm_service_spec(const SwarmSettings& settings, const std::string& server_id,
                        const std::string& session_id, const Image& image,
                        const SandboxLimits& limits, const SwarmTaskIdentity& task) {
    if (task.uid < kSwarmFirstUid || task.seccomp_hex.empty()) {
        throw SandboxError("swarm: a service needs a session uid and a seccomp program");
    }
    const std::string uid = std::to_string(task.uid);
    json command = {kSandboxShim, sandbox_protocol::kShimEngineOption, uid,
                    sandbox_protocol::kShimArgvEnd};
    for (const auto& arg : image.kernel_argv) {
        command.push_back(arg == "{connection_file}" ? std::string(kSecretPath) : arg);
    }
    json env = json::array();
    for (auto& var : sandbox_environment(image)) env.push_back(var);
    // The shim keeps it from the kernel's environment (it drops CELLBLOCK_*).
    env.push_back(std::string(sandbox_protocol::kSeccompBpfEnv) + "=" + task.seccomp_hex);
    if (settings.share_boot_memory) {
        env.push_back(std::string(sandbox_protocol::kShareBootMemoryEnv) + "=1");
        // str and bytes hashes seeded alike in every kernel: the same dicts,
        // the same pages (a seed only the session's own interpreter uses).
        env.push_back("PYTHONHASHSEED=0");
    }
    json mounts = json::array();
    if (image.rootfs == "host") {
        // The node's /usr, as a host image on runc binds the host's.
        mounts.push_back(bind_ro("/usr"));
        for (const auto& path : image.host_binds) mounts.push_back(bind_ro(path));
    }
    mounts.push_back(tmpfs("/tmp", limits.disk_mb, 01777));
    mounts.push_back(tmpfs(kSandboxHome, limits.disk_mb, 0700));
    mounts.push_back(tmpfs("/dev/shm", limits.shm_mb, 01777));
    mounts.push_back(tmpfs(kSandboxOutputDir, limits.output_mb, 0755));
    // The kernel writes its uploads here itself (the front sends the bytes
    // over its control channel: server/kernel_files.hpp); disk_mb, as the
    // front's cap on what is put there.
    mounts.push_back(tmpfs(kSandboxInputDir, limits.disk_mb, 0755));
    json ports = json::array();
    for (int i = 0; i < kKernelPortCount; ++i) {
        ports.push_back(
            {{"Protocol", "tcp"}, {"TargetPort", kFirstKernelPort + i}, {"PublishMode", "host"}});
    }
    if (settings.egress_tunnel) {
        // The egress tunnel (server/egress_tunnel.hpp): its port, and the
        // ipc dir where the kernel writes the trust store and listens for
        // the shim's forwarder once the front says hello (a session without
        // the gateway never does, and its code is told it has no network).
        ports.push_back({{"Protocol", "tcp"},
                         {"TargetPort", sandbox_protocol::kEgressTunnelPort},
                         {"PublishMode", "host"}});
        mounts.push_back(tmpfs(sandbox_protocol::kIpcDir, kIpcDirMb, 0755));
    }
    const json labels = {{"cellblock.server", server_id},
                         {"cellblock.session", session_id},
                         {"cellblock.image", image.name}};
    json container = {
        {"Image", swarm_image_ref(settings, image)},
        {"Labels", labels},
        {"Command", command},
        {"Env", env},
        // The shim starts as root only to delete the default route, own the
        // home tmpfs and drop to the sandbox's uid; it keeps these four
        // capabilities until then and none after (kernel-shim/shim.cpp).
        {"User", "0:0"},
        {"CapabilityDrop", {"ALL"}},
        {"CapabilityAdd", {"CAP_NET_ADMIN", "CAP_SETUID", "CAP_SETGID", "CAP_CHOWN"}},
        {"ReadOnly", true},
        {"Hostname", "sandbox"},
        {"Init", false},
        // How long a drained node's task has to move its session (the shim
        // holds the engine's SIGTERM: SessionProxy::ask_kernel_to_exit).
        {"StopGracePeriod", static_cast<std::int64_t>(settings.drain_grace.count()) * 1000 * 1000},
        {"Mounts", mounts},
        {"Secrets",
         {{{"SecretID", task.secret_id},
           {"SecretName", task.secret_name},
           {"File", {{"Name", kSecretFile}, {"UID", uid}, {"GID", uid}, {"Mode", 0400}}}}}},
        {"Ulimits", {{{"Name", "nofile"}, {"Soft", limits.nofile}, {"Hard", limits.nofile}}}},
    };
    json resources = {{"Limits",
                       {{"MemoryBytes", static_cast<std::int64_t>(limits.memory_mb) << 20},
                        {"NanoCPUs", static_cast<std::int64_t>(limits.cpus * kNanoPerCore)},
                        {"Pids", limits.pids}}}};
    return {{"Name", "cb-" + session_id},
            {"Labels", labels},
            {"TaskTemplate",
             {{"ContainerSpec", container},
              {"Resources", resources},
              // Never a silent new kernel: a task that ends stays ended.
              {"RestartPolicy", {{"Condition", "none"}, {"MaxAttempts", 0}}},
              {"Networks", {{{"Target", settings.network}}}}}},
            {"Mode", {{"Replicated", {{"Replicas", 1}}}}},
            {"EndpointSpec", {{"Mode", "dnsrr"}, {"Ports", ports}}}};
}

SwarmBackend::SwarmBackend(SwarmSettings settings)
    : settings_(std::move(settings)), state_(std::make_shared<SwarmState>(settings_.docker_host)) {
    if (settings_.libexec_tag.empty() && !settings_.libexec_dir.empty()) {
        settings_.libexec_tag = libexec_digest(settings_.libexec_dir);
    }
    const json info = state_->api.expect("GET", "/info");
    const json swarm = info.value("Swarm", json::object());
    if (swarm.value("LocalNodeState", "") != "active" || !swarm.value("ControlAvailable", false)) {
        throw SandboxError("docker host " + settings_.docker_host +
                           " is not a Swarm manager (docker swarm init, or a manager's socket)");
    }
    server_id_ = read_or_create_server_id(settings_.state_dir);
    // The profile a runc session gets, compiled once: the same for every session
    // (with same-page merging allowed where the server shares boot memory).
    seccomp_hex_ = to_lower_hex(compile_seccomp_bpf(make_seccomp_profile(
        RuntimeKind::runc, SandboxRole::session, settings_.share_boot_memory)));
    state_->nodes = state_->api.expect("GET", "/nodes");
    watcher_ = std::thread([this] { watch(); });
}

std::unique_ptr<Sandbox> SwarmBackend::adopt(const std::string& session_id, const json& record,
                                             const Image& image, const SandboxLimits& limits) {
    DockerApi& api = state_->api;
    const std::string service_id = record.at("service_id").get<std::string>();
    const std::string task_id = record.at("task_id").get<std::string>();
    const json service = api.expect("GET", "/services/" + service_id, nullptr, 404);
    if (!service.contains("Spec")) throw SandboxError("its service " + service_id + " is gone");
    const json labels = service.value("Spec", json::object()).value("Labels", json::object());
    if (labels.value("cellblock.server", "") != server_id_ ||
        labels.value("cellblock.session", "") != session_id) {
        throw SandboxError("service " + service_id +
                           " is not this session's (its labels: " + labels.dump() + ")");
    }
    // The same task, still running, on a node still ready: a task the engine
    // replaced would be a new kernel without the session's state.
    json task;
    for (const auto& t :
         api.expect("GET", "/tasks?filters=" + docker_filters({{"service", {service_id}}}))) {
        if (t.value("ID", "") == task_id) task = t;
    }
    const std::string task_state =
        task.is_null() ? "gone" : task.value("Status", json::object()).value("State", "");
    if (task_state != "running") {
        throw SandboxError("its task " + task_id.substr(0, 12) + " is " + task_state);
    }
    const std::string node_id = record.at("node_id").get<std::string>();
    const json node = api.expect("GET", "/nodes/" + node_id);
    if (task.value("NodeID", "") != node_id || node_field(node, "Status", "State") != "ready") {
        throw SandboxError("its node " + record.value("node_name", node_id) + " is " +
                           node_field(node, "Status", "State", "gone"));
    }
    // Its uid stays taken (a record from before per-session uids has none:
    // its kernel runs as kSandboxUid, outside every block).
    const auto uid = record.value("uid", static_cast<std::uint32_t>(kSandboxUid));
    auto box = std::make_unique<SwarmSandbox>(state_, service_id,
                                              record.at("secret_id").get<std::string>(), task_id,
                                              node_id, record.value("node_name", node_id), uid);
    box->set_identity(session_id, ConnectionInfo::from_json(record.at("kernel")), image, limits);
    std::lock_guard lock(state_->mutex);
    state_->live[service_id] = box.get();
    state_->uids.insert(uid);
    return box;
}

void SwarmBackend::remove_unclaimed() {
    // What an earlier run of this server left and no session took back
    // (adopt): its pool's services, and those whose records did not open.
    std::set<std::string> adopted_services, adopted_secrets;
    {
        std::lock_guard lock(state_->mutex);
        for (const auto& [service_id, box] : state_->live) {
            adopted_services.insert(service_id);
            adopted_secrets.insert(box->secret_id());
        }
    }
    reaped_ = state_->labelled(server_id_, true, adopted_services, adopted_secrets);
    for (const auto& name : reaped_) {
        spdlog::info("swarm: removed service {} left by an earlier run of this server", name);
    }
}

std::vector<std::string> swarm_services_left(const SwarmSettings& settings, bool remove) {
    // Read, never made: a state dir whose server had no Swarm identity left nothing.
    const std::string server_id = read_server_id(settings.state_dir);
    if (server_id.empty()) return {};
    return SwarmState(settings.docker_host).labelled(server_id, remove);
}

SwarmBackend::~SwarmBackend() {
    {
        std::lock_guard lock(wake_mutex_);
        stopping_ = true;
    }
    wake_.notify_all();
    if (watcher_.joinable()) watcher_.join();
}

std::optional<BackendRefusal> SwarmBackend::refuse(const Image& image) const {
    if (runtime_kind(image.runtime) == RuntimeKind::runc) return std::nullopt;
    return BackendRefusal{ename::UnknownRuntime,
                          "runtime '" + image.runtime +
                              "' is not available on the swarm backend: its services run on each "
                              "node engine's default runtime (runc)"};
}

bool SwarmBackend::can_serve(const Image&, const SandboxLimits& a, const SandboxLimits& b) const {
    return a.memory_mb == b.memory_mb && a.pids == b.pids && a.cpus == b.cpus &&
           a.disk_mb == b.disk_mb && a.shm_mb == b.shm_mb && a.output_mb == b.output_mb &&
           a.nofile == b.nofile;
}

std::unique_ptr<Sandbox> SwarmBackend::start(const std::string& session_id, const Image& image,
                                             const SandboxLimits& limits, bool /*background*/) {
    DockerApi& api = state_->api;
    ConnectionInfo kernel;
    kernel.transport = "tcp";
    kernel.ip = "0.0.0.0";
    for (int i = 0; i < kKernelPortCount; ++i) kernel.*kKernelPorts[i] = kFirstKernelPort + i;
    kernel.key = make_random_key();
    kernel.kernel_name = image.name;
    if (settings_.egress_tunnel) kernel.egress_port = sandbox_protocol::kEgressTunnelPort;
    const std::size_t published = kKernelPortCount + (kernel.egress_port ? 1 : 0);
    // The channels cross the network between the front and the node: the
    // kernel binds them as CurveZMQ servers with a key made for this session
    // (only its secret has it); the front keeps the public half.
    char public_key[41] = {}, secret_key[41] = {};
    if (zmq_curve_keypair(public_key, secret_key) != 0) {
        throw SandboxError(std::string("swarm: no CurveZMQ key for the kernel's channels: ") +
                           zmq_strerror(zmq_errno()));
    }
    kernel.curve_secret_key = secret_key;
    const json labels = {{"cellblock.server", server_id_}, {"cellblock.session", session_id}};
    const std::string secret_name = "cb-" + session_id + "-" + make_random_key().substr(0, 8);
    const json secret_spec = {
        {"Name", secret_name}, {"Labels", labels}, {"Data", base64(kernel.to_json().dump())}};
    SwarmTaskIdentity identity{api.expect("POST", "/secrets/create", &secret_spec).value("ID", ""),
                               secret_name, 0, seccomp_hex_};
    const std::string& secret_id = identity.secret_id;
    std::string service_id;
    try {
        identity.uid = state_->take_uid(swarm_uid_block_start(server_id_));
        const json spec =
            swarm_service_spec(settings_, server_id_, session_id, image, limits, identity);
        service_id = api.expect("POST", "/services/create", &spec).value("ID", "");
        if (service_id.empty()) throw SandboxError("swarm: the engine gave the service no id");
        // Placed and running, with its five ports published on its node.
        const std::string query = "/tasks?filters=" + docker_filters({{"service", {service_id}}});
        const auto deadline = Clock::now() + settings_.start_timeout;
        json task;
        // Tasks whose container the engine failed to start, each followed by
        // a new one (kStartRetries at most): no kernel ever ran in them.
        std::set<std::string> not_started;
        for (;;) {
            task = nullptr;  // the newest task as the engine sees it now
            for (const auto& t : api.expect("GET", query)) {
                if (task.is_null() || t.value("CreatedAt", "") > task.value("CreatedAt", ""))
                    task = t;
            }
            const json status =
                task.is_null() ? json::object() : task.value("Status", json::object());
            const std::string state = status.value("State", "");
            if (state == "running" &&
                status.value("PortStatus", json::object()).value("Ports", json::array()).size() ==
                    published) {
                break;
            }
            const std::string task_id = task.is_null() ? "" : task.value("ID", "");
            if (not_started.count(task_id)) {  // its successor is not listed yet
                ::usleep(50000);
                continue;
            }
            // Seen under load on this host's docker-in-docker nodes: "starting
            // container failed: unable to remount dir as readonly: mount
            // tmpfs:…/secrets …: device or resource busy". The service's own
            // restart policy is none (a task that ran stays ended), so a task
            // that never started is replaced here, and only that one.
            const std::string err = status.value("Err", "");
            if (state == "failed" && err.starts_with("starting container failed") &&
                not_started.size() < kStartRetries) {
                not_started.insert(task_id);
                spdlog::warn(
                    "swarm service cb-{}: its task's container did not start ({}); a "
                    "new task ({} of {})",
                    session_id, err, not_started.size(), kStartRetries);
                force_new_task(api, service_id);
                continue;
            }
            if (state == "failed" || state == "rejected" || state == "shutdown" ||
                state == "complete" || state == "orphaned" || state == "remove") {
                throw SandboxError("swarm service cb-" + session_id + ": task " + state + ": " +
                                   status.value("Err", status.value("Message", "")) +
                                   "; log: " + service_log_tail(api, service_id));
            }
            if (abandoned_) {
                throw SandboxError("swarm service cb-" + session_id +
                                   ": its start was abandoned (the server is stopping)");
            }
            // Assigned to a node that has since gone down (the engine places
            // on a node until it is marked down): it would wait there until
            // the timeout, and the pool's workers with it. Fail now; the next
            // start goes to a live node.
            if (const std::string node_id = task.is_null() ? "" : task.value("NodeID", "");
                !node_id.empty()) {
                std::lock_guard lock(state_->mutex);
                for (const auto& node : state_->nodes) {
                    const std::string node_state = node_field(node, "Status", "State", "ready");
                    if (node.value("ID", "") == node_id && node_state != "ready") {
                        throw SandboxError("swarm service cb-" + session_id + ": placed on node " +
                                           node_field(node, "Description", "Hostname", node_id) +
                                           ", which is " + node_state + " (task state " +
                                           (state.empty() ? "none" : state) + ")");
                    }
                }
            }
            if (Clock::now() > deadline) {
                throw SandboxError("swarm service cb-" + session_id + " not running within " +
                                   std::to_string(settings_.start_timeout.count() / 1000) +
                                   " s (task state " + (state.empty() ? "none" : state) + ": " +
                                   status.value("Err", status.value("Message", "")) + ")");
            }
            ::usleep(50000);
        }
        ConnectionInfo inner = kernel;
        inner.curve_server_key = public_key;
        inner.curve_secret_key.clear();
        for (const auto& port : task["Status"]["PortStatus"]["Ports"]) {
            const int i = port.value("TargetPort", 0) - kFirstKernelPort;
            if (i >= 0 && i < kKernelPortCount)
                inner.*kKernelPorts[i] = port.value("PublishedPort", 0);
            if (port.value("TargetPort", 0) == sandbox_protocol::kEgressTunnelPort)
                inner.egress_port = port.value("PublishedPort", 0);
        }
        const std::string node_id = task.value("NodeID", "");
        const json node = api.expect("GET", "/nodes/" + node_id);
        const std::string node_name = node_field(node, "Description", "Hostname", node_id);
        inner.ip = settings_.connect_host.empty() ? node_field(node, "Status", "Addr")
                                                  : settings_.connect_host;
        if (inner.ip.empty()) throw SandboxError("swarm node " + node_name + " has no address");
        auto box = std::make_unique<SwarmSandbox>(
            state_, service_id, secret_id, task.value("ID", ""), node_id, node_name,
            std::exchange(identity.uid, 0));  // the box gives it back
        box->set_identity(session_id, inner, image, limits);
        {
            std::lock_guard lock(state_->mutex);
            state_->live[service_id] = box.get();
        }
        spdlog::debug("swarm: session {} on node {} (service {})", session_id, node_name,
                      service_id.substr(0, 12));
        return box;
    } catch (...) {
        state_->remove(service_id, secret_id);
        if (identity.uid != 0) state_->give_back_uid(identity.uid);
        throw;
    }
}

void SwarmBackend::watch() {
    std::unique_lock wake_lock(wake_mutex_);
    while (!stopping_) {
        wake_.wait_for(wake_lock, settings_.watch_interval, [this] { return stopping_; });
        if (stopping_) break;
        wake_lock.unlock();
        try {
            const json listed = state_->api.expect("GET", "/nodes");
            std::map<std::string, json> nodes;
            for (const auto& node : listed) nodes[node.value("ID", "")] = node;
            // Judged below: only sessions registered before the tasks are
            // listed (a session registers once its task runs, so its task
            // is in the list; one registered after could be missing from it).
            std::set<std::string> judged;
            {
                std::lock_guard lock(state_->mutex);
                state_->nodes = listed;
                for (const auto& [service_id, box] : state_->live) judged.insert(service_id);
                if (!state_->watch_error.empty()) {
                    spdlog::info("swarm: the engine answers again");
                    state_->watch_error.clear();
                }
            }
            std::map<std::string, json> tasks;
            if (!judged.empty()) {
                for (const auto& task : state_->api.expect("GET", "/tasks")) {
                    tasks[task.value("ID", "")] = task;
                }
            }
            std::lock_guard lock(state_->mutex);
            for (auto& [service_id, box] : state_->live) {
                if (!judged.count(service_id)) continue;
                auto node = nodes.find(box->node_id());
                const std::string node_state =
                    node == nodes.end() ? "gone" : node_field(node->second, "Status", "State");
                if (node_state != "ready") {
                    box->lost("node " + box->node_name() + " is " + node_state +
                                  " (the session's kernel and its state went with it)",
                              true);
                    continue;
                }
                // Drained: the engine stops the task once its stop grace is
                // over; the session moves meanwhile.
                if (node_field(node->second, "Spec", "Availability") == "drain") box->drained();
                auto task = tasks.find(box->task_id());
                const json status = task == tasks.end()
                                        ? json::object()
                                        : task->second.value("Status", json::object());
                const std::string state = status.value("State", "gone");
                if (state != "running" && !box->is_lost()) {
                    // Once, as the task is found ended: its shim's last lines say how.
                    box->lost("the kernel's task on node " + box->node_name() + " is " + state +
                                  (status.contains("Err") ? ": " + status.value("Err", "") : ""),
                              false, read_task_end(service_log_tail(state_->api, service_id)));
                }
            }
        } catch (const std::exception& e) {
            // Said once per change, not every second while the engine is away.
            std::lock_guard lock(state_->mutex);
            if (state_->watch_error != e.what()) {
                spdlog::warn("swarm: watching the services: {}", e.what());
                state_->watch_error = e.what();
            }
        }
        wake_lock.lock();
    }
}

void SwarmBackend::abandon_starts() { abandoned_ = true; }

json SwarmBackend::extras() {
    json out = json::array();
    std::lock_guard lock(state_->mutex);
    std::map<std::string, int> per_node;
    for (const auto& [id, box] : state_->live) ++per_node[box->node_id()];
    for (const auto& node : state_->nodes) {
        const std::string id = node.value("ID", "");
        out.push_back({{"kind", "node"},
                       {"node_id", id},
                       {"hostname", node_field(node, "Description", "Hostname")},
                       {"state", node_field(node, "Status", "State")},
                       {"availability", node_field(node, "Spec", "Availability")},
                       {"sandboxes", per_node[id]}});
    }
    if (!state_->watch_error.empty()) {
        out.push_back({{"kind", "error"}, {"message", state_->watch_error}});
    }
    return out;
}

}  // namespace cellblock
