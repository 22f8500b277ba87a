// The sandbox policy is a value: these tests read it without running anything.
#include "cellblock/oci_bundle.hpp"
#include "cellblock/session_policy.hpp"
#include "cellblock/zygote.hpp"

#include <stdlib.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <set>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

namespace cellblock {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

Image test_image() {
    return Image::from_json(json{{"name", "host"},
                                 {"rootfs", "host"},
                                 {"host_binds", {"/etc/alternatives"}},
                                 {"hidden_paths", {"/usr/local"}},
                                 {"kernel_argv", {"/usr/bin/python3", "-f", "{connection_file}"}},
                                 {"env", {{"MPLBACKEND", "agg"}}}});
}

SandboxSpec test_spec() {
    SandboxSpec spec;
    spec.container_id = "cb-0123456789abcdef";
    spec.image = test_image();
    spec.limits.memory_mb = 512;
    spec.limits.pids = 64;
    spec.limits.disk_mb = 100;
    spec.limits.cpus = 0.5;
    spec.rootfs = "/state/sessions/x/bundle/rootfs";
    spec.ipc_dir = "/state/sessions/x/ipc";
    spec.input_dir = "/state/sessions/x/input";
    spec.output_dir = "/state/sessions/x/output";
    spec.libexec_dir = "/opt/cb/libexec";
    return spec;
}

const json* find_mount(const json& config, const std::string& destination) {
    for (const auto& m : config["mounts"]) {
        if (m["destination"] == destination) return &m;
    }
    return nullptr;
}

bool has_option(const json& mount, const std::string& option) {
    const auto& options = mount["options"];
    return std::find(options.begin(), options.end(), option) != options.end();
}

TEST(OciBundle, RootIsReadOnlyAndProcessIsUnprivileged) {
    const json c = make_oci_config(test_spec());
    EXPECT_TRUE(c["root"]["readonly"].get<bool>());
    EXPECT_EQ(c["process"]["user"]["uid"], kSandboxUid);
    EXPECT_NE(c["process"]["user"]["uid"], 0);
    EXPECT_TRUE(c["process"]["noNewPrivileges"].get<bool>());
    for (const char* set : {"bounding", "effective", "inheritable", "permitted", "ambient"}) {
        EXPECT_TRUE(c["process"]["capabilities"][set].empty()) << set;
    }
}

TEST(OciBundle, ContainerRootMapsToAnUnprivilegedHostRange) {
    const json c = make_oci_config(test_spec());
    for (const char* key : {"uidMappings", "gidMappings"}) {
        ASSERT_EQ(c["linux"][key].size(), 1u);
        const auto& m = c["linux"][key][0];
        EXPECT_EQ(m["containerID"], 0);
        EXPECT_GE(m["hostID"].get<std::uint64_t>(), 65536u) << key << " maps onto real host ids";
    }
}

TEST(OciBundle, EveryIsolatingNamespaceIsNew) {
    const json c = make_oci_config(test_spec());
    std::vector<std::string> types;
    for (const auto& ns : c["linux"]["namespaces"]) {
        EXPECT_FALSE(ns.contains("path")) << "joins an existing namespace";
        types.push_back(ns["type"]);
    }
    for (const char* t : {"pid", "network", "ipc", "uts", "mount", "user", "cgroup"}) {
        EXPECT_NE(std::find(types.begin(), types.end(), t), types.end()) << t;
    }
}

TEST(OciBundle, ResourceLimitsComeFromThePolicy) {
    const json c = make_oci_config(test_spec());
    const auto& r = c["linux"]["resources"];
    EXPECT_EQ(r["memory"]["limit"], 512ll << 20);
    EXPECT_EQ(r["memory"]["swap"], 512ll << 20);
    EXPECT_EQ(r["pids"]["limit"], 64);
    EXPECT_EQ(r["cpu"]["quota"], 50000);
    EXPECT_EQ(r["cpu"]["period"], 100000);
    EXPECT_EQ(c["linux"]["cgroupsPath"], "/cellblock/cb-0123456789abcdef");
    bool nofile = false, core = false;
    for (const auto& l : c["process"]["rlimits"]) {
        if (l["type"] == "RLIMIT_NOFILE") nofile = l["hard"] == 4096;
        if (l["type"] == "RLIMIT_CORE") core = l["hard"] == 0;
    }
    EXPECT_TRUE(nofile);
    EXPECT_TRUE(core);
}

TEST(OciBundle, EveryWritableMountIsCapped) {
    const json c = make_oci_config(test_spec());
    const json* tmp = find_mount(c, "/tmp");
    const json* home = find_mount(c, kSandboxHome);
    const json* shm = find_mount(c, "/dev/shm");
    ASSERT_TRUE(tmp && home && shm);
    EXPECT_TRUE(has_option(*tmp, "size=100m"));
    EXPECT_TRUE(has_option(*home, "size=100m"));
    EXPECT_TRUE(has_option(*shm, "size=64m"));
    for (const auto& m : c["mounts"]) {
        if (m["type"] == "tmpfs" && !has_option(m, "ro")) {
            const auto& opts = m["options"];
            EXPECT_TRUE(std::any_of(
                opts.begin(), opts.end(),
                [](const json& o) { return o.get<std::string>().rfind("size=", 0) == 0; }))
                << m["destination"] << " is a writable tmpfs without a size";
        }
    }
}

TEST(OciBundle, DataAndLibexecMountsHaveTheRightModes) {
    const json c = make_oci_config(test_spec());
    const json* input = find_mount(c, kSandboxInputDir);
    const json* output = find_mount(c, kSandboxOutputDir);
    const json* ipc = find_mount(c, kSandboxIpcDir);
    const json* libexec = find_mount(c, kSandboxLibexec);
    const json* usr = find_mount(c, "/usr");
    ASSERT_TRUE(input && output && ipc && libexec && usr);
    EXPECT_TRUE(has_option(*input, "ro"));
    EXPECT_TRUE(has_option(*output, "rw"));
    EXPECT_TRUE(has_option(*output, "noexec"));
    EXPECT_TRUE(has_option(*libexec, "ro"));
    EXPECT_TRUE(has_option(*usr, "ro"));
    EXPECT_TRUE(has_option(*usr, "nosuid"));
    EXPECT_EQ((*ipc)["source"], "/state/sessions/x/ipc");
    const json* hidden = find_mount(c, "/usr/local");
    ASSERT_TRUE(hidden);
    EXPECT_EQ((*hidden)["type"], "tmpfs");
    EXPECT_TRUE(has_option(*hidden, "ro"));
}

TEST(OciBundle, HostEtcIsNeverBoundWhole) {
    const json c = make_oci_config(test_spec());
    for (const auto& m : c["mounts"]) {
        if (m["type"] == "bind") {
            EXPECT_NE(m["source"], "/etc");
            EXPECT_NE(m["source"], "/");
            EXPECT_NE(m["source"], "/root");
        }
    }
}

TEST(OciBundle, ProcIsMaskedAsDockerDoes) {
    const json c = make_oci_config(test_spec());
    const auto& masked = c["linux"]["maskedPaths"];
    const auto& ro = c["linux"]["readonlyPaths"];
    for (const char* p : {"/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug"}) {
        EXPECT_NE(std::find(masked.begin(), masked.end(), p), masked.end()) << p;
    }
    for (const char* p : {"/proc/sys", "/proc/sysrq-trigger"}) {
        EXPECT_NE(std::find(ro.begin(), ro.end(), p), ro.end()) << p;
    }
}

TEST(OciBundle, InitIsTheShimRunningTheImageKernel) {
    const json c = make_oci_config(test_spec());
    const std::vector<std::string> args = c["process"]["args"];
    const std::vector<std::string> expected = {kSandboxShim, "--", "/usr/bin/python3", "-f",
                                               kSandboxConnectionFile};
    EXPECT_EQ(args, expected);
}

TEST(OciBundle, EnvironmentHoldsNothingOfTheServers) {
    ::setenv("CELLBLOCK_CANARY_SECRET", "do-not-leak", 1);
    const json c = make_oci_config(test_spec());
    const std::vector<std::string> env = c["process"]["env"];
    for (const auto& e : env) {
        EXPECT_EQ(e.find("do-not-leak"), std::string::npos) << e;
        EXPECT_NE(e.rfind("CELLBLOCK_", 0), 0u) << e;
    }
    EXPECT_NE(std::find(env.begin(), env.end(), "MPLBACKEND=agg"), env.end());
    EXPECT_NE(std::find(env.begin(), env.end(), std::string("HOME=") + kSandboxHome), env.end());
    ::unsetenv("CELLBLOCK_CANARY_SECRET");
}

TEST(Seccomp, DeniesEscapeAndHijackSyscalls) {
    const json p = make_seccomp_profile();
    EXPECT_EQ(p["defaultAction"], "SCMP_ACT_ERRNO");
    std::vector<std::string> denied;
    for (const auto& rule : p["syscalls"]) {
        if (rule["action"] == "SCMP_ACT_ERRNO" && !rule.contains("args")) {
            for (const auto& n : rule["names"]) denied.push_back(n);
        }
    }
    for (const char* s : {"ptrace",
                          "process_vm_readv",
                          "process_vm_writev",
                          "pidfd_getfd",
                          "mount",
                          "umount2",
                          "pivot_root",
                          "unshare",
                          "setns",
                          "bpf",
                          "userfaultfd",
                          "perf_event_open",
                          "keyctl",
                          "add_key",
                          "request_key",
                          "kexec_load",
                          "init_module",
                          "finit_module",
                          "delete_module",
                          "open_by_handle_at",
                          "reboot",
                          "swapon",
                          "swapoff",
                          "clock_settime",
                          "settimeofday",
                          "sethostname",
                          "acct",
                          "quotactl",
                          "syslog",
                          "io_uring_setup",
                          "fsopen",
                          "fsmount",
                          "move_mount",
                          "open_tree",
                          "clone3"}) {
        EXPECT_NE(std::find(denied.begin(), denied.end(), s), denied.end()) << s;
    }
}

TEST(Seccomp, CloneIsAllowedOnlyWithoutNamespaceFlags) {
    const json p = make_seccomp_profile();
    int clone_rules = 0;
    for (const auto& rule : p["syscalls"]) {
        if (rule["names"] == json::array({"clone"})) {
            ++clone_rules;
            EXPECT_EQ(rule["action"], "SCMP_ACT_ALLOW");
            ASSERT_EQ(rule["args"].size(), 1u);
            EXPECT_EQ(rule["args"][0]["op"], "SCMP_CMP_MASKED_EQ");
            EXPECT_EQ(rule["args"][0]["valueTwo"], 0);
            const std::uint64_t all_namespaces = 0x80 | 0x20000 | 0x02000000 | 0x04000000 |
                                                 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000;
            EXPECT_EQ(rule["args"][0]["value"].get<std::uint64_t>(), all_namespaces);
        }
    }
    EXPECT_EQ(clone_rules, 1);
}

TEST(Seccomp, IsAnAllowlistOfKnownCallsWithoutTheDeniedOnes) {
    const json p = make_seccomp_profile();
    EXPECT_EQ(p["defaultAction"], "SCMP_ACT_ERRNO");
    EXPECT_EQ(p["defaultErrnoRet"], 38);  // ENOSYS: glibc falls back, nothing new gets through
    std::set<std::string> allowed_unconditionally;
    for (const auto& rule : p["syscalls"]) {
        if (rule["action"] == "SCMP_ACT_ALLOW" && !rule.contains("args")) {
            for (const auto& n : rule["names"]) allowed_unconditionally.insert(n);
        }
    }
    for (const char* needed : {"read", "write", "mmap", "futex", "epoll_wait", "execve", "openat",
                               "close_range", "rseq", "statx"}) {
        EXPECT_TRUE(allowed_unconditionally.count(needed)) << needed;
    }
    for (const char* refused :
         {"ptrace", "mount", "bpf", "unshare", "clone", "clone3", "socket", "process_vm_writev",
          "pidfd_getfd", "userfaultfd",
          // newer than the headers, or i386 only: never listed
          "open_tree_attr", "listmount", "umount", "stime", "clock_settime64"}) {
        EXPECT_FALSE(allowed_unconditionally.count(refused)) << refused;
    }
}

// What a profile says of `call`: the values its argument rules allow and
// refuse (EPERM), whether every such rule is an equality (a `!=` on the whole
// register lets `value | 1 << 32` through as `value`), and whether an
// unconditional rule allows it.
struct ArgumentRules {
    std::set<std::uint64_t> allowed, refused;
    bool equalities_only = true;
    bool unconditional = false;
};

ArgumentRules argument_rules(const json& profile, const std::string& call) {
    ArgumentRules seen;
    for (const auto& rule : profile["syscalls"]) {
        const auto& names = rule["names"];
        if (std::find(names.begin(), names.end(), call) == names.end()) continue;
        if (!rule.contains("args")) {
            seen.unconditional = seen.unconditional || rule["action"] == "SCMP_ACT_ALLOW";
            continue;
        }
        const auto& arg = rule["args"][0];
        seen.equalities_only =
            seen.equalities_only && rule["args"].size() == 1 && arg["op"] == "SCMP_CMP_EQ";
        const std::uint64_t value = arg["value"];
        if (rule["action"] == "SCMP_ACT_ALLOW") {
            seen.allowed.insert(value);
        } else if (rule["action"] == "SCMP_ACT_ERRNO" && rule.value("errnoRet", 0) == EPERM) {
            seen.refused.insert(value);
        }
    }
    return seen;
}

TEST(Seccomp, JoiningSamePageMergingIsRefusedUnlessAllowed) {
    const json plain = make_seccomp_profile();
    struct Expected {
        const char* call;
        std::uint64_t refused;  // MADV_MERGEABLE, PR_SET_MEMORY_MERGE
        std::vector<std::uint64_t> still_allowed;
    };
    for (const Expected& want :
         {Expected{"madvise", 12, {0, 4, 8, 13, 14, 21, 102, 103}},
          Expected{"prctl", 67, {1, 3, 4, 15, 22, 38, 0x59616d61, 0x53564d41}}}) {
        const auto rules = argument_rules(plain, want.call);
        EXPECT_FALSE(rules.unconditional) << want.call;
        EXPECT_TRUE(rules.equalities_only) << want.call;
        EXPECT_EQ(rules.refused, (std::set<std::uint64_t>{want.refused})) << want.call;
        EXPECT_FALSE(rules.allowed.count(want.refused)) << want.call;
        for (std::uint64_t value : want.still_allowed) {
            EXPECT_TRUE(rules.allowed.count(value)) << want.call << " " << value;
        }
    }
    // The zygote's profile refuses it as well.
    EXPECT_EQ(
        argument_rules(make_seccomp_profile(RuntimeKind::runc, SandboxRole::zygote), "madvise")
            .refused,
        (std::set<std::uint64_t>{12}));
    // Allowed: both calls unconditionally, no rule about them otherwise.
    const json merging = make_seccomp_profile(RuntimeKind::runc, SandboxRole::session, true);
    for (const char* call : {"madvise", "prctl"}) {
        const auto rules = argument_rules(merging, call);
        EXPECT_TRUE(rules.unconditional) << call;
        EXPECT_TRUE(rules.allowed.empty() && rules.refused.empty()) << call;
    }
    // Both compile, within what the kernel takes.
    for (const json& profile : {plain, merging}) {
        const std::string bpf = compile_seccomp_bpf(profile);
        EXPECT_GT(bpf.size(), 0u);
        EXPECT_LE(bpf.size() / 8, 4096u);  // sock_filter is 8 bytes; BPF_MAXINSNS
    }
}

TEST(Seccomp, SocketIsAllowedForEveryFamilyButVsockAndNoHighWord) {
    const auto socket = argument_rules(make_seccomp_profile(), "socket");
    EXPECT_FALSE(socket.unconditional);
    EXPECT_TRUE(socket.equalities_only);
    // AF_VSOCK gets the default ENOSYS: a refusal rule would collide with the
    // allowances in libseccomp's i386 socketcall form (runc refuses that).
    EXPECT_TRUE(socket.refused.empty());
    for (std::uint64_t family : {1, 2, 10, 16, 38}) {  // unix, inet, inet6, netlink, alg
        EXPECT_TRUE(socket.allowed.count(family)) << family;
    }
    EXPECT_FALSE(socket.allowed.count(40));
}

// ---------------------------------------------------------------- runtimes

SandboxSpec runsc_spec() {
    SandboxSpec spec = test_spec();
    spec.runtime = "runsc";
    return spec;
}

std::uint64_t rlimit_of(const json& config, const std::string& type) {
    for (const auto& l : config["process"]["rlimits"]) {
        if (l["type"] == type) return l["hard"].get<std::uint64_t>();
    }
    return 0;
}

bool has_rule_for(const json& profile, const std::string& name) {
    for (const auto& rule : profile["syscalls"]) {
        for (const auto& n : rule["names"]) {
            if (n == name) return true;
        }
    }
    return false;
}

TEST(Runtime, KindComesFromTheNameOrPath) {
    EXPECT_EQ(runtime_kind("runc"), RuntimeKind::runc);
    EXPECT_EQ(runtime_kind("/usr/sbin/runc"), RuntimeKind::runc);
    EXPECT_EQ(runtime_kind("crun"), RuntimeKind::crun);
    EXPECT_EQ(runtime_kind("runsc"), RuntimeKind::runsc);
    EXPECT_EQ(runtime_kind("/usr/bin/runsc"), RuntimeKind::runsc);
    EXPECT_EQ(runtime_kind("something-else"), RuntimeKind::runc);
    EXPECT_TRUE(runtime_passes_fds(RuntimeKind::runc));
    EXPECT_TRUE(runtime_passes_fds(RuntimeKind::crun));
    EXPECT_FALSE(runtime_passes_fds(RuntimeKind::runsc));
}

TEST(Runtime, RuncBundleHasNoRunscDifferences) {
    SandboxSpec spec = test_spec();
    spec.runtime = "/usr/sbin/runc";
    const json c = make_oci_config(spec);
    for (const std::string e : c["process"]["env"]) {
        EXPECT_NE(e.rfind(kLifelineEnv, 0), 0u) << "runc passes the lifeline as fd 3: " << e;
    }
    EXPECT_TRUE(has_rule_for(c["linux"]["seccomp"], "clone3"));
    EXPECT_EQ(c["linux"]["resources"]["pids"]["limit"], 64);
    EXPECT_EQ(rlimit_of(c, "RLIMIT_NPROC"), 64u * 4);
    EXPECT_EQ(c, make_oci_config(test_spec())) << "the default runtime is runc";
}

TEST(Runtime, RunscShimIsToldWhereItsLifelineListens) {
    const json c = make_oci_config(runsc_spec());
    const std::vector<std::string> env = c["process"]["env"];
    const std::string expected = std::string(kLifelineEnv) + "=" + kSandboxLifelineSocket;
    EXPECT_NE(std::find(env.begin(), env.end(), expected), env.end());
    // The socket is in the ipc dir, the one place the server and the sandbox share.
    EXPECT_EQ(fs::path(kSandboxLifelineSocket).parent_path(), fs::path(kSandboxIpcDir));
    // Nothing else of the environment differs from runc's.
    std::vector<std::string> rest;
    for (const auto& e : env) {
        if (e != expected) rest.push_back(e);
    }
    EXPECT_EQ(json(rest), make_oci_config(test_spec())["process"]["env"]);
}

TEST(Runtime, AnExactLevelImagesShimBridgesTheKernelsChannels) {
    auto spec = runsc_spec();
    const std::string bridge =
        std::string(sandbox_protocol::kBridgeEnv) + "=" + sandbox_protocol::kBridgeDir;
    const auto has = [&](const json& c) {
        const std::vector<std::string> env = c["process"]["env"];
        return std::find(env.begin(), env.end(), bridge) != env.end();
    };
    EXPECT_FALSE(has(make_oci_config(spec))) << "the namespace level binds in ipc/ as ever";
    spec.image.hibernate_level = "exact";
    EXPECT_TRUE(has(make_oci_config(spec)));
    // Its own /tmp: a tmpfs of the sandbox's (saved in the checkpoint), not a host mount.
    EXPECT_EQ(fs::path(sandbox_protocol::kBridgeDir).parent_path(), fs::path("/tmp"));
}

TEST(Runtime, EitherRuntimesShimIsToldItsAdoptionGrace) {
    // runsc's too since its shim shows a key to the adopting server.
    for (SandboxSpec spec : {test_spec(), runsc_spec()}) {
        const std::string grace = std::string(sandbox_protocol::kAdoptGraceEnv) + "=";
        const auto graces = [&](const SandboxSpec& s) {
            std::vector<std::string> found;
            const json config = make_oci_config(s);
            for (const std::string e : config["process"]["env"]) {
                if (e.rfind(grace, 0) == 0) found.push_back(e);
            }
            return found;
        };
        spec.adopt_grace_ms = 0;
        EXPECT_TRUE(graces(spec).empty()) << spec.runtime;
        spec.adopt_grace_ms = 180000;
        EXPECT_EQ(graces(spec), std::vector<std::string>{grace + "180000"}) << spec.runtime;
    }
}

TEST(Runtime, RunscSeccompLetsClone3ThroughToTheSentry) {
    const json runc = make_seccomp_profile(RuntimeKind::runc);
    const json runsc = make_seccomp_profile(RuntimeKind::runsc);
    // gVisor turns errnoRet ENOSYS into EPERM, and glibc then cannot start a
    // thread; the Sentry has no clone3 and answers ENOSYS itself.
    const json allow_clone3 = {{"names", {"clone3"}}, {"action", "SCMP_ACT_ALLOW"}};
    json expected = json::array();
    for (const auto& rule : runc["syscalls"]) {
        expected.push_back(rule["names"] == json::array({"clone3"}) ? allow_clone3 : rule);
    }
    EXPECT_NE(runc["syscalls"], expected) << "runc answers clone3 with ENOSYS";
    EXPECT_EQ(runsc["syscalls"], expected);
    EXPECT_EQ(runsc["defaultAction"], runc["defaultAction"]);
    EXPECT_EQ(make_oci_config(runsc_spec())["linux"]["seccomp"], runsc);
}

TEST(Runtime, RunscEnforcesPidsInsideWithTheCgroupAsBackstop) {
    const json c = make_oci_config(runsc_spec());
    EXPECT_EQ(rlimit_of(c, "RLIMIT_NPROC"), 64u);
    const int host = c["linux"]["resources"]["pids"]["limit"];
    EXPECT_EQ(host, host_pids_limit(RuntimeKind::runsc, 64));
    EXPECT_GT(host, 64 * 10) << "room for the Sentry's threads and ptrace stubs";
    EXPECT_EQ(host_pids_limit(RuntimeKind::runc, 64), 64);
    EXPECT_EQ(host_pids_limit(RuntimeKind::crun, 64), 64);
}

TEST(Runtime, RunscBundleKeepsEveryOtherControl) {
    json runc = make_oci_config(test_spec());
    json runsc = make_oci_config(runsc_spec());
    // Mounts, root, user, mappings, namespaces, masks, memory and CPU: the same.
    for (json* c : {&runc, &runsc}) {
        (*c)["process"].erase("env");
        (*c)["process"].erase("rlimits");
        (*c)["linux"].erase("seccomp");
        (*c)["linux"]["resources"].erase("pids");
    }
    ASSERT_FALSE(runsc["mounts"].empty());
    EXPECT_EQ(runc, runsc);
}

class RootfsTest : public ::testing::Test {
  protected:
    void SetUp() override {
        char tmpl[] = "/tmp/cellblock-rootfs-XXXXXX";
        ASSERT_NE(::mkdtemp(tmpl), nullptr);
        dir_ = tmpl;
    }
    void TearDown() override { fs::remove_all(dir_); }
    fs::path dir_;
};

TEST_F(RootfsTest, SkeletonHasMountPointsAndAGeneratedEtc) {
    SandboxSpec spec = test_spec();
    spec.rootfs = dir_ / "rootfs";
    spec.image.host_binds = {"/etc/hostname"};  // a file bind
    const json config = make_oci_config(spec);
    prepare_host_rootfs(spec, config);
    const fs::path r = spec.rootfs;
    EXPECT_TRUE(fs::is_directory(r / "tmp"));
    EXPECT_TRUE(fs::is_directory(r / "home/sandbox"));
    EXPECT_TRUE(fs::is_directory(r / "data/input"));
    EXPECT_TRUE(fs::is_directory(r / "run/cellblock"));
    EXPECT_TRUE(fs::is_regular_file(r / "etc/hostname"));
    EXPECT_TRUE(fs::is_symlink(r / "bin"));
    EXPECT_EQ(fs::read_symlink(r / "lib"), "usr/lib");
    struct stat st {};
    ASSERT_EQ(::stat((r / "tmp").c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 07777, 01777u);
    std::ifstream passwd(r / "etc/passwd");
    const std::string text((std::istreambuf_iterator<char>(passwd)), {});
    EXPECT_NE(text.find("sandbox:x:1000:1000"), std::string::npos);
    EXPECT_FALSE(fs::exists(r / "etc/shadow"));
    EXPECT_FALSE(fs::exists(r / "etc/resolv.conf"));
}

TEST(Image, RejectsRelativeBindsAndMissingFields) {
    EXPECT_THROW(Image::from_json(json{{"name", "x"}}), std::runtime_error);
    EXPECT_THROW(
        Image::from_json(json{{"name", "x"}, {"kernel_argv", {"k"}}, {"host_binds", {"etc"}}}),
        std::runtime_error);
    EXPECT_THROW(Image::from_json(
                     json{{"name", "x"}, {"kernel_argv", {"k"}}, {"host_binds", {"/a/../etc"}}}),
                 std::runtime_error);
    EXPECT_THROW(Image::from_json(json{{"name", "x"}, {"kernel_argv", "notalist"}}),
                 std::runtime_error);
}

TEST(Image, PreloadTakesModuleNamesOnly) {
    const json base{{"name", "x"}, {"kernel_argv", {"k"}}};
    json ok = base;
    ok["preload"] = {"numpy", "matplotlib.pyplot", "_private2"};
    EXPECT_EQ(Image::from_json(ok).preload.size(), 3u);
    for (const char* bad : {"os; import sys", "", "a..b", ".a", "a.", "1abc", "__import__('os')"}) {
        json j = base;
        j["preload"] = {bad};
        EXPECT_THROW(Image::from_json(j), std::runtime_error) << bad;
    }
}

TEST(Image, LimitsLayerOverTheBase) {
    SandboxLimits base;
    base.memory_mb = 2048;
    const SandboxLimits l = SandboxLimits::from_json(json{{"pids", 10}}, base);
    EXPECT_EQ(l.memory_mb, 2048);
    EXPECT_EQ(l.pids, 10);
    EXPECT_THROW(SandboxLimits::from_json(json{{"pids", "many"}}, base), std::runtime_error);
}

// Each rule of an image definition is a named check, and a refusal names it.
TEST(Image, DefinitionsAreCheckedByNamedChecks) {
    std::set<std::string_view> names;
    for (const auto& check : image_checks()) names.insert(check.name);
    EXPECT_EQ(names,
              (std::set<std::string_view>{"kernel_argv", "rootfs", "host_binds", "build", "preload",
                                          "warm_imports", "zygote", "hibernate_level"}));
    const json base = {{"name", "x"}, {"kernel_argv", {"k"}}};
    auto refusal = [&](json patch) -> std::string {
        json j = base;
        j.merge_patch(patch);
        try {
            Image::from_json(j);
        } catch (const std::runtime_error& e) {
            return e.what();
        }
        return "";
    };
    EXPECT_EQ(refusal({{"rootfs", "rel"}}),
              "image x: rootfs 'rel' is not host, store or an absolute path (check rootfs)");
    EXPECT_EQ(refusal({{"host_binds", {"etc"}}}),
              "image x: host bind 'etc' is not an absolute path (check host_binds)");
    EXPECT_EQ(refusal({{"preload", {"os;rm"}}}),
              "image x: preload 'os;rm' is not a module name (check preload)");
    EXPECT_EQ(refusal({{"kernel_argv", json::array()}}),
              "image x: missing field 'kernel_argv' (check kernel_argv)");
    EXPECT_EQ(refusal({{"rootfs", "/srv/root"}}), "");
    const json launcher = {"/usr/bin/python3", "/opt/cellblock/cellblock_ipykernel.py", "-f",
                           "{connection_file}"};
    EXPECT_EQ(refusal({{"zygote", true}, {"kernel_argv", launcher}}), "");
    EXPECT_EQ(refusal({{"zygote", true}, {"kernel_argv", launcher}, {"runtime", "runsc"}}),
              "image x: zygote sessions need the runc runtime, not runsc (check zygote)");
    EXPECT_EQ(refusal({{"zygote", true}}),
              "image x: zygote sessions fork cellblock's ipykernel launcher: kernel_argv must be "
              "[python, /opt/cellblock/cellblock_ipykernel.py, ...] (check zygote)");
    EXPECT_EQ(refusal({{"zygote", true}, {"kernel_argv", launcher}, {"warm_imports", {"pandas"}}}),
              "");
    EXPECT_EQ(refusal({{"warm_imports", {"pandas"}}}), "");  // a booted kernel skips them
    EXPECT_EQ(refusal({{"hibernate_level", "exact"}, {"runtime", "runsc"}}), "");
    EXPECT_EQ(refusal({{"hibernate_level", "exact"}}),
              "image x: hibernate_level 'exact' needs the runsc runtime (runc has no checkpoint "
              "here: CRIU fails on this kernel), not runc (check hibernate_level)");
    EXPECT_EQ(refusal({{"hibernate_level", "frozen"}}),
              "image x: hibernate_level 'frozen' is neither 'namespace' nor 'exact' (check "
              "hibernate_level)");
    EXPECT_EQ(refusal({{"zygote", true}, {"kernel_argv", launcher}, {"warm_imports", {"a;b"}}}),
              "image x: warm_imports 'a;b' is not a module name (check warm_imports)");
}

// A zygote's container: no user or PID namespace (its forks make their own),
// the host ids of its lease with no capabilities, an unmasked /proc, and a
// profile that lets its forks contain themselves; the session's is unchanged.
TEST(OciConfig, ZygoteRole) {
    SandboxSpec spec;
    spec.container_id = "cb-z";
    spec.image.kernel_argv = {"/usr/bin/python3", "/opt/cellblock/cellblock_ipykernel.py"};
    spec.image.preload = {"numpy", "pandas"};
    spec.ids = {(1u << 30) + 65536, 65536};
    spec.role = SandboxRole::zygote;
    const json config = make_oci_config(spec);
    std::set<std::string> namespaces;
    for (const auto& ns : config["linux"]["namespaces"]) namespaces.insert(ns["type"]);
    EXPECT_EQ(namespaces, (std::set<std::string>{"network", "ipc", "uts", "mount", "cgroup"}));
    EXPECT_FALSE(config["linux"].contains("uidMappings"));
    EXPECT_EQ(config["process"]["user"]["uid"], (1u << 30) + 65536 + kSandboxUid);
    EXPECT_TRUE(config["process"]["capabilities"]["bounding"].empty());
    EXPECT_TRUE(config["process"]["noNewPrivileges"]);
    EXPECT_EQ(config["linux"]["readonlyPaths"], json::array());
    EXPECT_EQ(config["linux"]["maskedPaths"], json::array());
    const auto& args = config["process"]["args"];
    EXPECT_EQ(args[2], "/usr/bin/python3");
    EXPECT_EQ(args[3], "/opt/cellblock/cellblock_zygote.py");
    EXPECT_EQ(args.back(), "numpy,pandas");
    // Warm imports on their own option, after the preload; none, no option.
    spec.image.warm_imports = {"scipy", "matplotlib.pyplot"};
    const auto warm_args = make_oci_config(spec)["process"]["args"];
    ASSERT_GE(warm_args.size(), 4u);
    EXPECT_EQ(warm_args[warm_args.size() - 3], "numpy,pandas");
    EXPECT_EQ(warm_args[warm_args.size() - 2], "--warm-imports");
    EXPECT_EQ(warm_args.back(), "scipy,matplotlib.pyplot");
    spec.image.warm_imports.clear();
    auto denied = [](const json& profile) {
        std::set<std::string> names;
        for (const auto& rule : profile["syscalls"])
            if (rule["action"] == "SCMP_ACT_ERRNO")
                for (const auto& n : rule["names"]) names.insert(n);
        return names;
    };
    const auto zygote_denied = denied(config["linux"]["seccomp"]);
    const auto session_denied = denied(make_seccomp_profile(RuntimeKind::runc));
    for (const char* call : {"unshare", "mount", "umount2", "move_mount", "sethostname"}) {
        EXPECT_EQ(zygote_denied.count(call), 0u) << call;
        EXPECT_EQ(session_denied.count(call), 1u) << call;
    }
    EXPECT_EQ(zygote_denied.count("ptrace"), 1u);
    EXPECT_EQ(zygote_denied.count("open_tree"), 1u);
    spec.role = SandboxRole::session;
    const json session = make_oci_config(spec);
    EXPECT_EQ(session["linux"]["namespaces"].size(), 7u);
    EXPECT_EQ(session["process"]["user"]["uid"], kSandboxUid);
}

// An image's limits go through the one parser the server layers them with
// (session_policy.cpp): the same bounds and the same words, at load.
TEST(Image, LimitsAreCheckedByThePolicysParserAtLoad) {
    auto message_for = [](const json& limits) -> std::string {
        try {
            Image::from_json(json{{"name", "x"}, {"kernel_argv", {"k"}}, {"limits", limits}});
        } catch (const std::runtime_error& e) {
            return e.what();
        }
        return "";
    };
    EXPECT_EQ(message_for({{"memory_mb", 0}}), "image x: memory_mb must be positive, got 0");
    EXPECT_EQ(message_for({{"pids", 3000000000ll}}), "image x: pids 3000000000 is out of range");
    // Session fields too, and names nobody knows (a typo no longer waits for a create).
    EXPECT_EQ(message_for({{"max_executions", "x"}}),
              "image x: max_executions must be a positive integer, got string");
    EXPECT_EQ(message_for({{"memroy_mb", 10}}), "image x: unknown limit 'memroy_mb'");
    const Image ok = Image::from_json(
        json{{"name", "x"}, {"kernel_argv", {"k"}}, {"limits", {{"cpus", 0.5}, {"pids", 64}}}});
    EXPECT_EQ(ok.limits.pids, 64);
    EXPECT_DOUBLE_EQ(ok.limits.cpus, 0.5);
    try {
        SandboxLimits::from_json(json{{"max_executions", 3}}, SandboxLimits{});
        ADD_FAILURE() << "a session limit taken as a sandbox limit";
    } catch (const PolicyError& e) {
        EXPECT_EQ(e.ename(), "InvalidLimits");
    }
}

TEST(Image, FindImageRefusesPathsAsNames) {
    EXPECT_THROW(find_image("../etc", {"/tmp"}), std::runtime_error);
    EXPECT_THROW(find_image("no-such-image", {"/tmp"}), std::runtime_error);
    const Image host =
        find_image("host", {fs::path(CELLBLOCK_FIXTURES_DIR) / ".." / ".." / "images"});
    EXPECT_EQ(host.name, "host");
    EXPECT_FALSE(host.kernel_argv.empty());
}

}  // namespace
}  // namespace cellblock
