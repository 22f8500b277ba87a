// The local file socket's parts that need no server: the copy hashed as it
// goes (file_copy.hpp) and the datagram packing (local_files.hpp).
#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <thread>

#include "cellblock/sha256.hpp"

#include "file_copy.hpp"
#include "file_transfer.hpp"
#include "local_files.hpp"

namespace cellblock {
namespace {
namespace fs = std::filesystem;

std::string pattern(std::size_t n) {
    std::string s(n, '\0');
    for (std::size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 131 + i / 4093) & 0xff);
    return s;
}

std::string slurp(const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), {}};
}

// Turns a hang into a failure: aborts with `what` unless destroyed within
// two minutes.
class Watchdog {
  public:
    explicit Watchdog(const char* what)
        : thread_([this, what] {
              for (int i = 0; i < 1200 && !over_; ++i)
                  std::this_thread::sleep_for(std::chrono::milliseconds(100));
              if (!over_) {
                  std::fprintf(stderr, "copy_and_hash hung: %s\n", what);
                  std::abort();
              }
          }) {}
    ~Watchdog() {
        over_ = true;
        thread_.join();
    }

  private:
    std::atomic<bool> over_{false};
    std::thread thread_;
};

class FileCopyTest : public ::testing::Test {
  protected:
    void SetUp() override {
        char tmpl[] = "/tmp/cellblock-copy-XXXXXX";
        root_ = ::mkdtemp(tmpl);
    }
    void TearDown() override { fs::remove_all(root_); }
    UniqueFd source(const std::string& data) {
        std::ofstream(root_ / "src", std::ios::binary) << data;
        return UniqueFd(::open((root_ / "src").c_str(), O_RDONLY | O_CLOEXEC));
    }
    UniqueFd destination(int flags = O_RDWR) {
        return UniqueFd(
            ::open((root_ / "dst").c_str(), flags | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    }
    fs::path root_;
};

TEST_F(FileCopyTest, CopiesAndHashesWhatLandedAcrossManySteps) {
    const std::string data = pattern((20 << 20) + 12345);  // three copy steps, many hash reads
    const UniqueFd src = source(data), dst = destination();
    CopyControl control;
    int steps = 0;
    const std::string digest =
        copy_and_hash(src.get(), dst.get(), data.size(), control, [&] { ++steps; });
    EXPECT_EQ(digest, sha256_hex(data));
    EXPECT_EQ(slurp(root_ / "dst"), data);
    EXPECT_EQ(control.done.load(), data.size());
    EXPECT_GE(steps, 3);
}

TEST_F(FileCopyTest, AnEmptyFileHasTheEmptyDigest) {
    const UniqueFd src = source(""), dst = destination();
    CopyControl control;
    EXPECT_EQ(copy_and_hash(src.get(), dst.get(), 0, control), sha256_hex(""));
}

TEST_F(FileCopyTest, ASourceShorterThanAnnouncedIsFileChanged) {
    const std::string data = pattern(1 << 20);
    const UniqueFd src = source(data), dst = destination();
    CopyControl control;
    try {
        copy_and_hash(src.get(), dst.get(), data.size() + 100, control);
        FAIL() << "a short source went through";
    } catch (const FileRequestError& e) {
        EXPECT_EQ(e.ename(), "FileChanged");
        EXPECT_NE(std::string(e.what()).find("1048576"), std::string::npos) << e.what();
    }
}

TEST_F(FileCopyTest, AWriteOnlyDestinationIsEnough) {
    // Where the destination cannot be read back, the digest is of the bytes written.
    const std::string data = pattern(3 << 20);
    const UniqueFd src = source(data), dst = destination(O_WRONLY);
    CopyControl control;
    EXPECT_EQ(copy_and_hash(src.get(), dst.get(), data.size(), control), sha256_hex(data));
    EXPECT_EQ(slurp(root_ / "dst"), data);
}

TEST_F(FileCopyTest, ADestinationThatCannotBeWrittenIsAnError) {
    const UniqueFd src = source(pattern(4096));
    destination();
    const UniqueFd dst(::open((root_ / "dst").c_str(), O_RDONLY | O_CLOEXEC));
    CopyControl control;
    try {
        copy_and_hash(src.get(), dst.get(), 4096, control);
        FAIL() << "a read-only destination was written";
    } catch (const FileRequestError& e) {
        EXPECT_EQ(e.ename(), "FileError");
        EXPECT_NE(std::string(e.what()).find("copy after 0"), std::string::npos) << e.what();
    }
}

// The copier runs ahead of the hash by at most the ring's eight slots, then
// waits for a free one. Whatever ends the hashing side while the copier
// waits (a cancel, an exception from on_step) must wake it, or joining it
// hangs. A watchdog turns a hang into a failure.
TEST_F(FileCopyTest, AHashingSideThatStopsReleasesAWaitingCopier) {
    const Watchdog watchdog("a copier waiting for a slot");
    const std::string data = pattern(64 << 20);
    const UniqueFd src = source(data);
    for (int round = 0; round < 20; ++round) {
        {
            const UniqueFd dst = destination();
            CopyControl control;
            // Slow enough at the first step that the copier fills the ring.
            const auto slow_then_cancel = [&] {
                std::this_thread::sleep_for(std::chrono::milliseconds(round % 4 * 5));
                control.cancel = true;
            };
            EXPECT_THROW(
                copy_and_hash(src.get(), dst.get(), data.size(), control, slow_then_cancel),
                FileRequestError);
            EXPECT_LT(fs::file_size(root_ / "dst"), data.size());
        }
        {
            const UniqueFd dst = destination();
            CopyControl control;
            const auto fails = [&] {
                std::this_thread::sleep_for(std::chrono::milliseconds(round % 4 * 5));
                throw std::runtime_error("progress failed");
            };
            EXPECT_THROW(copy_and_hash(src.get(), dst.get(), data.size(), control, fails),
                         std::runtime_error);
            EXPECT_TRUE(control.cancel.load());
        }
    }
}

TEST_F(FileCopyTest, ACancelStopsTheCopy) {
    const std::string data = pattern(64 << 20);
    const UniqueFd src = source(data), dst = destination();
    CopyControl control;
    try {
        copy_and_hash(src.get(), dst.get(), data.size(), control, [&] { control.cancel = true; });
        FAIL() << "a cancelled copy ran to its end";
    } catch (const FileRequestError& e) {
        EXPECT_EQ(e.ename(), "FileError");
        EXPECT_NE(std::string(e.what()).find("cancelled"), std::string::npos) << e.what();
    }
    EXPECT_LT(fs::file_size(root_ / "dst"), data.size());
}

// A copy that ends without copying anything more (cancelled before its first
// step, or a source that ends exactly at a step) must still wake the hashing
// thread, which waits for the next report. Run many times: the lost wake-up
// was a race. A watchdog turns a hang into a failure.
TEST_F(FileCopyTest, AnEndThatCopiesNothingMoreStillEnds) {
    const Watchdog watchdog("a lost wake-up");
    const std::string data = pattern(8 << 20);  // a whole number of slots exactly
    const UniqueFd src = source(data);
    for (int round = 0; round < 200; ++round) {
        const UniqueFd dst = destination();
        CopyControl control;
        control.cancel = true;
        EXPECT_THROW(copy_and_hash(src.get(), dst.get(), data.size(), control), FileRequestError);
        CopyControl more;
        try {
            copy_and_hash(src.get(), dst.get(), data.size() + 1, more);
            ADD_FAILURE() << "a source shorter than announced was copied";
        } catch (const FileRequestError& e) {
            EXPECT_EQ(e.ename(), "FileChanged") << e.what();
        }
    }
}

TEST_F(FileCopyTest, AnAppendOnlyDestinationGetsTheBytesInOrder) {
    // pwrite on O_APPEND appends whatever the offset: in order, that is the same.
    const std::string data = pattern(3 << 20);
    const UniqueFd src = source(data), dst = destination(O_RDWR | O_APPEND);
    CopyControl control;
    EXPECT_EQ(copy_and_hash(src.get(), dst.get(), data.size(), control), sha256_hex(data));
    EXPECT_EQ(slurp(root_ / "dst"), data);
}

TEST(LocalFramesTest, PackAndUnpackAreInverse) {
    const std::vector<std::string> frames = {"<IDS|MSG>", "sig", "{}", "", std::string(70000, 'x')};
    const std::string packed = pack_frames(frames);
    const auto back = unpack_frames(packed, 64);
    ASSERT_TRUE(back);
    ASSERT_EQ(back->size(), frames.size());
    for (std::size_t i = 0; i < frames.size(); ++i) EXPECT_EQ((*back)[i], frames[i]);
}

TEST(LocalFramesTest, MalformedPackingsAreRefused) {
    const std::string good = pack_frames({"a", "bc"});
    EXPECT_FALSE(unpack_frames("", 64));
    EXPECT_FALSE(unpack_frames(good.substr(0, good.size() - 1), 64)) << "a frame cut short";
    EXPECT_FALSE(unpack_frames(good + "x", 64)) << "bytes after the last frame";
    EXPECT_FALSE(unpack_frames(good, 1)) << "more frames than allowed";
    std::string huge = good;
    huge[4] = '\xff';  // the first frame's size says 255 bytes, far past the end
    EXPECT_FALSE(unpack_frames(huge, 64));
    const std::string lying_count("\xff\xff\xff\xff", 4);
    EXPECT_FALSE(unpack_frames(lying_count, 1u << 30)) << "a count past the bytes";
}

}  // namespace
}  // namespace cellblock
