// Whether the hogging sessions weigh a process each against the host: only
// while the host's own processes contend for the CPU (host_contention.hpp).
#include "cellblock/host_contention.hpp"

#include <gtest/gtest.h>

namespace cellblock {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr std::uint64_t kCore = 1'000'000'000;  // ns of CPU per second of one core

// A host whose processes use `host` cores and whose sandboxes use
// `sandboxes` (the servers a tenth of a core), read every 250 ms.
struct Host {
    Clock::time_point now = Clock::time_point{} + 1h;
    HostCpuReading total{now, 0, 0, 0};
    HostCpuReading step(double host, double sandboxes, double servers = 0.1) {
        now += 250ms;
        total.at = now;
        const auto add = [](double cores) { return static_cast<std::uint64_t>(cores * kCore / 4); };
        total.sandboxes_ns += add(sandboxes);
        total.servers_ns += add(servers);
        total.host_busy_ns += add(host + sandboxes + servers);
        return total;
    }
};

TEST(HostContention, AnInteractiveHostProcessBesideSpinningSessionsDoesNotContend) {
    // Bench figure 6: a client stepping a quiet session uses 0.4 of a core
    // while ten sessions spin on 1.5 cores.
    HostContention c;
    Host h;
    for (int i = 0; i < 40; ++i) EXPECT_FALSE(c.observe(h.step(0.4, 1.5), true)) << i;
    EXPECT_NE(c.why().find("do not contend"), std::string::npos) << c.why();
    EXPECT_NE(c.why().find("0.40 of a core, the sandboxes 1.50"), std::string::npos) << c.why();
}

TEST(HostContention, HostSpinnersContendAfterAWindowAtOneProcesssWeight) {
    // Figure 16: two host spinners take 1.33 cores at equal weight, the
    // sandboxes 0.67.
    HostContention c;
    Host h;
    EXPECT_FALSE(c.observe(h.step(1.33, 0.67), true));  // no window yet
    for (int i = 0; i < 3; ++i) EXPECT_FALSE(c.observe(h.step(1.33, 0.67), true)) << i;
    EXPECT_TRUE(c.observe(h.step(1.33, 0.67), true));  // a whole second seen
    EXPECT_TRUE(c.changed());
    EXPECT_NE(c.why().find("they contend"), std::string::npos) << c.why();
    // Counted, a host spinner gets what a session gets: its use no longer
    // tells, and it stays counted until the next check.
    for (int i = 0; i < 50; ++i) EXPECT_TRUE(c.observe(h.step(0.3, 1.6), true)) << i;
    EXPECT_FALSE(c.changed());
}

TEST(HostContention, OneHostSpinnerBesideManySessionsContends) {
    // At one process's weight a single host spinner takes a whole core, as
    // much as all the sandboxes together.
    HostContention c;
    Host h;
    bool counted = false;
    for (int i = 0; i < 5; ++i) counted = c.observe(h.step(1.0, 0.9), true);
    EXPECT_TRUE(counted) << c.why();
}

TEST(HostContention, ALittleHostWorkIsNotContentionEvenBesideLittleSandboxWork) {
    HostContention c;
    Host h;
    for (int i = 0; i < 20; ++i) EXPECT_FALSE(c.observe(h.step(0.2, 0.1), true)) << c.why();
}

TEST(HostContention, WhileCountedItChecksAgainAtOneProcesssWeight) {
    HostContentionPolicy p;
    p.recheck_every = 5s;
    HostContention c(p);
    Host h;
    for (int i = 0; i < 5; ++i) c.observe(h.step(1.33, 0.67), true);
    ASSERT_TRUE(c.counted());
    int steps = 0;
    while (c.observe(h.step(0.3, 1.6), true)) ++steps;
    EXPECT_EQ(steps, 19);  // 5 s at 250 ms, the 20th reading starts the check
    EXPECT_TRUE(c.changed());
    EXPECT_NE(c.why().find("checking again"), std::string::npos) << c.why();
    // The spinners are still there: at one process's weight they take their
    // 1.33 cores again, and after a window the hogs count again.
    for (int i = 0; i < 3; ++i) EXPECT_FALSE(c.observe(h.step(1.33, 0.67), true)) << i;
    EXPECT_TRUE(c.observe(h.step(1.33, 0.67), true));
    // Later the spinners are gone: the next check finds the host quiet, and
    // the hogs stay one process together.
    while (c.observe(h.step(0.3, 1.6), true)) {
    }
    for (int i = 0; i < 40; ++i) EXPECT_FALSE(c.observe(h.step(0.3, 1.6), true)) << i;
    EXPECT_NE(c.why().find("do not contend"), std::string::npos) << c.why();
}

TEST(HostContention, NoHogsNoQuestionAndJudgedAfreshWhenOneHogs) {
    HostContention c;
    Host h;
    for (int i = 0; i < 5; ++i) c.observe(h.step(1.33, 0.67), true);
    ASSERT_TRUE(c.counted());
    EXPECT_FALSE(c.observe(std::nullopt, false));
    EXPECT_TRUE(c.changed());
    // A new hog: a new window, the old readings forgotten.
    for (int i = 0; i < 4; ++i) EXPECT_FALSE(c.observe(h.step(0.3, 1.6), true)) << i;
    EXPECT_FALSE(c.observe(h.step(0.3, 1.6), true));
}

TEST(HostContention, CalmOnlyOnceAWholeWindowFoundTheHostQuiet) {
    // serve --cpu-idle makes the sandboxes' parent idle only when calm: never
    // while a window is still gathered, so that a host that does contend is
    // not given every sandbox for that second.
    HostContentionPolicy p;
    p.recheck_every = 5s;
    HostContention c(p);
    Host h;
    for (int i = 0; i < 4; ++i) {
        EXPECT_FALSE(c.observe(h.step(0.3, 1.6), true)) << i;
        EXPECT_FALSE(c.calm()) << i;  // the first window is still gathered
    }
    c.observe(h.step(0.3, 1.6), true);
    EXPECT_TRUE(c.calm()) << c.why();
    // Host spinners start: calm until a window holds enough of them.
    while (!c.observe(h.step(1.33, 0.67), true)) {
    }
    EXPECT_FALSE(c.calm()) << c.why();
    // The re-check: not calm while its window is gathered, calm once it has
    // found the spinners gone.
    int checking = 0;
    while (c.observe(h.step(0.3, 1.6), true)) {
    }
    while (!c.calm()) {
        ASSERT_LT(++checking, 10) << c.why();
        c.observe(h.step(0.3, 1.6), true);
    }
    EXPECT_EQ(checking, 4);  // the re-check's reading, then a second of them
    EXPECT_NE(c.why().find("do not contend"), std::string::npos) << c.why();
    c.observe(std::nullopt, false);
    EXPECT_FALSE(c.calm());
    EXPECT_TRUE(c.observe(std::nullopt, true));  // unreadable: counted, not calm
    EXPECT_FALSE(c.calm());
}

TEST(HostContention, AHostWhoseFiguresCannotBeReadCountsTheHogs) {
    // As before the judgement existed: a session's share against the host
    // is what cannot be lost.
    HostContention c;
    EXPECT_TRUE(c.observe(std::nullopt, true));
    EXPECT_NE(c.why().find("could not be read"), std::string::npos);
}

TEST(HostContention, ReadsThisHost) {
    // Real /proc/stat; the sandboxes' parent may not exist on a host that
    // never ran a local sandbox, and then there is no reading.
    const auto r = read_host_cpu();
    if (!r) GTEST_SKIP() << "no sandboxes' parent cgroup with CPU accounting here";
    EXPECT_GT(r->host_busy_ns, 0u);
    EXPECT_GE(r->host_busy_ns + 10 * kCore, r->sandboxes_ns) << "busy time covers the sandboxes'";
}

}  // namespace
}  // namespace cellblock
