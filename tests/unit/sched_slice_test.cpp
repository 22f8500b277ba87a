#include "cellblock/sched_slice.hpp"

#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include <gtest/gtest.h>

namespace cellblock {
namespace {

// A thread of this process that waits until told to end: a task whose
// slice the test may change without touching the test's own.
class Sleeper {
  public:
    Sleeper() {
        thread_ = std::thread([this] {
            std::unique_lock lock(mu_);
            tid_ = ::gettid();
            cv_.notify_all();
            cv_.wait(lock, [this] { return done_; });
        });
        std::unique_lock lock(mu_);
        cv_.wait(lock, [this] { return tid_ != 0; });
    }
    ~Sleeper() {
        {
            std::lock_guard lock(mu_);
            done_ = true;
        }
        cv_.notify_all();
        thread_.join();
    }
    pid_t tid() const { return tid_; }

  private:
    std::mutex mu_;
    std::condition_variable cv_;
    pid_t tid_ = 0;
    bool done_ = false;
    std::thread thread_;
};

TEST(SchedSlice, AThreadTakesTheShortSliceAndGetsTheDefaultBack) {
    Sleeper sleeper;
    const std::int64_t before = sched_slice_us(sleeper.tid());
    if (before < 0) GTEST_SKIP() << "this kernel reports no EEVDF slice";
    ASSERT_TRUE(set_sched_slice(sleeper.tid(), kInteractiveSliceUs)) << std::strerror(errno);
    EXPECT_EQ(sched_slice_us(sleeper.tid()), kInteractiveSliceUs);
    // The test's own thread is untouched.
    EXPECT_EQ(sched_slice_us(::gettid()), before);
    ASSERT_TRUE(set_sched_slice(sleeper.tid(), 0));
    EXPECT_EQ(sched_slice_us(sleeper.tid()), before);
}

TEST(SchedSlice, ANiceValueIsKeptWhenTheSliceChanges) {
    Sleeper sleeper;
    if (sched_slice_us(sleeper.tid()) < 0) GTEST_SKIP() << "this kernel reports no EEVDF slice";
    ASSERT_EQ(::setpriority(PRIO_PROCESS, static_cast<id_t>(sleeper.tid()), 7), 0);
    ASSERT_TRUE(set_sched_slice(sleeper.tid(), 300));
    errno = 0;
    EXPECT_EQ(::getpriority(PRIO_PROCESS, static_cast<id_t>(sleeper.tid())), 7);
    EXPECT_EQ(sched_slice_us(sleeper.tid()), 300);
}

TEST(SchedSlice, ATaskThatIsGoneIsRefusedWithEsrch) {
    // pid_max is at most 2^22: this tid cannot exist.
    constexpr pid_t gone = (1 << 22) + 1;
    errno = 0;
    EXPECT_FALSE(set_sched_slice(gone, kInteractiveSliceUs));
    EXPECT_EQ(errno, ESRCH);
    EXPECT_EQ(sched_slice_us(gone), -1);
}

}  // namespace
}  // namespace cellblock
