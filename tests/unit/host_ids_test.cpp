// Host id leases: real lease files, real flock, real processes in /proc.
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "cellblock/host_ids.hpp"

namespace fs = std::filesystem;
using cellblock::HostIdLease;
using cellblock::HostIdPool;
using cellblock::lease_host_ids;

namespace {

// A child process that takes the given ids (kKeep leaves one as it is) and,
// unless kKeep, sets its dumpable flag, then waits to be killed. ready()
// once it has; end() kills and reaps it (and returns its wait status).
class ProcessAs {
  public:
    static constexpr std::uint32_t kKeep = ~0u;
    ProcessAs(std::uint32_t uid, std::uint32_t gid, int dumpable = -1) {
        if (::pipe(ready_) != 0) return;
        pid_ = ::fork();
        if (pid_ != 0) return;
        if ((gid != kKeep && ::setresgid(gid, gid, gid) != 0) ||
            (uid != kKeep && ::setresuid(uid, uid, uid) != 0) ||
            (dumpable >= 0 && ::prctl(PR_SET_DUMPABLE, dumpable) != 0))
            _exit(1);
        (void)!::write(ready_[1], "r", 1);
        ::pause();
        _exit(0);
    }
    ~ProcessAs() {
        end();
        ::close(ready_[0]);
        ::close(ready_[1]);
    }
    ProcessAs(const ProcessAs&) = delete;
    ProcessAs& operator=(const ProcessAs&) = delete;
    bool ready() {
        char c = 0;
        return pid_ > 0 && ::read(ready_[0], &c, 1) == 1;
    }
    pid_t pid() const { return pid_; }
    int end() {
        int status = -1;
        if (pid_ > 0) {
            ::kill(pid_, SIGKILL);
            ::waitpid(pid_, &status, 0);
            pid_ = -1;
        }
        return status;
    }

  private:
    int ready_[2] = {-1, -1};
    pid_t pid_ = -1;
};

class HostIdsTest : public ::testing::Test {
  protected:
    void SetUp() override {
        // Which ids are in use is read from all of /proc, and CI runs tests two
        // at a time: a test of this fixture in another process runs as ids of
        // this same pool. One test of the fixture at a time on this machine.
        serial_ = ::open("/tmp/cellblock-host-ids-test.lock", O_RDWR | O_CREAT | O_CLOEXEC, 0600);
        ASSERT_GE(serial_, 0);
        ASSERT_EQ(::flock(serial_, LOCK_EX), 0);
        char tmpl[] = "/tmp/cellblock-host-ids-XXXXXX";
        ASSERT_NE(::mkdtemp(tmpl), nullptr);
        dir_ = tmpl;
        // A pool of its own, far from the one sandboxes use, in its own lease dir.
        pool_.lease_dir = dir_ / "leases";
        pool_.first_id = 4000000000u;
        pool_.range_size = 1000;
        pool_.ranges = 3;
    }
    void TearDown() override {
        fs::remove_all(dir_);
        if (serial_ >= 0) ::close(serial_);  // and with it the lock
    }
    int serial_ = -1;
    fs::path dir_;
    HostIdPool pool_;
};

TEST_F(HostIdsTest, RangesFollowThePool) {
    EXPECT_EQ(pool_.range(0).host_base, 4000000000u);
    EXPECT_EQ(pool_.range(2).host_base, 4000002000u);
    EXPECT_EQ(pool_.range(2).size, 1000u);
    // The default pool: above the one range all sandboxes used to share, and
    // its last id below (uid_t)-1.
    const HostIdPool defaults;
    EXPECT_GT(defaults.range(0).host_base, 1u << 30);
    const auto last = defaults.range(defaults.ranges - 1);
    EXPECT_LT(std::uint64_t{last.host_base} + last.size - 1, 0xffffffffull);
}

TEST_F(HostIdsTest, TwoLeasesInOneDirGetDifferentRanges) {
    HostIdLease a = lease_host_ids(pool_, dir_ / "a");
    HostIdLease b = lease_host_ids(pool_, dir_ / "b");
    ASSERT_TRUE(a.held());
    ASSERT_TRUE(b.held());
    EXPECT_NE(a.index(), b.index());
    EXPECT_NE(a.ids().host_base, b.ids().host_base);
    // The holder is recorded in the lease file.
    std::ifstream in(pool_.lease_dir / (std::to_string(a.index()) + ".lock"));
    std::string holder;
    std::getline(in, holder);
    EXPECT_EQ(holder, (dir_ / "a").string());
}

TEST_F(HostIdsTest, AnExhaustedPoolSaysSo) {
    HostIdLease a = lease_host_ids(pool_, dir_ / "a");
    HostIdLease b = lease_host_ids(pool_, dir_ / "b");
    HostIdLease c = lease_host_ids(pool_, dir_ / "c");
    try {
        lease_host_ids(pool_, dir_ / "d");
        FAIL() << "a fourth lease from three ranges";
    } catch (const std::runtime_error& e) {
        EXPECT_NE(std::string(e.what()).find("all 3 ranges of 1000 ids are taken (3 leased"),
                  std::string::npos)
            << e.what();
    }
}

TEST_F(HostIdsTest, ALeaseIsReleasedOnDestructionAndMove) {
    std::uint32_t first = 0;
    {
        HostIdLease a = lease_host_ids(pool_, dir_ / "a");
        first = a.index();
        HostIdLease moved = std::move(a);
        EXPECT_FALSE(a.held());  // NOLINT(bugprone-use-after-move): checking the moved-from state
        EXPECT_TRUE(moved.held());
        EXPECT_NE(lease_host_ids(pool_, dir_ / "b").index(), first);
    }
    // Both gone (the holder dirs never existed): the first range is free again.
    EXPECT_EQ(lease_host_ids(pool_, dir_ / "c").index(), first);
}

// A restarted server adopting a sandbox takes its range back: only while the
// lease is free and still names the sandbox's dir (docs/restarts.md).
TEST_F(HostIdsTest, ARangeIsLetAgainOnlyToItsHolderAndOnlyWhenFree) {
    cellblock::IdMapping ids;
    {
        HostIdLease a = lease_host_ids(pool_, dir_ / "a");
        ids = a.ids();
        EXPECT_THROW(cellblock::relet_host_ids(pool_, ids, dir_ / "a"), std::runtime_error)
            << "held by a live lease";
    }
    EXPECT_THROW(cellblock::relet_host_ids(pool_, ids, dir_ / "b"), std::runtime_error)
        << "another holder's range";
    EXPECT_THROW(cellblock::relet_host_ids(pool_, {ids.host_base + 1, ids.size}, dir_ / "a"),
                 std::runtime_error)
        << "not a range of the pool";
    HostIdLease again = cellblock::relet_host_ids(pool_, ids, dir_ / "a");
    EXPECT_TRUE(again.held());
    EXPECT_EQ(again.ids().host_base, ids.host_base);
    EXPECT_NE(lease_host_ids(pool_, dir_ / "c").ids().host_base, ids.host_base)
        << "held again: no one else gets it";
}

TEST_F(HostIdsTest, AnotherProcessHoldingALeaseIsRespected) {
    // A child process (a second cellblock on the host) holds range 0 until told to stop.
    int go[2];
    ASSERT_EQ(::pipe(go), 0);
    int ready[2];
    ASSERT_EQ(::pipe(ready), 0);
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
        ::close(go[1]);  // so that the parent's close is this child's EOF
        HostIdLease held = lease_host_ids(pool_, dir_ / "child");
        const char index = static_cast<char>('0' + held.index());
        (void)!::write(ready[1], &index, 1);
        char c;
        (void)!::read(go[0], &c, 1);
        _exit(0);
    }
    char index = 0;
    ASSERT_EQ(::read(ready[0], &index, 1), 1);
    EXPECT_EQ(index, '0');
    EXPECT_EQ(lease_host_ids(pool_, dir_ / "parent").index(), 1u);
    ::close(go[1]);  // the child exits; its lock goes with it
    int status = 0;
    ::waitpid(child, &status, 0);
    EXPECT_EQ(lease_host_ids(pool_, dir_ / "parent").index(), 0u);
    for (int fd : {go[0], ready[0], ready[1]}) ::close(fd);
}

TEST_F(HostIdsTest, ARangeWhoseHolderRemainsIsSkipped) {
    // The last holder's session dir is still there (its owner died, nothing reaped it).
    fs::create_directories(dir_ / "left-behind");
    { HostIdLease a = lease_host_ids(pool_, dir_ / "left-behind"); }
    EXPECT_EQ(lease_host_ids(pool_, dir_ / "next").index(), 1u);
    fs::remove(dir_ / "left-behind");
    EXPECT_EQ(lease_host_ids(pool_, dir_ / "next").index(), 0u);
}

TEST_F(HostIdsTest, ARangeAProcessRunsInIsSkipped) {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a process as another uid";
    const uid_t inside = pool_.range(0).host_base + 5;
    // Only the gid is in range 0: both Uid and Gid lines are read.
    ProcessAs child(ProcessAs::kKeep, inside);
    ASSERT_TRUE(child.ready());
    EXPECT_TRUE(cellblock::host_ids_in_use().count(inside));
    // Nothing holds range 0's lease, yet a process runs as one of its ids.
    EXPECT_EQ(lease_host_ids(pool_, dir_ / "a").index(), 1u);
    child.end();
    EXPECT_FALSE(cellblock::host_ids_in_use().count(inside));
    EXPECT_EQ(lease_host_ids(pool_, dir_ / "b").index(), 0u);
}

TEST_F(HostIdsTest, ASandboxsProcessIsSeenWhetherOrNotItIsDumpable) {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a process as another uid";
    // Its /proc dir shows its effective ids whether it is dumpable or not (not,
    // the default after a change of ids), so a stat alone tells.
    for (const bool dumpable : {true, false}) {
        const uid_t inside = pool_.range(2).host_base + 1000;
        ProcessAs child(inside, inside, dumpable ? 1 : 0);
        ASSERT_TRUE(child.ready());
        struct stat st {};
        ASSERT_EQ(::stat(("/proc/" + std::to_string(child.pid())).c_str(), &st), 0);
        EXPECT_EQ(st.st_uid, inside);
        EXPECT_EQ(st.st_gid, inside);
        EXPECT_TRUE(cellblock::host_ids_in_use().count(inside)) << "dumpable " << dumpable;
        child.end();
        EXPECT_FALSE(cellblock::host_ids_in_use().count(inside));
    }
}

TEST_F(HostIdsTest, LeftoversOfACrashedHolderAreKilledOnlyWhenTheLeaseIsStillTheirs) {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a process as another uid";
    // A dead owner's lease: free, naming its session dir.
    std::uint32_t index = 0;
    { index = lease_host_ids(pool_, dir_ / "crashed").index(); }
    const auto ids = pool_.range(index);
    ProcessAs child(ids.host_base + 5, ids.host_base + 5);
    ASSERT_TRUE(child.ready());
    // Another holder named, or the lease held by a live owner: left alone.
    EXPECT_TRUE(cellblock::kill_leftovers_in(pool_, ids, dir_ / "someone-else").empty());
    const fs::path lease = pool_.lease_dir / (std::to_string(index) + ".lock");
    const int held = ::open(lease.c_str(), O_RDWR | O_CLOEXEC);
    ASSERT_EQ(::flock(held, LOCK_EX | LOCK_NB), 0);
    EXPECT_TRUE(cellblock::kill_leftovers_in(pool_, ids, dir_ / "crashed").empty());
    ::close(held);
    EXPECT_EQ(::waitpid(child.pid(), nullptr, WNOHANG), 0);
    const auto killed = cellblock::kill_leftovers_in(pool_, ids, dir_ / "crashed");
    EXPECT_EQ(killed, std::vector<int>{child.pid()});
    // Ended, not yet waited for: a zombie is not killed (again) nor counted.
    const std::string stat = "/proc/" + std::to_string(child.pid()) + "/stat";
    bool zombie = false;
    for (int i = 0; i < 1000 && !zombie; ++i) {
        std::ifstream in(stat);
        std::string line;
        std::getline(in, line);
        zombie = line.find(") Z ") != std::string::npos;
        if (!zombie) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ASSERT_TRUE(zombie) << "the killed child never became a zombie";
    EXPECT_TRUE(cellblock::kill_leftovers_in(pool_, ids, dir_ / "crashed").empty());
    const int status = child.end();  // whatever the outcome, no child outlives the test
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
}

}  // namespace
