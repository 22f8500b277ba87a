#include "event_loop.hpp"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cerrno>
#include <string>
#include <thread>

#include "cellblock/unique_fd.hpp"
#include "multipart.hpp"

namespace cellblock {
namespace {

struct Pair {
    zmq::socket_t a, b;
    Pair(zmq::context_t& ctx, const std::string& name)
        : a(ctx, zmq::socket_type::pair), b(ctx, zmq::socket_type::pair) {
        a.bind("inproc://" + name);
        b.connect("inproc://" + name);
    }
};

TEST(EventLoop, CallsTheHandlerOfTheReadySocketOnly) {
    zmq::context_t ctx;
    Pair one(ctx, "one"), two(ctx, "two");
    EventLoop loop;
    int calls_one = 0, calls_two = 0;
    loop.watch(one.b, [&] {
        zmq::message_t m;
        ASSERT_TRUE(one.b.recv(m, zmq::recv_flags::dontwait));
        ++calls_one;
    });
    loop.watch(two.b, [&] { ++calls_two; });
    one.a.send(zmq::str_buffer("x"), zmq::send_flags::none);
    loop.run_once(std::chrono::milliseconds(1000));
    EXPECT_EQ(calls_one, 1);
    EXPECT_EQ(calls_two, 0);
}

TEST(EventLoop, AWatchRemovedDuringATurnIsNotCalledLaterInIt) {
    zmq::context_t ctx;
    Pair first(ctx, "first"), second(ctx, "second");
    EventLoop loop;
    EventLoop::WatchId second_id = 0;
    bool second_called = false;
    loop.watch(first.b, [&] {
        zmq::message_t m;
        (void)first.b.recv(m, zmq::recv_flags::dontwait);
        loop.unwatch(second_id);
        second.b.close();  // what a closing session does to its sockets
    });
    second_id = loop.watch(second.b, [&] { second_called = true; });
    first.a.send(zmq::str_buffer("x"), zmq::send_flags::none);
    second.a.send(zmq::str_buffer("y"), zmq::send_flags::none);
    loop.run_once(std::chrono::milliseconds(1000));
    EXPECT_FALSE(second_called);
    EXPECT_EQ(loop.watched(), 1u);
}

TEST(EventLoop, WatchesAFileDescriptor) {
    int fds[2];
    ASSERT_EQ(::pipe(fds), 0);
    UniqueFd read_end(fds[0]), write_end(fds[1]);
    EventLoop loop;
    int calls = 0;
    loop.watch_fd(read_end.get(), [&] {
        char c;
        ASSERT_EQ(::read(read_end.get(), &c, 1), 1);
        ++calls;
    });
    loop.run_once(std::chrono::milliseconds(0));
    EXPECT_EQ(calls, 0);
    ASSERT_EQ(::write(write_end.get(), "x", 1), 1);
    loop.run_once(std::chrono::milliseconds(1000));
    EXPECT_EQ(calls, 1);
}

TEST(EventLoop, RunsADeadlineOnceItsTimeHasCome) {
    EventLoop loop;
    const auto due = EventLoop::Clock::now() + std::chrono::milliseconds(20);
    std::optional<EventLoop::Clock::time_point> fired;
    loop.add_deadline(
        [&]() -> std::optional<EventLoop::Clock::time_point> {
            if (fired) return std::nullopt;
            return due;
        },
        [&](EventLoop::Clock::time_point now) {
            fired = now;
            loop.stop();
        });
    loop.run();  // returns only through the deadline's stop()
    ASSERT_TRUE(fired);
    EXPECT_GE(*fired, due);
}

TEST(EventLoop, ANotYetDueDeadlineDoesNotRun) {
    EventLoop loop;
    bool ran = false;
    loop.add_deadline([] { return std::optional(EventLoop::Clock::now() + std::chrono::hours(1)); },
                      [&](EventLoop::Clock::time_point) { ran = true; });
    loop.run_once(std::chrono::milliseconds(0));
    EXPECT_FALSE(ran);
}

// A send processes the socket's pending commands and can consume the ZMQ_FD
// signal of a message that arrived meanwhile; the loop must still see it.
TEST(EventLoop, AMessageWhoseSignalASendConsumedIsStillHandled) {
    zmq::context_t ctx;
    zmq::socket_t router(ctx, zmq::socket_type::router), dealer(ctx, zmq::socket_type::dealer);
    router.bind("inproc://touched");
    dealer.set(zmq::sockopt::routing_id, "d");
    dealer.connect("inproc://touched");
    EventLoop loop;
    int received = 0;
    loop.watch(dealer, [&] {
        Multipart in;
        if (recv_multipart(dealer, in, 8)) ++received;
    });
    loop.run_once(std::chrono::milliseconds(0));  // the watch's first look
    // The dealer says hello so the router knows its identity.
    std::vector<Frame> hello;
    hello.push_back(Frame::copy_of("hello"));
    ASSERT_TRUE(send_multipart(dealer, hello));
    Multipart at_router;
    for (int i = 0; i < 100 && !recv_multipart(router, at_router, 8); ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    ASSERT_EQ(at_router.frames.size(), 2u);
    std::vector<Frame> reply;
    reply.push_back(Frame::copy_of("d"));
    reply.push_back(Frame::copy_of("answer"));
    ASSERT_TRUE(send_multipart(router, reply));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    // Reading the dealer's events consumes its signal, as a send on it can.
    (void)dealer.get(zmq::sockopt::events);
    std::vector<Frame> more;
    more.push_back(Frame::copy_of("more"));
    ASSERT_TRUE(send_multipart(dealer, more));
    loop.run_once(std::chrono::milliseconds(200));
    EXPECT_EQ(received, 1);
}

TEST(EventLoop, ASocketWithSeveralMessagesIsHandledUntilDrained) {
    zmq::context_t ctx;
    Pair pair(ctx, "drain");
    EventLoop loop;
    int received = 0;
    loop.watch(pair.b, [&] {
        zmq::message_t m;
        if (pair.b.recv(m, zmq::recv_flags::dontwait)) ++received;  // one per call
    });
    for (int i = 0; i < 5; ++i) pair.a.send(zmq::str_buffer("x"), zmq::send_flags::none);
    for (int turn = 0; turn < 20 && received < 5; ++turn)
        loop.run_once(std::chrono::milliseconds(100));
    EXPECT_EQ(received, 5);
}

// A source that answers with its own reading of the clock ("due now") is due.
TEST(EventLoop, ADeadlineThatSaysNowFromItsOwnClockRuns) {
    EventLoop loop;
    bool ran = false;
    loop.add_deadline([] { return std::optional(EventLoop::Clock::now()); },
                      [&](EventLoop::Clock::time_point) { ran = true; });
    loop.run_once(std::chrono::milliseconds(0));
    EXPECT_TRUE(ran);
}

// A source that buffers in user space (a ZMTP connection holding decoded
// messages) is handled again on the following turns while pending() says
// so, though its fd has nothing more to read, and without waiting.
TEST(EventLoop, AWatchedFdIsHandledAgainWhilePendingSaysSo) {
    int fds[2];
    ASSERT_EQ(::pipe2(fds, O_NONBLOCK), 0);
    UniqueFd read_end(fds[0]), write_end(fds[1]);
    EventLoop loop;
    int calls = 0, left = 0, bytes_read = 0;
    loop.watch_fd(
        read_end.get(),
        [&] {
            char c;
            while (::read(read_end.get(), &c, 1) == 1) ++bytes_read;
            ++calls;
            if (left > 0) --left;
        },
        [&] { return left > 0; });
    loop.run_once(std::chrono::milliseconds(0));
    EXPECT_EQ(calls, 0) << "neither readable nor pending";

    left = 3;  // three "messages" buffered once the byte is read
    ASSERT_EQ(::write(write_end.get(), "x", 1), 1);
    const auto start = EventLoop::Clock::now();
    loop.run_once(std::chrono::milliseconds(1000));
    EXPECT_EQ(calls, 1) << "once per turn";
    EXPECT_EQ(bytes_read, 1);
    // The fd is no longer readable: only pending() brings the handler back,
    // and a turn with a pending handler does not wait.
    loop.run_once(std::chrono::milliseconds(1000));
    EXPECT_EQ(calls, 2);
    loop.run_once(std::chrono::milliseconds(1000));
    EXPECT_EQ(calls, 3);
    EXPECT_LT(EventLoop::Clock::now() - start, std::chrono::milliseconds(900))
        << "a turn waited although the handler was pending";
    ASSERT_EQ(left, 0);
    // pending() now says false: no more calls.
    loop.run_once(std::chrono::milliseconds(20));
    loop.run_once(std::chrono::milliseconds(0));
    EXPECT_EQ(calls, 3);
    EXPECT_EQ(bytes_read, 1);
    // Readability still calls it.
    ASSERT_EQ(::write(write_end.get(), "y", 1), 1);
    loop.run_once(std::chrono::milliseconds(1000));
    EXPECT_EQ(calls, 4);
    EXPECT_EQ(bytes_read, 2);
}

// A watch whose source has messages buffered already when it is registered
// (a probe's connection, handed over) is handled on the first turn.
TEST(EventLoop, PendingAtRegistrationIsHandledOnTheFirstTurn) {
    int fds[2];
    ASSERT_EQ(::pipe2(fds, O_NONBLOCK), 0);
    UniqueFd read_end(fds[0]), write_end(fds[1]);
    EventLoop loop;
    int calls = 0;
    bool pending = true;
    loop.watch_fd(
        read_end.get(),
        [&] {
            ++calls;
            pending = false;
        },
        [&] { return pending; });
    loop.run_once(std::chrono::milliseconds(0));
    EXPECT_EQ(calls, 1);
    loop.run_once(std::chrono::milliseconds(0));
    EXPECT_EQ(calls, 1);
}

TEST(EventLoop, PendingFalseAtRegistrationDoesNotCallTheHandler) {
    int fds[2];
    ASSERT_EQ(::pipe2(fds, O_NONBLOCK), 0);
    UniqueFd read_end(fds[0]), write_end(fds[1]);
    EventLoop loop;
    int calls = 0;
    loop.watch_fd(
        read_end.get(), [&] { ++calls; }, [] { return false; });
    loop.run_once(std::chrono::milliseconds(0));
    EXPECT_EQ(calls, 0);
}

// want_writable: the handler also runs while the fd is writable (a
// transport with bytes left to write), and no longer once asked not to;
// readability keeps calling it either way.
TEST(EventLoop, WantWritableCallsTheHandlerWhileTheFdIsWritable) {
    int sv[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, sv), 0);
    UniqueFd ours(sv[0]), theirs(sv[1]);
    EventLoop loop;
    int calls = 0;
    const auto id = loop.watch_fd(ours.get(), [&] {
        char buf[16];
        while (::read(ours.get(), buf, sizeof buf) > 0) {
        }
        ++calls;
    });
    loop.run_once(std::chrono::milliseconds(0));
    EXPECT_EQ(calls, 0) << "writable, but nobody asked for writability";

    loop.want_writable(id, true);
    loop.run_once(std::chrono::milliseconds(1000));
    EXPECT_EQ(calls, 1);
    loop.run_once(std::chrono::milliseconds(1000));
    EXPECT_EQ(calls, 2) << "still writable: called again";

    loop.want_writable(id, false);
    loop.run_once(std::chrono::milliseconds(20));
    loop.run_once(std::chrono::milliseconds(0));
    EXPECT_EQ(calls, 2);

    // Readability is still watched after want_writable(false).
    ASSERT_EQ(::write(theirs.get(), "x", 1), 1);
    loop.run_once(std::chrono::milliseconds(1000));
    EXPECT_EQ(calls, 3);
    loop.run_once(std::chrono::milliseconds(0));
    EXPECT_EQ(calls, 3);

    // And asking twice is harmless; an unknown id is ignored.
    loop.want_writable(id, true);
    loop.want_writable(id, true);
    loop.run_once(std::chrono::milliseconds(1000));
    EXPECT_EQ(calls, 4);
    loop.want_writable(id, false);
    loop.want_writable(id + 1000, true);
    loop.run_once(std::chrono::milliseconds(0));
    EXPECT_EQ(calls, 4);
}

// A full socket is not writable: asking for writability does not call the
// handler until the peer reads.
TEST(EventLoop, WantWritableWaitsForRoomInAFullSocket) {
    int sv[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, sv), 0);
    UniqueFd ours(sv[0]), theirs(sv[1]);
    std::string chunk(65536, 'z');
    while (::write(ours.get(), chunk.data(), chunk.size()) > 0) {
    }
    ASSERT_TRUE(errno == EAGAIN || errno == EWOULDBLOCK);
    EventLoop loop;
    int calls = 0;
    const auto id = loop.watch_fd(ours.get(), [&] { ++calls; });
    loop.want_writable(id, true);
    loop.run_once(std::chrono::milliseconds(20));
    EXPECT_EQ(calls, 0) << "the socket is full";
    // Drain the other end: room again.
    std::string sink(1 << 20, '\0');
    while (::read(theirs.get(), sink.data(), sink.size()) > 0) {
    }
    loop.run_once(std::chrono::milliseconds(1000));
    EXPECT_EQ(calls, 1);
}

}  // namespace
}  // namespace cellblock
