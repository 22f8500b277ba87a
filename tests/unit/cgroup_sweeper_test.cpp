// remove_cgroup_dirs: a cgroup whose last process outlives the short wait at
// a sandbox's close is removed once that process is gone, instead of being
// left on the host until the next server start.
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include <gtest/gtest.h>

#include "../../sessions/sandbox_internal.hpp"
#include "cellblock/runc_sandbox.hpp"
#include "held_child.hpp"

namespace cellblock::sandbox_detail {
namespace {
namespace fs = std::filesystem;

// A fresh cgroup in a hierarchy this test may use, or empty.
fs::path make_cgroup() {
    const std::string name = "cellblock-unit-sweeper-" + std::to_string(::getpid());
    for (const fs::path parent :
         {"/sys/fs/cgroup/pids", "/sys/fs/cgroup/memory", "/sys/fs/cgroup"}) {
        if (!fs::exists(parent / "cgroup.procs")) continue;
        std::error_code ec;
        if (fs::create_directory(parent / name, ec)) return parent / name;
    }
    return {};
}

TEST(CgroupSweeper, ACgroupEmptiedAfterTheWaitIsStillRemoved) {
    const fs::path dir = make_cgroup();
    if (dir.empty()) GTEST_SKIP() << "no cgroup hierarchy this process may write to";
    auto [pid, hold] = testing::fork_held_child();
    {
        std::ofstream procs(dir / "cgroup.procs");
        procs << pid << "\n";
    }
    const auto before = cgroups_pending_removal();
    remove_cgroup_dirs({dir});  // the child still runs in it: the kernel refuses
    EXPECT_TRUE(fs::exists(dir));
    EXPECT_EQ(cgroups_pending_removal(), before + 1);
    hold.reset();  // now the child ends
    ASSERT_EQ(::waitpid(pid, nullptr, 0), pid);
    EXPECT_TRUE(await_cgroup_removals(std::chrono::seconds(60)));
    EXPECT_FALSE(fs::exists(dir)) << "the emptied cgroup was left on the host";
    std::error_code ec;
    fs::remove(dir, ec);
}

TEST(CgroupSweeper, AnEmptyCgroupIsRemovedAtOnce) {
    const fs::path dir = make_cgroup();
    if (dir.empty()) GTEST_SKIP() << "no cgroup hierarchy this process may write to";
    const auto before = cgroups_pending_removal();
    remove_cgroup_dirs({dir, dir.parent_path() / "cellblock-unit-never-made"});
    EXPECT_FALSE(fs::exists(dir));
    EXPECT_EQ(cgroups_pending_removal(), before) << "nothing to wait for";
}

TEST(CgroupLayout, EachHierarchyOnceWithTheSandboxesParentInEach) {
    const auto hierarchies = cgroup_hierarchies();
    if (hierarchies.empty()) GTEST_SKIP() << "no cgroup hierarchy mounted";
    std::set<fs::path> seen;
    for (const auto& hierarchy : hierarchies) {
        EXPECT_FALSE(fs::is_symlink(hierarchy)) << hierarchy << ": an alias of another";
        EXPECT_TRUE(seen.insert(fs::canonical(hierarchy)).second) << hierarchy << " twice";
    }
    const auto parents = sandboxes_cgroup_parents();
    ASSERT_EQ(parents.size(), hierarchies.size());
    for (std::size_t i = 0; i < parents.size(); ++i) {
        EXPECT_EQ(parents[i], hierarchies[i] / kSandboxesCgroup);
    }
    // A container that does not exist has no cgroup but on v2 (one path, made by the runtime).
    EXPECT_EQ(sandbox_cgroup_dirs("cb-unit-never-made").size(), cgroup_v2() ? 1U : 0U);
}

}  // namespace
}  // namespace cellblock::sandbox_detail
