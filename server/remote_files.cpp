// File transfer for sessions whose sandbox has no directory on this host (a
// Swarm task on another node; docs/scale-out.md, "Files"). The client's side
// is the local one, unchanged: FileTransfers works on a staging copy the
// front keeps of the session's /data/input and /data/output, under
// STATE_DIR/remote-files/<session>/ (0700, root's). What lands in the input
// copy goes on to the kernel before the put is answered; what a get asks for
// is first fetched from the kernel into the output copy. The bytes travel on
// the kernel's control channel (kernel_files.hpp).
#include "server.hpp"
#include "session_snapshots.hpp"

namespace cellblock {

bool Server::files_in_kernel(SessionProxy& s) { return s.sandbox() && !s.sandbox()->files(); }

fs::path Server::remote_files_dir(const std::string& session_id) const {
    return settings_.state_dir / kRemoteFilesDir / session_id;
}

fs::path Server::make_remote_files_dir(const std::string& session_id) const {
    const fs::path dir = remote_files_dir(session_id);
    std::error_code ec;
    fs::create_directories(dir.parent_path(), ec);
    ::chmod(dir.parent_path().c_str(), 0700);
    for (const char* sub : {"input", "output", "partial"}) {
        if (!ec) fs::create_directories(dir / sub, ec);
    }
    ::chmod(dir.c_str(), 0700);
    if (ec) {
        throw RequestError{ename::FileError, "the front's copy of the session's files, " +
                                                 dir.string() + ": " + ec.message()};
    }
    return dir;
}

AskKernel Server::kernel_asker(const std::string& session_id) {
    return [this, session_id](const std::string& type, json content,
                              std::vector<std::string> buffers, KernelAnswered answered) {
        Session* session = sessions_.find(session_id);
        if (!session || !session->proxy()) return false;
        return session->proxy()->ask_kernel(type, std::move(content), std::move(buffers),
                                            std::move(answered));
    };
}

SessionFiles Server::session_files(SessionProxy& s) const {
    Sandbox* box = s.sandbox();
    if (!box) {
        throw RequestError{ename::FileError, "session " + s.session_id() + " is " + s.state() +
                                                 ": its files move once it is awake "
                                                 "(session_resume_request)"};
    }
    const std::uint64_t cap = static_cast<std::uint64_t>(s.governor()->limits().sandbox.disk_mb)
                              << 20;
    if (const SandboxFiles* files = box->files()) {
        return {s.session_id(), files->input_dir(), files->output_dir(), files->staging_dir(), cap};
    }
    const fs::path dir = make_remote_files_dir(s.session_id());
    return {s.session_id(), dir / "input", dir / "output", dir / "partial", cap};
}

KernelFilesDone Server::counted_move(const std::string& session_id, KernelFilesDone done) {
    const std::size_t cap = transfers_.limits().max_session_transfers;
    std::size_t& moving = kernel_moves_[session_id];
    if (moving >= cap) {
        throw FileRequestError(ename::TooManyTransfers,
                               std::to_string(moving) + " files are moving to or from session " +
                                   session_id + "'s kernel already (at most " +
                                   std::to_string(cap) + " at once); try again when one ends");
    }
    ++moving;
    return [this, session_id, done = std::move(done)](std::optional<FileRequestError> error) {
        if (auto it = kernel_moves_.find(session_id); it != kernel_moves_.end()) {
            if (--it->second == 0) kernel_moves_.erase(it);
        }
        done(std::move(error));
    };
}

void Server::put_in_kernel(const std::string& session_id, FileTransfers::Reply done,
                           KernelFilesAnswer answer) {
    // "/data/input/<path>", as the put's reply names it for the client.
    const std::string path =
        checked_relative_path(json_string(done.content, "path"), kSandboxInputDir);
    const fs::path local = remote_files_dir(session_id) / "input" / path;
    push_to_kernel(kernel_asker(session_id), local, path,
                   counted_move(session_id, [this, session_id, done = std::move(done),
                                             answer = std::move(answer)](
                                                std::optional<FileRequestError> error) mutable {
                       if (error) {
                           // The front's copy stays (and counts): a put again replaces it.
                           spdlog::warn("session {}: a put did not reach the kernel: {}: {}",
                                        session_id, error->ename(), error->what());
                           return answer(nullptr, &*error);
                       }
                       if (done.event) on_event(session_id, done.event->first, done.event->second);
                       answer(&done, nullptr);
                   }));
}

void Server::pull_output(const std::string& session_id, const json& content,
                         std::uint64_t max_bytes, const std::string& over_what, PulledThen then) {
    const std::string path = checked_relative_path(json_string(content, "path"), kSandboxOutputDir);
    const fs::path local = remote_files_dir(session_id) / "output" / path;
    pull_from_kernel(kernel_asker(session_id), path, local, max_bytes, over_what,
                     counted_move(session_id, [local, then = std::move(then)](
                                                  std::optional<FileRequestError> error) {
                         then(error ? &*error : nullptr, local);
                     }));
}

void Server::kernel_file_request(const WireMessage& request) {
    const std::string type = request.msg_type();
    const std::string session_id = session_id_of(request.content);
    const auto answer = [this, request](FileTransfers::Reply* done, const FileRequestError* e) {
        if (e) return reply_error(request, e->ename(), e->what());
        if (metrics_) {
            std::uint64_t out = 0;
            for (const auto& b : done->buffers) out += b.size();
            if (out > 0) metrics_->file_bytes("out", "manager", out);
        }
        reply(request, std::move(done->content), std::move(done->buffers));
    };
    if (type == "file_list_request") {
        list_kernel_files(kernel_asker(session_id),
                          [answer](json listing, std::optional<FileRequestError> error) {
                              FileTransfers::Reply done{std::move(listing), {}, {}, {}};
                              answer(error ? nullptr : &done, error ? &*error : nullptr);
                          });
        return;
    }
    const bool whole = type == "file_get_request";
    const auto& limits = transfers_.limits();
    const std::uint64_t max = whole ? limits.max_inline_bytes : limits.max_file_bytes;
    const std::string over_what =
        whole ? "the " + std::to_string(max) +
                    " bytes one message may carry; use file_get_begin_request"
              : "the server's maximum of " + std::to_string(max) + " bytes";
    pull_output(
        session_id, request.content, max, over_what,
        [this, request, type, answer](const FileRequestError* error, const fs::path& local) {
            if (error) return answer(nullptr, error);
            try {
                SessionProxy& s = live_session(request.content);
                auto done = transfers_.handle(type, request.content, std::vector<std::string>{},
                                              session_files(s), Clock::now());
                ::unlink(local.c_str());  // a download holds it open
                answer(&done, nullptr);
            } catch (const FileRequestError& e) {
                ::unlink(local.c_str());
                answer(nullptr, &e);
            } catch (const RequestError& e) {
                ::unlink(local.c_str());
                const FileRequestError as_file(e.ename, e.evalue);
                answer(nullptr, &as_file);
            }
        });
}

void Server::fetch_snapshot(const std::string& session_id, SessionIo::Moved done) {
    fs::path output;
    try {
        output = make_remote_files_dir(session_id) / "output";
    } catch (const RequestError& e) {
        return done(&e.evalue);
    }
    const std::uint64_t cap = snapshots_->caps().per_session;
    pull_from_kernel(
        kernel_asker(session_id), kSnapshotFile, output / kSnapshotFile, cap,
        "the snapshot cap of " + std::to_string(cap) + " bytes per session (--snapshot-max-mb)",
        [done = std::move(done)](std::optional<FileRequestError> error) {
            if (!error) return done(nullptr);
            // Past the cap: StorageFull, as a local snapshot's.
            const std::string why = (error->ename() == ename::FileTooLarge
                                         ? std::string(ename::StorageFull) + ": "
                                         : std::string("fetching the snapshot from the kernel: ")) +
                                    error->what();
            done(&why);
        });
}

namespace {

// Every file of the front's copy of /data/input to the kernel, one after
// another; `done` once, with null or why not.
struct InputsToKernel : std::enable_shared_from_this<InputsToKernel> {
    AskKernel ask;
    fs::path input;
    std::vector<std::string> paths;
    std::size_t next = 0;
    SessionIo::Moved done;

    // The store opened its files into `input` (or not: `why`): each goes to
    // the kernel, or `done` says why not.
    void placed(std::string why) {
        try {
            if (why.empty()) {
                for (const auto& entry : fs::recursive_directory_iterator(input)) {
                    if (entry.is_regular_file() && !entry.is_symlink()) {
                        paths.push_back(fs::relative(entry.path(), input).string());
                    }
                }
            }
        } catch (const std::exception& e) {
            why = std::string("placing the snapshot: listing its inputs: ") + e.what();
        }
        if (!why.empty()) return done(&why);  // the store's errors name their step
        step();
    }

    void step() {
        if (next == paths.size()) return done(nullptr);
        const std::string path = paths[next++];
        auto self = shared_from_this();
        push_to_kernel(
            ask, input / path, path, [self, path](std::optional<FileRequestError> error) {
                if (!error) return self->step();
                const std::string why =
                    "placing " + std::string(kSandboxInputDir) + "/" + path + ": " + error->what();
                self->done(&why);
            });
    }
};

}  // namespace

void Server::place_snapshot(const std::string& session_id, SessionIo::Moved done) {
    // The store's sealed copies are what the session had: the front's copy
    // of /data/input is made anew from them, then every file of it goes to
    // the new kernel, the snapshot with them. Opened off the loop
    // (background_work.hpp), as a local wake's is.
    auto moving = std::make_shared<InputsToKernel>();
    moving->ask = kernel_asker(session_id);
    moving->input = remote_files_dir(session_id) / "input";
    moving->done = std::move(done);
    std::shared_ptr<SnapshotPlacing> placing;
    try {
        std::error_code ec;
        fs::remove_all(moving->input, ec);
        fs::create_directories(moving->input);
        placing = snapshots_->begin_place(session_id, moving->input);
    } catch (const SnapshotError& e) {
        const std::string why = e.what();  // it names its step
        return moving->done(&why);
    } catch (const std::exception& e) {
        const std::string why = std::string("placing the snapshot: ") + e.what();
        return moving->done(&why);
    }
    background_->run([placing] { placing->open(); },
                     [this, moving, session_id](const std::string& error) {
                         const Session* session = sessions_.find(session_id);
                         if (session && session->live()) moving->placed(error);
                     });
}

void Server::remove_remote_files(const std::string& session_id) {
    std::error_code ec;
    fs::remove_all(remote_files_dir(session_id), ec);
}

void Server::remove_stale_remote_files() {
    // What an earlier run kept for sessions that are not live now: the
    // front's copies of their files, and their egress listeners
    // (session_egress.cpp).
    for (const char* kept : {kRemoteFilesDir, kRemoteEgressDir}) {
        const fs::path root = settings_.state_dir / kept;
        std::error_code ec;
        for (const auto& entry : fs::directory_iterator(root, ec)) {
            const std::string id = entry.path().filename().string();
            if (!sessions_.live(id)) fs::remove_all(entry.path(), ec);
        }
    }
}

}  // namespace cellblock
