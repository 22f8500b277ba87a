// The front's end of the egress tunnel (server/egress_tunnel.hpp) against a
// task played by a real CurveZMQ ROUTER on 127.0.0.1 and a gateway played by
// a real unix listener: what reaches the gateway, what comes back, the
// window, and what a task that breaks the protocol gets.
#include "egress_tunnel.hpp"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
#include <zmq.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cellblock/sandbox_protocol.hpp"
#include "cellblock/signer.hpp"
#include "multipart.hpp"
#include "unix_address.hpp"

namespace cellblock {
namespace {

namespace protocol = sandbox_protocol;
using Message = std::vector<std::string>;
constexpr auto kWait = std::chrono::seconds(10);

// The hello the front must send: the trust store, signed with the kernel's key.
Message hello() {
    return {protocol::kTunnelHello, "", "the trust store",
            Signer("the kernel's key").sign("the trust store", "", "", "")};
}

struct Harness {
    zmq::context_t context;
    EventLoop loop;
    zmq::socket_t task{context, zmq::socket_type::router};
    std::string front;  // the front's routing id, from its hello
    std::filesystem::path dir;
    UniqueFd listener;
    std::optional<EgressTunnel> tunnel;

    char public_key[41] = {}, secret_key[41] = {};

    void bind_task(const std::string& endpoint) {
        task.set(zmq::sockopt::curve_server, 1);
        task.set(zmq::sockopt::curve_secretkey, std::string(secret_key));
        task.set(zmq::sockopt::linger, 0);
        task.bind(endpoint);
    }
    Harness() {
        EXPECT_EQ(zmq_curve_keypair(public_key, secret_key), 0);
        bind_task("tcp://127.0.0.1:*");
        char tmpl[] = "/tmp/egress-tunnel-test-XXXXXX";
        EXPECT_NE(::mkdtemp(tmpl), nullptr);
        dir = tmpl;
        listener.reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
        const auto addr = unix_address((dir / "egress.sock").native());
        EXPECT_EQ(::bind(listener.get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof *addr),
                  0);
        EXPECT_EQ(::listen(listener.get(), 256), 0);
        tunnel.emplace(loop, context,
                       EgressTunnelSettings{"s1", task.get(zmq::sockopt::last_endpoint),
                                            std::string(public_key), dir / "egress.sock",
                                            "the trust store", "the kernel's key"});
    }
    ~Harness() {
        tunnel.reset();
        std::filesystem::remove_all(dir);
    }

    // The next message the task gets (turning the front's loop meanwhile).
    Message task_receives() {
        const auto deadline = std::chrono::steady_clock::now() + kWait;
        while (std::chrono::steady_clock::now() < deadline) {
            Multipart m;
            if (recv_multipart(task, m, 8)) {
                front = std::string(m.view(0));
                Message out;
                for (std::size_t i = 1; i < m.frames.size(); ++i) out.emplace_back(m.view(i));
                return out;
            }
            loop.run_once(std::chrono::milliseconds(5));
        }
        ADD_FAILURE() << "the task got nothing in 10 s";
        return {};
    }
    void task_sends(const Message& frames) {
        std::vector<Frame> out{Frame::copy_of(front)};
        for (const auto& f : frames) out.push_back(Frame::copy_of(f));
        ASSERT_TRUE(send_multipart(task, out));
        for (int i = 0; i < 5; ++i) loop.run_once(std::chrono::milliseconds(5));
    }
    // The gateway's side of a connection the front opened.
    UniqueFd gateway_accepts() {
        const auto deadline = std::chrono::steady_clock::now() + kWait;
        while (std::chrono::steady_clock::now() < deadline) {
            const int fd = ::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC);
            if (fd >= 0) return UniqueFd(fd);
            loop.run_once(std::chrono::milliseconds(5));
        }
        ADD_FAILURE() << "the gateway got no connection in 10 s";
        return {};
    }
    // Reads what the gateway side gets until `size` bytes or EOF.
    std::string gateway_reads(int fd, std::size_t size) {
        std::string got;
        const auto deadline = std::chrono::steady_clock::now() + kWait;
        while (got.size() < size && std::chrono::steady_clock::now() < deadline) {
            char buf[65536];
            const ssize_t n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
            if (n == 0) break;
            if (n > 0) got.append(buf, static_cast<std::size_t>(n));
            loop.run_once(std::chrono::milliseconds(5));
        }
        return got;
    }
    // hello from the front, answered; then an open connection "1".
    UniqueFd greet_and_open(const std::string& id = "1") {
        if (front.empty()) {
            EXPECT_EQ(task_receives(), hello());
            task_sends({protocol::kTunnelHello, ""});
        }
        task_sends({protocol::kTunnelOpen, id});
        return gateway_accepts();
    }
};

std::string pattern(std::size_t size) {
    std::string s(size, '\0');
    for (std::size_t i = 0; i < size; ++i) s[i] = static_cast<char>('a' + (i * 7 + i / 251) % 26);
    return s;
}

TEST(EgressTunnel, HelloCarriesTheTrustStoreAndTheAnswerIsNoted) {
    Harness h;
    EXPECT_EQ(h.task_receives(), hello());
    EXPECT_FALSE(h.tunnel->counts().greeted);
    h.task_sends({protocol::kTunnelHello, ""});
    EXPECT_TRUE(h.tunnel->counts().greeted);
}

TEST(EgressTunnel, BytesFromTheTaskReachTheGatewayInOrderAndAreAcknowledged) {
    Harness h;
    UniqueFd gateway = h.greet_and_open();
    ASSERT_TRUE(gateway);
    const std::string body = pattern(3 * protocol::kTunnelChunkBytes);
    std::size_t offset = 0;
    for (std::size_t at = 0; at < body.size(); at += protocol::kTunnelChunkBytes) {
        h.task_sends({protocol::kTunnelData, "1", std::to_string(offset),
                      body.substr(at, protocol::kTunnelChunkBytes)});
        offset += protocol::kTunnelChunkBytes;
    }
    EXPECT_EQ(h.gateway_reads(gateway.get(), body.size()), body);
    // Acknowledgements are cumulative; the last says everything.
    std::string last;
    for (;;) {
        const Message m = h.task_receives();
        ASSERT_EQ(m.size(), 3u);
        ASSERT_EQ(m[0], protocol::kTunnelAck);
        last = m[2];
        if (last == std::to_string(body.size())) break;
    }
    EXPECT_EQ(h.tunnel->counts().bytes_out, body.size());
}

TEST(EgressTunnel, TheGatewaysBytesGoBackAtTheirOffsetsAndStopAtTheWindow) {
    Harness h;
    UniqueFd gateway = h.greet_and_open();
    ASSERT_TRUE(gateway);
    // More than a window, written from a thread: the socket's buffer is smaller.
    const std::string body = pattern(protocol::kTunnelWindowBytes + 100000);
    std::thread writer([&] {
        std::size_t at = 0;
        while (at < body.size()) {
            const ssize_t n =
                ::send(gateway.get(), body.data() + at, body.size() - at, MSG_NOSIGNAL);
            if (n <= 0) break;
            at += static_cast<std::size_t>(n);
        }
    });
    std::string got;
    while (got.size() < static_cast<std::size_t>(protocol::kTunnelWindowBytes)) {
        const Message m = h.task_receives();
        ASSERT_EQ(m.size(), 4u);
        ASSERT_EQ(m[0], protocol::kTunnelData);
        ASSERT_EQ(m[2], std::to_string(got.size()));
        ASSERT_LE(m[3].size(), static_cast<std::size_t>(protocol::kTunnelChunkBytes));
        got += m[3];
    }
    EXPECT_EQ(got.size(), static_cast<std::size_t>(protocol::kTunnelWindowBytes));
    // Unacknowledged, nothing more comes.
    for (int i = 0; i < 40; ++i) h.loop.run_once(std::chrono::milliseconds(5));
    Multipart none;
    EXPECT_FALSE(recv_multipart(h.task, none, 8));
    // An acknowledgement lets the rest come.
    h.task_sends({protocol::kTunnelAck, "1", std::to_string(got.size())});
    while (got.size() < body.size()) {
        const Message m = h.task_receives();
        ASSERT_EQ(m.size(), 4u);
        ASSERT_EQ(m[2], std::to_string(got.size()));
        got += m[3];
    }
    writer.join();
    EXPECT_EQ(got, body);
}

TEST(EgressTunnel, EofBothWaysEndsTheConnectionOnBothSides) {
    Harness h;
    UniqueFd gateway = h.greet_and_open();
    ASSERT_TRUE(gateway);
    h.task_sends({protocol::kTunnelData, "1", "0", "GET / HTTP/1.1\r\n\r\n"});
    h.task_sends({protocol::kTunnelEof, "1"});
    EXPECT_EQ(h.gateway_reads(gateway.get(), 1000), "GET / HTTP/1.1\r\n\r\n");  // then EOF
    ASSERT_EQ(::send(gateway.get(), "HTTP/1.1 200 OK\r\n\r\n", 19, MSG_NOSIGNAL), 19);
    ::shutdown(gateway.get(), SHUT_WR);
    std::vector<std::string> verbs;
    while (verbs.empty() || verbs.back() != protocol::kTunnelEof) {
        const Message m = h.task_receives();
        ASSERT_FALSE(m.empty());
        verbs.push_back(m[0]);
    }
    EXPECT_NE(std::find(verbs.begin(), verbs.end(), protocol::kTunnelData), verbs.end());
    // Not closed while the task has not acknowledged the answer: it may
    // still be on its way to the client.
    for (int i = 0; i < 20; ++i) h.loop.run_once(std::chrono::milliseconds(5));
    Multipart none;
    EXPECT_FALSE(recv_multipart(h.task, none, 8));
    EXPECT_EQ(h.tunnel->counts().open_now, 1u);
    h.task_sends({protocol::kTunnelAck, "1", "19"});
    EXPECT_EQ(h.task_receives(), (Message{protocol::kTunnelClose, "1"}));
    EXPECT_EQ(h.tunnel->counts().open_now, 0u);
}

TEST(EgressTunnel, ATaskThatBreaksTheProtocolLosesThatConnectionOnly) {
    Harness h;
    UniqueFd one = h.greet_and_open("1");
    UniqueFd two = h.greet_and_open("2");
    ASSERT_TRUE(one && two);
    h.task_sends({protocol::kTunnelData, "1", "5", "out of order"});
    EXPECT_EQ(h.task_receives(), (Message{protocol::kTunnelClose, "1"}));
    EXPECT_EQ(h.gateway_reads(one.get(), 100), "");  // closed
    h.task_sends({protocol::kTunnelAck, "2", "1"});  // nothing was sent on 2
    EXPECT_EQ(h.task_receives(), (Message{protocol::kTunnelClose, "2"}));
    UniqueFd three = h.greet_and_open("3");
    h.task_sends({protocol::kTunnelData, "3", "0",
                  std::string(protocol::kTunnelChunkBytes + 1, 'x')});  // past a chunk
    EXPECT_EQ(h.task_receives(), (Message{protocol::kTunnelClose, "3"}));
    // Unknown verbs and ids: ignored, or answered with close; the tunnel goes on.
    h.task_sends({"smuggle", "4", "x"});
    h.task_sends({protocol::kTunnelData, "99", "0", "x"});
    EXPECT_EQ(h.task_receives(), (Message{protocol::kTunnelClose, "99"}));
    UniqueFd five = h.greet_and_open("5");
    h.task_sends({protocol::kTunnelData, "5", "0", "still here"});
    EXPECT_EQ(h.gateway_reads(five.get(), 10), "still here");
    EXPECT_EQ(h.tunnel->counts().protocol_errors, 4u);
}

TEST(EgressTunnel, AChannelMadeAgainAfterABreakClosesTheOpenConnectionsAndSaysHelloAgain) {
    Harness h;
    UniqueFd gateway = h.greet_and_open();
    ASSERT_TRUE(gateway);
    // The task's side goes and comes back on the same port (a network break
    // as the front sees one: the connection is made again, to a new peer).
    const std::string endpoint = h.task.get(zmq::sockopt::last_endpoint);
    h.task.close();
    for (int i = 0; i < 20; ++i) h.loop.run_once(std::chrono::milliseconds(5));
    h.task = zmq::socket_t(h.context, zmq::socket_type::router);
    h.bind_task(endpoint);
    h.front.clear();
    EXPECT_EQ(h.task_receives(), hello());
    EXPECT_EQ(h.tunnel->counts().reconnects, 1u);
    EXPECT_EQ(h.tunnel->counts().open_now, 0u);
    EXPECT_EQ(h.gateway_reads(gateway.get(), 100), "");  // closed
    h.task_sends({protocol::kTunnelHello, ""});
    UniqueFd again = h.greet_and_open("1");
    h.task_sends({protocol::kTunnelData, "1", "0", "after the break"});
    EXPECT_EQ(h.gateway_reads(again.get(), 15), "after the break");
}

TEST(EgressTunnel, OpensPastTheCapOrRefusedByTheGatewayAreClosed) {
    Harness h;
    std::vector<UniqueFd> held;
    for (int i = 1; i <= protocol::kTunnelMaxConnections; ++i) {
        held.push_back(h.greet_and_open(std::to_string(i)));
        ASSERT_TRUE(held.back());
    }
    h.task_sends({protocol::kTunnelOpen, "1000"});
    EXPECT_EQ(h.task_receives(), (Message{protocol::kTunnelClose, "1000"}));
    // An id already open: the task broke the protocol, and loses that one.
    h.task_sends({protocol::kTunnelOpen, "1"});
    EXPECT_EQ(h.task_receives(), (Message{protocol::kTunnelClose, "1"}));
    EXPECT_EQ(h.tunnel->counts().open_now, static_cast<std::uint64_t>(held.size() - 1));
    EXPECT_EQ(h.tunnel->counts().protocol_errors, 1u);
    // The gateway gone: an open is refused, not waited on.
    h.task_sends({protocol::kTunnelClose, "2"});
    EXPECT_EQ(h.tunnel->counts().open_now, static_cast<std::uint64_t>(held.size() - 2));
    h.listener.reset();
    std::filesystem::remove(h.dir / "egress.sock");
    h.task_sends({protocol::kTunnelOpen, "2000"});
    EXPECT_EQ(h.task_receives(), (Message{protocol::kTunnelClose, "2000"}));
    EXPECT_EQ(h.tunnel->counts().refused, 2u);
}

}  // namespace
}  // namespace cellblock
