// An image build's child process stopped by a signal (sessions/build_process.cpp):
// told with SIGTERM, and killed with its whole process group when it still
// runs kStopGrace later (mmdebstrap finishes the step it is in first, which
// took minutes on a loaded host).
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <thread>

#include "../../sessions/image_builder_internal.hpp"

namespace {

using namespace cellblock::image_detail;

// The signal a user's Ctrl-C or a supervisor's stop would send, a little
// after the child started.
std::jthread stop_in(std::chrono::milliseconds after) {
    return std::jthread([after] {
        std::this_thread::sleep_for(after);
        ::kill(::getpid(), SIGTERM);
    });
}

// True once `pid` is gone or a zombie (its parent died: init reaps it).
bool ended(pid_t pid) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    if (!std::getline(stat, line)) return true;
    const auto close = line.rfind(')');
    return close != std::string::npos && close + 2 < line.size() && line[close + 2] == 'Z';
}

bool ends_within(pid_t pid, std::chrono::seconds limit) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (!ended(pid)) {
        if (std::chrono::steady_clock::now() > deadline) return false;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return true;
}

TEST(BuildProcess, AChildThatIgnoresTheStopIsKilledWithItsGroupAfterTheGrace) {
    StopSignals signals;
    // The shell and what it started ignore SIGTERM (as mmdebstrap's dpkg
    // does not stop mid-step); the shell says its child's pid first.
    const auto stop = stop_in(std::chrono::milliseconds(300));
    const Finished run =
        run_child({"/bin/sh", "-c", "trap '' TERM; sleep 600 & echo $!; sleep 600; wait"}, nullptr,
                  tool_env());
    EXPECT_EQ(run.exit_code, 128 + SIGKILL) << run.output;
    EXPECT_NE(g_stop_signal.load(), 0);
    std::istringstream out(run.output);
    pid_t grandchild = 0;
    ASSERT_TRUE(out >> grandchild) << run.output;
    ASSERT_GT(grandchild, 0);
    // Killed with the group, not left to run in a root about to be removed.
    EXPECT_TRUE(ends_within(grandchild, std::chrono::seconds(10))) << grandchild;
}

TEST(BuildProcess, AChildThatStopsWhenToldIsNotKilled) {
    StopSignals signals;
    const auto stop = stop_in(std::chrono::milliseconds(300));
    const Finished run = run_child(
        {"/bin/sh", "-c", "trap 'exit 3' TERM; while :; do sleep 0.1; done"}, nullptr, tool_env());
    // Its own exit: told with SIGTERM, which it answered, not SIGKILL.
    EXPECT_EQ(run.exit_code, 3) << run.output;
}

TEST(BuildProcess, WithoutAStopTheChildRunsToItsEnd) {
    StopSignals signals;
    const Finished run = run_child({"/bin/sh", "-c", "echo done; exit 4"}, nullptr, tool_env());
    EXPECT_EQ(run.exit_code, 4);
    EXPECT_EQ(run.output, "done\n");
    EXPECT_EQ(g_stop_signal.load(), 0);
}

}  // namespace
