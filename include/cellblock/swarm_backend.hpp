// The Docker Swarm backend (docs/scale-out.md): one session = one Swarm
// service running the image's kernel under cellblock-shim, placed by the
// engine on any node that can hold it. The server keeps the clients' keys,
// the policy and the relay; a service holds only its session's inner key
// (a Swarm secret) and publishes its five kernel ports on its node.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "cellblock/sandbox_backend.hpp"

namespace cellblock {

struct SwarmState;

struct SwarmSettings {
    // The engine API of a Swarm manager (serve --swarm-docker-host).
    std::string docker_host = "unix:///var/run/docker.sock";
    // Where the server reaches the ports a node publishes: empty, the node's
    // own address (Status.Addr); or one host for every node (a test swarm
    // whose workers' port ranges are forwarded to 127.0.0.1).
    std::string connect_host;
    // The network sessions are attached to (deploy/swarm/node-setup.sh):
    // no masquerade, no inter-container traffic, no new connections out of
    // it on any node. The shim also deletes the default route.
    std::string network = "cellblock-sessions";
    // Engine image references per cellblock image name; an image not named
    // here is "cellblock/NAME:CONTENT12-LIBEXEC12" (`cellblock image export`).
    std::map<std::string, std::string> images;
    // cellblock's shim and launcher, which an exported image carries: their
    // digest (libexec_digest) ends the default tags, so that a server never
    // places sessions on an image with another build's shim. Filled by
    // SwarmBackend from libexec_dir when empty.
    std::filesystem::path libexec_dir;
    std::string libexec_tag;
    // The server's own directory: its Swarm identity (server-id) lives there.
    std::filesystem::path state_dir;
    std::chrono::milliseconds watch_interval{1000};
    // A service's stop grace (serve --swarm-drain-grace): how long the task
    // of a session on a drained node keeps running while the session
    // hibernates and wakes on another node.
    std::chrono::milliseconds drain_grace{30000};
    std::chrono::milliseconds start_timeout{120000};
    // The server has an egress gateway (serve --egress-allow): every service
    // publishes the kernel's egress tunnel too (server/egress_tunnel.hpp),
    // used by the sessions the gateway serves. Sandboxes are pooled before
    // their session's network is known, as runc's all have the forwarder.
    bool egress_tunnel = false;
    // serve --swarm-share-boot-memory: every task's kernel boots with a fixed
    // layout and a fixed hash seed and marks its boot memory mergeable, so
    // a node's KSM keeps one copy of what identical kernels hold
    // (sandbox_protocol::kShareBootMemoryEnv; docs/scale-out.md, "Density").
    bool share_boot_memory = false;
};

// The engine image reference of an image (SwarmSettings::images, or the
// export tag "cellblock/NAME:CONTENT12-LIBEXEC12"; "host-LIBEXEC12" for a
// host image; without a libexec_tag, no suffix).
std::string swarm_image_ref(const SwarmSettings& settings, const Image& image);

// The first 12 hex digits of a SHA-256 over cellblock's files in
// `libexec_dir` (the shim, the kernel launcher, the zygote), names and bytes.
// Throws SandboxError when one is missing.
std::string libexec_digest(const std::filesystem::path& libexec_dir);

// The uids of a server's Swarm sessions on their nodes: one block of
// kSwarmUidBlock uids per server, chosen by its Swarm id among
// kSwarmUidBlocks, from kSwarmFirstUid up (below the local host-id pool,
// host_ids.hpp, and above any node's own users). Each live service of the
// server has a uid of its own in the block, so that no two of its sessions
// on one node share the per-uid limits of the node's kernel; two servers'
// blocks coincide with a chance of 1 in kSwarmUidBlocks (docs/scale-out.md).
inline constexpr std::uint32_t kSwarmFirstUid = 1u << 20;
inline constexpr std::uint32_t kSwarmUidBlock = 1u << 16;
inline constexpr std::uint32_t kSwarmUidBlocks = 1u << 13;
std::uint32_t swarm_uid_block_start(const std::string& server_id);

// What a session's task is given besides its image and limits.
struct SwarmTaskIdentity {
    std::string secret_id, secret_name;  // its connection file, a Swarm secret
    std::uint32_t uid = 0;               // the kernel's uid on its node (see above)
    // cellblock's seccomp program (compile_seccomp_bpf) as hex, for the shim
    // to install on top of the engine's profile (kSeccompBpfEnv).
    std::string seccomp_hex;
};

// The service spec of a session: what the engine is asked to run. Pure, so
// that its hardening is checked by a unit test.
nlohmann::json swarm_service_spec(const SwarmSettings& settings, const std::string& server_id,
                                  const std::string& session_id, const Image& image,
                                  const SandboxLimits& limits, const SwarmTaskIdentity& task);

// How a session's task ended, as its shim wrote it to the task's log (the
// log's end, read once the task is no longer running): the shim's last line
// (sandbox_protocol::kKernelExit, said as describe_kernel_exit says it; empty
// if the log does not end so) and whether the line before it is
// kMemoryLimitReached. Only lines the shim wrote count ("cellblock-shim: "),
// but the kernel's stderr goes through the shim too: a session can misstate
// its own end, never another's.
struct SwarmTaskEnd {
    std::string kernel_exit;
    bool memory_limit_reached = false;
};
SwarmTaskEnd read_task_end(std::string_view log_tail);

// The names of the services labelled with the Swarm identity kept in
// `settings.state_dir` (none when it has none); `remove`: removes them and
// their secrets too. What `cellblock keep` does for a crashed server that
// no server followed within its grace. Throws SandboxError.
std::vector<std::string> swarm_services_left(const SwarmSettings& settings, bool remove);

class SwarmBackend final : public SandboxBackend {
  public:
    // Reads or creates the server's Swarm identity and starts the watcher.
    // Throws SandboxError when the engine cannot be reached or is not a
    // Swarm manager. What an earlier run of this server left is adopted
    // (adopt) or removed (remove_unclaimed) next.
    explicit SwarmBackend(SwarmSettings settings);
    ~SwarmBackend() override;

    // Takes back a service an earlier run of this server left running
    // (docs/restarts.md, phase 3), from its session's adoption record: the
    // same service, labelled with this server's id and the session's, the
    // same task still running on a node still ready (a task the engine
    // replaced would be a new kernel). Throws SandboxError naming what does
    // not match; the service is then remove_unclaimed's.
    std::unique_ptr<Sandbox> adopt(const std::string& session_id, const nlohmann::json& record,
                                   const Image& image, const SandboxLimits& limits);
    // Removes every service and secret labelled with this server's id that
    // no adopted sandbox holds (a crashed run's pool, records that did not
    // open). Throws SandboxError when the engine cannot be reached.
    void remove_unclaimed();

    std::string name() const override { return "swarm"; }
    std::unique_ptr<Sandbox> start(const std::string& session_id, const Image& image,
                                   const SandboxLimits& limits, bool background) override;
    // A service's limits are fixed at its creation (an update re-creates its
    // task, and the kernel's state with it): only equal limits are served.
    // Only runc: a Swarm service runs on its node engine's default runtime.
    std::optional<BackendRefusal> refuse(const Image& image) const override;
    bool can_serve(const Image& image, const SandboxLimits& pooled,
                   const SandboxLimits& wanted) const override;
    // The nodes: [{kind: node, hostname, state, availability, sessions}].
    nlohmann::json extras() override;
    void abandon_starts() override;

    const std::string& server_id() const { return server_id_; }
    // The settings in use (libexec_tag filled in).
    const SwarmSettings& settings() const { return settings_; }
    // The services found and removed at start.
    const std::vector<std::string>& reaped() const { return reaped_; }

  private:
    void watch();

    SwarmSettings settings_;
    std::shared_ptr<SwarmState> state_;
    std::string server_id_;
    std::string seccomp_hex_;  // SwarmTaskIdentity::seccomp_hex, the same for every session
    std::vector<std::string> reaped_;
    std::mutex wake_mutex_;
    std::condition_variable wake_;
    bool stopping_ = false;
    std::atomic<bool> abandoned_{false};
    std::thread watcher_;
};

}  // namespace cellblock

namespace cellblock {

// Writes `output`, a tarball `docker import` takes, of `image` (resolved:
// a stored root, or for a host image a skeleton root whose /usr the node
// binds) with cellblock's shim and kernel launcher from `libexec_dir` at
// /opt/cellblock. Returns the tag swarm_image_ref gives it. Throws
// SandboxError. `cellblock image export`.
std::string export_engine_image(const Image& image, const std::filesystem::path& libexec_dir,
                                const std::filesystem::path& output);

}  // namespace cellblock
