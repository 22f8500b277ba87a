// SessionDir: every path of a session's directory is under it, distinct, and
// what the host names in ipc() is what the sandbox finds in its /run/cellblock.
#include <algorithm>
#include <set>
#include <string>

#include <gtest/gtest.h>

#include "cellblock/oci_bundle.hpp"
#include "cellblock/session_dir.hpp"

namespace cellblock {
namespace {
namespace fs = std::filesystem;

TEST(SessionDir, EveryPathIsUnderTheRootAndDistinct) {
    const SessionDir dir("/state/sessions/0123456789abcdef");
    const fs::path paths[] = {dir.lock(),
                              dir.lock_staging(),
                              dir.runtime_file(),
                              dir.ipc(),
                              dir.server_links(),
                              dir.connection_file(),
                              dir.kernel_sockets(),
                              dir.zygote_socket(),
                              dir.lifeline_socket(),
                              dir.input(),
                              dir.staging(),
                              dir.output(),
                              dir.log(),
                              dir.shim_log(),
                              dir.bundle(),
                              dir.bundle_config(),
                              dir.bundle_rootfs()};
    std::set<fs::path> seen;
    for (const auto& path : paths) {
        EXPECT_EQ(path.string().rfind(dir.root().string() + "/", 0), 0U) << path;
        EXPECT_TRUE(seen.insert(path).second) << path << " named twice";
    }
    for (const auto& mount : dir.mounts()) {
        EXPECT_NE(std::find(dir.subdirectories().begin(), dir.subdirectories().end(), mount),
                  dir.subdirectories().end())
            << mount << " is mounted but not made";
    }
}

TEST(SessionDir, TheSandboxSeesIpcAsRunCellblock) {
    // ipc() is bind-mounted at kSandboxIpcDir: a file's name there is its name here.
    const SessionDir dir("/s");
    const auto inside = [&](const fs::path& host) {
        return (fs::path(kSandboxIpcDir) / host.lexically_relative(dir.ipc())).string();
    };
    EXPECT_EQ(inside(dir.connection_file()), kSandboxConnectionFile);
    EXPECT_EQ(inside(dir.lifeline_socket()), kSandboxLifelineSocket);
    EXPECT_EQ(inside(dir.zygote_socket()), kSandboxZygoteSocket);
    EXPECT_EQ(dir.server_links().parent_path(), dir.ipc());
    EXPECT_EQ(dir.kernel_sockets().parent_path(), dir.ipc());
}

}  // namespace
}  // namespace cellblock
