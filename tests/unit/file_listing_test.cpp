// file_list_request over a real directory: regular files only, no symlink
// followed, bounded in count and depth.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "file_transfer.hpp"

namespace cellblock {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

class FileListingTest : public ::testing::Test {
  protected:
    void SetUp() override {
        char tmpl[] = "/tmp/cellblock-fl-XXXXXX";
        root_ = ::mkdtemp(tmpl);
        files_.session_id = "s1";
        files_.input_dir = root_ / "input";
        files_.output_dir = root_ / "output";
        fs::create_directories(files_.output_dir);
        fs::create_directories(root_ / "secret");
        write(root_ / "secret" / "key", "do not list");
    }
    void TearDown() override { fs::remove_all(root_); }
    static void write(const fs::path& p, const std::string& bytes) {
        fs::create_directories(p.parent_path());
        std::ofstream(p, std::ios::binary) << bytes;
    }
    std::set<std::string> paths(const json& reply) {
        std::set<std::string> out;
        for (const auto& f : reply["files"]) out.insert(f["path"].get<std::string>());
        return out;
    }

    fs::path root_;
    SessionFiles files_;
};

TEST_F(FileListingTest, ListsRegularFilesWithSizes) {
    write(files_.output_dir / "plot.png", "12345");
    write(files_.output_dir / "tables" / "a.csv", "x");
    const json reply = list_output_files(files_);
    EXPECT_EQ(reply["status"], "ok");
    EXPECT_FALSE(reply["truncated"]);
    EXPECT_EQ(paths(reply), (std::set<std::string>{"plot.png", "tables/a.csv"}));
    for (const auto& f : reply["files"]) {
        if (f["path"] == "plot.png") {
            EXPECT_EQ(f["size"], 5);
        }
    }
}

TEST_F(FileListingTest, FollowsNoSymlinkAndListsNoSpecialFile) {
    fs::create_symlink(root_ / "secret", files_.output_dir / "link-dir");
    fs::create_symlink(root_ / "secret" / "key", files_.output_dir / "link-file");
    ASSERT_EQ(::mkfifo((files_.output_dir / "fifo").c_str(), 0600), 0);
    write(files_.output_dir / "real.txt", "ok");
    EXPECT_EQ(paths(list_output_files(files_)), (std::set<std::string>{"real.txt"}));
}

TEST_F(FileListingTest, StopsAtItsBounds) {
    for (int i = 0; i < 5; ++i) write(files_.output_dir / ("f" + std::to_string(i)), "");
    const json few = list_output_files(files_, 3);
    EXPECT_EQ(few["files"].size(), 3u);
    EXPECT_TRUE(few["truncated"]);
    fs::remove_all(files_.output_dir);
    write(files_.output_dir / "a" / "b" / "c" / "deep.txt", "");
    write(files_.output_dir / "a" / "shallow.txt", "");
    const json shallow = list_output_files(files_, 1000, 2);
    EXPECT_EQ(paths(shallow), (std::set<std::string>{"a/shallow.txt"}));
    EXPECT_TRUE(shallow["truncated"]);
}

TEST_F(FileListingTest, AMissingOutputDirIsAFileError) {
    fs::remove_all(files_.output_dir);
    try {
        list_output_files(files_);
        FAIL() << "no error";
    } catch (const FileRequestError& e) {
        EXPECT_EQ(e.ename(), "FileError");
    }
}

}  // namespace
}  // namespace cellblock
