// bind_client_socket: the ROUTER and PUB that a session's clients connect
// to, against real libzmq client sockets (DEALER, REQ, SUB), over tcp on
// 127.0.0.1 and over ipc in a temporary directory, in both transports
// (RelayTransport::zmtp, spoken in the EventLoop; RelayTransport::libzmq).
// Every wait is a loop of EventLoop::run_once with a deadline, so a broken
// socket fails a test instead of hanging it.
#include "client_socket.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <malloc.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include <zmq_addon.hpp>

#include "cellblock/unique_fd.hpp"
#include "cellblock/zmtp.hpp"
#include "event_loop.hpp"
#include "multipart.hpp"

#if defined(__SANITIZE_ADDRESS__)
// ASan's allocator (GCC ships no <sanitizer/allocator_interface.h>).
extern "C" std::size_t __sanitizer_get_current_allocated_bytes();
#endif

namespace cellblock {
namespace {

using Clock = std::chrono::steady_clock;
using Frames = std::vector<std::string>;
constexpr auto kDeadline = std::chrono::seconds(5);

struct TempDir {
    std::string path;
    TempDir() {
        char tmpl[] = "/tmp/client_socket_test.XXXXXX";
        if (::mkdtemp(tmpl) != nullptr) path = tmpl;
    }
    ~TempDir() {
        std::error_code ec;
        if (!path.empty()) std::filesystem::remove_all(path, ec);
    }
};

struct Config {
    RelayTransport transport;
    bool ipc;
};

void PrintTo(const Config& c, std::ostream* os) {
    *os << relay_transport_name(c.transport) << (c.ipc ? " over ipc" : " over tcp");
}

std::string config_name(const ::testing::TestParamInfo<Config>& info) {
    return std::string(relay_transport_name(info.param.transport)) +
           (info.param.ipc ? "_ipc" : "_tcp");
}

const std::vector<Config> kAll = {{RelayTransport::zmtp, false},
                                  {RelayTransport::zmtp, true},
                                  {RelayTransport::libzmq, false},
                                  {RelayTransport::libzmq, true}};
const std::vector<Config> kZmtp = {{RelayTransport::zmtp, false}, {RelayTransport::zmtp, true}};

Frames strings(const Multipart& m) {
    Frames out;
    for (const auto& f : m.frames) out.emplace_back(f.view());
    return out;
}

std::vector<Frame> frames_of(const Frames& frames) {
    std::vector<Frame> out;
    for (const auto& f : frames) out.push_back(Frame::copy_of(f));
    return out;
}

// Printable, for failure messages (identities hold zero bytes).
std::string show(const Frames& frames) {
    std::string out = "[";
    for (const auto& f : frames) {
        if (out.size() > 1) out += ", ";
        if (f.size() > 64) {
            out += "<" + std::to_string(f.size()) + " bytes>";
            continue;
        }
        out += '"';
        for (unsigned char c : f) {
            if (c >= 0x20 && c < 0x7f) {
                out += static_cast<char>(c);
            } else {
                char hex[8];
                std::snprintf(hex, sizeof hex, "\\x%02x", c);
                out += hex;
            }
        }
        out += '"';
    }
    return out + "]";
}

// A whole message from a libzmq client socket, without waiting.
std::optional<Frames> try_recv(zmq::socket_t& s) {
    std::vector<zmq::message_t> parts;
    if (!zmq::recv_multipart(s, std::back_inserter(parts), zmq::recv_flags::dontwait)) {
        return std::nullopt;
    }
    Frames out;
    for (const auto& p : parts) out.push_back(p.to_string());
    return out;
}

void client_send(zmq::socket_t& s, const Frames& frames) {
    std::vector<zmq::const_buffer> parts;
    for (const auto& f : frames) parts.push_back(zmq::buffer(f));
    ASSERT_TRUE(zmq::send_multipart(s, parts).has_value());  // sndtimeo bounds it
}

// One socket bound by bind_client_socket and watched by the loop; what its
// handler received, one message per call (the handler need not drain: it
// is called again while one waits).
struct Listener {
    BoundSocket bound;
    std::string endpoint;  // what clients connect to
    std::string ipc_path;  // the socket file (ipc)
    std::deque<Frames> received;
    int handler_calls = 0;
    // Replaces the handler's body (after handler_calls is counted).
    std::function<void()> on_call;

    RelaySocket& socket() { return *bound.socket; }
    bool send(const Frames& frames) {
        auto f = frames_of(frames);
        return bound.socket->send(f);
    }
};

class ClientSocket : public ::testing::TestWithParam<Config> {
  public:
    void SetUp() override { ASSERT_FALSE(dir.path.empty()) << "mkdtemp failed"; }

    // `port`: the one to bind (0: a free one, or the next ipc name).
    Listener& bind(bool pub, ClientSocketOptions options = {}, int port = 0) {
        options.transport = GetParam().transport;
        options.linger_ms = 0;
        options.label = pub ? "test iopub" : "test shell";
        const Channel channel = pub ? Channel::iopub : Channel::shell;
        ConnectionInfo info;
        if (GetParam().ipc) {
            info.transport = "ipc";
            info.ip = dir.path + "/s";
            info.set_port(channel, port ? port : next_ipc_port_++);
        } else {
            info.transport = "tcp";
            info.ip = "127.0.0.1";
            info.set_port(channel, port);
        }
        auto l = std::make_unique<Listener>();
        l->bound = bind_client_socket(ctx, pub, info, channel, options);
        if (GetParam().ipc) {
            l->ipc_path = info.ip + "-" + std::to_string(info.port(channel));
            l->endpoint = "ipc://" + l->ipc_path;
            EXPECT_EQ(l->bound.port, info.port(channel));
        } else {
            EXPECT_GT(l->bound.port, 0) << "port 0 must come back as the port bound";
            l->endpoint = "tcp://127.0.0.1:" + std::to_string(l->bound.port);
        }
        EXPECT_TRUE(l->bound.socket->is_open());
        Listener* raw = l.get();
        l->bound.socket->watch(loop, [raw] {
            ++raw->handler_calls;
            if (raw->on_call) {
                raw->on_call();
                return;
            }
            Multipart m;
            if (raw->bound.socket->receive(m, 64)) raw->received.push_back(strings(m));
        });
        listeners_.push_back(std::move(l));
        return *raw;
    }

    zmq::socket_t client(zmq::socket_type type, const std::string& endpoint,
                         std::optional<std::string> routing_id = std::nullopt) {
        zmq::socket_t s(ctx, type);
        s.set(zmq::sockopt::linger, 0);
        s.set(zmq::sockopt::sndtimeo, 5000);
        if (routing_id) s.set(zmq::sockopt::routing_id, *routing_id);
        s.connect(endpoint);
        return s;
    }

    // Turns the loop until `done()` (checked between turns) or the deadline.
    bool drive(const std::function<bool()>& done, Clock::duration limit = kDeadline) {
        const auto until = Clock::now() + limit;
        while (!done()) {
            if (Clock::now() > until) return false;
            loop.run_once(std::chrono::milliseconds(5));
        }
        return true;
    }
    // Turns the loop for `d`, calling `each` between turns.
    void settle(
        Clock::duration d, const std::function<void()>& each = [] {}) {
        const auto until = Clock::now() + d;
        while (Clock::now() < until) {
            loop.run_once(std::chrono::milliseconds(5));
            each();
        }
    }
    // The next message a client receives, turning the loop meanwhile.
    std::optional<Frames> await(zmq::socket_t& s, Clock::duration limit = kDeadline) {
        std::optional<Frames> got;
        drive([&] { return (got = try_recv(s)).has_value(); }, limit);
        return got;
    }
    // The next message the listener's handler received.
    std::optional<Frames> await(Listener& l, Clock::duration limit = kDeadline) {
        if (!drive([&] { return !l.received.empty(); }, limit)) return std::nullopt;
        Frames f = std::move(l.received.front());
        l.received.pop_front();
        return f;
    }

    bool zmtp() const { return GetParam().transport == RelayTransport::zmtp; }

    // Destroyed in reverse: listeners (they unwatch from the loop), the
    // loop, the context (after the test's client sockets), the directory.
    TempDir dir;
    zmq::context_t ctx;
    EventLoop loop;

  private:
    std::vector<std::unique_ptr<Listener>> listeners_;
    int next_ipc_port_ = 41001;
};

// A connected raw stream socket to the listener (not ZMTP).
UniqueFd raw_connect(const Listener& l, bool ipc) {
    if (ipc) {
        UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
        sockaddr_un addr{};
        addr.sun_family = AF_UNIX;
        std::strncpy(addr.sun_path, l.ipc_path.c_str(), sizeof(addr.sun_path) - 1);
        if (!fd || ::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
            return UniqueFd();
        }
        return fd;
    }
    UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<std::uint16_t>(l.bound.port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (!fd || ::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
        return UniqueFd();
    }
    return fd;
}

std::string pattern(std::size_t n, unsigned seed) {
    std::string s(n, '\0');
    for (std::size_t i = 0; i < n; ++i)
        s[i] = static_cast<char>((i * 131 + seed * 7 + (i >> 12)) & 0xff);
    return s;
}

// ---------------------------------------------------------------------------
// ROUTER

using ClientRouter = ClientSocket;
using ClientRouterZmtp = ClientSocket;
using ClientPub = ClientSocket;
using ClientPubZmtp = ClientSocket;

TEST_P(ClientRouter, ADealersMessageArrivesUnderItsIdentityAndTheReplyReachesIt) {
    Listener& router = bind(false);
    auto alice = client(zmq::socket_type::dealer, router.endpoint, "alice");
    client_send(alice, {"f1", "", std::string(300, 'L')});
    auto got = await(router);
    ASSERT_TRUE(got) << "no message within the deadline";
    EXPECT_EQ(*got, (Frames{"alice", "f1", "", std::string(300, 'L')})) << show(*got);
    EXPECT_GE(router.handler_calls, 1);

    ASSERT_TRUE(router.send({"alice", "r1", "r2"}));
    auto reply = await(alice);
    ASSERT_TRUE(reply) << "the reply did not reach the DEALER";
    EXPECT_EQ(*reply, (Frames{"r1", "r2"}));

    // And again both ways (the connection stays up), with an empty frame last.
    client_send(alice, {"second", ""});
    got = await(router);
    ASSERT_TRUE(got);
    EXPECT_EQ(*got, (Frames{"alice", "second", ""})) << show(*got);
    ASSERT_TRUE(router.send({"alice", ""}));
    reply = await(alice);
    ASSERT_TRUE(reply);
    EXPECT_EQ(*reply, (Frames{""}));
}

TEST_P(ClientRouter, ADealerWithoutIdentityGetsAMadeUpOneAndRepliesReachIt) {
    Listener& router = bind(false);
    auto one = client(zmq::socket_type::dealer, router.endpoint);
    auto two = client(zmq::socket_type::dealer, router.endpoint);
    client_send(one, {"from-one"});
    client_send(two, {"from-two"});
    std::string id_one, id_two;
    for (int i = 0; i < 2; ++i) {
        auto got = await(router);
        ASSERT_TRUE(got) << "message " << i << " did not arrive";
        ASSERT_EQ(got->size(), 2u) << show(*got);
        const std::string& id = (*got)[0];
        EXPECT_EQ(id.size(), 5u) << show(*got);
        ASSERT_FALSE(id.empty());
        EXPECT_EQ(id[0], '\0') << show(*got);
        if ((*got)[1] == "from-one") {
            id_one = id;
        } else {
            ASSERT_EQ((*got)[1], "from-two");
            id_two = id;
        }
    }
    ASSERT_FALSE(id_one.empty());
    ASSERT_FALSE(id_two.empty());
    EXPECT_NE(id_one, id_two);

    // Replies are routed by the made-up identities, each to its own DEALER.
    ASSERT_TRUE(router.send({id_two, "for-two"}));
    ASSERT_TRUE(router.send({id_one, "for-one"}));
    auto r1 = await(one);
    auto r2 = await(two);
    ASSERT_TRUE(r1);
    ASSERT_TRUE(r2);
    EXPECT_EQ(*r1, (Frames{"for-one"}));
    EXPECT_EQ(*r2, (Frames{"for-two"}));
}

TEST_P(ClientRouter, ASecondDealerWithTheSameIdentityTakesItOver) {
    Listener& router = bind(false);
    auto old_dealer = client(zmq::socket_type::dealer, router.endpoint, "alice");
    // Once displaced, the old DEALER must not reconnect and take "alice" back.
    old_dealer.set(zmq::sockopt::reconnect_ivl, -1);
    client_send(old_dealer, {"from-old"});
    auto got = await(router);
    ASSERT_TRUE(got);
    EXPECT_EQ(*got, (Frames{"alice", "from-old"})) << show(*got);

    auto new_dealer = client(zmq::socket_type::dealer, router.endpoint, "alice");
    client_send(new_dealer, {"from-new"});
    got = await(router);
    ASSERT_TRUE(got);
    EXPECT_EQ(*got, (Frames{"alice", "from-new"})) << show(*got);

    ASSERT_TRUE(router.send({"alice", "reply"}));
    auto reply = await(new_dealer);
    ASSERT_TRUE(reply) << "the reply to alice did not reach the newest connection";
    EXPECT_EQ(*reply, (Frames{"reply"}));
    std::optional<Frames> at_old;
    settle(std::chrono::milliseconds(200), [&] {
        if (!at_old) at_old = try_recv(old_dealer);
    });
    EXPECT_FALSE(at_old) << "the displaced DEALER got " << show(*at_old);

    // The new one keeps working.
    client_send(new_dealer, {"again"});
    got = await(router);
    ASSERT_TRUE(got);
    EXPECT_EQ(*got, (Frames{"alice", "again"}));
}

// jupyter_client's heartbeat: a REQ that sends [payload] and waits for it back.
TEST_P(ClientRouter, AReqClientsRequestCarriesTheEmptyDelimiterAndItsReplyArrives) {
    Listener& router = bind(false);
    auto req = client(zmq::socket_type::req, router.endpoint);
    for (int round = 0; round < 3; ++round) {
        const std::string ping = "ping-" + std::to_string(round);
        client_send(req, {ping});
        auto got = await(router);
        ASSERT_TRUE(got) << "round " << round;
        ASSERT_EQ(got->size(), 3u) << show(*got);
        EXPECT_EQ((*got)[0].size(), 5u) << show(*got);
        EXPECT_EQ((*got)[1], "");
        EXPECT_EQ((*got)[2], ping);
        ASSERT_TRUE(router.send({(*got)[0], "", "pong-" + std::to_string(round)}));
        auto reply = await(req);
        ASSERT_TRUE(reply) << "round " << round << ": the REQ got no reply";
        EXPECT_EQ(*reply, (Frames{"pong-" + std::to_string(round)}));
    }
}

TEST_P(ClientRouter, TwoDealersMessagesAllArriveEachInOrderAndInTurn) {
    Listener& router = bind(false);
    auto d1 = client(zmq::socket_type::dealer, router.endpoint, "d1");
    auto d2 = client(zmq::socket_type::dealer, router.endpoint, "d2");
    client_send(d1, {"hello"});
    client_send(d2, {"hello"});
    ASSERT_TRUE(drive([&] { return router.received.size() == 2; }));
    router.received.clear();

    constexpr int kEach = 50;
    for (int i = 0; i < kEach; ++i) {
        client_send(d1, {"m", std::to_string(i)});
        client_send(d2, {"m", std::to_string(i)});
    }
    // Let both peers' messages arrive before the loop looks: then they are
    // served in turn, not one peer's all first.
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ASSERT_TRUE(drive([&] { return router.received.size() >= 2 * kEach; }))
        << "received " << router.received.size() << " of " << 2 * kEach;
    settle(std::chrono::milliseconds(50));
    ASSERT_EQ(router.received.size(), static_cast<std::size_t>(2 * kEach));
    int next_d1 = 0, next_d2 = 0, first20_d1 = 0, first20_d2 = 0;
    for (std::size_t i = 0; i < router.received.size(); ++i) {
        const Frames& m = router.received[i];
        ASSERT_EQ(m.size(), 3u) << show(m);
        ASSERT_EQ(m[1], "m");
        if (m[0] == "d1") {
            EXPECT_EQ(m[2], std::to_string(next_d1++)) << "d1's messages out of order";
            if (i < 20) ++first20_d1;
        } else {
            ASSERT_EQ(m[0], "d2") << show(m);
            EXPECT_EQ(m[2], std::to_string(next_d2++)) << "d2's messages out of order";
            if (i < 20) ++first20_d2;
        }
    }
    EXPECT_EQ(next_d1, kEach);
    EXPECT_EQ(next_d2, kEach);
    EXPECT_GE(first20_d1, 5) << "d2 was served before d1 had a turn";
    EXPECT_GE(first20_d2, 5) << "d1 was served before d2 had a turn";
}

TEST_P(ClientRouter, AFiveMebibyteFrameBothWays) {
    Listener& router = bind(false);
    auto alice = client(zmq::socket_type::dealer, router.endpoint, "alice");
    const std::string up = pattern(5 << 20, 1), down = pattern(5 << 20, 2);
    client_send(alice, {"big", up, "tail"});
    auto got = await(router);
    ASSERT_TRUE(got) << "the 5 MiB message did not arrive";
    ASSERT_EQ(got->size(), 4u) << show(*got);
    EXPECT_EQ((*got)[0], "alice");
    EXPECT_EQ((*got)[1], "big");
    EXPECT_EQ((*got)[2].size(), up.size());
    EXPECT_TRUE((*got)[2] == up) << "the big frame's bytes differ";
    EXPECT_EQ((*got)[3], "tail");

    ASSERT_TRUE(router.send({"alice", down, "after"}));
    ASSERT_TRUE(router.send({"alice", "second"}));
    auto reply = await(alice);
    ASSERT_TRUE(reply) << "the 5 MiB reply did not arrive";
    ASSERT_EQ(reply->size(), 2u) << show(*reply);
    EXPECT_EQ((*reply)[0].size(), down.size());
    EXPECT_TRUE((*reply)[0] == down) << "the big frame's bytes differ";
    EXPECT_EQ((*reply)[1], "after");
    reply = await(alice);
    ASSERT_TRUE(reply);
    EXPECT_EQ(*reply, (Frames{"second"}));
}

// A client that sends and leaves at once: what it sent is still delivered.
TEST_P(ClientRouter, AClientsLastMessagesBeforeItLeavesAreDelivered) {
    Listener& router = bind(false);
    {
        auto bye = client(zmq::socket_type::dealer, router.endpoint, "bye");
        bye.set(zmq::sockopt::linger, 2000);  // flush on close
        client_send(bye, {"one"});
        client_send(bye, {"two", std::string(100000, 't')});
        client_send(bye, {"three"});
        // Let the messages leave before the socket closes.
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    for (const char* expected : {"one", "two", "three"}) {
        auto got = await(router);
        ASSERT_TRUE(got) << expected << " never arrived";
        ASSERT_GE(got->size(), 2u) << show(*got);
        EXPECT_EQ((*got)[0], "bye");
        EXPECT_EQ((*got)[1], expected);
    }
    settle(std::chrono::milliseconds(50));
    EXPECT_TRUE(router.received.empty());
    if (zmtp()) {
        EXPECT_TRUE(drive([&] {
            return !router.send({"bye", "gone?"});
        })) << "the client left, yet sends to it succeed";
    }
}

// The session closing while it handles a message: close() from inside the
// ROUTER's own handler, while another client's message waits too.
TEST_P(ClientRouter, CloseFromInsideItsOwnHandler) {
    Listener& router = bind(false);
    auto a = client(zmq::socket_type::dealer, router.endpoint, "a");
    auto b = client(zmq::socket_type::dealer, router.endpoint, "b");
    client_send(a, {"hello"});
    client_send(b, {"hello"});
    ASSERT_TRUE(drive([&] { return router.received.size() == 2; }));
    router.received.clear();
    router.on_call = [&] {
        Multipart m;
        if (router.socket().receive(m, 64)) router.received.push_back(strings(m));
        router.socket().close();
    };
    const int calls_before = router.handler_calls;
    // Several messages from both, so more wait when the handler closes.
    for (int i = 0; i < 5; ++i) {
        client_send(a, {"a", std::to_string(i)});
        client_send(b, {"b", std::to_string(i)});
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ASSERT_TRUE(drive([&] { return router.handler_calls > calls_before; }));
    EXPECT_FALSE(router.socket().is_open());
    EXPECT_EQ(router.received.size(), 1u);
    // Turns after the close: nothing calls the handler again, nothing crashes.
    settle(std::chrono::milliseconds(100));
    EXPECT_EQ(router.handler_calls, calls_before + 1);
    EXPECT_FALSE(router.socket().is_open());
    EXPECT_FALSE(router.send({"a", "after close"}));
    EXPECT_FALSE(router.send({"b", "after close"}));
    Multipart m;
    EXPECT_FALSE(router.socket().receive(m, 64));
    router.socket().close();  // twice is harmless
    EXPECT_FALSE(router.socket().is_open());
    if (GetParam().ipc && zmtp()) {
        EXPECT_FALSE(std::filesystem::exists(router.ipc_path)) << "the socket file is left behind";
    }
}

INSTANTIATE_TEST_SUITE_P(Transports, ClientRouter, ::testing::ValuesIn(kAll), config_name);

// ---------------------------------------------------------------------------
// ROUTER, ZMTP only: where libzmq's ROUTER behaves otherwise (it drops an
// unroutable message silently, disconnects a client over its maxmsgsize,
// lets a client claim a made-up identity) or what only our listener has
// (the per-client backlog cap, the connection cap).

TEST_P(ClientRouterZmtp, SendToAnUnknownIdentityReturnsFalse) {
    Listener& router = bind(false);
    EXPECT_FALSE(router.send({"nobody", "x"}));
    auto alice = client(zmq::socket_type::dealer, router.endpoint, "alice");
    client_send(alice, {"hi"});
    ASSERT_TRUE(await(router));
    EXPECT_FALSE(router.send({"nobody", "x"}));
    EXPECT_FALSE(router.send({"alic", "x"}));
    EXPECT_FALSE(router.send({"alice2", "x"}));
    EXPECT_TRUE(router.send({"alice", "x"}));
    std::vector<Frame> none;
    EXPECT_FALSE(router.socket().send(none));
    auto got = await(alice);
    ASSERT_TRUE(got);
    EXPECT_EQ(*got, (Frames{"x"})) << "only the routable message arrives";

    // A client that left is unknown again.
    alice.close();
    EXPECT_TRUE(drive([&] {
        return !router.send({"alice", "gone?"});
    })) << "sends to a disconnected client still succeed";
}

// A planned restart (docs/restarts.md): half_close tells each client the
// server goes. A message a client sends meanwhile is read here before it
// closes its end, or kept by its libzmq for its next connection: it reaches
// this listener or the next one on the same port, once, never neither (a
// plain close loses what was written as it happened).
TEST_P(ClientRouterZmtp, AMessageSentAsTheListenerHalfClosesReachesItOrTheNextOneOnce) {
    Listener& router = bind(false);
    auto alice = client(zmq::socket_type::dealer, router.endpoint, "alice");
    client_send(alice, {"hello"});
    ASSERT_TRUE(await(router));
    EXPECT_TRUE(router.socket().peers_sending());
    router.socket().half_close();
    client_send(alice, {"as the server went"});
    ASSERT_TRUE(drive([&] { return !router.socket().peers_sending(); }))
        << "the client never closed its end";
    const bool here = !router.received.empty();
    if (here) {
        EXPECT_EQ(router.received.front(), (Frames{"alice", "as the server went"}));
    }
    router.socket().close();
    Listener& next = bind(false, {}, router.bound.port);
    auto got = await(next, here ? std::chrono::milliseconds(500) : kDeadline);
    if (here) {
        EXPECT_FALSE(got) << "delivered twice: " << show(*got);
    } else {
        ASSERT_TRUE(got) << "lost: neither listener got it";
        EXPECT_EQ(*got, (Frames{"alice", "as the server went"})) << show(*got);
    }
    client_send(alice, {"after"});
    auto after = await(next);
    ASSERT_TRUE(after) << "the client did not go on with the next listener";
    EXPECT_EQ(*after, (Frames{"alice", "after"})) << show(*after);
}

// A frame over the cap cuts the client off, as libzmq does past
// ZMQ_MAXMSGSIZE (the server never holds the frame); a client that
// reconnects is served again. A frame exactly at the cap passes.
TEST_P(ClientRouterZmtp, AFrameOverTheCapCutsTheClientOff) {
    ClientSocketOptions options;
    options.max_frame_bytes = 64 << 10;
    Listener& router = bind(false, options);
    {
        auto mallory = client(zmq::socket_type::dealer, router.endpoint, "mallory");
        client_send(mallory, {"exact", std::string(64 << 10, 'e')});
        auto got = await(router);
        ASSERT_TRUE(got);
        ASSERT_EQ(got->size(), 3u) << show(*got);
        EXPECT_EQ((*got)[1], "exact") << show(*got);
        client_send(mallory, {"over", std::string((64 << 10) + 1, 'o'), "x"});
        client_send(mallory, {"never"});
        settle(std::chrono::milliseconds(300));
        // Cut off: nothing it sent after the frame reached the relay (libzmq
        // may reconnect it later; that new connection starts clean).
        EXPECT_TRUE(router.received.empty()) << show(router.received.front());
    }
    auto alice = client(zmq::socket_type::dealer, router.endpoint, "alice");
    client_send(alice, {"after"});
    auto got = await(router);
    ASSERT_TRUE(got);
    EXPECT_EQ(*got, (Frames{"alice", "after"})) << show(*got);
}

// Frames each under the cap that add up past the message cap (4 frame caps)
// are read past without being held: the message is refused, and the
// client's connection and next message are fine.
TEST_P(ClientRouterZmtp, AMessageOverTheByteCapIsDroppedAndTheClientStays) {
    ClientSocketOptions options;
    options.max_frame_bytes = 64 << 10;
    Listener& router = bind(false, options);
    auto alice = client(zmq::socket_type::dealer, router.endpoint, "alice");
    std::vector<std::string> big(6, std::string(60 << 10, 'b'));
    big.insert(big.begin(), "big");
    client_send(alice, big);
    client_send(alice, {"after"});
    auto got = await(router);
    ASSERT_TRUE(got);
    EXPECT_EQ(*got, (Frames{"alice", "after"})) << show(*got);
    ASSERT_TRUE(router.send({"alice", "still here"}));
    auto reply = await(alice);
    ASSERT_TRUE(reply);
    EXPECT_EQ(*reply, (Frames{"still here"}));
}

TEST_P(ClientRouterZmtp, AClientSendingGarbageIsDisconnectedAndOthersKeepWorking) {
    Listener& router = bind(false);
    auto good = client(zmq::socket_type::dealer, router.endpoint, "good");
    client_send(good, {"before"});
    ASSERT_TRUE(await(router));

    const std::vector<std::string> garbage = {
        "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" + std::string(64, 'A'),
        // A ZMTP 3.0 signature and version, then a mechanism nobody speaks.
        std::string("\xff\0\0\0\0\0\0\0\x01\x7f\x03\x00", 12) + "BOGUS" + std::string(47, '\0'),
    };
    for (const auto& bytes : garbage) {
        UniqueFd raw = raw_connect(router, GetParam().ipc);
        ASSERT_TRUE(raw) << "connect: " << std::strerror(errno);
        ASSERT_EQ(::send(raw.get(), bytes.data(), bytes.size(), MSG_NOSIGNAL),
                  static_cast<ssize_t>(bytes.size()));
        bool closed = false;
        std::string why;
        ASSERT_TRUE(drive([&] {
            for (;;) {
                char buf[4096];
                const ssize_t n = ::recv(raw.get(), buf, sizeof buf, MSG_DONTWAIT);
                if (n > 0) continue;  // our greeting: read past it
                if (n == 0 || (n < 0 && errno == ECONNRESET)) {
                    closed = true;
                    return true;
                }
                return false;  // EAGAIN: still open
            }
        })) << "the server kept a client that sent "
            << show({bytes.substr(0, 16)});
        EXPECT_TRUE(closed);
    }
    EXPECT_TRUE(router.received.empty()) << show(router.received.front());

    // The good client is unaffected, both ways.
    client_send(good, {"after"});
    auto got = await(router);
    ASSERT_TRUE(got);
    EXPECT_EQ(*got, (Frames{"good", "after"}));
    ASSERT_TRUE(router.send({"good", "reply"}));
    auto reply = await(good);
    ASSERT_TRUE(reply);
    EXPECT_EQ(*reply, (Frames{"reply"}));
}

// Identities starting with a zero byte are the ROUTER's own: a client that
// announces one it saw does not take over the client it was made up for.
// (libzmq's ROUTER with ZMQ_ROUTER_HANDOVER lets it, so this is ZMTP only.)
TEST_P(ClientRouterZmtp, AMadeUpIdentityCannotBeClaimedByAnotherClient) {
    Listener& router = bind(false);
    auto owner = client(zmq::socket_type::dealer, router.endpoint);
    client_send(owner, {"hello"});
    auto got = await(router);
    ASSERT_TRUE(got);
    const std::string made_up = (*got)[0];
    ASSERT_EQ(made_up.size(), 5u);

    auto thief = client(zmq::socket_type::dealer, router.endpoint, made_up);
    client_send(thief, {"mine now"});
    got = await(router);
    ASSERT_TRUE(got);
    EXPECT_NE((*got)[0], made_up) << "the thief was routed as the owner";
    EXPECT_EQ((*got)[1], "mine now");

    ASSERT_TRUE(router.send({made_up, "for the owner"}));
    auto reply = await(owner);
    ASSERT_TRUE(reply) << "the owner lost its identity";
    EXPECT_EQ(*reply, (Frames{"for the owner"}));
    std::optional<Frames> at_thief;
    settle(std::chrono::milliseconds(100), [&] {
        if (!at_thief) at_thief = try_recv(thief);
    });
    EXPECT_FALSE(at_thief) << show(*at_thief);
}

// A client that does not read: its backlog is capped, sends past the cap
// return false, and every send that returned true is delivered, in order,
// once it reads again.
TEST_P(ClientRouterZmtp, AClientThatDoesNotReadHasItsBacklogCapped) {
    Listener& router = bind(false);
    auto slow = client(zmq::socket_type::dealer, router.endpoint, "slow");
    slow.set(zmq::sockopt::rcvhwm, 1);
    client_send(slow, {"hello"});
    ASSERT_TRUE(await(router));
    const std::string mib = pattern(1 << 20, 5);
    int accepted = 0;
    bool refused = false;
    // 64 MiB of backlog plus what the kernel and libzmq buffer.
    for (int i = 0; i < 400 && !refused; ++i) {
        if (router.send({"slow", std::to_string(i), mib})) {
            ++accepted;
        } else {
            refused = true;
        }
        loop.run_once(std::chrono::milliseconds(0));
    }
    EXPECT_TRUE(refused) << "400 MiB queued for a client that does not read";
    EXPECT_GE(accepted, 32);
    // Now it reads: everything accepted arrives, in order, intact.
    for (int i = 0; i < accepted; ++i) {
        auto got = await(slow);
        ASSERT_TRUE(got) << "message " << i << " of " << accepted << " accepted never arrived";
        ASSERT_EQ(got->size(), 2u);
        ASSERT_EQ((*got)[0], std::to_string(i));
        ASSERT_TRUE((*got)[1] == mib) << "message " << i << " corrupted";
    }
    std::optional<Frames> extra;
    settle(std::chrono::milliseconds(50), [&] {
        if (!extra) extra = try_recv(slow);
    });
    EXPECT_FALSE(extra) << "a refused message arrived: " << show(*extra);
    // With the backlog gone, sends are taken again.
    ASSERT_TRUE(router.send({"slow", "after"}));
    auto got = await(slow);
    ASSERT_TRUE(got);
    EXPECT_EQ(*got, (Frames{"after"}));
}

// More clients than the listener keeps are accepted and closed; those it
// keeps are unaffected, and one turned away gets in once others leave.
TEST_P(ClientRouterZmtp, ConnectionsPastTheCapAreClosed) {
    Listener& router = bind(false);
    auto first = client(zmq::socket_type::dealer, router.endpoint, "first");
    client_send(first, {"hello"});
    ASSERT_TRUE(await(router));
    std::vector<UniqueFd> raws;
    bool turned_away = false;
    constexpr int kMost = 2048;
    while (!turned_away && static_cast<int>(raws.size()) < kMost) {
        for (int i = 0; i < 32; ++i) {
            raws.push_back(raw_connect(router, GetParam().ipc));
            ASSERT_TRUE(raws.back()) << "connect " << raws.size() << ": " << std::strerror(errno);
        }
        settle(std::chrono::milliseconds(10));
        for (auto& fd : raws) {
            char buf[256];
            ssize_t n;
            while ((n = ::recv(fd.get(), buf, sizeof buf, MSG_DONTWAIT)) > 0) {
            }
            if (n == 0 || (n < 0 && errno == ECONNRESET)) turned_away = true;
        }
    }
    ASSERT_TRUE(turned_away) << kMost << " idle connections kept";
    const std::size_t kept = raws.size();
    // The first client still works both ways.
    client_send(first, {"still"});
    auto got = await(router);
    ASSERT_TRUE(got);
    EXPECT_EQ(*got, (Frames{"first", "still"}));
    ASSERT_TRUE(router.send({"first", "yes"}));
    ASSERT_TRUE(await(first));
    // A new client is turned away (libzmq retries it) until others leave.
    auto late = client(zmq::socket_type::dealer, router.endpoint, "late");
    client_send(late, {"let me in"});
    raws.clear();
    got = await(router);
    ASSERT_TRUE(got) << "the late client never got in after " << kept << " others left";
    EXPECT_EQ(*got, (Frames{"late", "let me in"}));
}

// Bytes the heap holds live (freed ones in ASan's quarantine not counted).
std::size_t live_heap_bytes() {
#if defined(__SANITIZE_ADDRESS__)
    return __sanitizer_get_current_allocated_bytes();
#else
    const struct mallinfo2 m = ::mallinfo2();
    return m.uordblks + m.hblkhd;
#endif
}

// A DEALER on a raw socket spoken by our own codec, for what a libzmq client
// never does: stop in the middle of a frame.
class RawDealer {
  public:
    RawDealer(const Listener& l, bool ipc, std::string identity)
        : fd_(raw_connect(l, ipc)), conn_("DEALER", std::move(identity)) {
        if (fd_) ::fcntl(fd_.get(), F_SETFL, ::fcntl(fd_.get(), F_GETFL) | O_NONBLOCK);
    }
    bool connected() const { return static_cast<bool>(fd_); }
    bool ready() const { return conn_.ready(); }
    bool eof() const { return eof_; }
    // Bytes to write as they are, after what the codec has queued.
    void queue_raw(std::string_view bytes) { raw_.append(bytes); }
    // Writes what is queued, reads what arrived. True once all is written.
    bool pump() {
        for (;;) {
            std::string_view out = conn_.output();
            const bool codec = !out.empty();
            if (!codec) out = std::string_view(raw_).substr(raw_sent_);
            if (out.empty()) break;
            const ssize_t n = ::send(fd_.get(), out.data(), out.size(), MSG_NOSIGNAL);
            if (n <= 0) break;
            if (codec) {
                conn_.consumed(static_cast<std::size_t>(n));
            } else {
                raw_sent_ += static_cast<std::size_t>(n);
            }
        }
        for (;;) {
            const auto span = conn_.read_buffer();
            if (span.size == 0) break;
            const ssize_t n = ::recv(fd_.get(), span.data, span.size, 0);
            if (n == 0 || (n < 0 && errno == ECONNRESET)) eof_ = true;
            if (n <= 0 || !conn_.commit(static_cast<std::size_t>(n))) break;
        }
        return conn_.output().empty() && raw_sent_ == raw_.size();
    }

  private:
    UniqueFd fd_;
    zmtp::Connection conn_;
    std::string raw_;
    std::size_t raw_sent_ = 0;
    bool eof_ = false;
};

// A client that reconnects with its identity displaces the connection it
// had; the displaced one must not stay held with what it was receiving (a
// partial frame, here). Otherwise a process that connects again and again
// under one identity makes the server hold more and more, whatever caps
// the listener puts on its live connections.
TEST_P(ClientRouterZmtp, DisplacedConnectionsAreNotHeldOnto) {
    Listener& router = bind(false);
    constexpr std::size_t kFrame = 4 << 20, kSent = 3 << 20;
    // A frame header (long, no MORE) announcing kFrame bytes, then kSent of them.
    std::string partial(1, '\x02');
    for (int shift = 56; shift >= 0; shift -= 8) {
        partial += static_cast<char>((kFrame >> shift) & 0xff);
    }
    partial += std::string(kSent, 'z');

    constexpr int kRounds = 30;
    std::unique_ptr<RawDealer> previous;
    std::size_t baseline = 0;
    for (int round = 0; round < kRounds; ++round) {
        auto dealer = std::make_unique<RawDealer>(router, GetParam().ipc, "mallory");
        ASSERT_TRUE(dealer->connected()) << std::strerror(errno);
        ASSERT_TRUE(drive([&] {
            dealer->pump();
            return dealer->ready();
        })) << "round "
            << round << ": no handshake";
        if (previous) {
            // Displaced: the server closes the old connection.
            ASSERT_TRUE(drive([&] {
                previous->pump();
                return previous->eof();
            })) << "round "
                << round << ": the displaced connection stayed open";
        }
        // Most of a big frame, written while the loop reads it.
        dealer->queue_raw(partial);
        ASSERT_TRUE(drive([&] { return dealer->pump(); }))
            << "round " << round << ": the partial frame was not read";
        settle(std::chrono::milliseconds(5), [&] { dealer->pump(); });
        previous = std::move(dealer);
        if (round == 0) baseline = live_heap_bytes();
    }
    previous.reset();
    settle(std::chrono::milliseconds(20));
    const std::size_t now = live_heap_bytes();
    const std::size_t grown = now > baseline ? now - baseline : 0;
    EXPECT_TRUE(router.received.empty());
    // What destroying the listener gives back: what it held.
    router.bound.socket.reset();
    const std::size_t after = live_heap_bytes();
    const std::size_t held = now > after ? now - after : 0;
    // One connection's partial frame is up to kFrame; 29 displaced ones held
    // would be about 29 * kFrame (116 MiB).
    EXPECT_LT(grown, 6 * kFrame) << "the heap grew by " << (grown >> 20) << " MiB over "
                                 << kRounds - 1 << " handovers of a connection holding "
                                 << (kSent >> 20) << " MiB of a partial frame; destroying the "
                                 << "listener freed " << (held >> 20) << " MiB";
}

INSTANTIATE_TEST_SUITE_P(Transports, ClientRouterZmtp, ::testing::ValuesIn(kZmtp), config_name);

// ---------------------------------------------------------------------------
// PUB

// Publishes `topic` each turn until every SUB in `subs` has received one
// (subscriptions reach the PUB asynchronously); the warm-up messages are
// consumed.
void warm_up(ClientSocket& t, Listener& pub, const std::vector<zmq::socket_t*>& subs,
             const std::string& topic, bool& ok) {
    std::vector<bool> got(subs.size(), false);
    ok = false;
    const auto until = Clock::now() + kDeadline;
    while (Clock::now() < until) {
        pub.send({topic, "warm"});
        t.loop.run_once(std::chrono::milliseconds(5));
        bool all = true;
        for (std::size_t i = 0; i < subs.size(); ++i) {
            while (auto m = try_recv(*subs[i])) {
                if (!m->empty() && (*m)[0] == topic) got[i] = true;
            }
            all = all && got[i];
        }
        if (all) {
            ok = true;
            return;
        }
    }
}

// Receives on `sub` until a message with first frame `last`, skipping the
// warm-up topic; the messages' first frames, `last` included.
std::vector<std::string> collect(ClientSocket& t, zmq::socket_t& sub, const std::string& last,
                                 const std::string& skip, std::vector<Frames>* whole = nullptr) {
    std::vector<std::string> topics;
    const auto until = Clock::now() + kDeadline;
    while (Clock::now() < until) {
        while (auto m = try_recv(sub)) {
            if (m->empty() || (*m)[0] == skip) continue;
            topics.push_back((*m)[0]);
            if (whole) whole->push_back(*m);
            if ((*m)[0] == last) return topics;
        }
        t.loop.run_once(std::chrono::milliseconds(5));
    }
    topics.push_back("<deadline: " + last + " never arrived>");
    return topics;
}

TEST_P(ClientPub, SubscriptionsFilterByPrefixOfTheFirstFrameAndUnsubscribeStops) {
    Listener& pub = bind(true);
    auto kernel_sub = client(zmq::socket_type::sub, pub.endpoint);
    kernel_sub.set(zmq::sockopt::subscribe, "kernel.");
    auto all_sub = client(zmq::socket_type::sub, pub.endpoint);
    all_sub.set(zmq::sockopt::subscribe, "");
    bool ok = false;
    warm_up(*this, pub, {&kernel_sub, &all_sub}, "kernel.warm", ok);
    ASSERT_TRUE(ok) << "no publication reached both subscribers";

    const std::vector<Frames> sequence = {
        {"other.x", "body"},
        {"kernel.a", "1", "2"},
        {"kern", "short"},
        {"xkernel.b"},
        {"Kernel.c"},
        {"kernel.", "exact"},
        {""},
        {"kernel.end"},
    };
    for (const auto& m : sequence) ASSERT_TRUE(pub.send(m));
    std::vector<Frames> kernel_whole;
    EXPECT_EQ(collect(*this, kernel_sub, "kernel.end", "kernel.warm", &kernel_whole),
              (std::vector<std::string>{"kernel.a", "kernel.", "kernel.end"}));
    ASSERT_GE(kernel_whole.size(), 1u);
    EXPECT_EQ(kernel_whole[0], (Frames{"kernel.a", "1", "2"})) << "the frames after the topic";
    EXPECT_EQ(collect(*this, all_sub, "kernel.end", "kernel.warm"),
              (std::vector<std::string>{"other.x", "kernel.a", "kern", "xkernel.b", "Kernel.c",
                                        "kernel.", "", "kernel.end"}));

    // Unsubscribe, then subscribe to "probe.": once a probe arrives, the
    // cancel (sent before it on the same connection) has been applied.
    kernel_sub.set(zmq::sockopt::unsubscribe, "kernel.");
    kernel_sub.set(zmq::sockopt::subscribe, "probe.");
    warm_up(*this, pub, {&kernel_sub}, "probe.warm", ok);
    ASSERT_TRUE(ok) << "the new subscription never took effect";
    ASSERT_TRUE(pub.send({"kernel.after"}));
    ASSERT_TRUE(pub.send({"probe.end"}));
    EXPECT_EQ(collect(*this, kernel_sub, "probe.end", "probe.warm"),
              (std::vector<std::string>{"probe.end"}))
        << "messages kept coming after unsubscribe";
    EXPECT_EQ(collect(*this, all_sub, "probe.end", "probe.warm"),
              (std::vector<std::string>{"kernel.after", "probe.end"}));
}

TEST_P(ClientPub, TwoSubscribersEachGetEveryMessageInOrder) {
    Listener& pub = bind(true);
    auto one = client(zmq::socket_type::sub, pub.endpoint);
    one.set(zmq::sockopt::subscribe, "");
    auto two = client(zmq::socket_type::sub, pub.endpoint);
    two.set(zmq::sockopt::subscribe, "");
    bool ok = false;
    warm_up(*this, pub, {&one, &two}, "warm", ok);
    ASSERT_TRUE(ok) << "no publication reached both subscribers";
    constexpr int kCount = 200;
    std::vector<std::string> expected;
    for (int i = 0; i < kCount; ++i) {
        const std::string topic = "t" + std::to_string(i);
        ASSERT_TRUE(pub.send({topic, std::string(static_cast<std::size_t>(i) * 37, 'p')}));
        expected.push_back(topic);
        if (i % 50 == 0) loop.run_once(std::chrono::milliseconds(0));
    }
    ASSERT_TRUE(pub.send({"end"}));
    expected.push_back("end");
    std::vector<Frames> whole_one, whole_two;
    EXPECT_EQ(collect(*this, one, "end", "warm", &whole_one), expected);
    EXPECT_EQ(collect(*this, two, "end", "warm", &whole_two), expected);
    for (std::size_t i = 0; i + 1 < whole_one.size() && i + 1 < whole_two.size(); ++i) {
        ASSERT_EQ(whole_one[i].size(), 2u);
        EXPECT_EQ(whole_one[i][1].size(), i * 37);
        EXPECT_EQ(whole_one[i], whole_two[i]);
    }
}

// A subscriber that does not read costs the others nothing: they get every
// message; it gets, once it reads again, an in-order subset and then what is
// published after.
TEST_P(ClientPub, ASubscriberThatDoesNotReadDoesNotHoldUpTheOthers) {
    Listener& pub = bind(true);
    auto stalled = client(zmq::socket_type::sub, pub.endpoint);
    stalled.set(zmq::sockopt::rcvhwm, 1);
    stalled.set(zmq::sockopt::subscribe, "");
    auto reader = client(zmq::socket_type::sub, pub.endpoint);
    reader.set(zmq::sockopt::subscribe, "");
    bool ok = false;
    warm_up(*this, pub, {&stalled, &reader}, "warm", ok);
    ASSERT_TRUE(ok);
    while (try_recv(stalled)) {
    }

    const std::string mib = pattern(1 << 20, 9);
    constexpr int kCount = 120;  // MiB: past the per-client backlog cap
    int next = 0;
    for (int burst = 0; burst < kCount / 10; ++burst) {
        for (int i = 0; i < 10; ++i) {
            ASSERT_TRUE(pub.send({"n", std::to_string(burst * 10 + i), mib}));
        }
        ASSERT_TRUE(drive([&] {
            while (auto m = try_recv(reader)) {
                if ((*m)[0] == "warm") continue;
                EXPECT_EQ(m->size(), 3u);
                EXPECT_EQ((*m)[1], std::to_string(next)) << "the reader lost or reordered one";
                EXPECT_TRUE(m->size() == 3 && (*m)[2] == mib);
                ++next;
            }
            return next == (burst + 1) * 10;
        })) << "the reader got "
            << next << " of " << (burst + 1) * 10;
    }
    EXPECT_EQ(next, kCount);

    // The stalled one reads now: what it gets is in order.
    int last = -1, got = 0;
    settle(std::chrono::milliseconds(300), [&] {
        while (auto m = try_recv(stalled)) {
            if ((*m)[0] != "n") continue;
            const int n = std::stoi((*m)[1]);
            EXPECT_GT(n, last);
            last = n;
            ++got;
        }
    });
    EXPECT_GT(got, 0);
    // And what is published after reaches it again, once the backlog queued
    // for it before it stalled has gone out (under ASan on a busy host that
    // took longer than kDeadline: a bound on a hang, not a speed).
    bool after = false;
    EXPECT_TRUE(drive(
        [&] {
            pub.send({"after"});
            while (auto m = try_recv(stalled)) after = after || (*m)[0] == "after";
            while (try_recv(reader)) {
            }
            return after;
        },
        std::chrono::seconds(60)))
        << "the stalled subscriber, reading again, never got a new message";
}

// A PUB has nothing to receive; its handler is never called for it.
TEST_P(ClientPub, ReceivesNothingAndClosesCleanly) {
    Listener& pub = bind(true);
    auto sub = client(zmq::socket_type::sub, pub.endpoint);
    sub.set(zmq::sockopt::subscribe, "");
    bool ok = false;
    warm_up(*this, pub, {&sub}, "warm", ok);
    ASSERT_TRUE(ok);
    if (zmtp()) {  // libzmq's PUB throws ENOTSUP: nobody receives on a PUB
        Multipart m;
        EXPECT_FALSE(pub.socket().receive(m, 64));
    }
    EXPECT_EQ(pub.handler_calls, 0);
    pub.socket().close();
    EXPECT_FALSE(pub.socket().is_open());
    EXPECT_FALSE(pub.send({"after"}));
    settle(std::chrono::milliseconds(50));
    if (GetParam().ipc && zmtp()) {
        EXPECT_FALSE(std::filesystem::exists(pub.ipc_path));
    }
}

INSTANTIATE_TEST_SUITE_P(Transports, ClientPub, ::testing::ValuesIn(kAll), config_name);

// An adopted session's iopub (docs/restarts.md): what is published before
// any client subscribed is kept, in order, for the first subscriber, and
// only what its subscription matches reaches it; what comes after goes to
// subscribers as before.
TEST_P(ClientPubZmtp, WhatIsPublishedBeforeTheFirstSubscriptionReachesIt) {
    Listener& pub = bind(true);
    pub.socket().hold_until_subscribed(std::chrono::seconds(30));
    const std::vector<Frames> before = {
        {"kernel.status", "busy"}, {"kernel.stream", "42\n"}, {"other.x"}, {"kernel.idle", "idle"}};
    for (const auto& m : before) ASSERT_TRUE(pub.send(m));
    settle(std::chrono::milliseconds(50));
    auto sub = client(zmq::socket_type::sub, pub.endpoint);
    sub.set(zmq::sockopt::subscribe, "kernel.");
    std::vector<Frames> got;
    ASSERT_TRUE(drive([&] {
        while (auto m = try_recv(sub)) got.push_back(*m);
        return got.size() >= 3;
    })) << got.size()
        << " of the 3 kept messages arrived";
    EXPECT_EQ(got, (std::vector<Frames>{before[0], before[1], before[3]}));
    // After the first subscription: published as usual, not kept again.
    ASSERT_TRUE(pub.send({"kernel.after"}));
    std::vector<std::string> after;
    ASSERT_TRUE(drive([&] {
        while (auto m = try_recv(sub)) after.push_back((*m)[0]);
        return !after.empty();
    }));
    EXPECT_EQ(after, (std::vector<std::string>{"kernel.after"}));
    auto late = client(zmq::socket_type::sub, pub.endpoint);
    late.set(zmq::sockopt::subscribe, "");
    bool ok = false;
    warm_up(*this, pub, {&late}, "warm", ok);
    ASSERT_TRUE(ok);
    settle(std::chrono::milliseconds(50), [&] {
        while (auto m = try_recv(late)) EXPECT_EQ((*m)[0], "warm") << "kept for the first only";
    });
}

// Kept no longer than asked: a subscriber that comes after gets only what
// is published after it.
TEST_P(ClientPubZmtp, WhatWasKeptPastItsTimeIsDropped) {
    Listener& pub = bind(true);
    pub.socket().hold_until_subscribed(std::chrono::milliseconds(1));
    ASSERT_TRUE(pub.send({"early"}));
    settle(std::chrono::milliseconds(20));
    auto sub = client(zmq::socket_type::sub, pub.endpoint);
    sub.set(zmq::sockopt::subscribe, "");
    bool ok = false;
    warm_up(*this, pub, {&sub}, "warm", ok);
    ASSERT_TRUE(ok);
    ASSERT_TRUE(pub.send({"end"}));
    EXPECT_EQ(collect(*this, sub, "end", "warm"), (std::vector<std::string>{"end"}));
}

INSTANTIATE_TEST_SUITE_P(Transports, ClientPubZmtp, ::testing::ValuesIn(kZmtp), config_name);

}  // namespace
}  // namespace cellblock
