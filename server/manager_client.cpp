#include "manager_client.hpp"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <fstream>

#include "cellblock/sha256.hpp"

#include "cellblock/error_names.hpp"
#include "cellblock/fd_passing.hpp"
#include "cellblock/unique_fd.hpp"
#include "local_files.hpp"
#include "manager_paths.hpp"
#include "multipart.hpp"
#include "unix_address.hpp"

namespace cellblock {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// How many chunk requests a transfer keeps in flight: enough to hide a round
// trip, few enough that both ends hold a few chunks at most.
constexpr std::size_t kWindow = 4;

json ok_content(const WireMessage& reply) {
    if (reply.content.value("status", "") != "ok") {
        throw std::runtime_error(reply.content.value("ename", "Error") + ": " +
                                 reply.content.value("evalue", reply.content.dump()));
    }
    return reply.content;
}

std::string read_chunk(std::ifstream& in, std::size_t length) {
    std::string bytes(length, '\0');
    in.read(bytes.data(), static_cast<std::streamsize>(length));
    bytes.resize(static_cast<std::size_t>(in.gcount()));
    return bytes;
}

}  // namespace

ManagerClient::ManagerClient(const fs::path& state_dir) {
    const fs::path file = server_file(state_dir);
    std::ifstream in(file);
    if (!in) {
        throw std::runtime_error("no server runs with state dir " + state_dir.string() + " (" +
                                 file.string() +
                                 " does not exist); start one with `cellblock serve`");
    }
    const auto j = nlohmann::json::parse(in, nullptr, false);
    if (j.is_discarded() || !j.contains("manager") || !j.contains("key")) {
        throw std::runtime_error(file.string() + ": not a cellblock server file");
    }
    // A server killed by SIGKILL leaves server.json behind: the lock it held
    // tells the truth at once, instead of a request timing out.
    if (!server_lock_holder(state_dir)) {
        throw std::runtime_error("no server running with state dir " + state_dir.string() + " (" +
                                 file.string() + " is left from pid " +
                                 std::to_string(j.value("pid", 0)) +
                                 ", which holds no lock there); start one with `cellblock serve`");
    }
    key_ = j["key"].get<std::string>();
    files_socket_ = j.value("files_socket", "");
    signer_ = Signer(key_);
    socket_.set(zmq::sockopt::linger, 0);
    const std::string monitor = "inproc://cellblock-manager-client-" + make_uuid();
    if (zmq_socket_monitor(socket_.handle(), monitor.c_str(), ZMQ_EVENT_DISCONNECTED) == 0) {
        monitor_.set(zmq::sockopt::linger, 0);
        monitor_.connect(monitor);
    }
    socket_.connect(j["manager"].get<std::string>());
}

ManagerClient::~ManagerClient() {
    zmq_socket_monitor(socket_.handle(), nullptr, 0);
    monitor_.close();
    socket_.close();
}

std::vector<std::string> ManagerClient::encoded(const std::string& type, json content,
                                                std::vector<std::string> buffers,
                                                std::string& msg_id) {
    WireMessage msg;
    msg.header = make_header(type, session_, "cellblock-cli");
    msg.content = std::move(content);
    msg.buffers = std::move(buffers);
    msg_id = msg.msg_id();
    return encode(msg, signer_);
}

void ManagerClient::send_frames(const std::vector<std::string>& frames) {
    for (std::size_t i = 0; i < frames.size(); ++i) {
        socket_.send(zmq::const_buffer(frames[i].data(), frames[i].size()),
                     i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
    }
}

std::string ManagerClient::send(const std::string& type, json content,
                                std::vector<std::string> buffers) {
    std::string id;
    send_frames(encoded(type, std::move(content), std::move(buffers), id));
    return id;
}

WireMessage ManagerClient::wait(const std::string& id, const std::string& type,
                                std::chrono::milliseconds timeout) {
    return *wait_for(id, type, timeout, false);
}

std::optional<WireMessage> ManagerClient::wait_for(const std::string& id, const std::string& type,
                                                   std::chrono::milliseconds timeout,
                                                   bool until_dropped) {
    if (auto early = early_.find(id); early != early_.end()) {
        WireMessage reply = std::move(early->second);
        early_.erase(early);
        return reply;
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    Multipart scratch;
    for (;;) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        if (left.count() <= 0) {
            if (until_dropped) return std::nullopt;
            throw std::runtime_error("the server did not answer " + type + " in time");
        }
        zmq::pollitem_t items[] = {{socket_.handle(), 0, ZMQ_POLLIN, 0},
                                   {monitor_.handle(), 0, ZMQ_POLLIN, 0}};
        zmq::poll(items, 2, left);
        // What came before the connection dropped is read before the drop.
        if ((items[0].revents & ZMQ_POLLIN) && recv_multipart(socket_, scratch, 1024)) {
            WireLimits limits;
            limits.max_total_bytes = 1u << 30;
            auto decoded = decode(scratch.views(), signer_, nullptr, limits);
            if (!decoded.message) continue;
            const std::string parent = decoded.message->parent_msg_id();
            if (parent == id) return std::move(*decoded.message);
            if (early_.size() < 64) early_.emplace(parent, std::move(*decoded.message));
            continue;
        }
        if (items[1].revents & ZMQ_POLLIN) {
            // An event is two frames: its number and value, then the endpoint.
            Multipart event;
            if (recv_multipart(monitor_, event, 4) && until_dropped) return std::nullopt;
        }
    }
}

WireMessage ManagerClient::call(const std::string& type, json content,
                                std::vector<std::string> buffers,
                                std::chrono::milliseconds timeout) {
    // A server restarting (SIGHUP, an upgrade: docs/restarts.md) refuses
    // what it cannot hand over, and its next start serves it. The same
    // message goes again, byte for byte, when the connection to the process
    // that refused drops (or every kAgainEvery): a server takes a signature
    // once (its replay guard), so no copy, whichever process reads it, is
    // served twice, and the one that refused ignores the rest.
    constexpr auto kAgainEvery = std::chrono::seconds(5);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    std::string id;
    const std::vector<std::string> frames =
        encoded(type, std::move(content), std::move(buffers), id);
    send_frames(frames);
    bool refused = false;
    for (;;) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        auto answer = wait_for(
            id, type, refused ? std::min<std::chrono::milliseconds>(left, kAgainEvery) : left,
            refused);
        if (answer && answer->content.value("ename", "") != ename::ServerRestarting)
            return std::move(*answer);
        if (answer) {
            refused = true;  // the next start will take it: wait for the drop
            continue;
        }
        if (std::chrono::steady_clock::now() >= deadline)
            throw std::runtime_error("the server did not answer " + type +
                                     " in time (it was restarting)");
        send_frames(frames);
    }
}

std::optional<json> ManagerClient::local_copy(const std::string& type, json content, int fd,
                                              const Progress& progress, Route route) {
    const auto unreachable = [&](const std::string& why) -> std::optional<json> {
        if (route == Route::Local) throw std::runtime_error("the local file socket: " + why);
        return std::nullopt;
    };
    if (files_socket_.empty()) return unreachable("the server offers none");
    const auto addr = unix_address(files_socket_);
    if (!addr) return unreachable(files_socket_ + " is too long for a unix socket");
    UniqueFd sock(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    if (!sock ||
        ::connect(sock.get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof *addr) != 0)
        return unreachable(files_socket_ + ": " + std::strerror(errno));

    WireMessage msg;
    msg.header = make_header(type, session_, "cellblock-cli");
    msg.content = std::move(content);
    const std::string id = msg.msg_id();
    if (send_with_fd(sock.get(), pack_frames(encode(msg, signer_)), fd) < 0)
        throw std::runtime_error("send to " + files_socket_ + ": " + std::strerror(errno));

    // Each message comes within the timeout (progress every 64 MiB), not the whole copy.
    const timeval wait{120, 0};
    ::setsockopt(sock.get(), SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof wait);
    std::string datagram(kLocalRequestBytes, '\0');
    for (;;) {
        const ssize_t n = ::recv(sock.get(), datagram.data(), datagram.size(), 0);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            throw std::runtime_error("the server said nothing for 120 s on " + files_socket_);
        if (n <= 0)
            throw std::runtime_error("the server closed " + files_socket_ + " without a reply");
        const auto frames =
            unpack_frames(std::string_view(datagram.data(), static_cast<std::size_t>(n)), 64);
        if (!frames) throw std::runtime_error("a malformed message on " + files_socket_);
        auto decoded = decode(*frames, signer_, nullptr, WireLimits{});
        if (!decoded.message || decoded.message->parent_msg_id() != id) continue;
        if (decoded.message->msg_type() == "file_progress") {
            const json& c = decoded.message->content;
            if (progress)
                progress(c.value("done", std::uint64_t{0}), c.value("size", std::uint64_t{0}));
            continue;
        }
        json reply = ok_content(*decoded.message);
        if (progress) {
            const auto size = reply.value("size", std::uint64_t{0});
            progress(size, size);
        }
        return reply;
    }
}

json ManagerClient::put_file(const std::string& session_id, const fs::path& local,
                             const std::string& remote, const Progress& progress, Route route) {
    if (route != Route::Stream) {
        const UniqueFd fd(::open(local.c_str(), O_RDONLY | O_CLOEXEC));
        if (!fd)
            throw std::runtime_error("cannot read " + local.string() + ": " + std::strerror(errno));
        if (auto reply =
                local_copy("file_put_local_request", {{"session_id", session_id}, {"path", remote}},
                           fd.get(), progress, route))
            return *reply;
    }
    return stream_put(session_id, local, remote, progress);
}

json ManagerClient::stream_put(const std::string& session_id, const fs::path& local,
                               const std::string& remote, const Progress& progress) {
    std::ifstream in(local, std::ios::binary);
    std::error_code ec;
    const auto size = fs::file_size(local, ec);
    if (!in || ec) throw std::runtime_error("cannot read " + local.string());
    const json begin = ok_content(call(
        "file_put_begin_request", {{"session_id", session_id}, {"path", remote}, {"size", size}}));
    const std::string upload = begin["upload_id"].get<std::string>();
    const auto chunk = begin["chunk_bytes"].get<std::size_t>();
    std::uint64_t offset = begin["offset"].get<std::uint64_t>();
    // The digest covers the whole file: bytes the server already holds are hashed too.
    Sha256 hash;
    for (std::uint64_t hashed = 0; hashed < offset;) {
        const std::string bytes = read_chunk(in, std::min<std::uint64_t>(chunk, offset - hashed));
        if (bytes.empty()) throw std::runtime_error(local.string() + " shrank while read");
        hash.update(bytes);
        hashed += bytes.size();
    }
    try {
        std::deque<std::pair<std::string, std::uint64_t>> in_flight;  // msg_id, end offset
        while (offset < size || !in_flight.empty()) {
            if (offset < size && in_flight.size() < kWindow) {
                std::string bytes = read_chunk(in, std::min<std::uint64_t>(chunk, size - offset));
                if (bytes.empty()) throw std::runtime_error(local.string() + " shrank while read");
                hash.update(bytes);
                const std::uint64_t at = offset;
                offset += bytes.size();
                in_flight.emplace_back(
                    send("file_put_chunk_request",
                         {{"session_id", session_id}, {"upload_id", upload}, {"offset", at}},
                         {std::move(bytes)}),
                    offset);
                continue;
            }
            ok_content(wait(in_flight.front().first, "file_put_chunk_request"));
            if (progress) progress(in_flight.front().second, size);
            in_flight.pop_front();
        }
        return ok_content(
            call("file_put_commit_request",
                 {{"session_id", session_id}, {"upload_id", upload}, {"sha256", hash.hex()}}));
    } catch (...) {
        // Best effort: the server drops an abandoned upload by itself anyway.
        send("file_put_abort_request", {{"session_id", session_id}, {"upload_id", upload}});
        throw;
    }
}

json ManagerClient::get_file(const std::string& session_id, const std::string& remote,
                             const fs::path& local, const Progress& progress, Route route) {
    const fs::path partial = local.string() + ".part";
    if (route != Route::Stream) {
        // The server cuts this file to length, copies into it and hashes it back.
        const UniqueFd fd(::open(partial.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
        if (!fd)
            throw std::runtime_error("cannot write " + partial.string() + ": " +
                                     std::strerror(errno));
        try {
            if (auto reply = local_copy("file_get_local_request",
                                        {{"session_id", session_id}, {"path", remote}}, fd.get(),
                                        progress, route)) {
                fs::rename(partial, local);
                return {{"path", (*reply)["path"]},
                        {"size", (*reply)["size"]},
                        {"sha256", (*reply)["sha256"]},
                        {"local", true}};
            }
        } catch (...) {
            std::error_code ignored;
            fs::remove(partial, ignored);
            throw;
        }
    }
    return stream_get(session_id, remote, local, progress);
}

json ManagerClient::stream_get(const std::string& session_id, const std::string& remote,
                               const fs::path& local, const Progress& progress) {
    const json begin =
        ok_content(call("file_get_begin_request", {{"session_id", session_id}, {"path", remote}}));
    const auto size = begin["size"].get<std::uint64_t>();
    const auto chunk = begin["chunk_bytes"].get<std::uint64_t>();
    const std::string download = begin.value("download_id", "");
    const fs::path partial = local.string() + ".part";
    std::ofstream out(partial, std::ios::binary | std::ios::trunc);
    if (!out) throw std::runtime_error("cannot write " + partial.string());
    Sha256 hash;
    std::string server_sha = begin.value("sha256", "");
    try {
        std::deque<std::string> in_flight;
        std::uint64_t requested = 0, received = 0;
        while (received < size) {
            if (requested < size && in_flight.size() < kWindow) {
                in_flight.push_back(send("file_get_chunk_request", {{"session_id", session_id},
                                                                    {"download_id", download},
                                                                    {"offset", requested},
                                                                    {"length", chunk}}));
                requested += std::min(chunk, size - requested);
                continue;
            }
            const WireMessage reply = wait(in_flight.front(), "file_get_chunk_request");
            in_flight.pop_front();
            const json content = ok_content(reply);
            if (reply.buffers.size() != 1 || reply.buffers[0].empty())
                throw std::runtime_error("file_get_chunk_reply without bytes");
            const std::string& bytes = reply.buffers[0];
            out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
            hash.update(bytes);
            received += bytes.size();
            if (content.contains("sha256")) server_sha = content["sha256"].get<std::string>();
            if (progress) progress(received, size);
        }
        out.close();
        if (!out) throw std::runtime_error("cannot write " + partial.string());
        const std::string sha = hash.hex();
        if (sha != server_sha) {
            throw std::runtime_error("ChecksumMismatch: received bytes hash to " + sha +
                                     ", the server's file to " + server_sha);
        }
        fs::rename(partial, local);
        return {{"path", begin["path"]}, {"size", size}, {"sha256", sha}};
    } catch (...) {
        std::error_code ignored;
        fs::remove(partial, ignored);
        if (!download.empty()) {
            send("file_get_end_request", {{"session_id", session_id}, {"download_id", download}});
        }
        throw;
    }
}

}  // namespace cellblock
