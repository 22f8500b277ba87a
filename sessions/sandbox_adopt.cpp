// A sandbox that outlived its server, taken back by the next start
// (docs/restarts.md, phase 2). The shim waited for a lifeline (its grace,
// kAdoptGraceEnv); this file checks that the sandbox is still the one the
// record names and gives it one.
#include <sys/file.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>

#include <spdlog/spdlog.h>

#include "cellblock/host_ids.hpp"
#include "cellblock/image_builder.hpp"
#include "cellblock/session_dir.hpp"
#include "sandbox_internal.hpp"

namespace cellblock {
namespace fs = std::filesystem;
using nlohmann::json;
using namespace sandbox_detail;

namespace {
constexpr int kRecordVersion = 1;

bool in_cgroup(const std::vector<fs::path>& dirs, pid_t pid) {
    for (const auto& dir : dirs) {
        std::ifstream procs(dir / "cgroup.procs");
        for (pid_t member; procs >> member;) {
            if (member == pid) return true;
        }
    }
    return false;
}
}  // namespace

std::optional<json> RuncSandbox::adoption_record() const {
    // A fork of a zygote has its lifeline passed too; runsc's shim connects
    // its own and shows a key when it connects again (give_adopt_key).
    const bool runsc = !runtime_passes_fds(runtime_kind(settings_.runtime));
    if (init_pid_ <= 0 || exited_ || settings_.adopt_grace_ms <= 0 ||
        (runsc && (adopt_key_.empty() || gofer_pid_ <= 0))) {
        return std::nullopt;
    }
    if (adoption_record_) return adoption_record_;
    ConnectionInfo inner = inner_;
    inner.ip = std::string(kSandboxIpcDir) + "/k";  // as the sandbox's file says
    json zygote = nullptr;
    if (forked_) {
        // A fork's root is its zygote's mount tree: adopted with it, or not at all.
        const auto zygote_record = zygote_box_ ? zygote_box_->adoption_record() : std::nullopt;
        if (!zygote_record) return std::nullopt;
        zygote = {{"session_id", zygote_box_->session_id()}, {"record", *zygote_record}};
    }
    json record{{"forked_from", zygote},
                {"version", kRecordVersion},
                {"runtime", settings_.runtime},
                {"forked", forked_},
                {"bridged", bridged_},
                {"init_pid", init_pid_},
                {"init_start", process_start_ticks(init_pid_)},
                {"host_base", host_ids().host_base},
                {"host_count", host_ids().size},
                {"inner", inner.to_json()}};
    if (runsc) {
        // The Sentry is the init; the gofer serves its files and goes with it.
        record["gofer_pid"] = gofer_pid_;
        record["gofer_start"] = process_start_ticks(gofer_pid_);
        record["adopt_key"] = adopt_key_;
    }
    adoption_record_ = std::move(record);
    return adoption_record_;
}

namespace {
SandboxError adoption_error(const std::string& session_id, const std::string& why) {
    return SandboxError("session " + session_id + ": its sandbox cannot be adopted: " + why);
}
}  // namespace

std::unique_ptr<RuncSandbox> RuncSandbox::adopt(const std::string& session_id, const json& record,
                                                const Image& image, const SandboxLimits& limits,
                                                const RuntimeSettings& settings,
                                                std::chrono::milliseconds wait,
                                                std::shared_ptr<RuncSandbox> zygote) {
    return finish_adoption(
        begin_adoption(session_id, record, image, limits, settings, std::move(zygote)), wait);
}

RuncSandbox::Adoption RuncSandbox::begin_adoption(const std::string& session_id, const json& record,
                                                  const Image& image, const SandboxLimits& limits,
                                                  const RuntimeSettings& settings,
                                                  std::shared_ptr<RuncSandbox> zygote) {
    const auto fail = [&](const std::string& why) { return adoption_error(session_id, why); };
    if (record.value("version", 0) != kRecordVersion)
        throw fail("a record this server cannot read");
    std::unique_ptr<RuncSandbox> box(new RuncSandbox());
    box->session_id_ = session_id;
    box->container_id_ = container_id_for(session_id);
    box->settings_ = settings;
    box->settings_.runtime = record.at("runtime").get<std::string>();
    box->limits_ = limits;
    box->image_name_ = image.name;
    box->preload_ = image.preload;
    box->dir_ = SessionDir(settings.sessions_dir() / session_id);
    const SessionDir& paths = box->dir_;
    std::error_code ec;
    if (!fs::is_directory(paths.root(), ec)) throw fail("its session dir is gone");
    // What the session dir says ran it: the runtime, or a zygote's fork.
    box->forked_ = record.value("forked", false);
    // Its shim bridges the kernel's channels (the exact level): it can still
    // be checkpointed once adopted.
    box->bridged_ = record.value("bridged", false);
    if (box->forked_ && !zygote) throw fail("a fork whose zygote is not adopted");
    // Its record names the zygote again (adoption_record): a second crash
    // adopts it as the first did.
    box->zygote_box_ = zygote.get();
    box->keep_ = std::move(zygote);
    const std::string ran_by = box->forked_ ? kForkedRuntime : box->settings_.runtime;
    if (read_text(runtime_file(paths.root())) != ran_by + "\n") {
        throw fail("its runtime is not the record's " + ran_by);
    }
    const bool runsc = !runtime_passes_fds(runtime_kind(box->settings_.runtime));
    if (runsc) {
        box->adopt_key_ = record.value("adopt_key", "");
        if (!sandbox_protocol::well_formed_adopt_key(box->adopt_key_)) {
            throw fail("a runsc record without the key its shim shows");
        }
    }
    // The dead server's lock went with it; whoever holds it now owns the sandbox.
    box->lock_fd_.reset(::open(paths.lock().c_str(), O_RDWR | O_CLOEXEC));
    if (!box->lock_fd_ || ::flock(box->lock_fd_.get(), LOCK_EX | LOCK_NB) != 0) {
        throw fail("its session lock is held or gone");
    }
    try {
        box->host_ids_ = relet_host_ids(settings.host_ids,
                                        {record.at("host_base").get<std::uint32_t>(),
                                         record.at("host_count").get<std::uint32_t>()},
                                        paths.root());
    } catch (const std::exception& e) {
        throw fail(e.what());
    }
    // The init is the record's: the same pid, started at the same tick (not
    // a pid used again), still in the container's cgroup, not ended.
    const auto init = record.at("init_pid").get<pid_t>();
    if (init <= 0 || process_gone(init)) throw fail("its init has ended");
    if (process_start_ticks(init) != record.at("init_start").get<std::uint64_t>()) {
        throw fail("pid " + std::to_string(init) + " is not its init any more");
    }
    box->cgroup_dirs_ = sandbox_cgroup_dirs(box->container_id_);
    if (!in_cgroup(box->cgroup_dirs_, init)) {
        throw fail("pid " + std::to_string(init) + " is not in the container's cgroup");
    }
    box->init_pid_ = init;
    if (runsc) {
        // The gofer: the same process as the record's, or the sandbox's files are gone.
        const auto gofer = record.value("gofer_pid", pid_t{-1});
        if (gofer <= 0 || process_gone(gofer) ||
            process_start_ticks(gofer) != record.value("gofer_start", std::uint64_t{0})) {
            throw fail("its gofer (pid " + std::to_string(gofer) + ") has ended");
        }
        box->gofer_pid_ = gofer;
    }
    if (!image.content_id.empty() && !image.rootfs.empty() && image.rootfs[0] == '/') {
        try {
            box->version_fd_.reset(hold_stored_version(image.rootfs));
        } catch (const std::exception& e) {
            throw fail(std::string("its image: ") + e.what());
        }
    }
    // The shim connects every kAdoptRetryMs to this socket. Root's, 0666 in
    // the sticky ipc dir: the sandbox can connect (only the init's
    // connection is taken) but neither remove nor replace it.
    const fs::path socket = paths.lifeline_socket();
    ::unlink(socket.c_str());  // whatever the sandbox left under the name
    Adoption adoption;
    try {
        adoption.listener.reset(listen_lifeline(socket, 0, 0666));
    } catch (const std::exception& e) {
        ::unlink(socket.c_str());
        throw fail(e.what());
    }
    box->inner_ = ConnectionInfo::from_json(record.at("inner"));
    box->inner_.ip = paths.kernel_sockets().string();
    adoption.box = std::move(box);
    return adoption;
}

std::unique_ptr<RuncSandbox> RuncSandbox::finish_adoption(Adoption adoption,
                                                          std::chrono::milliseconds wait) {
    std::unique_ptr<RuncSandbox>& box = adoption.box;
    const fs::path socket = box->dir_.lifeline_socket();
    const auto fail = [&](const std::string& why) { return adoption_error(box->session_id_, why); };
    try {
        LifelinePeer shim{.only_init = true, .proof = {}};
        if (!box->adopt_key_.empty()) {
            // Under runsc the connection comes through the gofer: no pid to check.
            shim = {.only_init = false, .proof = sandbox_protocol::adopt_line(box->adopt_key_)};
        }
        box->lifeline_.reset(accept_lifeline(adoption.listener.get(), box->init_pid_, wait, shim));
    } catch (const std::exception& e) {
        ::unlink(socket.c_str());
        throw fail(e.what());
    }
    ::unlink(socket.c_str());
    if (!box->lifeline_) {
        throw fail("its shim did not connect within " + std::to_string(wait.count()) +
                   " ms (its grace over, or the sandbox ending)");
    }
    if (!box->adopt_key_.empty()) {
        // A runsc shim takes the connection once it is answered so.
        const std::string line = sandbox_protocol::adopted_line();
        if (::send(box->lifeline_.get(), line.data(), line.size(), MSG_NOSIGNAL) !=
            static_cast<ssize_t>(line.size())) {
            throw fail("its shim's connection ended before it was answered: " + errno_text());
        }
    }
    box->open_counters();
    return std::move(box);
}

}  // namespace cellblock
