// The host's servers' CPU demand: real files, real flock, a real child
// process standing for another server.
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "cellblock/cpu_demand.hpp"

namespace fs = std::filesystem;
using cellblock::CpuDemand;
using cellblock::HostCpuDemand;

namespace {

class CpuDemandTest : public ::testing::Test {
  protected:
    void SetUp() override {
        char tmpl[] = "/tmp/cellblock-cpu-demand-XXXXXX";
        ASSERT_NE(::mkdtemp(tmpl), nullptr);
        dir_ = fs::path(tmpl) / "demand";
    }
    void TearDown() override { fs::remove_all(dir_.parent_path()); }
    std::size_t files() const {
        std::size_t n = 0;
        for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir_)) ++n;
        return n;
    }
    // A file as a server writes it, with nobody holding it.
    void write_unlocked(const std::string& name, const std::string& text) {
        std::ofstream(dir_ / name) << text;
    }
    fs::path dir_;
};

const std::string kTwoAndOne = "0000000002 0000000001\n";

TEST_F(CpuDemandTest, EachServerCountsEveryLiveServersFigures) {
    HostCpuDemand a(dir_), b(dir_);
    EXPECT_EQ(fs::status(dir_).permissions() & fs::perms::all, fs::perms::owner_all);
    a.publish(2, 0);
    b.publish(1, 1);
    for (HostCpuDemand* server : {&a, &b}) {
        const CpuDemand sum = server->totals();
        EXPECT_EQ(sum.interactive, 3u);
        EXPECT_EQ(sum.hogging, 1u);
        EXPECT_EQ(sum.servers, 2u);
    }
    b.publish(0, 0);
    EXPECT_EQ(a.totals().interactive, 2u);
    EXPECT_EQ(a.totals().hogging, 0u);
}

TEST_F(CpuDemandTest, AServerThatIsGoneCountsNoMoreAndItsFileIsRemoved) {
    HostCpuDemand a(dir_);
    {
        HostCpuDemand b(dir_);
        b.publish(5, 0);
        EXPECT_EQ(a.totals().interactive, 5u);
    }
    EXPECT_EQ(a.totals().interactive, 0u);
    EXPECT_EQ(a.totals().servers, 1u);
    EXPECT_EQ(files(), 1u);
}

TEST_F(CpuDemandTest, AKilledServersFileIsRemovedByTheNextReader) {
    HostCpuDemand a(dir_);
    int ready[2];
    ASSERT_EQ(::pipe(ready), 0);
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
        HostCpuDemand other(dir_);
        other.publish(4, 2);
        [[maybe_unused]] auto n = ::write(ready[1], "x", 1);
        ::pause();
        ::_exit(0);
    }
    char x;
    ASSERT_EQ(::read(ready[0], &x, 1), 1);
    EXPECT_EQ(a.totals().interactive, 4u);
    EXPECT_EQ(a.totals().hogging, 2u);
    EXPECT_EQ(a.totals().servers, 2u);
    // Killed: no destructor ran, its file is still there, unlocked.
    ::kill(child, SIGKILL);
    ::waitpid(child, nullptr, 0);
    EXPECT_EQ(files(), 2u);
    EXPECT_EQ(a.totals().interactive, 0u);
    EXPECT_EQ(files(), 1u);
    ::close(ready[0]);
    ::close(ready[1]);
}

TEST_F(CpuDemandTest, UnlockedAndHalfMadeFilesAreRemovedLockedGarbageIsIgnored) {
    HostCpuDemand a(dir_);
    write_unlocked("123-456", kTwoAndOne);     // a crashed server's
    write_unlocked(".new-789-1", kTwoAndOne);  // one that crashed making its file
    // Locked by a live holder but not a record: counted as nothing, kept.
    const fs::path garbage = dir_ / "999-1";
    std::ofstream(garbage) << "not numbers";
    const int fd = ::open(garbage.c_str(), O_RDONLY | O_CLOEXEC);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::flock(fd, LOCK_EX), 0);
    const CpuDemand sum = a.totals();
    EXPECT_EQ(sum.interactive, 0u);
    EXPECT_EQ(sum.servers, 1u);
    EXPECT_FALSE(fs::exists(dir_ / "123-456"));
    EXPECT_FALSE(fs::exists(dir_ / ".new-789-1"));
    EXPECT_TRUE(fs::exists(garbage));
    ::close(fd);
}

TEST_F(CpuDemandTest, FiguresKeepOneWidthSoAReaderNeverSeesHalfARecord) {
    HostCpuDemand a(dir_);
    a.publish(12345, 7);
    std::ifstream in(a.file());
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(text, "0000012345 0000000007\n");
    a.publish(1, 0);
    std::ifstream again(a.file());
    const std::string shorter((std::istreambuf_iterator<char>(again)),
                              std::istreambuf_iterator<char>());
    EXPECT_EQ(shorter.size(), text.size());
}

TEST_F(CpuDemandTest, ADirectoryThatCannotBeMadeIsAClearError) {
    fs::create_directories(dir_.parent_path());
    std::ofstream(dir_.parent_path() / "file") << "x";
    try {
        HostCpuDemand bad(dir_.parent_path() / "file" / "demand");
        FAIL() << "no error";
    } catch (const std::runtime_error& e) {
        EXPECT_NE(std::string(e.what()).find("mkdir"), std::string::npos) << e.what();
    }
}

}  // namespace
