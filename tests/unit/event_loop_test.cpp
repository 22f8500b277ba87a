#include "event_loop.hpp"

#include <unistd.h>

#include <gtest/gtest.h>

#include "cellblock/unique_fd.hpp"

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

}  // namespace
}  // namespace cellblock
