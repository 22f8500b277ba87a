// ManagerClient against a real ZMQ ROUTER playing the server: a request
// refused ServerRestarting is sent again, the same bytes, once the refusing
// process's socket goes and the next one is bound on the same endpoint
// (docs/restarts.md).
#include "manager_client.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "cellblock/error_names.hpp"
#include "cellblock/signer.hpp"
#include "cellblock/wire_message.hpp"
#include "manager_paths.hpp"

namespace cellblock {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kKey = "manager-client-test-key";

// A state dir whose server.lock a child process holds (a process never
// sees its own POSIX lock as held), and whose server.json names `endpoint`.
struct FakeServerDir {
    fs::path dir;
    pid_t holder = -1;
    explicit FakeServerDir(const std::string& endpoint) {
        char tmpl[] = "/tmp/cellblock-manager-client-XXXXXX";
        dir = ::mkdtemp(tmpl);
        std::ofstream(server_file(dir)) << json{{"manager", endpoint}, {"key", kKey}}.dump();
        int ready[2];
        if (::pipe(ready) != 0) return;
        holder = ::fork();
        if (holder == 0) {
            const int fd = ::open(server_lock_file(dir).c_str(), O_RDWR | O_CREAT, 0600);
            struct flock lock {};
            lock.l_type = F_WRLCK;
            lock.l_whence = SEEK_SET;
            ::fcntl(fd, F_SETLK, &lock);
            const char byte = 1;
            (void)!::write(ready[1], &byte, 1);
            ::pause();
            ::_exit(0);
        }
        // Our write end closed first: a child that dies before it holds the
        // lock fails the test at once (no lock holder), not at ctest's timeout.
        ::close(ready[1]);
        char byte = 0;
        const bool locked = holder > 0 && ::read(ready[0], &byte, 1) == 1;
        ::close(ready[0]);
        if (!locked && holder > 0) {
            ::kill(holder, SIGKILL);
            ::waitpid(holder, nullptr, 0);
            holder = -1;
        }
    }
    ~FakeServerDir() {
        if (holder > 0) {
            ::kill(holder, SIGKILL);
            ::waitpid(holder, nullptr, 0);
        }
        std::error_code ec;
        fs::remove_all(dir, ec);
    }
};

struct Received {
    std::string identity;
    std::vector<std::string> frames;  // after the identity
    WireMessage message;
};

Received receive(zmq::socket_t& router) {
    std::vector<zmq::message_t> parts;
    Received r;
    if (!zmq::recv_multipart(router, std::back_inserter(parts)) || parts.size() < 2) {
        ADD_FAILURE() << "no request within the socket's 10 s";
        return r;
    }
    r.identity = parts.at(0).to_string();
    for (std::size_t i = 1; i < parts.size(); ++i) r.frames.push_back(parts[i].to_string());
    std::vector<std::string_view> views(r.frames.begin(), r.frames.end());
    auto decoded = decode(views, Signer(kKey), nullptr);
    EXPECT_TRUE(decoded.message.has_value()) << decoded.error;
    if (decoded.message) r.message = std::move(*decoded.message);
    return r;
}

void answer(zmq::socket_t& router, const Received& request, json content) {
    if (request.identity.empty()) return;
    WireMessage reply;
    reply.identities = {request.identity};
    reply.header = make_header("session_create_reply", "fake-server");
    reply.parent_header = request.message.header;
    reply.content = std::move(content);
    const auto frames = encode(reply, Signer(kKey));
    for (std::size_t i = 0; i < frames.size(); ++i) {
        router.send(zmq::const_buffer(frames[i].data(), frames[i].size()),
                    i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
    }
}

zmq::socket_t bound_router(zmq::context_t& context, const std::string& endpoint) {
    zmq::socket_t router(context, zmq::socket_type::router);
    router.set(zmq::sockopt::linger, 0);
    router.set(zmq::sockopt::rcvtimeo, 10000);
    router.bind(endpoint);
    return router;
}

TEST(ManagerClient, ARefusedRequestGoesAgainByteForByteToTheNextProcess) {
    const std::string socket_path =
        "/tmp/cellblock-manager-client-" + std::to_string(::getpid()) + ".sock";
    const std::string endpoint = "ipc://" + socket_path;
    FakeServerDir state(endpoint);
    ASSERT_GT(state.holder, 0);
    zmq::context_t context;
    Received first, again;
    std::thread server([&] {
        {
            // The process handing over: refuses, then its socket goes.
            auto old_process = bound_router(context, endpoint);
            first = receive(old_process);
            answer(old_process, first,
                   {{"status", "error"},
                    {"ename", ename::ServerRestarting},
                    {"evalue", "the server is restarting; send the create again"}});
            std::this_thread::sleep_for(std::chrono::milliseconds(200));
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        // The next start, on the same endpoint.
        auto next_start = bound_router(context, endpoint);
        again = receive(next_start);
        answer(next_start, again, {{"status", "ok"}, {"session_id", "s1"}});
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
    });
    ManagerClient client(state.dir);
    WireMessage reply =
        client.call("session_create_request", {{"image", "python"}}, {}, std::chrono::seconds(30));
    server.join();
    ::unlink(socket_path.c_str());
    EXPECT_EQ(reply.content.value("status", ""), "ok") << reply.content.dump();
    EXPECT_EQ(reply.content.value("session_id", ""), "s1");
    ASSERT_FALSE(first.frames.empty());
    EXPECT_EQ(again.frames, first.frames)
        << "sent again as the same signed message: a server takes a signature once";
}

}  // namespace
}  // namespace cellblock
