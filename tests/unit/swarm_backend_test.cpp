// The Swarm backend's pure parts and its engine client: the service spec a
// session gets (its hardening is security code), image references, the
// filters encoding, and the Docker API client against a fake engine on a
// unix socket (status, chunked bodies, errors, a silent engine).
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <zmq.h>

#include "../../sessions/docker_api.hpp"
#include "cellblock/oci_bundle.hpp"
#include "cellblock/signer.hpp"
#include "cellblock/swarm_backend.hpp"
#include "cellblock/zygote.hpp"

using namespace cellblock;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

Image host_image() {
    Image image;
    image.name = "host";
    image.rootfs = "host";
    image.host_binds = {"/etc/python3.11", "/etc/fonts"};
    image.kernel_argv = {"/usr/bin/python3", "/opt/cellblock/cellblock_ipykernel.py", "-f",
                         "{connection_file}"};
    image.preload = {"numpy"};
    return image;
}

constexpr std::uint32_t kTestUid = kSwarmFirstUid + 7;

json spec_for(const Image& image, const SandboxLimits& limits = {}, bool egress_tunnel = false) {
    SwarmSettings settings;
    settings.network = "sessions-net";
    settings.egress_tunnel = egress_tunnel;
    return swarm_service_spec(settings, "server-1", "abcdef0123456789", image, limits,
                              {"secret-id", "secret-name", kTestUid, "0123abcd"});
}

}  // namespace

TEST(SwarmServiceSpec, RunsTheShimAsRootOnlyToDropToTheSandboxUid) {
    const json c = spec_for(host_image())["TaskTemplate"]["ContainerSpec"];
    const json command = c["Command"];
    ASSERT_GE(command.size(), 5u);
    EXPECT_EQ(command[0], kSandboxShim);
    EXPECT_EQ(command[1], "--engine");
    EXPECT_EQ(command[2], std::to_string(kTestUid));
    EXPECT_EQ(command[3], "--");
    // The connection file is the session's secret, never a path of the image.
    EXPECT_EQ(command.back(), "/run/secrets/cellblock-connection.json");
    EXPECT_EQ(c["User"], "0:0");
}

TEST(SwarmServiceSpec, HasEveryHardeningDockerAllows) {
    const json spec = spec_for(host_image());
    const json c = spec["TaskTemplate"]["ContainerSpec"];
    EXPECT_EQ(c["ReadOnly"], true);
    EXPECT_EQ(c["CapabilityDrop"], json::array({"ALL"}));
    // Only what the shim needs before it drops to the sandbox uid (and with it every capability).
    EXPECT_EQ(c["CapabilityAdd"],
              json::array({"CAP_NET_ADMIN", "CAP_SETUID", "CAP_SETGID", "CAP_CHOWN"}));
    // A drained node's task runs this long (ns) while its session moves.
    EXPECT_EQ(c["StopGracePeriod"], std::int64_t{30} * 1000 * 1000 * 1000);
    EXPECT_FALSE(c.contains("Privileges"));
    EXPECT_FALSE(c.contains("Sysctls"));
    // Never restarted: a new kernel would silently lose the session's state.
    EXPECT_EQ(spec["TaskTemplate"]["RestartPolicy"]["Condition"], "none");
    // Only the sessions' network, never the host's or the ingress mesh.
    EXPECT_EQ(spec["TaskTemplate"]["Networks"], json::array({{{"Target", "sessions-net"}}}));
    EXPECT_EQ(spec["EndpointSpec"]["Mode"], "dnsrr");
    const json ports = spec["EndpointSpec"]["Ports"];
    ASSERT_EQ(ports.size(), 5u);
    for (int i = 0; i < 5; ++i) {
        EXPECT_EQ(ports[i]["TargetPort"], 5555 + i);
        EXPECT_EQ(ports[i]["PublishMode"], "host");
        EXPECT_FALSE(ports[i].contains("PublishedPort")) << "a fixed port would collide on a node";
    }
    // The secret: readable by the sandbox's uid only.
    const json secret = c["Secrets"][0];
    EXPECT_EQ(secret["SecretID"], "secret-id");
    EXPECT_EQ(secret["File"]["Mode"], 0400);
    EXPECT_EQ(secret["File"]["UID"], std::to_string(kTestUid));
    EXPECT_EQ(secret["File"]["GID"], std::to_string(kTestUid));
    // cellblock's seccomp program, for the shim to install over the engine's profile.
    EXPECT_TRUE(std::find(c["Env"].begin(), c["Env"].end(), "CELLBLOCK_SECCOMP_BPF=0123abcd") !=
                c["Env"].end())
        << c["Env"].dump();
    EXPECT_EQ(spec["Labels"]["cellblock.server"], "server-1");
    EXPECT_EQ(spec["Labels"]["cellblock.session"], "abcdef0123456789");
    EXPECT_EQ(spec["Name"], "cb-abcdef0123456789");
}

TEST(SwarmServiceSpec, AServerWithAGatewayPublishesTheEgressTunnelAndAnIpcDir) {
    const auto targets = [](const json& spec) {
        std::vector<int> ports;
        for (const auto& p : spec["EndpointSpec"]["Ports"]) ports.push_back(p["TargetPort"]);
        std::vector<std::string> tmpfs;
        for (const auto& m : spec["TaskTemplate"]["ContainerSpec"]["Mounts"]) {
            if (m["Type"] == "tmpfs") tmpfs.push_back(m["Target"]);
        }
        return std::pair{ports, tmpfs};
    };
    const auto [plain_ports, plain_tmpfs] = targets(spec_for(host_image()));
    EXPECT_EQ(plain_ports, (std::vector<int>{5555, 5556, 5557, 5558, 5559}));
    EXPECT_EQ(std::count(plain_tmpfs.begin(), plain_tmpfs.end(), "/run/cellblock"), 0);
    const json spec = spec_for(host_image(), {}, /*egress_tunnel=*/true);
    const auto [ports, tmpfs] = targets(spec);
    EXPECT_EQ(ports, (std::vector<int>{5555, 5556, 5557, 5558, 5559, 5560}));
    EXPECT_EQ(spec["EndpointSpec"]["Ports"][5]["PublishMode"], "host");
    EXPECT_FALSE(spec["EndpointSpec"]["Ports"][5].contains("PublishedPort"));
    EXPECT_EQ(std::count(tmpfs.begin(), tmpfs.end(), "/run/cellblock"), 1);
}

TEST(SwarmServiceSpec, OnlyAServerThatAsksSharesItsKernelsBootMemory) {
    const auto env_of = [](bool share) {
        SwarmSettings settings;
        settings.share_boot_memory = share;
        const json spec =
            swarm_service_spec(settings, "server-1", "abcdef0123456789", host_image(), {},
                               {"secret-id", "secret-name", kTestUid, "0123abcd"});
        std::vector<std::string> env;
        for (const auto& var : spec["TaskTemplate"]["ContainerSpec"]["Env"]) env.push_back(var);
        return env;
    };
    const auto has = [](const std::vector<std::string>& env, const std::string& prefix) {
        return std::any_of(env.begin(), env.end(),
                           [&](const std::string& var) { return var.rfind(prefix, 0) == 0; });
    };
    const auto plain = env_of(false);
    EXPECT_FALSE(has(plain, "CELLBLOCK_SHARE_BOOT_MEMORY="));
    EXPECT_FALSE(has(plain, "PYTHONHASHSEED=")) << "a session's hashes stay randomized by default";
    const auto shared = env_of(true);
    EXPECT_TRUE(has(shared, "CELLBLOCK_SHARE_BOOT_MEMORY=1"));
    EXPECT_TRUE(has(shared, "PYTHONHASHSEED=0"));
    EXPECT_TRUE(has(shared, "CELLBLOCK_SECCOMP_BPF=0123abcd"));
}

TEST(SwarmServiceSpec, CarriesTheSessionsLimits) {
    SandboxLimits limits;
    limits.memory_mb = 768;
    limits.pids = 99;
    limits.cpus = 1.5;
    limits.disk_mb = 100;
    limits.shm_mb = 32;
    limits.output_mb = 50;
    limits.nofile = 512;
    const json spec = spec_for(host_image(), limits);
    const json l = spec["TaskTemplate"]["Resources"]["Limits"];
    EXPECT_EQ(l["MemoryBytes"], 768ll << 20);
    EXPECT_EQ(l["Pids"], 99);
    EXPECT_EQ(l["NanoCPUs"], 1500000000ll);
    const json c = spec["TaskTemplate"]["ContainerSpec"];
    EXPECT_EQ(c["Ulimits"][0]["Soft"], 512);
    std::map<std::string, std::int64_t> tmpfs;
    for (const auto& m : c["Mounts"]) {
        if (m["Type"] == "tmpfs") tmpfs[m["Target"]] = m["TmpfsOptions"]["SizeBytes"];
    }
    EXPECT_EQ(tmpfs["/tmp"], 100ll << 20);
    EXPECT_EQ(tmpfs[kSandboxHome], 100ll << 20);
    EXPECT_EQ(tmpfs["/dev/shm"], 32ll << 20);
    EXPECT_EQ(tmpfs[kSandboxOutputDir], 50ll << 20);
}

TEST(SwarmServiceSpec, BindsOnlyTheNodesUsrAndTheHostImagesEntriesReadOnly) {
    std::vector<std::string> binds;
    const json spec =
        spec_for(host_image());  // kept: a range-for over a temporary's member dangles
    for (const auto& m : spec["TaskTemplate"]["ContainerSpec"]["Mounts"]) {
        if (m["Type"] != "bind") continue;
        EXPECT_EQ(m["ReadOnly"], true) << m.dump();
        EXPECT_EQ(m["Source"], m["Target"]);
        binds.push_back(m["Source"]);
    }
    EXPECT_EQ(binds, (std::vector<std::string>{"/usr", "/etc/python3.11", "/etc/fonts"}));

    Image stored = host_image();
    stored.rootfs = "/var/lib/cellblock/images/x/rootfs";
    stored.content_id = "0123456789abcdef0123";
    const json stored_spec = spec_for(stored);
    for (const auto& m : stored_spec["TaskTemplate"]["ContainerSpec"]["Mounts"]) {
        EXPECT_NE(m["Type"], "bind") << "a stored image brings its own root: " << m.dump();
    }
}

TEST(SwarmImageRef, ExportTagsOrTheOperatorsMapping) {
    SwarmSettings settings;
    Image image = host_image();
    EXPECT_EQ(swarm_image_ref(settings, image), "cellblock/host:host");
    image.name = "python-minimal";
    image.rootfs = "/store/rootfs";
    image.content_id = "0123456789abcdef0123";
    EXPECT_EQ(swarm_image_ref(settings, image), "cellblock/python-minimal:0123456789ab");
    settings.images["python-minimal"] = "registry.local/pm@sha256:feed";
    EXPECT_EQ(swarm_image_ref(settings, image), "registry.local/pm@sha256:feed");
    // With the shim's digest: an image exported with another build's shim is another tag.
    settings.images.clear();
    settings.libexec_tag = "feedfacecafe";
    EXPECT_EQ(swarm_image_ref(settings, image),
              "cellblock/python-minimal:0123456789ab-feedfacecafe");
    EXPECT_EQ(swarm_image_ref(settings, host_image()), "cellblock/host:host-feedfacecafe");
}

TEST(SwarmImageRef, TheShimsDigestCoversItsFilesAndTheirNames) {
    const fs::path dir =
        fs::temp_directory_path() / ("cellblock-libexec-" + std::to_string(::getpid()));
    fs::create_directories(dir);
    auto write = [&](const char* name, const std::string& text) {
        std::ofstream(dir / name, std::ios::binary) << text;
    };
    write("cellblock-shim", "shim v1");
    write("cellblock_ipykernel.py", "launcher");
    write("cellblock_zygote.py", "zygote");
    write("cellblock_containment.py", "containment");
    write("cellblock_protocol.py", "protocol");
    write("cellblock_snapshot.py", "snapshot");
    write("cellblock_egress_tunnel.py", "egress tunnel");
    const std::string first = libexec_digest(dir);
    EXPECT_EQ(first.size(), 12u);
    EXPECT_EQ(libexec_digest(dir), first);
    write("cellblock-shim", "shim v2");
    EXPECT_NE(libexec_digest(dir), first);
    write("cellblock_protocol.py", "protocol v2");
    const std::string second = libexec_digest(dir);
    EXPECT_NE(second, first);
    // A module the launcher imports that no list names is covered too, and
    // so is its name: every file the image carries at /opt/cellblock.
    write("cellblock_files.py", "files");
    const std::string third = libexec_digest(dir);
    EXPECT_NE(third, second);
    fs::rename(dir / "cellblock_files.py", dir / "cellblock_files2.py");
    EXPECT_NE(libexec_digest(dir), third);
    fs::remove(dir / "cellblock_files2.py");
    EXPECT_EQ(libexec_digest(dir), second);
    fs::remove(dir / "cellblock_ipykernel.py");
    EXPECT_THROW(libexec_digest(dir), SandboxError);
    fs::remove_all(dir);
}

TEST(SwarmTaskEnd, TheShimsLastLinesSayHowTheTaskEnded) {
    const std::string kernel_noise = "Traceback ...\nMemoryError\n";
    // Killed at its memory limit: the shim's two lines end the log.
    SwarmTaskEnd end = read_task_end(kernel_noise + "cellblock-shim: memory-limit-reached\n" +
                                     "cellblock-shim: kernel-exit signal=9\n");
    EXPECT_TRUE(end.memory_limit_reached);
    EXPECT_EQ(end.kernel_exit, "the kernel was killed by signal 9");
    // An exit of its own, with CRLF line ends.
    end = read_task_end("cellblock-shim: kernel-exit status=3\r\n");
    EXPECT_FALSE(end.memory_limit_reached);
    EXPECT_EQ(end.kernel_exit, "the kernel exited with status 3");
    // The memory line counts only right before the kernel-exit line.
    end = read_task_end(
        "cellblock-shim: memory-limit-reached\ncellblock-shim: something else\n"
        "cellblock-shim: kernel-exit signal=9\n");
    EXPECT_FALSE(end.memory_limit_reached);
    // Lines the kernel wrote (no prefix) are not the shim's; a log that does
    // not end with the shim's exit line says nothing.
    for (const std::string& log :
         {std::string("memory-limit-reached\nkernel-exit signal=9\n"),
          std::string("cellblock-shim: memory-limit-reached\n"), std::string(),
          std::string("cellblock-shim: kernel-exit signal=9\nafter\ncellblock-shim: junk")}) {
        end = read_task_end(log);
        EXPECT_EQ(end.kernel_exit, "") << log;
        EXPECT_FALSE(end.memory_limit_reached) << log;
    }
}

TEST(DockerFilters, AreUrlEncodedJson) {
    EXPECT_EQ(docker_filters({{"label", {"cellblock.server=ab"}}}),
              "%7B%22label%22%3A%5B%22cellblock.server%3Dab%22%5D%7D");
}

// A fake engine: answers each connection with `reply`, once per request.
class FakeEngine {
  public:
    using Route = std::function<std::string(const std::string& request)>;
    explicit FakeEngine(std::string reply, bool silent = false)
        : FakeEngine([reply](const std::string&) { return reply; }, silent) {}
    // Answers each request with route(its text).
    explicit FakeEngine(Route route, bool silent = false)
        : route_(std::move(route)), silent_(silent) {
        path_ = fs::temp_directory_path() / ("cellblock-fake-docker-" + std::to_string(::getpid()) +
                                             "-" + std::to_string(counter_++) + ".sock");
        fs::remove(path_);
        fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        sockaddr_un addr{};
        addr.sun_family = AF_UNIX;
        std::strncpy(addr.sun_path, path_.c_str(), sizeof addr.sun_path - 1);
        EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
        EXPECT_EQ(::listen(fd_, 8), 0);
        thread_ = std::thread([this] { serve(); });
    }
    ~FakeEngine() {
        stop_ = true;
        ::shutdown(fd_, SHUT_RDWR);
        thread_.join();
        ::close(fd_);
        fs::remove(path_);
    }
    std::string host() const { return "unix://" + path_.string(); }
    std::string last_request() const { return last_; }

  private:
    // The head, and the body as long as its Content-Length says (a service
    // spec is longer than one read).
    static std::string read_request(int c) {
        std::string in;
        char buf[8192];
        for (;;) {
            const auto head_end = in.find("\r\n\r\n");
            if (head_end != std::string::npos) {
                std::size_t length = 0;
                if (const auto at = in.find("Content-Length: ");
                    at != std::string::npos && at < head_end)
                    length = std::stoul(in.substr(at + 16));
                if (in.size() >= head_end + 4 + length) return in;
            }
            const ssize_t n = ::recv(c, buf, sizeof buf, 0);
            if (n <= 0) return in;
            in.append(buf, static_cast<std::size_t>(n));
        }
    }

    void serve() {
        while (!stop_) {
            const int c = ::accept(fd_, nullptr, nullptr);
            if (c < 0) return;
            last_ = read_request(c);
            if (silent_) {
                while (!stop_) ::usleep(10000);
            } else {
                const std::string reply = route_(last_);
                [[maybe_unused]] auto w = ::send(c, reply.data(), reply.size(), MSG_NOSIGNAL);
            }
            ::close(c);
        }
    }
    static inline int counter_ = 0;
    Route route_;
    bool silent_;
    fs::path path_;
    int fd_ = -1;
    std::atomic<bool> stop_{false};
    std::string last_;
    std::thread thread_;
};

TEST(DockerApi, ReadsAChunkedJsonAnswer) {
    FakeEngine engine(
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        "5\r\n{\"ID\"\r\n9\r\n:\"svc-1\"}\r\n0\r\n\r\n");
    DockerApi api(engine.host());
    const json body = {{"Name", "x"}};
    EXPECT_EQ(api.expect("POST", "/services/create", &body)["ID"], "svc-1");
    const std::string request = engine.last_request();
    EXPECT_EQ(request.rfind("POST /services/create HTTP/1.1\r\n", 0), 0u) << request;
    EXPECT_NE(request.find("Content-Length: 12\r\n"), std::string::npos) << request;
}

TEST(DockerApi, AnErrorCarriesTheEnginesMessageUnlessAllowed) {
    FakeEngine engine(
        "HTTP/1.1 404 Not Found\r\nContent-Length: 33\r\n\r\n{\"message\":\"service x not "
        "found\"}");
    DockerApi api(engine.host());
    try {
        api.expect("DELETE", "/services/x");
        FAIL() << "a 404 must throw";
    } catch (const SandboxError& e) {
        EXPECT_NE(std::string(e.what()).find("404 service x not found"), std::string::npos)
            << e.what();
    }
    EXPECT_NO_THROW(api.expect("DELETE", "/services/x", nullptr, 404));
}

TEST(DockerApi, ASilentEngineTimesOutAndAMissingOneSaysSo) {
    FakeEngine engine("", /*silent=*/true);
    DockerApi api(engine.host(), std::chrono::milliseconds(200));
    EXPECT_THROW(api.call("GET", "/info"), SandboxError);
    DockerApi nowhere("unix:///nonexistent/docker.sock");
    try {
        nowhere.call("GET", "/info");
        FAIL() << "no engine must throw";
    } catch (const SandboxError& e) {
        EXPECT_NE(std::string(e.what()).find("cannot connect"), std::string::npos) << e.what();
    }
    EXPECT_THROW(DockerApi("tcp://127.0.0.1:2375"), SandboxError);
}

TEST(SwarmBackend, RefusesAnEngineThatIsNotASwarmManager) {
    FakeEngine engine(
        "HTTP/1.1 200 OK\r\nContent-Length: "
        "44\r\n\r\n{\"Swarm\":{\"LocalNodeState\":\"inactive\"}}    ");
    SwarmSettings settings;
    settings.docker_host = engine.host();
    settings.state_dir = fs::temp_directory_path() / "cellblock-swarm-unit";
    try {
        SwarmBackend backend(settings);
        FAIL() << "an engine outside a swarm must be refused";
    } catch (const SandboxError& e) {
        EXPECT_NE(std::string(e.what()).find("not a Swarm manager"), std::string::npos) << e.what();
    }
    fs::remove_all(settings.state_dir);
}

// An engine with one service of this server's, as a crashed run left it,
// for SwarmBackend::adopt to check against (a real engine: test_swarm.py).
class LeftService : public ::testing::Test {
  protected:
    void SetUp() override {
        settings_.state_dir =
            fs::temp_directory_path() / ("cellblock-swarm-adopt-" + std::to_string(::getpid()));
        fs::create_directories(settings_.state_dir / "swarm");
        std::ofstream(settings_.state_dir / "swarm" / "server-id") << "0123456789abcdef\n";
    }
    void TearDown() override { fs::remove_all(settings_.state_dir); }

    static std::string ok(const json& body) {
        const std::string text = body.dump();
        return "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: " +
               std::to_string(text.size()) + "\r\n\r\n" + text;
    }
    std::string answer(const std::string& request) const {
        const std::string line = request.substr(0, request.find("\r\n"));
        if (line.find(" /info ") != std::string::npos) {
            return ok({{"Swarm", {{"LocalNodeState", "active"}, {"ControlAvailable", true}}}});
        }
        if (line.find(" /nodes/node-1 ") != std::string::npos) {
            return ok({{"ID", "node-1"}, {"Status", {{"State", node_state_}}}});
        }
        if (line.find(" /nodes ") != std::string::npos) {
            return ok(json::array({{{"ID", "node-1"},
                                    {"Status", {{"State", node_state_}}},
                                    {"Spec", {{"Availability", drained_ ? "drain" : "active"}}}}}));
        }
        if (line.find(" /services/svc-1 ") != std::string::npos) {
            return ok({{"ID", "svc-1"},
                       {"Spec",
                        {{"Name", "cb-s1"},
                         {"Labels",
                          {{"cellblock.server", server_label_}, {"cellblock.session", "s1"}}}}}});
        }
        if (line.find(" /tasks") != std::string::npos) {  // a service's, or all (the watcher)
            const std::string state = task_ended_ ? "shutdown" : task_state_;
            return ok(json::array(
                {{{"ID", task_id_}, {"NodeID", "node-1"}, {"Status", {{"State", state}}}}}));
        }
        return "HTTP/1.1 404 Not Found\r\nContent-Length: 24\r\n\r\n{\"message\":\"not found\"}";
    }
    // The engine's answer to a new service's task list: running on node-1,
    // its five kernel ports published.
    static std::string running_task() {
        json ports = json::array();
        for (int i = 0; i < 5; ++i) {
            ports.push_back({{"TargetPort", 5555 + i}, {"PublishedPort", 30000 + i}});
        }
        return ok(json::array(
            {{{"ID", "task-1"},
              {"NodeID", "node-1"},
              {"CreatedAt", "2026-11-29T00:00:00Z"},
              {"Status", {{"State", "running"}, {"PortStatus", {{"Ports", ports}}}}}}}));
    }
    json record() const {
        ConnectionInfo kernel;
        kernel.transport = "tcp";
        kernel.ip = "127.0.0.1";
        kernel.shell_port = 30001;
        kernel.key = "inner-key";
        return {{"backend", "swarm"},        {"service_id", "svc-1"}, {"secret_id", "sec-1"},
                {"task_id", "task-1"},       {"node_id", "node-1"},   {"node_name", "worker-1"},
                {"kernel", kernel.to_json()}};
    }
    // adopt's refusal, or "" when it adopted.
    std::string refusal(const json& rec, const std::string& session = "s1") {
        FakeEngine engine([this](const std::string& r) { return answer(r); });
        settings_.docker_host = engine.host();
        SwarmBackend backend(settings_);
        try {
            auto box = backend.adopt(session, rec, host_image(), SandboxLimits{});
            EXPECT_EQ(box->container_id(), "svc-1");
            EXPECT_EQ(box->inner_connection().key, "inner-key");
            EXPECT_EQ(box->inner_connection().shell_port, 30001);
            // Its record names the same service, task and key again.
            EXPECT_EQ(box->adoption_record()->at("task_id"), "task-1");
            EXPECT_EQ(box->adoption_record()->at("kernel").at("key"), "inner-key");
            return "";
        } catch (const SandboxError& e) {
            return e.what();
        }
    }

    SwarmSettings settings_;
    std::string server_label_ = "0123456789abcdef";
    std::string task_id_ = "task-1";
    std::string task_state_ = "running";
    std::string node_state_ = "ready";
    // Changed while the backend's watcher reads them.
    std::atomic<bool> drained_{false}, task_ended_{false};
};

TEST_F(LeftService, ItsOwnRunningServiceIsAdopted) { EXPECT_EQ(refusal(record()), ""); }

TEST_F(LeftService, ADrainedNodesSandboxIsToldToMoveAndSaysSoIfItsTaskEndsFirst) {
    FakeEngine engine([this](const std::string& r) { return answer(r); });
    settings_.docker_host = engine.host();
    settings_.watch_interval = std::chrono::milliseconds(20);
    SwarmBackend backend(settings_);
    auto box = backend.adopt("s1", record(), host_image(), SandboxLimits{});
    // Its kill waits out the stop grace: the relay asks the kernel to exit first.
    EXPECT_TRUE(box->kill_is_slow());
    const auto said = [&](int ms) {
        pollfd p{box->lifeline_fd(), POLLIN, 0};
        return ::poll(&p, 1, ms) == 1;
    };
    // On a ready, active node: nothing to say.
    EXPECT_FALSE(said(200));
    EXPECT_FALSE(box->moving());
    // Drained: said once, and it still runs.
    drained_ = true;
    ASSERT_TRUE(said(10000));
    EXPECT_TRUE(box->read_lifeline());
    EXPECT_TRUE(box->moving());
    EXPECT_FALSE(said(200));  // not again at every look
    // Its task ends before the session moved: lost, and the reason says why.
    task_ended_ = true;
    ASSERT_TRUE(said(10000));
    EXPECT_FALSE(box->read_lifeline());
    EXPECT_FALSE(box->moving());
    EXPECT_NE(box->exit_description().find("its node was drained before the session could move"),
              std::string::npos)
        << box->exit_description();
}

TEST_F(LeftService, AnotherServersOrAnotherSessionsServiceIsNot) {
    server_label_ = "fedcba9876543210";
    EXPECT_NE(refusal(record()).find("is not this session's"), std::string::npos);
    server_label_ = "0123456789abcdef";
    EXPECT_NE(refusal(record(), "s2").find("is not this session's"), std::string::npos);
}

TEST_F(LeftService, AReplacedOrEndedTaskOrADownNodeIsNot) {
    task_id_ = "task-2";  // the engine started another kernel: the state is gone
    EXPECT_NE(refusal(record()).find("is gone"), std::string::npos);
    task_id_ = "task-1";
    task_state_ = "complete";
    EXPECT_NE(refusal(record()).find("is complete"), std::string::npos);
    task_state_ = "running";
    node_state_ = "down";
    EXPECT_NE(refusal(record()).find("worker-1 is down"), std::string::npos);
}

TEST_F(LeftService, AServiceTheEngineNoLongerHasIsNot) {
    json rec = record();
    rec["service_id"] = "svc-9";
    EXPECT_NE(refusal(rec).find("is gone"), std::string::npos);
}

namespace {

// Standard base64 (RFC 4648) back to bytes: a secret's Data as the engine got it.
std::string from_base64(const std::string& text) {
    static const std::string kAlphabet =
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::string out;
    unsigned bits = 0;
    int count = 0;
    for (const char c : text) {
        const auto at = kAlphabet.find(c);
        if (at == std::string::npos) break;  // '=' padding
        bits = (bits << 6) | static_cast<unsigned>(at);
        if ((count += 6) >= 8) out.push_back(static_cast<char>((bits >> (count -= 8)) & 0xff));
    }
    return out;
}

}  // namespace

// A session started on a fake engine: the kernel's channels are CurveZMQ
// servers with a key pair made for the session; the secret the service gets
// holds the secret key, the front keeps only the public one, and so does the
// record an adopting server reads.
TEST_F(LeftService, EachStartedKernelGetsItsOwnCurveKeyAndOnlyItsSecretHoldsIt) {
    std::vector<json> secrets;
    std::mutex mutex;
    FakeEngine engine([&](const std::string& request) {
        const std::string line = request.substr(0, request.find("\r\n"));
        if (line.find(" /secrets/create ") != std::string::npos) {
            std::lock_guard lock(mutex);
            secrets.push_back(json::parse(request.substr(request.find("\r\n\r\n") + 4)));
            return ok({{"ID", "sec-" + std::to_string(secrets.size())}});
        }
        if (line.find(" /services/create ") != std::string::npos) return ok({{"ID", "svc-1"}});
        if (line.find(" /tasks?") != std::string::npos) {
            return running_task();
        }
        return answer(request);
    });
    settings_.docker_host = engine.host();
    settings_.connect_host = "127.0.0.1";
    SwarmBackend backend(settings_);
    std::vector<std::string> server_keys;
    for (const char* session : {"s1", "s2"}) {
        auto box = backend.start(session, host_image(), SandboxLimits{}, false);
        const ConnectionInfo& inner = box->inner_connection();
        EXPECT_TRUE(inner.curve_secret_key.empty()) << "the front holds no kernel's secret key";
        ASSERT_EQ(inner.curve_server_key.size(), 40u);
        const json kept = box->adoption_record()->at("kernel");
        EXPECT_EQ(kept.at("curve_server_key"), inner.curve_server_key);
        EXPECT_FALSE(kept.contains("curve_secret_key"));

        std::lock_guard lock(mutex);
        const json file = json::parse(from_base64(secrets.back().at("Data").get<std::string>()));
        const std::string secret_key = file.at("curve_secret_key").get<std::string>();
        char derived[41] = {};
        ASSERT_EQ(zmq_curve_public(derived, secret_key.c_str()), 0);
        EXPECT_EQ(std::string(derived), inner.curve_server_key)
            << "the kernel's secret key and the front's public key are one pair";
        EXPECT_EQ(file.at("key"), inner.key);
        server_keys.push_back(inner.curve_server_key);
    }
    EXPECT_NE(server_keys[0], server_keys[1]) << "a key pair per session";
}

// Sessions started on a fake engine: each live service runs its kernel as a
// uid of its own, in this server's block (so neighbours on one node share no
// per-uid limit), a uid an adopted service holds is not handed out again, one
// given back is not the next taken, and every service carries cellblock's
// seccomp program for the shim.
TEST_F(LeftService, EachLiveServiceHasAUidOfItsOwnAndCellblocksSeccompProgram) {
    std::vector<json> services;
    std::mutex mutex;
    FakeEngine engine([&](const std::string& request) {
        const std::string line = request.substr(0, request.find("\r\n"));
        if (line.find(" /secrets/create ") != std::string::npos) return ok({{"ID", "sec"}});
        if (line.find(" /services/create ") != std::string::npos) {
            std::lock_guard lock(mutex);
            services.push_back(json::parse(request.substr(request.find("\r\n\r\n") + 4)));
            return ok({{"ID", "svc-new-" + std::to_string(services.size())}});
        }
        if (line.find(" /tasks?") != std::string::npos &&
            line.find("svc-new-") != std::string::npos) {
            return running_task();
        }
        return answer(request);
    });
    settings_.docker_host = engine.host();
    settings_.connect_host = "127.0.0.1";
    SwarmBackend backend(settings_);
    const std::uint32_t first = swarm_uid_block_start("0123456789abcdef");
    ASSERT_GE(first, kSwarmFirstUid);
    ASSERT_LE(first + kSwarmUidBlock, kSwarmFirstUid + kSwarmUidBlock * kSwarmUidBlocks);
    EXPECT_LT(first + kSwarmUidBlock, 1u << 30) << "below the local host-id pool";

    // An adopted service keeps the uid its record names.
    json rec = record();
    rec["uid"] = first;
    auto adopted = backend.adopt("s1", rec, host_image(), SandboxLimits{});
    EXPECT_EQ(adopted->adoption_record()->at("uid"), first);

    const std::string bpf_hex =
        to_lower_hex(compile_seccomp_bpf(make_seccomp_profile(RuntimeKind::runc)));
    auto uid_of = [&](std::size_t service) {
        std::lock_guard lock(mutex);
        const json c = services.at(service)["TaskTemplate"]["ContainerSpec"];
        const std::string uid = c["Command"][2].get<std::string>();
        EXPECT_EQ(c["Secrets"][0]["File"]["UID"], uid) << "the secret is its kernel's to read";
        EXPECT_TRUE(std::find(c["Env"].begin(), c["Env"].end(),
                              "CELLBLOCK_SECCOMP_BPF=" + bpf_hex) != c["Env"].end());
        return static_cast<std::uint32_t>(std::stoul(uid));
    };
    auto a = backend.start("s2", host_image(), SandboxLimits{}, false);
    auto b = backend.start("s3", host_image(), SandboxLimits{}, false);
    const std::uint32_t uid_a = uid_of(0), uid_b = uid_of(1);
    std::set<std::uint32_t> seen = {first, uid_a, uid_b};
    EXPECT_EQ(seen.size(), 3u) << "live services share no uid";
    for (std::uint32_t uid : seen) {
        EXPECT_GE(uid, first);
        EXPECT_LT(uid, first + kSwarmUidBlock);
    }
    EXPECT_EQ(a->adoption_record()->at("uid"), uid_a);
    a.reset();  // destroyed: its uid is free again, but not the next one taken
    auto c = backend.start("s4", host_image(), SandboxLimits{}, false);
    const std::uint32_t uid_c = uid_of(2);
    EXPECT_EQ(seen.count(uid_c), 0u) << uid_c;
}

// A task whose container the engine failed to start (seen on this host's
// docker-in-docker nodes: the secrets' tmpfs "device or resource busy") is
// followed by a new task of the same service, twice at most; a task that
// ended otherwise is not (its restart policy is none: a kernel that ran is
// never replaced by a fresh one).
TEST_F(LeftService, ATaskWhoseContainerDidNotStartIsFollowedByANewOneTwiceAtMost) {
    const std::string busy =
        "starting container failed: unable to remount dir as readonly: mount "
        "tmpfs:/var/lib/docker/containers/x/mounts/secrets: device or resource busy";
    const std::string body = running_task().substr(running_task().find("\r\n\r\n") + 4);
    for (const auto& [err, starts_after] : std::vector<std::pair<std::string, int>>{
             {busy, 1}, {busy, 2}, {busy, 3}, {busy, 4}, {"task: non-zero exit (1)", 2}}) {
        std::mutex mutex;
        std::vector<std::string> updates;  // each update's request line and ForceUpdate
        FakeEngine engine([&](const std::string& request) {
            const std::string line = request.substr(0, request.find("\r\n"));
            std::lock_guard lock(mutex);
            if (line.find(" /secrets/create ") != std::string::npos) return ok({{"ID", "sec"}});
            if (line.find(" /services/create ") != std::string::npos) return ok({{"ID", "svc-1"}});
            if (line.find("GET /services/svc-1 ") != std::string::npos) {
                return ok(
                    {{"ID", "svc-1"},
                     {"Version", {{"Index", 7 + updates.size()}}},
                     {"Spec",
                      {{"Name", "cb-s1"}, {"TaskTemplate", {{"ForceUpdate", updates.size()}}}}}});
            }
            if (line.find(" /services/svc-1/update?") != std::string::npos) {
                const json spec = json::parse(request.substr(request.find("\r\n\r\n") + 4));
                updates.push_back(line.substr(0, line.find(" HTTP")) + " ForceUpdate " +
                                  std::to_string(spec["TaskTemplate"].value("ForceUpdate", 0)));
                return ok(json::object());
            }
            if (line.find(" /tasks?") != std::string::npos) {
                // Task n (from 1) fails until task `starts_after`, which runs.
                json tasks = json::array();
                for (int n = 1; n <= static_cast<int>(updates.size()) + 1; ++n) {
                    json task = json::parse(body)[0];
                    task["ID"] = "task-" + std::to_string(n);
                    task["CreatedAt"] = "2026-11-29T00:00:0" + std::to_string(n) + "Z";
                    if (n < starts_after) task["Status"] = {{"State", "failed"}, {"Err", err}};
                    tasks.push_back(task);
                }
                return ok(tasks);
            }
            return answer(request);
        });
        settings_.docker_host = engine.host();
        settings_.connect_host = "127.0.0.1";
        SwarmBackend backend(settings_);
        std::string why, task_id;
        try {
            task_id = backend.start("s1", host_image(), SandboxLimits{}, false)
                          ->adoption_record()
                          ->at("task_id");
        } catch (const SandboxError& e) {
            why = e.what();
        }
        std::lock_guard lock(mutex);
        if (err != busy) {
            EXPECT_NE(why.find("task failed: task: non-zero exit (1)"), std::string::npos) << why;
            EXPECT_TRUE(updates.empty()) << "a task that ran is not replaced";
            continue;
        }
        const std::size_t expected = std::min(starts_after - 1, 2);
        ASSERT_EQ(updates.size(), expected) << starts_after;
        for (std::size_t i = 0; i < updates.size(); ++i) {
            EXPECT_EQ(updates[i], "POST /services/svc-1/update?version=" + std::to_string(7 + i) +
                                      " ForceUpdate " + std::to_string(i + 1));
        }
        if (starts_after <= 3) {
            EXPECT_EQ(why, "") << starts_after;
            EXPECT_EQ(task_id, "task-" + std::to_string(starts_after));
        } else {
            EXPECT_NE(why.find("task failed: starting container failed"), std::string::npos) << why;
        }
    }
}
