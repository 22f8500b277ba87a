// FileTransfers as a value with a directory: uploads appear whole or not at
// all, digests are checked, caps say their numbers, downloads are one version.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "cellblock/sha256.hpp"

#include "file_copy.hpp"
#include "file_transfer.hpp"

namespace cellblock {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;
using Clock = FileTransfers::Clock;

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

// ------------------------------------------------------------------ local copies

// A local file as a client would pass it: its descriptor, open as asked.
int open_local(const fs::path& p, int flags, const std::string& data = {}) {
    if (!data.empty() || (flags & O_CREAT)) std::ofstream(p, std::ios::binary) << data;
    return ::open(p.c_str(), (flags & ~O_CREAT) | O_CLOEXEC);
}

// Runs the copy as the local file socket's thread would.
std::string run_copy(FileTransfers::LocalCopy& copy) {
    CopyControl control;
    return copy_and_hash(copy.src.get(), copy.dst.get(), copy.size, control);
}

TEST_F(FileTransferTest, LocalPutLandsWholeAtFinishWithTheDigestOfWhatLanded) {
    const std::string data = pattern(200 << 10);
    const UniqueFd src(open_local(root_ / "mine.csv", O_RDONLY, data));
    auto copy = transfers_.begin_local_put({{"path", "d/mine.csv"}, {"sha256", sha256_hex(data)}},
                                           src.get(), files_, now_);
    EXPECT_EQ(copy.sandbox_path, "/data/input/d/mine.csv");
    EXPECT_EQ(copy.size, data.size());
    EXPECT_EQ(transfers_.open_transfers(), 1u);
    const std::string digest = run_copy(copy);
    EXPECT_EQ(entries(files_.input_dir), 0u) << "visible before the finish";
    // An idle sweep long after does not drop a copy whose thread may still run.
    transfers_.expire(now_ + std::chrono::hours(1));
    auto done = transfers_.finish_local(copy.id, digest, files_);
    EXPECT_EQ(done.content["sha256"], sha256_hex(data));
    EXPECT_EQ(done.content["local"], true);
    ASSERT_TRUE(done.event);
    EXPECT_EQ(slurp(files_.input_dir / "d" / "mine.csv"), data);
    EXPECT_EQ(entries(files_.partial_dir), 0u);
    EXPECT_EQ(transfers_.open_transfers(), 0u);
    EXPECT_EQ(transfers_.input_bytes("s1"), data.size());
    EXPECT_TRUE(done.discard.empty());

    // Again, smaller, under the same name: swapped in whole; the old file is
    // handed back to be freed after the reply, and no longer counts.
    const std::string second = pattern(50 << 10, 'k');
    const UniqueFd src2(open_local(root_ / "mine2.csv", O_RDONLY, second));
    auto copy2 = transfers_.begin_local_put({{"path", "d/mine.csv"}}, src2.get(), files_, now_);
    auto done2 = transfers_.finish_local(copy2.id, run_copy(copy2), files_);
    EXPECT_EQ(slurp(files_.input_dir / "d" / "mine.csv"), second);
    ASSERT_FALSE(done2.discard.empty());
    EXPECT_EQ(slurp(done2.discard), data) << "the displaced file is the old one";
    EXPECT_EQ(transfers_.input_bytes("s1"), second.size());
    ::unlink(done2.discard.c_str());
    EXPECT_EQ(entries(files_.partial_dir), 0u);
}

TEST_F(FileTransferTest, LocalPutWithAnotherDigestIsDiscarded) {
    const std::string data = pattern(10 << 10);
    const UniqueFd src(open_local(root_ / "mine", O_RDONLY, data));
    auto copy = transfers_.begin_local_put({{"path", "x"}, {"sha256", sha256_hex("other")}},
                                           src.get(), files_, now_);
    const std::string digest = run_copy(copy);
    try {
        transfers_.finish_local(copy.id, digest, files_);
        FAIL() << "a copy with another digest was installed";
    } catch (const FileRequestError& e) {
        EXPECT_EQ(e.ename(), "ChecksumMismatch");
    }
    EXPECT_EQ(entries(files_.input_dir), 0u);
    EXPECT_EQ(entries(files_.partial_dir), 0u);
    EXPECT_EQ(transfers_.open_transfers(), 0u);
}

TEST_F(FileTransferTest, LocalPutRefusesWhatItCannotRead) {
    auto ename_of = [&](int fd, json content = {{"path", "x"}}) {
        const UniqueFd owned(fd);
        try {
            transfers_.begin_local_put(content, owned.get(), files_, now_);
        } catch (const FileRequestError& e) {
            return e.ename() + ": " + e.what();
        }
        return std::string("no error");
    };
    EXPECT_EQ(ename_of(open_local(root_ / "w", O_WRONLY | O_CREAT)),
              "FileError: the descriptor passed is not open for reading");
    EXPECT_EQ(ename_of(::open(root_.c_str(), O_RDONLY | O_DIRECTORY)),
              "FileError: the descriptor passed is not a regular file");
    EXPECT_EQ(ename_of(::open(root_.c_str(), O_PATH)),
              "FileError: the descriptor passed is not a regular file");
    int pipe_fds[2];
    ASSERT_EQ(::pipe(pipe_fds), 0);
    const UniqueFd write_end(pipe_fds[1]);
    EXPECT_EQ(ename_of(pipe_fds[0]), "FileError: the descriptor passed is not a regular file");
    EXPECT_EQ(
        ename_of(open_local(root_ / "r", O_RDONLY, "x"), {{"path", "../escape"}}).substr(0, 11),
        "InvalidPath");
    // The session's cap (1 MiB here) holds for a local copy as for a stream.
    EXPECT_EQ(ename_of(open_local(root_ / "big", O_RDONLY, pattern(2 << 20))).substr(0, 12),
              "FileTooLarge");
    EXPECT_EQ(transfers_.open_transfers(), 0u);
    EXPECT_EQ(entries(files_.partial_dir), 0u);
}

TEST_F(FileTransferTest, LocalCopiesCountAgainstTheTransferCaps) {
    const std::string data = pattern(1 << 10);
    std::vector<FileTransfers::LocalCopy> copies;
    std::vector<UniqueFd> fds;
    for (std::size_t i = 0; i < limits_.max_session_transfers; ++i) {
        fds.emplace_back(open_local(root_ / ("f" + std::to_string(i)), O_RDONLY, data));
        copies.push_back(transfers_.begin_local_put({{"path", "f" + std::to_string(i)}},
                                                    fds.back().get(), files_, now_));
    }
    fds.emplace_back(open_local(root_ / "one-more", O_RDONLY, data));
    EXPECT_THROW(transfers_.begin_local_put({{"path", "one-more"}}, fds.back().get(), files_, now_),
                 FileRequestError);
    // A local copy is not a chunked upload: its id takes no chunks.
    EXPECT_EQ(
        error_of("file_put_chunk_request", {{"upload_id", copies[0].id}, {"offset", 0}}, {"x"}),
        "TransferNotFound");
    for (auto& c : copies) transfers_.abort_local(c.id);
    EXPECT_EQ(transfers_.open_transfers(), 0u);
    EXPECT_EQ(entries(files_.partial_dir), 0u);
}

TEST_F(FileTransferTest, LocalGetWritesThePassedFileAndRefusesAChangedOne) {
    const std::string data = pattern(300 << 10);
    std::ofstream(files_.output_dir / "r.bin", std::ios::binary) << data;
    // Bytes already in the client's file go: it is cut to length 0 first.
    const UniqueFd dst(open_local(root_ / "back", O_RDWR, std::string(500 << 10, 'z')));
    auto copy =
        transfers_.begin_local_get({{"path", "/data/output/r.bin"}}, dst.get(), files_, now_);
    const std::string digest = run_copy(copy);
    auto done = transfers_.finish_local(copy.id, digest, files_);
    EXPECT_EQ(done.content["sha256"], sha256_hex(data));
    EXPECT_EQ(slurp(root_ / "back"), data);
    EXPECT_EQ(transfers_.open_transfers(), 0u);

    // The code rewrites its file during the copy: refused.
    auto again = transfers_.begin_local_get({{"path", "r.bin"}}, dst.get(), files_, now_);
    run_copy(again);
    std::ofstream(files_.output_dir / "r.bin", std::ios::binary | std::ios::app) << "more";
    try {
        transfers_.finish_local(again.id, digest, files_);
        FAIL() << "a changed file was handed out";
    } catch (const FileRequestError& e) {
        EXPECT_EQ(e.ename(), "FileChanged");
    }
    EXPECT_EQ(transfers_.open_transfers(), 0u);
}

TEST_F(FileTransferTest, LocalGetNeedsAWritableFileAndARealOutput) {
    std::ofstream(files_.output_dir / "r.bin") << "x";
    std::ofstream(root_ / "ro") << "";
    const UniqueFd read_only(open_local(root_ / "ro", O_RDONLY));
    try {
        transfers_.begin_local_get({{"path", "r.bin"}}, read_only.get(), files_, now_);
        ADD_FAILURE() << "a read-only descriptor was taken for a get";
    } catch (const FileRequestError& e) {
        EXPECT_NE(std::string(e.what()).find("not open for writing"), std::string::npos)
            << e.what();
    }
    EXPECT_EQ(transfers_.open_transfers(), 0u);
    // Write-only is enough: the copy reads what it wrote from its own buffer.
    const UniqueFd write_only(open_local(root_ / "wo", O_WRONLY | O_CREAT));
    auto copy = transfers_.begin_local_get({{"path", "r.bin"}}, write_only.get(), files_, now_);
    const auto done = transfers_.finish_local(copy.id, run_copy(copy), files_);
    EXPECT_EQ(done.content["sha256"], sha256_hex("x"));
    EXPECT_EQ(slurp(root_ / "wo"), "x");
    const UniqueFd dst(open_local(root_ / "rw", O_RDWR | O_CREAT));
    // A symlink the code planted to a host file is not followed.
    fs::create_symlink("/etc/passwd", files_.output_dir / "link");
    EXPECT_THROW(transfers_.begin_local_get({{"path", "link"}}, dst.get(), files_, now_),
                 FileRequestError);
    EXPECT_EQ(slurp(root_ / "rw"), "");
    EXPECT_EQ(transfers_.open_transfers(), 0u);
}

TEST_F(FileTransferTest, ASessionClosingDropsItsLocalCopies) {
    const UniqueFd src(open_local(root_ / "s", O_RDONLY, pattern(4 << 10)));
    auto copy = transfers_.begin_local_put({{"path", "s"}}, src.get(), files_, now_);
    run_copy(copy);
    transfers_.session_closed("s1");
    EXPECT_EQ(entries(files_.partial_dir), 0u);
    EXPECT_THROW(transfers_.finish_local(copy.id, "", files_), FileRequestError);
    EXPECT_EQ(entries(files_.input_dir), 0u);
}

}  // namespace
}  // namespace cellblock
