#include "manager_client.hpp"

#include <fstream>

#include "manager_paths.hpp"
#include "multipart.hpp"

namespace cellblock {
namespace fs = std::filesystem;

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
    signer_ = Signer(key_);
    socket_.set(zmq::sockopt::linger, 0);
    socket_.connect(j["manager"].get<std::string>());
}

WireMessage ManagerClient::call(const std::string& type, nlohmann::json content,
                                std::vector<std::string> buffers,
                                std::chrono::milliseconds timeout) {
    WireMessage msg;
    msg.header = make_header(type, session_, "cellblock-cli");
    msg.content = std::move(content);
    msg.buffers = std::move(buffers);
    const std::string id = msg.msg_id();
    std::vector<zmq::message_t> frames;
    for (auto& f : encode(msg, signer_)) frames.push_back(to_frame(f));
    for (std::size_t i = 0; i < frames.size(); ++i) {
        socket_.send(frames[i],
                     i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    Multipart scratch;
    for (;;) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        if (left.count() <= 0)
            throw std::runtime_error("the server did not answer " + type + " in time");
        zmq::pollitem_t item{socket_.handle(), 0, ZMQ_POLLIN, 0};
        zmq::poll(&item, 1, left);
        if (!(item.revents & ZMQ_POLLIN)) continue;
        if (!recv_multipart(socket_, scratch, 1024)) continue;
        WireLimits limits;
        limits.max_total_bytes = 1u << 30;
        auto decoded = decode(scratch.views(), signer_, nullptr, limits);
        if (decoded.message && decoded.message->parent_msg_id() == id)
            return std::move(*decoded.message);
    }
}

}  // namespace cellblock
