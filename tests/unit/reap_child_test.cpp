// reap_child: a killed sandbox init that takes longer than its wait to die is
// still reaped once it does, instead of staying a zombie that runs as the
// sandbox's host ids for the server's whole life.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <thread>

#include <gtest/gtest.h>

#include "../../sessions/sandbox_internal.hpp"
#include "held_child.hpp"

namespace cellblock::sandbox_detail {
namespace {

// Whether `pid` is still a child of this process (alive or a zombie), probed
// without reaping it.
bool still_our_child(pid_t pid) {
    siginfo_t info{};
    return ::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0;
}

TEST(ReapChild, AChildThatOutlivesTheWaitIsReapedWhenItEnds) {
    auto [pid, hold] = testing::fork_held_child();
    reap_child(pid);  // gives up after its wait: the child still runs
    ASSERT_TRUE(still_our_child(pid));
    hold.reset();  // now it ends
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (still_our_child(pid) && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_FALSE(still_our_child(pid)) << "the ended child was left a zombie";
    errno = 0;
    EXPECT_EQ(::waitpid(pid, nullptr, WNOHANG), -1);
    EXPECT_EQ(errno, ECHILD) << "someone else must have reaped it: reap_child's waiter";
}

TEST(ReapChild, AKilledChildIsReapedAtOnce) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
        ::pause();
        ::_exit(0);
    }
    ASSERT_EQ(::kill(pid, SIGKILL), 0);
    reap_child(pid);
    // Reaped by reap_child itself, or (on a machine slow enough that SIGKILL
    // took longer than its wait) by its waiter thread.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (still_our_child(pid) && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_FALSE(still_our_child(pid));
}

}  // namespace
}  // namespace cellblock::sandbox_detail
