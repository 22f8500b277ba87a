#include "event_loop.hpp"

#include <unistd.h>

#include <gtest/gtest.h>

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
    std::vector<zmq::message_t> hello;
    hello.push_back(to_frame("hello"));
    ASSERT_TRUE(send_multipart(dealer, hello));
    Multipart at_router;
    for (int i = 0; i < 100 && !recv_multipart(router, at_router, 8); ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    ASSERT_EQ(at_router.frames.size(), 2u);
    std::vector<zmq::message_t> reply;
    reply.push_back(to_frame("d"));
    reply.push_back(to_frame("answer"));
    ASSERT_TRUE(send_multipart(router, reply));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    // Reading the dealer's events consumes its signal, as a send on it can.
    (void)dealer.get(zmq::sockopt::events);
    std::vector<zmq::message_t> more;
    more.push_back(to_frame("more"));
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

}  // namespace
}  // namespace cellblock
