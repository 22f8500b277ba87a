// reap_abandoned_sessions on real session dirs and real flocks: what it takes
// and what it leaves, including a dir whose remover was killed midway.
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "cellblock/runc_sandbox.hpp"
#include "cellblock/session_dir.hpp"
#include "cellblock/unique_fd.hpp"

namespace cellblock {
namespace {
namespace fs = std::filesystem;

class Reaper : public ::testing::Test {
  protected:
    void SetUp() override {
        char tmpl[] = "/tmp/cellblock-reaper-XXXXXX";
        ASSERT_NE(::mkdtemp(tmpl), nullptr);
        settings_.state_dir = tmpl;
        fs::create_directories(settings_.sessions_dir());
    }
    void TearDown() override { fs::remove_all(settings_.state_dir); }

    // A session dir as a forked session leaves it (no container to delete),
    // with a file in ipc/; `lock`: whether it has its lock file.
    SessionDir make(const std::string& id, bool lock) {
        const SessionDir dir(settings_.sessions_dir() / id);
        fs::create_directories(dir.ipc());
        std::ofstream(dir.runtime_file()) << "zygote\n";
        std::ofstream(dir.connection_file()) << "{}";
        if (lock) std::ofstream(dir.lock()) << "";
        return dir;
    }
    bool reaped(const std::vector<std::string>& ids, const std::string& id) {
        return std::find(ids.begin(), ids.end(), id) != ids.end();
    }

    RuntimeSettings settings_;
};

TEST_F(Reaper, TakesAnUnheldLockAndLeavesAHeldOne) {
    const SessionDir held = make("aaaaaaaaaaaaaaaa", true);
    make("bbbbbbbbbbbbbbbb", true);
    const UniqueFd owner(::open(held.lock().c_str(), O_RDWR | O_CLOEXEC));
    ASSERT_TRUE(owner);
    ASSERT_EQ(::flock(owner.get(), LOCK_EX | LOCK_NB), 0);

    const auto ids = reap_abandoned_sessions(settings_);
    EXPECT_FALSE(reaped(ids, "aaaaaaaaaaaaaaaa"));
    EXPECT_TRUE(fs::exists(held.connection_file()));
    EXPECT_TRUE(reaped(ids, "bbbbbbbbbbbbbbbb"));
    EXPECT_FALSE(fs::exists(settings_.sessions_dir() / "bbbbbbbbbbbbbbbb"));
}

TEST_F(Reaper, ADirLeftWithoutItsLockIsTakenAtOnce) {
    // What a server killed while removing a session could leave: files but
    // no lock. Nothing being made looks like this, so it is not left to age.
    make("cccccccccccccccc", false);
    const auto ids = reap_abandoned_sessions(settings_);
    EXPECT_TRUE(reaped(ids, "cccccccccccccccc"));
    EXPECT_FALSE(fs::exists(settings_.sessions_dir() / "cccccccccccccccc"));
}

TEST_F(Reaper, ADirBeingMadeIsLeftWhileYoung) {
    // mkdir, then the lock's staging file: another process is making it.
    const SessionDir empty(settings_.sessions_dir() / "dddddddddddddddd");
    fs::create_directories(empty.root());
    const SessionDir staging(settings_.sessions_dir() / "eeeeeeeeeeeeeeee");
    fs::create_directories(staging.root());
    std::ofstream(staging.lock_staging()) << "";

    const auto ids = reap_abandoned_sessions(settings_);
    EXPECT_TRUE(ids.empty());
    EXPECT_TRUE(fs::exists(empty.root()));
    EXPECT_TRUE(fs::exists(staging.lock_staging()));

    // Once old, nobody is making them: they are taken.
    const auto old = fs::file_time_type::clock::now() - std::chrono::minutes(5);
    fs::last_write_time(empty.root(), old);
    fs::last_write_time(staging.root(), old);
    EXPECT_EQ(reap_abandoned_sessions(settings_).size(), 2U);
    EXPECT_FALSE(fs::exists(empty.root()));
    EXPECT_FALSE(fs::exists(staging.root()));
}

}  // namespace
}  // namespace cellblock
