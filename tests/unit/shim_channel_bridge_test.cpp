// The shim's bridge of the kernel's channels (kernel-shim/channel_bridge.hpp)
// on real unix sockets: it listens only once the kernel's sockets exist,
// copies both ways in order under back-pressure, ends a pair with either
// side, and lets go of every outer socket on quiesce, listening again after.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "cellblock/unique_fd.hpp"
#include "channel_bridge.hpp"

namespace cellblock::shim {
namespace {
namespace fs = std::filesystem;

sockaddr_un address(const fs::path& path) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path.c_str());
    return addr;
}

UniqueFd listen_at(const fs::path& path) {
    UniqueFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    const sockaddr_un addr = address(path);
    EXPECT_EQ(bind(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr), 0);
    EXPECT_EQ(listen(fd.get(), 8), 0);
    return fd;
}

// -1 (errno set) where nothing listens there.
UniqueFd connect_to(const fs::path& path) {
    UniqueFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    const sockaddr_un addr = address(path);
    if (connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) return {};
    return fd;
}

bool is_socket(const fs::path& path) {
    struct stat st {};
    return lstat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode);
}

class ChannelBridgeTest : public ::testing::Test {
  protected:
    void SetUp() override {
        char tmpl[] = "/tmp/cb-bridge-XXXXXX";
        ASSERT_NE(mkdtemp(tmpl), nullptr);
        dir_ = tmpl;
        fs::create_directory(dir_ / "outer");
        fs::create_directory(dir_ / "inner");
        for (int port = 1; port <= 2; ++port) {
            const std::string name = "k-" + std::to_string(port);
            routes_.push_back({(dir_ / "outer" / name).string(), (dir_ / "inner" / name).string()});
        }
    }
    void TearDown() override { fs::remove_all(dir_); }

    // What the shim's loop does, for about `ms`.
    void pump(ChannelBridge& bridge, int ms = 20) {
        const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
        while (std::chrono::steady_clock::now() < until) {
            std::vector<pollfd> fds = {{-1, 0, 0}};  // one of the shim's own first
            bridge.want(fds);
            if (poll(fds.data(), fds.size(), 2) > 0) bridge.handle(fds, 1);
        }
    }

    // The kernel's side of a connection the bridge made on route `i`.
    UniqueFd kernel_accepts(ChannelBridge& bridge, const UniqueFd& listener) {
        for (int i = 0; i < 100; ++i) {
            pump(bridge, 5);
            UniqueFd fd(accept4(listener.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
            if (fd) return fd;
        }
        return {};
    }

    // Everything readable on `fd` within `ms`, pumping the bridge; ended
    // says whether the peer closed.
    std::string read_all(ChannelBridge& bridge, int fd, int ms, bool* ended = nullptr) {
        std::string got;
        const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
        while (std::chrono::steady_clock::now() < until) {
            pump(bridge, 2);
            char buf[65536];
            ssize_t n;
            while ((n = recv(fd, buf, sizeof buf, 0)) > 0) got.append(buf, n);
            if (n == 0) {
                if (ended) *ended = true;
                return got;
            }
        }
        return got;
    }

    fs::path dir_;
    std::vector<ChannelBridge::Route> routes_;
};

TEST_F(ChannelBridgeTest, ListensOnlyOnceEveryKernelSocketExists) {
    ChannelBridge bridge(routes_);
    EXPECT_FALSE(bridge.listen());
    EXPECT_NE(bridge.why().find("has not bound"), std::string::npos) << bridge.why();
    const UniqueFd first = listen_at(routes_[0].inner);
    EXPECT_FALSE(bridge.listen());
    EXPECT_FALSE(is_socket(routes_[0].outer)) << "a server must not find a channel half there";
    const UniqueFd second = listen_at(routes_[1].inner);
    ASSERT_TRUE(bridge.listen()) << bridge.why();
    EXPECT_TRUE(is_socket(routes_[0].outer));
    EXPECT_TRUE(is_socket(routes_[1].outer));
}

TEST_F(ChannelBridgeTest, CopiesBothWaysInOrderUnderBackPressure) {
    const UniqueFd kernel0 = listen_at(routes_[0].inner);
    const UniqueFd kernel1 = listen_at(routes_[1].inner);
    ChannelBridge bridge(routes_);
    ASSERT_TRUE(bridge.listen()) << bridge.why();
    const UniqueFd client = connect_to(routes_[1].outer);
    ASSERT_TRUE(client) << strerror(errno);
    const UniqueFd inner = kernel_accepts(bridge, kernel1);
    ASSERT_TRUE(inner);
    EXPECT_EQ(bridge.connections(), 1u);

    // 8 MiB each way, far past what the bridge holds (kMaxHeld) and the
    // sockets' buffers: the writers are held back, nothing is lost or reordered.
    std::string up(8 << 20, '\0'), down(8 << 20, '\0');
    for (std::size_t i = 0; i < up.size(); ++i) {
        up[i] = static_cast<char>(i * 7 + i / 4093);
        down[i] = static_cast<char>(i * 13 + i / 65521);
    }
    std::size_t up_sent = 0, down_sent = 0;
    std::string up_got, down_got;
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while ((up_got.size() < up.size() || down_got.size() < down.size()) &&
           std::chrono::steady_clock::now() < give_up) {
        if (up_sent < up.size()) {
            const ssize_t n = send(client.get(), up.data() + up_sent, up.size() - up_sent, 0);
            if (n > 0) up_sent += n;
        }
        if (down_sent < down.size()) {
            const ssize_t n =
                send(inner.get(), down.data() + down_sent, down.size() - down_sent, 0);
            if (n > 0) down_sent += n;
        }
        pump(bridge, 1);
        char buf[16384];  // read slowly: the bridge must hold back, not pile up
        ssize_t n = recv(inner.get(), buf, sizeof buf, 0);
        if (n > 0) up_got.append(buf, n);
        n = recv(client.get(), buf, sizeof buf, 0);
        if (n > 0) down_got.append(buf, n);
    }
    ASSERT_EQ(up_got.size(), up.size());
    ASSERT_EQ(down_got.size(), down.size());
    EXPECT_TRUE(up_got == up) << "bytes to the kernel changed or reordered";
    EXPECT_TRUE(down_got == down) << "bytes from the kernel changed or reordered";
}

TEST_F(ChannelBridgeTest, EitherSideEndingEndsThePairAfterWhatItSent) {
    const UniqueFd kernel0 = listen_at(routes_[0].inner);
    const UniqueFd kernel1 = listen_at(routes_[1].inner);
    ChannelBridge bridge(routes_);
    ASSERT_TRUE(bridge.listen());
    {
        UniqueFd client = connect_to(routes_[0].outer);
        const UniqueFd inner = kernel_accepts(bridge, kernel0);
        ASSERT_TRUE(inner);
        ASSERT_EQ(send(client.get(), "last words", 10, 0), 10);
        client.reset();  // the server's ZMQ goes: the kernel sees what it sent, then the end
        bool ended = false;
        EXPECT_EQ(read_all(bridge, inner.get(), 2000, &ended), "last words");
        EXPECT_TRUE(ended);
        EXPECT_EQ(bridge.connections(), 0u);
    }
    {
        const UniqueFd client = connect_to(routes_[0].outer);
        UniqueFd inner = kernel_accepts(bridge, kernel0);
        ASSERT_TRUE(inner);
        ASSERT_EQ(send(inner.get(), "bye", 3, 0), 3);
        inner.reset();
        bool ended = false;
        EXPECT_EQ(read_all(bridge, client.get(), 2000, &ended), "bye");
        EXPECT_TRUE(ended);
        EXPECT_EQ(bridge.connections(), 0u);
    }
}

TEST_F(ChannelBridgeTest, AConnectionTheKernelCannotTakeIsClosed) {
    UniqueFd kernel0 = listen_at(routes_[0].inner);
    const UniqueFd kernel1 = listen_at(routes_[1].inner);
    ChannelBridge bridge(routes_);
    ASSERT_TRUE(bridge.listen());
    kernel0.reset();  // the kernel's socket is gone (its file stays)
    const UniqueFd client = connect_to(routes_[0].outer);
    ASSERT_TRUE(client);
    bool ended = false;
    EXPECT_EQ(read_all(bridge, client.get(), 2000, &ended), "");
    EXPECT_TRUE(ended) << "the server's connection must end, so that its ZMQ tries again";
    EXPECT_EQ(bridge.connections(), 0u);
}

TEST_F(ChannelBridgeTest, QuiesceLetsGoOfEveryOuterSocketAndListenStartsAgain) {
    const UniqueFd kernel0 = listen_at(routes_[0].inner);
    const UniqueFd kernel1 = listen_at(routes_[1].inner);
    ChannelBridge bridge(routes_);
    ASSERT_TRUE(bridge.listen());
    const UniqueFd client = connect_to(routes_[0].outer);
    const UniqueFd inner = kernel_accepts(bridge, kernel0);
    ASSERT_TRUE(inner);

    bridge.quiesce();
    EXPECT_FALSE(bridge.listening());
    EXPECT_EQ(bridge.connections(), 0u);
    for (const auto& route : routes_) EXPECT_FALSE(fs::exists(route.outer)) << route.outer;
    EXPECT_FALSE(connect_to(routes_[1].outer));
    bool client_ended = false, inner_ended = false;
    read_all(bridge, client.get(), 500, &client_ended);
    read_all(bridge, inner.get(), 500, &inner_ended);
    EXPECT_TRUE(client_ended) << "the server's end is closed";
    EXPECT_TRUE(inner_ended) << "the kernel sees its peer go, as at a disconnect";
    std::vector<pollfd> fds;
    bridge.want(fds);
    EXPECT_TRUE(fds.empty()) << "a quiesced bridge holds no descriptor";

    // Woken: the same kernel sockets, new outer ones.
    ASSERT_TRUE(bridge.listen()) << bridge.why();
    const UniqueFd again = connect_to(routes_[0].outer);
    ASSERT_TRUE(again);
    const UniqueFd inner_again = kernel_accepts(bridge, kernel0);
    ASSERT_TRUE(inner_again);
    ASSERT_EQ(send(again.get(), "ping", 4, 0), 4);
    EXPECT_EQ(read_all(bridge, inner_again.get(), 300), "ping");
}

}  // namespace
}  // namespace cellblock::shim
