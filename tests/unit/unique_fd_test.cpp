// UniqueFd: one owner, closed once; close() reports what close(2) said.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>

#include <gtest/gtest.h>

#include "cellblock/unique_fd.hpp"

namespace cellblock {
namespace {

bool is_open(int fd) { return ::fcntl(fd, F_GETFD) != -1; }

TEST(UniqueFd, ClosesOnceWhenItsOwnerGoes) {
    int raw = -1;
    {
        UniqueFd fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
        ASSERT_TRUE(fd);
        raw = fd.get();
        UniqueFd moved = std::move(fd);
        EXPECT_FALSE(fd);
        EXPECT_TRUE(is_open(raw));
    }
    EXPECT_FALSE(is_open(raw));
}

TEST(UniqueFd, CloseReportsTheResult) {
    UniqueFd fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    const int raw = fd.get();
    EXPECT_TRUE(fd.close());
    EXPECT_FALSE(fd);
    EXPECT_FALSE(is_open(raw));
    EXPECT_TRUE(fd.close()) << "nothing held: nothing to fail";
    UniqueFd bad(1 << 20);  // above any open descriptor
    errno = 0;
    EXPECT_FALSE(bad.close());
    EXPECT_EQ(errno, EBADF);
}

TEST(UniqueFd, ResetKeepsErrno) {
    UniqueFd fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    errno = ENOSPC;  // the failure a caller is about to report
    fd.reset();
    EXPECT_EQ(errno, ENOSPC);
}

}  // namespace
}  // namespace cellblock
