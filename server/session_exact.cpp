// The exact level of hibernation, the server's part (docs/hibernation.md):
// a bridged runsc sandbox, its shim quiesced by the relay, is checkpointed
// whole by its runtime off the loop; the image, /data/output and /data/input
// are sealed into the store and the sandbox goes. The wake restores that
// image into a new sandbox of the same image and limits (not a pooled one:
// a restore makes its own), whose kernel answers as it was.
#include <sys/stat.h>

#include "inner_channels.hpp"
#include "server.hpp"

namespace cellblock {

void Server::checkpoint_session(const std::string& session_id, std::unique_ptr<Sandbox> box,
                                SessionIo::Checkpointed done) {
    // From here the sandbox is quiesced: a failure ends it (awake = false).
    auto held = std::make_shared<std::unique_ptr<Sandbox>>(std::move(box));
    const auto fail = [this, held, done](const std::string& why) {
        if (*held) pool_->dispose(std::move(*held));
        done(&why, false);
    };
    const HostProcess* host = (*held)->host_process();
    const SandboxFiles* files = (*held)->files();
    if (!host || !files) return fail("its sandbox has no directory on this host");
    const fs::path image_dir = host->session_dir().root() / "checkpoint";
    if (::mkdir(image_dir.c_str(), 0700) != 0) {
        return fail("mkdir " + image_dir.string() + ": " + std::strerror(errno));
    }
    const std::string secrets = (*held)->checkpointable()->restore_secrets().dump();
    const fs::path output = files->output_dir(), input = files->input_dir();
    const auto started = Clock::now();
    background_->run(
        [held, image_dir] { (*held)->checkpointable()->checkpoint(image_dir); },
        [this, session_id, held, image_dir, output, input, secrets, started, fail,
         done](const std::string& error) {
            const Session* session = sessions_.find(session_id);
            if (!session || !session->live()) {
                pool_->dispose(std::move(*held));  // closed meanwhile: nobody waits
                return;
            }
            if (!error.empty()) return fail("checkpoint: " + error);
            const double checkpoint_ms =
                std::chrono::duration<double, std::milli>(Clock::now() - started).count();
            std::shared_ptr<SnapshotKeeping> keeping;
            try {
                keeping =
                    snapshots_->begin_exact_keep(session_id, image_dir, output, input, secrets);
            } catch (const std::exception& e) {
                return fail(why_not_kept(e));
            }
            const auto sealing = Clock::now();
            background_->run(
                [keeping] { keeping->seal(); },
                [this, keeping, held, fail, done, checkpoint_ms,
                 sealing](const std::string& error) {
                    const Session* session = sessions_.find(keeping->session_id);
                    if (!session || !session->live()) {
                        snapshots_->abandon(*keeping);
                        pool_->dispose(std::move(*held));
                        return;
                    }
                    if (!error.empty()) {
                        snapshots_->abandon(*keeping);
                        return fail(error);
                    }
                    std::uint64_t bytes = 0;
                    try {
                        bytes = snapshots_->finish_keep(*keeping);
                    } catch (const std::exception& e) {
                        return fail(why_not_kept(e));
                    }
                    spdlog::info(
                        "session {}: checkpointed whole (exact level): image {} bytes, "
                        "runsc checkpoint {:.0f} ms, sealed in {:.0f} ms",
                        keeping->session_id, bytes, checkpoint_ms,
                        std::chrono::duration<double, std::milli>(Clock::now() - sealing).count());
                    pool_->dispose(std::move(*held));  // its dir, the image's copy with it
                    trim_due_ = true;
                    done(nullptr, false);
                });
        });
}

void Server::wake_exact(const std::string& session_id) {
    Session* session = sessions_.find(session_id);
    SessionProxy* relay = session ? session->proxy() : nullptr;
    if (!relay) return;
    std::shared_ptr<SnapshotPlacing> placing;
    try {
        // Where it goes is known once the new sandbox's dirs are made (off the loop).
        placing = snapshots_->begin_exact_place(session_id, {}, {}, {}, 0, 0);
    } catch (const std::exception& e) {
        relay->close(std::string("resume_failed: ") + e.what());
        return;
    }
    const SessionOrigin& origin = session->origin();
    const Image image = origin.image;
    const SessionLimits limits = origin.limits;
    auto woken = std::make_shared<WarmSandbox>();
    SandboxBackend& backend = pool_->backend();
    background_->run(
        [&backend, placing, image, limits, woken, ctx = &context_, stopping = &stopping_,
         transport = options_.kernel_transport, id = make_session_id()] {
            std::unique_ptr<Sandbox> box =
                backend.restore(id, image, limits.sandbox, [placing](const RestoreDirs& dirs) {
                    placing->image_to = dirs.image_dir;
                    placing->output_to = dirs.output_dir;
                    placing->to = dirs.input_dir;
                    placing->output_uid = dirs.uid;
                    placing->output_gid = dirs.uid;
                    placing->open();
                    return json::parse(placing->secrets());
                });
            if (!box) throw std::runtime_error("this server's backend cannot restore a sandbox");
            // No warm-up: it would run a cell in the restored kernel.
            woken->channels = std::shared_ptr<InnerChannels>(
                probe_kernel(*ctx, *box, kProbeTimeout, 64 << 20, stopping, transport, false));
            woken->sandbox = std::move(box);
        },
        [this, session_id, limits, woken](const std::string& error) {
            if (error.empty()) return attach_resumed(session_id, limits, std::move(*woken), "");
            if (woken->sandbox) pool_->dispose(std::move(woken->sandbox));
            if (SessionProxy* relay = sessions_.live(session_id)) {
                relay->close("resume_failed: " + error);
            }
        });
}

}  // namespace cellblock
