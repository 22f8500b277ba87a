// The local file socket (local_files.hpp): accept, one signed request with
// one descriptor, a copy on its own thread, progress and the reply.
#include "local_files.hpp"

#include <sys/socket.h>
#include <sys/stat.h>

#include "server.hpp"
#include "unix_address.hpp"

namespace cellblock {

namespace {

void wake(int fd) {
    const std::uint64_t one = 1;
    [[maybe_unused]] auto n = ::write(fd, &one, sizeof one);
}

}  // namespace

void LocalCopyJob::start(int wake_fd) {
    thread = std::jthread([this, wake_fd] {
        try {
            sha256 = copy_and_hash(copy.src.get(), copy.dst.get(), copy.size, control,
                                   [wake_fd] { wake(wake_fd); });
        } catch (const FileRequestError& e) {
            ename = e.ename();
            evalue = e.what();
        } catch (const std::exception& e) {
            ename = ename::ServerError;
            evalue = e.what();
        }
        copy.src.reset();
        copy.dst.reset();
        finished.store(true, std::memory_order_release);
        wake(wake_fd);
    });
}

LocalCopyJob::~LocalCopyJob() {
    control.cancel = true;  // the thread stops at its next step; `thread` joins it
}

// ------------------------------------------------------------------ Server's side

void Server::open_local_files() {
    const fs::path path = local_files_socket(settings_.state_dir);
    const auto addr = unix_address(path.string());
    if (!addr) {
        spdlog::warn("local file socket: {} is too long for a unix socket; clients stream files",
                     path.string());
        return;
    }
    local_wake_ = UniqueFd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    UniqueFd listener(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    ::unlink(path.c_str());  // a dead server's (the state dir's lock is ours)
    // Only the server's own user may connect: the socket's mode says so
    // before the first byte (set before it listens: until then a connect is
    // refused), the request's signature after it. Not by umask, which is the
    // whole process's: a sandbox directory made meanwhile by another thread
    // would come out 0700, out of its sessions' reach.
    const bool bound =
        listener && local_wake_ &&
        ::bind(listener.get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof *addr) == 0 &&
        ::chmod(path.c_str(), 0600) == 0;
    if (!bound || ::listen(listener.get(), 16) != 0) {
        spdlog::warn("local file socket {}: {}; clients stream files", path.string(),
                     std::strerror(errno));
        return;
    }
    local_listener_ = std::move(listener);
    loop_.watch_fd(local_listener_.get(), [this] { on_local_accept(); });
    loop_.watch_fd(local_wake_.get(), [this] { on_local_copies(); });
    loop_.add_deadline(
        [this]() -> std::optional<Clock::time_point> {
            std::optional<Clock::time_point> next;
            for (const auto& [id, c] : local_clients_) {
                if (!c->request) {
                    const auto due = c->opened + kLocalRequestWait;
                    next = next ? std::min(*next, due) : due;
                }
            }
            return next;
        },
        [this](Clock::time_point now) {
            std::vector<std::uint64_t> late;
            for (const auto& [id, c] : local_clients_) {
                if (!c->request && now - c->opened >= kLocalRequestWait) late.push_back(id);
            }
            for (auto id : late) {
                spdlog::warn("local file socket: a client sent no request in {} s; closed",
                             kLocalRequestWait.count());
                close_local_client(id);
            }
        });
}

void Server::on_local_accept() {
    while (true) {
        UniqueFd fd(
            ::accept4(local_listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
        if (!fd) return;
        if (local_clients_.size() >= kLocalMaxClients) {
            spdlog::warn("local file socket: {} clients connected, its maximum; one refused",
                         local_clients_.size());
            continue;
        }
        const std::uint64_t id = ++next_local_;
        auto client = std::make_unique<LocalClient>();
        client->opened = Clock::now();
        client->watch = loop_.watch_fd(fd.get(), [this, id] { on_local_client(id); });
        client->socket = std::move(fd);
        local_clients_.emplace(id, std::move(client));
    }
}

void Server::close_local_client(std::uint64_t id) {
    const auto it = local_clients_.find(id);
    if (it == local_clients_.end()) return;
    if (it->second->watch) loop_.unwatch(it->second->watch);
    if (it->second->job) transfers_.abort_local(it->second->job->copy.id);
    local_clients_.erase(it);  // a copy still running is cancelled and joined
}

void Server::send_local(LocalClient& c, const std::string& msg_type, json content) {
    const WireMessage msg =
        make_reply(*c.request, msg_type, std::move(content), "cellblock-server");
    const std::string packed = pack_frames(encode(msg, manager_.signer()));
    // A client that does not read loses its progress messages, never the
    // reply: the socket's buffer holds far more than a progress message.
    if (::send(c.socket.get(), packed.data(), packed.size(), MSG_NOSIGNAL | MSG_DONTWAIT) < 0 &&
        errno != EAGAIN) {
        c.gone = true;
    }
}

void Server::on_local_client(std::uint64_t id) {
    LocalClient& c = *local_clients_.at(id);
    std::string datagram(kLocalRequestBytes, '\0');
    alignas(cmsghdr) char control[CMSG_SPACE(4 * sizeof(int))];
    iovec iov{datagram.data(), datagram.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    const ssize_t n = ::recvmsg(c.socket.get(), &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    std::vector<UniqueFd> fds;  // every descriptor that came is owned, then closed
    for (cmsghdr* h = CMSG_FIRSTHDR(&msg); n >= 0 && h; h = CMSG_NXTHDR(&msg, h)) {
        if (h->cmsg_level != SOL_SOCKET || h->cmsg_type != SCM_RIGHTS) continue;
        const std::size_t count = (h->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (std::size_t i = 0; i < count; ++i) {
            int fd = -1;
            std::memcpy(&fd, CMSG_DATA(h) + i * sizeof(int), sizeof fd);
            fds.emplace_back(fd);
        }
    }
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
    if (c.request) {
        // One request per connection: anything after it is ignored; the end
        // of the connection cancels the copy (its reply would go nowhere).
        if (n <= 0 && c.job && !c.job->finished) {
            spdlog::info("local file socket: the client of copy {} hung up; cancelled",
                         c.job->copy.id);
            c.gone = true;
            c.job->control.cancel = true;
            loop_.unwatch(c.watch);
            c.watch = 0;
        } else if (n <= 0) {
            close_local_client(id);
        }
        return;
    }
    if (n <= 0) {
        close_local_client(id);
        return;
    }
    const auto frames =
        (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC))
            ? std::nullopt
            : unpack_frames(std::string_view(datagram.data(), static_cast<std::size_t>(n)),
                            kManagerMaxFrames);
    if (!frames) {
        spdlog::warn("local file socket: rejected a request: {}",
                     (msg.msg_flags & MSG_TRUNC)
                         ? "over " + std::to_string(kLocalRequestBytes) + " bytes"
                     : (msg.msg_flags & MSG_CTRUNC) ? std::string("too many descriptors")
                                                    : std::string("not a packed message"));
        close_local_client(id);
        return;
    }
    auto decoded = decode(*frames, manager_.signer(), &manager_.replay_guard(), WireLimits{});
    if (!decoded.message) {
        spdlog::warn("local file socket: rejected a request: {}", decoded.error);
        close_local_client(id);
        return;
    }
    c.request = std::move(*decoded.message);
    const std::string type = c.request->msg_type();
    try {
        if (type != "file_put_local_request" && type != "file_get_local_request") {
            throw RequestError{ename::UnknownRequest,
                               "the local file socket takes file_put_local_request and "
                               "file_get_local_request, not '" +
                                   type + "'"};
        }
        if (fds.size() != 1) {
            throw RequestError{ename::InvalidRequest,
                               type + " carries exactly one descriptor (SCM_RIGHTS), not " +
                                   std::to_string(fds.size())};
        }
        SessionProxy& s = live_session(c.request->content);
        if (files_in_kernel(s) && type == "file_get_local_request") {
            // Fetched from the kernel into the front's copy first.
            auto fd = std::make_shared<UniqueFd>(std::move(fds[0]));
            pull_output(s.session_id(), c.request->content, transfers_.limits().max_file_bytes,
                        "the server's maximum of " +
                            std::to_string(transfers_.limits().max_file_bytes) + " bytes",
                        [this, id, fd](const FileRequestError* error, const fs::path& local) {
                            const auto it = local_clients_.find(id);
                            if (it == local_clients_.end()) {
                                ::unlink(local.c_str());  // the client left
                            } else if (error) {
                                refuse_local(id, error->ename(), error->what());
                            } else {
                                start_local_copy(id, fd->get());
                                // The copy reads its own descriptor of it.
                                ::unlink(local.c_str());
                            }
                        });
            return;
        }
        start_local_copy(id, fds[0].get());
    } catch (...) {
        refuse_local_for_exception(id, type);
    }
}

void Server::start_local_copy(std::uint64_t id, int client_file) {
    LocalClient& c = *local_clients_.at(id);
    const std::string type = c.request->msg_type();
    try {
        SessionProxy& s = live_session(c.request->content);
        const SessionFiles files = session_files(s);
        auto job = std::make_unique<LocalCopyJob>();
        job->session_id = s.session_id();
        job->copy =
            type == "file_put_local_request"
                ? transfers_.begin_local_put(c.request->content, client_file, files, Clock::now())
                : transfers_.begin_local_get(c.request->content, client_file, files, Clock::now());
        send_local(c, "file_progress",
                   {{"path", job->copy.sandbox_path}, {"done", 0}, {"size", job->copy.size}});
        job->start(local_wake_.get());
        c.job = std::move(job);
    } catch (...) {
        refuse_local_for_exception(id, type);
    }
}

void Server::refuse_local_for_exception(std::uint64_t id, const std::string& type) {
    try {
        throw;
    } catch (const RequestError& e) {
        refuse_local(id, e.ename, e.evalue);
    } catch (const FileRequestError& e) {
        refuse_local(id, e.ename(), e.what());
    } catch (const std::exception& e) {
        spdlog::error("local file socket {}: {}", type, e.what());
        refuse_local(id, ename::ServerError, e.what());
    }
}

void Server::refuse_local(std::uint64_t id, const std::string& ename, const std::string& evalue) {
    LocalClient& c = *local_clients_.at(id);
    spdlog::warn("local file socket: refused {}: {}: {}", c.request->msg_type(), ename, evalue);
    send_local(c, reply_type(c.request->msg_type()),
               {{"status", "error"}, {"ename", ename}, {"evalue", evalue}});
    close_local_client(id);
}

void Server::on_local_copies() {
    std::uint64_t count = 0;
    [[maybe_unused]] auto n = ::read(local_wake_.get(), &count, sizeof count);
    std::vector<std::uint64_t> ended;
    for (auto& [id, c] : local_clients_) {
        LocalCopyJob* job = c->job.get();
        if (!job) continue;
        if (job->finished.load(std::memory_order_acquire)) {
            ended.push_back(id);
            continue;
        }
        const std::uint64_t done = job->control.done.load(std::memory_order_relaxed);
        if (!c->gone && done >= job->reported + kLocalProgressBytes) {
            job->reported = done;
            send_local(
                *c, "file_progress",
                {{"path", job->copy.sandbox_path}, {"done", done}, {"size", job->copy.size}});
        }
    }
    for (auto id : ended) finish_local_copy(id);
}

void Server::finish_local_copy(std::uint64_t id) {
    LocalClient& c = *local_clients_.at(id);
    std::unique_ptr<LocalCopyJob> job = std::move(c.job);
    job->thread.join();
    const std::string type = c.request->msg_type();
    try {
        if (!job->ename.empty()) {
            // A copy cancelled because its session closed says so.
            if (!sessions_.live(job->session_id)) {
                live_session(c.request->content);  // throws SessionClosed with the reason
            }
            throw FileRequestError(job->ename, job->evalue);
        }
        SessionProxy& s = live_session(c.request->content);
        auto done = transfers_.finish_local(job->copy.id, job->sha256, session_files(s));
        if (metrics_) {
            metrics_->file_bytes(type.starts_with("file_put") ? "in" : "out", "local",
                                 job->copy.size);
        }
        if (files_in_kernel(s) && done.event) {
            // In the front's copy: answered once the kernel has it.
            put_in_kernel(s.session_id(), std::move(done),
                          [this, id](FileTransfers::Reply* put, const FileRequestError* error) {
                              const auto it = local_clients_.find(id);
                              if (put && !put->discard.empty()) ::unlink(put->discard.c_str());
                              if (it == local_clients_.end()) return;  // the client left
                              if (error) return refuse_local(id, error->ename(), error->what());
                              if (!it->second->gone) {
                                  send_local(*it->second,
                                             reply_type(it->second->request->msg_type()),
                                             std::move(put->content));
                              }
                              close_local_client(id);
                          });
            return;
        }
        if (done.event) on_event(s.session_id(), done.event->first, done.event->second);
        if (c.gone) {
            spdlog::info("local file socket: copy {} ended after its client left", job->copy.id);
        } else {
            send_local(c, reply_type(type), std::move(done.content));
        }
        if (!done.discard.empty()) ::unlink(done.discard.c_str());  // the file it replaced
        close_local_client(id);
        return;
    } catch (const RequestError& e) {
        transfers_.abort_local(job->copy.id);
        if (!c.gone) refuse_local(id, e.ename, e.evalue);
    } catch (const FileRequestError& e) {
        transfers_.abort_local(job->copy.id);
        if (!c.gone) refuse_local(id, e.ename(), e.what());
    }
    close_local_client(id);
}

void Server::cancel_local_copies(const std::string& session_id) {
    for (auto& [id, c] : local_clients_) {
        if (c->job && c->job->session_id == session_id) c->job->control.cancel = true;
    }
}

}  // namespace cellblock
