// BackgroundWork (server/background_work.hpp): work on a thread of its own,
// what follows it back on the loop's thread, with a real EventLoop.
#include "background_work.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>

namespace cellblock {
namespace {

using namespace std::chrono_literals;

// Turns the loop until `done` or 10 s (a bound, not a measure).
template <typename Done>
void turn_until(EventLoop& loop, Done done) {
    const auto give_up = std::chrono::steady_clock::now() + 10s;
    while (!done() && std::chrono::steady_clock::now() < give_up) loop.run_once(100ms);
}

TEST(BackgroundWork, WorkRunsOffTheLoopsThreadAndWhatFollowsOnIt) {
    EventLoop loop;
    BackgroundWork work(loop);
    const auto loop_thread = std::this_thread::get_id();
    std::thread::id worked_on, followed_on;
    std::string error = "not called";
    work.run([&] { worked_on = std::this_thread::get_id(); },
             [&](const std::string& e) {
                 followed_on = std::this_thread::get_id();
                 error = e;
             });
    EXPECT_EQ(work.running(), 1u);
    turn_until(loop, [&] { return work.running() == 0; });
    EXPECT_NE(worked_on, loop_thread);
    EXPECT_EQ(followed_on, loop_thread);
    EXPECT_EQ(error, "");
}

TEST(BackgroundWork, WhatTheWorkThrowsIsWhatFollowsItsArgument) {
    EventLoop loop;
    BackgroundWork work(loop);
    std::string error;
    work.run([] { throw std::runtime_error("disk full"); },
             [&](const std::string& e) { error = e; });
    turn_until(loop, [&] { return work.running() == 0; });
    EXPECT_EQ(error, "disk full");
}

TEST(BackgroundWork, TheLoopServesOthersWhileTheWorkRuns) {
    EventLoop loop;
    BackgroundWork work(loop);
    std::atomic<bool> release{false};
    bool followed = false;
    work.run(
        [&] {
            while (!release) std::this_thread::sleep_for(1ms);
        },
        [&](const std::string&) { followed = true; });
    // A deadline of the loop's comes due and runs while the work holds on.
    bool deadline_ran = false;
    const auto due = std::chrono::steady_clock::now();
    const auto id = loop.add_deadline(
        [&]() -> std::optional<EventLoop::Clock::time_point> {
            if (deadline_ran) return std::nullopt;
            return due;
        },
        [&](EventLoop::Clock::time_point) { deadline_ran = true; });
    turn_until(loop, [&] { return deadline_ran; });
    EXPECT_TRUE(deadline_ran);
    EXPECT_FALSE(followed);
    release = true;
    turn_until(loop, [&] { return followed; });
    EXPECT_TRUE(followed);
    loop.remove_deadline(id);
}

TEST(BackgroundWork, EndingWaitsForTheWorkAndDoesNotFollowIt) {
    EventLoop loop;
    std::atomic<bool> finished{false};
    bool followed = false;
    {
        BackgroundWork work(loop);
        work.run(
            [&] {
                std::this_thread::sleep_for(50ms);
                finished = true;
            },
            [&](const std::string&) { followed = true; });
    }
    EXPECT_TRUE(finished);
    EXPECT_FALSE(followed);
}

}  // namespace
}  // namespace cellblock
