// The lifeline's listener as an adopting server uses it: real unix sockets.
// Under runsc the shim's connection comes through gVisor's gofer, so the
// server takes only a connection that first shows the shim's key.
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <future>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "../../sessions/sandbox_internal.hpp"
#include "cellblock/sandbox_protocol.hpp"

namespace cellblock::sandbox_detail {
namespace {
namespace fs = std::filesystem;
using namespace std::chrono_literals;

class LifelineTest : public ::testing::Test {
  protected:
    void SetUp() override {
        char tmpl[] = "/tmp/cellblock-lifeline-XXXXXX";
        ASSERT_NE(::mkdtemp(tmpl), nullptr);
        dir_ = tmpl;
        socket_ = dir_ / "lifeline.sock";
        listener_.reset(listen_lifeline(socket_, ::geteuid(), 0600));
    }
    void TearDown() override {
        listener_.reset();
        fs::remove_all(dir_);
    }
    // A connection to the listener that writes `first` at once.
    UniqueFd connect_and_say(const std::string& first) {
        UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
        sockaddr_un addr{};
        addr.sun_family = AF_UNIX;
        std::strncpy(addr.sun_path, socket_.c_str(), sizeof addr.sun_path - 1);
        EXPECT_EQ(::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
        if (!first.empty()) {
            EXPECT_EQ(::send(fd.get(), first.data(), first.size(), MSG_NOSIGNAL),
                      static_cast<ssize_t>(first.size()));
        }
        return fd;
    }
    // Whether `taken` (the server's end) is `ours`'s peer: what one writes the other reads.
    static bool same_connection(int taken, int ours) {
        if (::send(ours, "x", 1, MSG_NOSIGNAL) != 1) return false;
        pollfd p{taken, POLLIN, 0};
        char c = 0;
        return ::poll(&p, 1, 2000) == 1 && ::recv(taken, &c, 1, MSG_DONTWAIT) == 1 && c == 'x';
    }
    // Whether the server closed `fd`'s connection (end of file, within a while).
    static bool closed_by_peer(int fd) {
        pollfd p{fd, POLLIN, 0};
        char c = 0;
        if (::poll(&p, 1, 10000) != 1) return false;
        const ssize_t n = ::recv(fd, &c, 1, MSG_DONTWAIT);
        // A unix socket closed with bytes unread resets the connection.
        return n == 0 || (n < 0 && errno == ECONNRESET);
    }
    // What a shim writes first, its '\n' included.
    static std::string proof(const std::string& key) { return sandbox_protocol::adopt_line(key); }
    fs::path dir_, socket_;
    UniqueFd listener_;
    const std::string key_ = std::string(sandbox_protocol::kAdoptKeyHexDigits, 'a');
};

TEST_F(LifelineTest, OnlyAConnectionShowingTheKeyIsTakenAndWhatFollowsItIsTheLifelines) {
    auto taken = std::async(std::launch::async, [&] {
        return UniqueFd(
            accept_lifeline(listener_.get(), -1, 20s, {.only_init = false, .proof = proof(key_)}));
    });
    // The kernel, which can reach the socket too, connects first: one that
    // says nothing, one with a wrong key, one with the key's first half.
    const std::string wrong(sandbox_protocol::kAdoptKeyHexDigits, 'b');
    UniqueFd silent = connect_and_say("");
    UniqueFd impostor1 = connect_and_say(proof(wrong));
    UniqueFd impostor2 = connect_and_say(proof(key_.substr(0, 16)));
    UniqueFd shim = connect_and_say(proof(key_) + "interrupt\n");
    const UniqueFd fd = taken.get();
    ASSERT_TRUE(fd);
    // The line after the proof is left for the lifeline's reader.
    char buf[16] = {};
    ASSERT_EQ(::recv(fd.get(), buf, sizeof buf, MSG_DONTWAIT), 10);
    EXPECT_EQ(std::string(buf, 10), "interrupt\n");
    EXPECT_TRUE(same_connection(fd.get(), shim.get()));
    // The impostors' connections were closed by the server.
    for (const auto& impostor : {impostor1.get(), impostor2.get(), silent.get()}) {
        EXPECT_TRUE(closed_by_peer(impostor));
    }
}

TEST_F(LifelineTest, ConnectionsThatNeverShowAKeyDoNotKeepTheShimOut) {
    auto taken = std::async(std::launch::async, [&] {
        return UniqueFd(
            accept_lifeline(listener_.get(), -1, 60s, {.only_init = false, .proof = proof(key_)}));
    });
    // More silent connections than the server holds, and one that never ends its line.
    std::vector<UniqueFd> silent;
    for (int i = 0; i < 20; ++i) silent.push_back(connect_and_say(""));
    UniqueFd endless =
        connect_and_say(proof(key_).substr(0, proof(key_).size() - 1) + std::string(200, 'a'));
    UniqueFd shim = connect_and_say(proof(key_));
    const UniqueFd fd = taken.get();
    ASSERT_TRUE(fd);
    EXPECT_TRUE(same_connection(fd.get(), shim.get()));
    EXPECT_TRUE(closed_by_peer(endless.get()));
}

TEST_F(LifelineTest, WithoutTheShimTheWaitEndsAtItsTimeout) {
    UniqueFd silent = connect_and_say("");
    const auto started = std::chrono::steady_clock::now();
    EXPECT_EQ(
        accept_lifeline(listener_.get(), -1, 1500ms, {.only_init = false, .proof = proof(key_)}),
        -1);
    EXPECT_GE(std::chrono::steady_clock::now() - started, 1500ms);
}

TEST_F(LifelineTest, WithoutAProofTheFirstConnectionIsTaken) {
    // A start: the shim connects before the kernel exists.
    UniqueFd shim = connect_and_say("");
    const UniqueFd taken(accept_lifeline(listener_.get(), -1, 10s));
    ASSERT_TRUE(taken);
    EXPECT_TRUE(same_connection(taken.get(), shim.get()));
}

}  // namespace
}  // namespace cellblock::sandbox_detail
