// FileTransfers as a value with a directory: uploads appear whole or not at
// all, digests are checked, caps say their numbers, downloads are one version.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <openssl/evp.h>

#include "file_transfer.hpp"

namespace cellblock {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;
using Clock = FileTransfers::Clock;

std::string sha256_hex(std::string_view data) {
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    EVP_Digest(data.data(), data.size(), md, &len, EVP_sha256(), nullptr);
    std::string out;
    for (unsigned int i = 0; i < len; ++i) {
        out += "0123456789abcdef"[md[i] >> 4];
        out += "0123456789abcdef"[md[i] & 15];
    }
    return out;
}

std::string pattern(std::size_t n, char seed = 'a') {
    std::string s(n, '\0');
    for (std::size_t i = 0; i < n; ++i) s[i] = static_cast<char>(seed + (i * 7 + i / 251) % 26);
    return s;
}

std::string slurp(const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), {}};
}

std::size_t entries(const fs::path& dir) {
    std::error_code ec;
    std::size_t n = 0;
    for (auto it = fs::recursive_directory_iterator(dir, ec);
         it != fs::recursive_directory_iterator(); ++it)
        n += it->is_regular_file();
    return n;
}

class FileTransferTest : public ::testing::Test {
  protected:
    void SetUp() override {
        char tmpl[] = "/tmp/cellblock-ft-XXXXXX";
        root_ = ::mkdtemp(tmpl);
        files_.session_id = "s1";
        files_.input_dir = root_ / "input";
        files_.output_dir = root_ / "output";
        files_.partial_dir = root_ / "partial";
        files_.input_cap_bytes = 1 << 20;
        fs::create_directories(files_.input_dir);
        fs::create_directories(files_.output_dir);
    }
    void TearDown() override { fs::remove_all(root_); }

    FileTransfers::Reply call(const std::string& type, json content,
                              std::vector<std::string> buffers = {}) {
        content["session_id"] = files_.session_id;
        return transfers_.handle(type, content, buffers, files_, now_);
    }
    // The ename a request fails with, and its evalue in `evalue`.
    std::string error_of(const std::string& type, json content,
                         std::vector<std::string> buffers = {}, std::string* evalue = nullptr) {
        try {
            call(type, std::move(content), std::move(buffers));
        } catch (const FileRequestError& e) {
            if (evalue) *evalue = e.what();
            return e.ename();
        }
        return "no error";
    }
    std::string begin(const std::string& path, const std::string& data) {
        return call("file_put_begin_request",
                    {{"path", path}, {"size", data.size()}, {"sha256", sha256_hex(data)}})
            .content["upload_id"];
    }
    void chunk(const std::string& id, std::uint64_t offset, std::string bytes) {
        call("file_put_chunk_request", {{"upload_id", id}, {"offset", offset}}, {std::move(bytes)});
    }

    fs::path root_;
    SessionFiles files_;
    FileTransferLimits limits_{.max_file_bytes = 4 << 20,
                               .max_inline_bytes = 64 << 10,
                               .chunk_bytes = 16 << 10,
                               .max_chunk_bytes = 32 << 10};
    FileTransfers transfers_{limits_};
    Clock::time_point now_ = Clock::now();
};

TEST_F(FileTransferTest, ChunkedUploadAppearsWholeOnlyAtCommit) {
    const std::string data = pattern(100 << 10);
    const std::string id = begin("dir/data.csv", data);
    for (std::size_t at = 0; at < data.size(); at += 16 << 10) {
        EXPECT_EQ(entries(files_.input_dir), 0u) << "a partial is visible in /data/input";
        chunk(id, at, data.substr(at, 16 << 10));
    }
    EXPECT_EQ(entries(files_.input_dir), 0u);
    auto done = call("file_put_commit_request", {{"upload_id", id}});
    EXPECT_EQ(done.content["path"], "/data/input/dir/data.csv");
    EXPECT_EQ(done.content["sha256"], sha256_hex(data));
    ASSERT_TRUE(done.event);
    EXPECT_EQ(slurp(files_.input_dir / "dir" / "data.csv"), data);
    EXPECT_EQ(entries(files_.partial_dir), 0u) << "the partial stayed behind";
    EXPECT_EQ(transfers_.open_transfers(), 0u);
    EXPECT_EQ(transfers_.input_bytes("s1"), data.size());
    struct stat st {};
    ASSERT_EQ(::stat((files_.input_dir / "dir" / "data.csv").c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0644u);
}

TEST_F(FileTransferTest, SameFileAgainResumesWhereItStopped) {
    const std::string data = pattern(64 << 10);
    const std::string id = begin("a.bin", data);
    chunk(id, 0, data.substr(0, 16 << 10));
    chunk(id, 16 << 10, data.substr(16 << 10, 16 << 10));
    // The client comes back: the same name, size and digest.
    auto again = call("file_put_begin_request",
                      {{"path", "a.bin"}, {"size", data.size()}, {"sha256", sha256_hex(data)}});
    EXPECT_EQ(again.content["upload_id"], id);
    EXPECT_EQ(again.content["offset"], 32 << 10);
    EXPECT_EQ(again.content["resumed"], true);
    chunk(id, 32 << 10, data.substr(32 << 10));
    call("file_put_commit_request", {{"upload_id", id}});
    EXPECT_EQ(slurp(files_.input_dir / "a.bin"), data);
}

TEST_F(FileTransferTest, AnotherFileUnderTheSameNameRestartsCleanly) {
    const std::string first = pattern(32 << 10), second = pattern(40 << 10, 'b');
    const std::string id = begin("a.bin", first);
    chunk(id, 0, first.substr(0, 16 << 10));
    const std::string id2 = begin("a.bin", second);
    EXPECT_NE(id, id2);
    EXPECT_EQ(error_of("file_put_chunk_request", {{"upload_id", id}, {"offset", 16 << 10}}, {"x"}),
              "TransferNotFound");
    EXPECT_EQ(entries(files_.partial_dir), 1u);
}

TEST_F(FileTransferTest, ChunksOutOfOrderOrPastTheSizeAreRefused) {
    const std::string data = pattern(32 << 10);
    const std::string id = begin("a.bin", data);
    std::string evalue;
    EXPECT_EQ(
        error_of("file_put_chunk_request", {{"upload_id", id}, {"offset", 100}}, {"xyz"}, &evalue),
        "InvalidOffset");
    EXPECT_NE(evalue.find("holds 0 bytes"), std::string::npos) << evalue;
    chunk(id, 0, data);
    EXPECT_EQ(
        error_of("file_put_chunk_request", {{"upload_id", id}, {"offset", data.size()}}, {"more"}),
        "FileTooLarge");
    EXPECT_EQ(error_of("file_put_chunk_request", {{"upload_id", id}, {"offset", 0}},
                       {std::string(40 << 10, 'x')}),
              "InvalidRequest");
}

TEST_F(FileTransferTest, DigestMismatchDiscardsTheUpload) {
    const std::string data = pattern(20 << 10);
    const std::string id =
        call("file_put_begin_request",
             {{"path", "a.bin"}, {"size", data.size()}, {"sha256", sha256_hex("something else")}})
            .content["upload_id"];
    chunk(id, 0, data.substr(0, 16 << 10));
    chunk(id, 16 << 10, data.substr(16 << 10));
    std::string evalue;
    EXPECT_EQ(error_of("file_put_commit_request", {{"upload_id", id}}, {}, &evalue),
              "ChecksumMismatch");
    EXPECT_NE(evalue.find(sha256_hex(data)), std::string::npos) << evalue;
    EXPECT_EQ(entries(files_.input_dir), 0u);
    EXPECT_EQ(entries(files_.partial_dir), 0u);
}

TEST_F(FileTransferTest, DigestAtCommitWorksAndIsRequired) {
    const std::string data = pattern(10 << 10);
    std::string id =
        call("file_put_begin_request", {{"path", "a"}, {"size", data.size()}}).content["upload_id"];
    chunk(id, 0, data);
    EXPECT_EQ(error_of("file_put_commit_request", {{"upload_id", id}}), "InvalidRequest");
    call("file_put_commit_request", {{"upload_id", id}, {"sha256", sha256_hex(data)}});
    EXPECT_EQ(slurp(files_.input_dir / "a"), data);
}

TEST_F(FileTransferTest, CapsAreFileTooLargeWithTheNumbers) {
    std::string evalue;
    // The server's maximum for one file.
    EXPECT_EQ(
        error_of("file_put_begin_request",
                 {{"path", "big"}, {"size", 5 << 20}, {"sha256", sha256_hex("")}}, {}, &evalue),
        "FileTooLarge");
    EXPECT_NE(evalue.find(std::to_string(5 << 20)), std::string::npos) << evalue;
    EXPECT_NE(evalue.find(std::to_string(4 << 20)), std::string::npos) << evalue;
    // The session's cap (disk_mb), counting files put and uploads under way.
    const std::string half = pattern(600 << 10);
    begin("one", half);
    EXPECT_EQ(error_of("file_put_begin_request",
                       {{"path", "two"}, {"size", half.size()}, {"sha256", sha256_hex(half)}}, {},
                       &evalue),
              "FileTooLarge");
    EXPECT_NE(evalue.find(std::to_string(1 << 20)), std::string::npos) << evalue;
    EXPECT_NE(evalue.find("disk_mb 1"), std::string::npos) << evalue;
    EXPECT_NE(evalue.find(std::to_string(half.size()) + " bytes in uploads"), std::string::npos)
        << evalue;
    // The single-message put has its own, smaller limit.
    EXPECT_EQ(error_of("file_put_request", {{"path", "x"}}, {std::string(65 << 10, 'x')}, &evalue),
              "FileTooLarge");
    EXPECT_NE(evalue.find("file_put_begin_request"), std::string::npos) << evalue;
}

TEST_F(FileTransferTest, ReplacingAFileFreesItsShareOfTheCap) {
    files_.input_cap_bytes = 60 << 10;
    const std::string big = pattern(40 << 10);
    call("file_put_request", {{"path", "x"}}, {big});
    call("file_put_request", {{"path", "x"}}, {big});  // 80 kB put, 40 kB held
    EXPECT_EQ(transfers_.input_bytes("s1"), big.size());
    EXPECT_EQ(slurp(files_.input_dir / "x"), big);
}

TEST_F(FileTransferTest, PathsStayInside) {
    for (const char* path : {"../x", "/etc/passwd", "a/../../b", "a//b", "./a", ""}) {
        EXPECT_EQ(error_of("file_put_begin_request",
                           {{"path", path}, {"size", 1}, {"sha256", sha256_hex("x")}}),
                  "InvalidPath")
            << path;
        EXPECT_EQ(error_of("file_get_begin_request", {{"path", path}}), "InvalidPath") << path;
    }
    // A symlink the code planted in /data/output is never followed.
    fs::create_symlink("/etc/hostname", files_.output_dir / "link");
    EXPECT_EQ(error_of("file_get_begin_request", {{"path", "link"}}), "FileError");
    EXPECT_EQ(error_of("file_get_begin_request", {{"path", "none"}}), "FileNotFound");
    ::mkfifo((files_.output_dir / "fifo").c_str(), 0600);
    EXPECT_EQ(error_of("file_get_begin_request", {{"path", "fifo"}}), "FileError");
}

TEST_F(FileTransferTest, AbandonedUploadsExpireAndLeaveNothing) {
    const std::string data = pattern(32 << 10);
    const std::string id = begin("a.bin", data);
    chunk(id, 0, data.substr(0, 16 << 10));
    EXPECT_EQ(entries(files_.partial_dir), 1u);
    transfers_.expire(now_ + limits_.idle_timeout - std::chrono::seconds(1));
    EXPECT_EQ(transfers_.open_transfers(), 1u);
    transfers_.expire(now_ + limits_.idle_timeout);
    EXPECT_EQ(transfers_.open_transfers(), 0u);
    EXPECT_EQ(entries(files_.partial_dir), 0u);
    EXPECT_EQ(entries(files_.input_dir), 0u);
    EXPECT_EQ(error_of("file_put_commit_request", {{"upload_id", id}}), "TransferNotFound");
}

TEST_F(FileTransferTest, ClosedSessionDropsItsTransfers) {
    const std::string data = pattern(32 << 10);
    begin("a.bin", data);
    transfers_.session_closed("s1");
    EXPECT_EQ(transfers_.open_transfers(), 0u);
    EXPECT_EQ(entries(files_.partial_dir), 0u);
}

TEST_F(FileTransferTest, TransfersPerSessionAreCapped) {
    for (std::size_t i = 0; i < limits_.max_session_transfers; ++i)
        begin("f" + std::to_string(i), "x");
    EXPECT_EQ(error_of("file_put_begin_request",
                       {{"path", "more"}, {"size", 1}, {"sha256", sha256_hex("x")}}),
              "TooManyTransfers");
}

TEST_F(FileTransferTest, DownloadInChunksWithTheDigestOfTheWhole) {
    const std::string data = pattern(50 << 10);
    std::ofstream(files_.output_dir / "out.bin", std::ios::binary) << data;
    auto begun = call("file_get_begin_request", {{"path", "/data/output/out.bin"}});
    EXPECT_EQ(begun.content["size"], data.size());
    const std::string id = begun.content["download_id"];
    std::string got, sha;
    while (got.size() < data.size()) {
        auto part = call("file_get_chunk_request", {{"download_id", id}, {"offset", got.size()}});
        ASSERT_EQ(part.buffers.size(), 1u);
        got += part.buffers[0];
        if (part.content.contains("sha256")) sha = part.content["sha256"];
    }
    EXPECT_EQ(got, data);
    EXPECT_EQ(sha, sha256_hex(data));
    EXPECT_EQ(transfers_.open_transfers(), 0u) << "a finished download stays open";
}

TEST_F(FileTransferTest, ResumedDownloadStillGetsTheWholeDigest) {
    const std::string data = pattern(50 << 10);
    std::ofstream(files_.output_dir / "out.bin", std::ios::binary) << data;
    const std::string id =
        call("file_get_begin_request", {{"path", "out.bin"}}).content["download_id"];
    auto last = call("file_get_chunk_request",
                     {{"download_id", id}, {"offset", 40 << 10}, {"length", 20 << 10}});
    EXPECT_EQ(last.buffers[0], data.substr(40 << 10));
    EXPECT_EQ(last.content["sha256"], sha256_hex(data));
}

TEST_F(FileTransferTest, FileRewrittenDuringADownloadIsFileChanged) {
    const std::string data = pattern(50 << 10);
    std::ofstream(files_.output_dir / "out.bin", std::ios::binary) << data;
    const std::string id =
        call("file_get_begin_request", {{"path", "out.bin"}}).content["download_id"];
    call("file_get_chunk_request", {{"download_id", id}, {"offset", 0}});
    std::ofstream(files_.output_dir / "out.bin", std::ios::binary | std::ios::app) << "more";
    EXPECT_EQ(error_of("file_get_chunk_request", {{"download_id", id}, {"offset", 16 << 10}}),
              "FileChanged");
}

TEST_F(FileTransferTest, SingleMessageApiStillWorks) {
    call("file_put_request", {{"path", "/data/input/small.txt"}}, {"hello"});
    EXPECT_EQ(slurp(files_.input_dir / "small.txt"), "hello");
    std::ofstream(files_.output_dir / "r.txt") << "result";
    auto got = call("file_get_request", {{"path", "r.txt"}});
    EXPECT_EQ(got.buffers.at(0), "result");
    std::ofstream(files_.output_dir / "big.txt") << std::string(65 << 10, 'x');
    EXPECT_EQ(error_of("file_get_request", {{"path", "big.txt"}}), "FileTooLarge");
}

TEST_F(FileTransferTest, OtherSessionsCannotTouchAnUpload) {
    const std::string id = begin("a", "x");
    SessionFiles other = files_;
    other.session_id = "s2";
    EXPECT_THROW(transfers_.handle("file_put_chunk_request",
                                   {{"session_id", "s2"}, {"upload_id", id}, {"offset", 0}}, {"x"},
                                   other, now_),
                 FileRequestError);
}

}  // namespace
}  // namespace cellblock
