// A remote session's files through its kernel (kernel_files.hpp), against a
// kernel played here: the protocol of kernel-shim/cellblock_ipykernel.py
// (FileTransfers) over a temporary directory, its answers delivered later,
// as the relay's would be. The kernel's side itself is tested against the
// real kernel in tests/python/test_kernel_shim.py.
#include <gtest/gtest.h>

#include <unistd.h>

#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>

#include "cellblock/sha256.hpp"
#include "kernel_files.hpp"

namespace cellblock {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

std::string random_bytes(std::size_t n, unsigned seed) {
    std::mt19937 gen(seed);
    std::string s(n, '\0');
    for (auto& c : s) c = static_cast<char>(gen());
    return s;
}

std::string read_file(const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), {}};
}

// The names in `dir` (what a move left there).
std::set<std::string> names(const fs::path& dir) {
    std::set<std::string> out;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(dir, ec)) out.insert(e.path().filename());
    return out;
}

void write_file(const fs::path& p, const std::string& bytes) {
    fs::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << bytes;
}

// The kernel: answers each request in a later pump(), like the relay.
class PlayedKernel {
  public:
    explicit PlayedKernel(fs::path root) : input_(root / "input"), output_(root / "output") {
        fs::create_directories(input_);
        fs::create_directories(output_);
    }

    AskKernel ask() {
        return [this](const std::string& type, json content, std::vector<std::string> buffers,
                      KernelAnswered answered) {
            if (gone) return false;
            requests.push_back({type, content, buffers.empty() ? 0 : buffers[0].size()});
            // A silent kernel never sees the request.
            queue_.push_back(
                {silent ? KernelAnswer{} : answer(type, content, buffers), std::move(answered)});
            return true;
        };
    }
    // Delivers every answer due, and those their callbacks led to.
    void pump() {
        while (!queue_.empty()) {
            auto [answer, answered] = std::move(queue_.front());
            queue_.pop_front();
            if (silent) {
                answered(nullptr);
            } else {
                answered(&answer);
            }
        }
    }

    struct Seen {
        std::string type;
        json content;
        std::size_t bytes;
    };
    std::vector<Seen> requests;
    bool gone = false;     // ask() cannot send
    bool silent = false;   // answers never come
    bool corrupt = false;  // flips a byte of what it writes
    bool disk_full_at_second = false;
    std::function<void(KernelAnswer&)> tamper;  // with a read's answer
    fs::path input_, output_;

  private:
    KernelAnswer answer(const std::string& type, const json& c,
                        const std::vector<std::string>& buffers) {
        KernelAnswer a;
        const std::string id = c.value("transfer", "");
        if (type == kKernelFileAbort) {
            a.content = {{"status", "ok"}, {"aborted", writes_.erase(id) + reads_.erase(id) > 0}};
            return a;
        }
        if (type == kKernelFileWrite) {
            auto& w = writes_[id];
            if (c["offset"] == 0) w = {};
            if (disk_full_at_second && c["offset"] != 0) {
                writes_.erase(id);
                a.content = {{"status", "error"}, {"ename", "DiskFull"}, {"evalue", "full"}};
                return a;
            }
            std::string chunk = buffers.at(0);
            if (corrupt && !chunk.empty()) chunk[0] ^= 1;
            w.bytes += chunk;
            a.content = {{"status", "ok"}, {"written", w.bytes.size()}};
            if (c["last"] == true) {
                write_file(input_ / c["path"].get<std::string>(), w.bytes);
                a.content["sha256"] = sha256_hex(w.bytes);
                writes_.erase(id);
            }
            return a;
        }
        if (type == kKernelFileRead) {
            auto& r = reads_[id];
            if (c["offset"] == 0) r = {read_file(output_ / c["path"].get<std::string>()), 0};
            const std::size_t offset = c["offset"];
            const std::size_t n =
                std::min<std::size_t>(c["length"].get<std::size_t>(), r.bytes.size() - offset);
            a.buffers.push_back(r.bytes.substr(offset, n));
            const bool eof = offset + n >= r.bytes.size();
            a.content = {
                {"status", "ok"}, {"size", r.bytes.size()}, {"offset", offset}, {"eof", eof}};
            if (eof) a.content["sha256"] = sha256_hex(r.bytes);
            if (tamper) tamper(a);
            return a;
        }
        a.content = {{"status", "error"}, {"ename", "FileError"}, {"evalue", "unknown"}};
        return a;
    }
    struct Write {
        std::string bytes;
    };
    struct Read {
        std::string bytes;
        std::size_t sent = 0;
    };
    std::map<std::string, Write> writes_;
    std::map<std::string, Read> reads_;
    std::deque<std::pair<KernelAnswer, KernelAnswered>> queue_;
};

class KernelFilesTest : public ::testing::Test {
  protected:
    void SetUp() override {
        char tmpl[] = "/tmp/cellblock-kf-XXXXXX";
        root_ = ::mkdtemp(tmpl);
        kernel_ = std::make_unique<PlayedKernel>(root_ / "kernel");
        fs::create_directories(root_ / "front");
    }
    void TearDown() override { fs::remove_all(root_); }

    // Runs a move to its end; its error, if any.
    std::optional<FileRequestError> push(const std::string& bytes, const std::string& path) {
        write_file(root_ / "front" / "staged", bytes);
        return run([&](KernelFilesDone done) {
            push_to_kernel(kernel_->ask(), root_ / "front" / "staged", path, std::move(done));
        });
    }
    std::optional<FileRequestError> pull(const std::string& path, std::uint64_t max) {
        return run([&](KernelFilesDone done) {
            pull_from_kernel(kernel_->ask(), path, root_ / "front" / "out" / path, max,
                             "the test's limit", std::move(done));
        });
    }
    std::optional<FileRequestError> run(const std::function<void(KernelFilesDone)>& start) {
        bool ended = false;
        std::optional<FileRequestError> result;
        start([&](std::optional<FileRequestError> e) {
            EXPECT_FALSE(ended) << "done called twice";
            ended = true;
            result = std::move(e);
        });
        kernel_->pump();
        EXPECT_TRUE(ended) << "the move never ended";
        return result;
    }
    std::size_t count(const std::string& type) const {
        return static_cast<std::size_t>(
            std::count_if(kernel_->requests.begin(), kernel_->requests.end(),
                          [&](const PlayedKernel::Seen& s) { return s.type == type; }));
    }

    fs::path root_;
    std::unique_ptr<PlayedKernel> kernel_;
};

TEST_F(KernelFilesTest, APutGoesInChunksAndEndsWhenTheKernelsHashIsTheFronts) {
    const std::string bytes = random_bytes(2 * kKernelFileChunk + 12345, 1);
    EXPECT_FALSE(push(bytes, "sub/data.bin").has_value());
    EXPECT_EQ(read_file(kernel_->input_ / "sub" / "data.bin"), bytes);
    ASSERT_EQ(kernel_->requests.size(), 3u);
    for (std::size_t i = 0; i < 3; ++i) {
        const json& c = kernel_->requests[i].content;
        EXPECT_EQ(c["offset"], i * kKernelFileChunk);
        EXPECT_EQ(c["last"], i == 2);
        EXPECT_EQ(c["path"], "sub/data.bin");
        EXPECT_EQ(c["transfer"], kernel_->requests[0].content["transfer"]);
    }
    EXPECT_EQ(kernel_->requests[2].bytes, 12345u);
}

TEST_F(KernelFilesTest, AtMostAWindowOfChunksIsInFlightAndTheyGoInOrder) {
    const std::string bytes = random_bytes(6 * kKernelFileChunk, 9);
    write_file(root_ / "front" / "staged", bytes);
    bool ended = false;
    push_to_kernel(kernel_->ask(), root_ / "front" / "staged", "six",
                   [&](std::optional<FileRequestError> e) {
                       EXPECT_FALSE(e.has_value());
                       ended = true;
                   });
    // Nothing answered yet: the window is full.
    EXPECT_EQ(kernel_->requests.size(), static_cast<std::size_t>(kKernelFileWindow));
    kernel_->pump();
    ASSERT_TRUE(ended);
    ASSERT_EQ(kernel_->requests.size(), 6u);
    for (std::size_t i = 0; i < 6; ++i) {
        EXPECT_EQ(kernel_->requests[i].content["offset"], i * kKernelFileChunk);
    }
    EXPECT_EQ(read_file(kernel_->input_ / "six"), bytes);

    // A get asks once until it knows the size, then a window at a time.
    write_file(kernel_->output_ / "six", bytes);
    kernel_->requests.clear();
    ended = false;
    pull_from_kernel(kernel_->ask(), "six", root_ / "front" / "six", 1ull << 30, "",
                     [&](std::optional<FileRequestError> e) {
                         EXPECT_FALSE(e.has_value());
                         ended = true;
                     });
    EXPECT_EQ(kernel_->requests.size(), 1u);
    kernel_->pump();
    ASSERT_TRUE(ended);
    EXPECT_EQ(kernel_->requests.size(), 6u);
    EXPECT_EQ(read_file(root_ / "front" / "six"), bytes);
}

TEST_F(KernelFilesTest, AnEmptyFileIsOneLastRequest) {
    EXPECT_FALSE(push("", "empty").has_value());
    ASSERT_EQ(kernel_->requests.size(), 1u);
    EXPECT_EQ(kernel_->requests[0].content["last"], true);
    EXPECT_TRUE(fs::exists(kernel_->input_ / "empty"));
}

TEST_F(KernelFilesTest, BytesTheKernelHashesOtherwiseFailThePut) {
    kernel_->corrupt = true;
    const auto error = push(random_bytes(1000, 2), "x");
    ASSERT_TRUE(error.has_value());
    EXPECT_EQ(error->ename(), "FileError");
    EXPECT_NE(std::string(error->what()).find("hashes to"), std::string::npos) << error->what();
}

TEST_F(KernelFilesTest, AFullInputIsFileTooLargeAndNothingMoreIsSent) {
    kernel_->disk_full_at_second = true;
    const auto error = push(random_bytes(kKernelFileChunk + 1, 3), "big");
    ASSERT_TRUE(error.has_value());
    EXPECT_EQ(error->ename(), "FileTooLarge");
    EXPECT_NE(std::string(error->what()).find("the kernel"), std::string::npos);
    EXPECT_EQ(count(kKernelFileWrite), 2u);
    EXPECT_EQ(count(kKernelFileAbort), 0u);  // the kernel dropped it itself
}

TEST_F(KernelFilesTest, NoAnswerFailsTheMoveAndTheKernelIsToldToDropIt) {
    kernel_->silent = true;
    const auto error = push(random_bytes(100, 4), "x");
    ASSERT_TRUE(error.has_value());
    EXPECT_EQ(error->ename(), "FileError");
    EXPECT_NE(std::string(error->what()).find("no answer"), std::string::npos);
    EXPECT_EQ(count(kKernelFileAbort), 1u);
    EXPECT_FALSE(fs::exists(kernel_->input_ / "x"));
}

TEST_F(KernelFilesTest, AKernelThatCannotBeAskedEndsTheMoveAtOnce) {
    kernel_->gone = true;
    const auto put = push("abc", "x");
    ASSERT_TRUE(put.has_value());
    EXPECT_EQ(put->ename(), "FileError");
    write_file(kernel_->output_ / "y", "abc");
    const auto get = pull("y", 100);
    ASSERT_TRUE(get.has_value());
    EXPECT_EQ(names(root_ / "front" / "out"), std::set<std::string>{});
}

TEST_F(KernelFilesTest, AGetComesInChunksBesideItsPlaceAndIsRenamedWhole) {
    const std::string bytes = random_bytes(kKernelFileChunk + 7, 5);
    write_file(kernel_->output_ / "plots" / "a.png", bytes);
    EXPECT_FALSE(pull("plots/a.png", bytes.size()).has_value());
    EXPECT_EQ(read_file(root_ / "front" / "out" / "plots" / "a.png"), bytes);
    EXPECT_EQ(names(root_ / "front" / "out" / "plots"), std::set<std::string>{"a.png"});
    EXPECT_EQ(count(kKernelFileRead), 2u);
}

TEST_F(KernelFilesTest, TwoGetsOfOnePathAtOnceEachLandWhole) {
    const std::string bytes = random_bytes(3 * kKernelFileChunk, 11);
    write_file(kernel_->output_ / "same", bytes);
    int ended = 0;
    for (int i = 0; i < 2; ++i) {
        pull_from_kernel(kernel_->ask(), "same", root_ / "front" / "out" / "same", 1ull << 30, "",
                         [&](std::optional<FileRequestError> e) {
                             EXPECT_FALSE(e.has_value());
                             ++ended;
                         });
    }
    kernel_->pump();
    EXPECT_EQ(ended, 2);
    EXPECT_EQ(read_file(root_ / "front" / "out" / "same"), bytes);
    EXPECT_EQ(names(root_ / "front" / "out"), std::set<std::string>{"same"});
}

TEST_F(KernelFilesTest, AGetPastItsLimitIsFileTooLargeAndKeepsNothing) {
    write_file(kernel_->output_ / "big", random_bytes(1000, 6));
    const auto error = pull("big", 999);
    ASSERT_TRUE(error.has_value());
    EXPECT_EQ(error->ename(), "FileTooLarge");
    EXPECT_NE(std::string(error->what()).find("the test's limit"), std::string::npos);
    EXPECT_EQ(names(root_ / "front" / "out"), std::set<std::string>{});
    EXPECT_EQ(count(kKernelFileAbort), 1u);
}

TEST_F(KernelFilesTest, AnswersThatDoNotAddUpAreRefused) {
    write_file(kernel_->output_ / "f", random_bytes(kKernelFileChunk + 10, 7));
    // More bytes than the file has left.
    kernel_->tamper = [](KernelAnswer& a) { a.buffers[0] += "extra"; };
    auto error = pull("f", 1ull << 30);
    ASSERT_TRUE(error.has_value());
    EXPECT_EQ(error->ename(), "FileError");
    // A size that moves between chunks.
    kernel_->requests.clear();
    int n = 0;
    kernel_->tamper = [&n](KernelAnswer& a) {
        if (n++ == 1) a.content["size"] = a.content["size"].get<std::uint64_t>() + 1;
    };
    error = pull("f", 1ull << 30);
    ASSERT_TRUE(error.has_value());
    EXPECT_EQ(error->ename(), "FileError");
    // A digest that is not of the bytes sent.
    kernel_->tamper = [](KernelAnswer& a) {
        if (a.content.contains("sha256")) a.content["sha256"] = std::string(64, '0');
    };
    error = pull("f", 1ull << 30);
    ASSERT_TRUE(error.has_value());
    EXPECT_EQ(error->ename(), "FileError");
    EXPECT_EQ(names(root_ / "front" / "out"), std::set<std::string>{});
}

TEST_F(KernelFilesTest, AMissingFileIsTheKernelsFileNotFound) {
    kernel_->tamper = [](KernelAnswer& a) {
        a.content = {{"status", "error"}, {"ename", "FileNotFound"}, {"evalue", "no such file"}};
        a.buffers.clear();
    };
    const auto error = pull("nope", 100);
    ASSERT_TRUE(error.has_value());
    EXPECT_EQ(error->ename(), "FileNotFound");
}

TEST_F(KernelFilesTest, TheListingKeepsOnlyWellFormedEntries) {
    const json listed = {{"status", "ok"},
                         {"truncated", false},
                         {"files",
                          {{{"path", "a.csv"}, {"size", 10}, {"mtime", 1.5}},
                           {{"path", "../escape"}, {"size", 1}, {"mtime", 1}},
                           {{"path", "/etc/passwd"}, {"size", 1}, {"mtime", 1}},
                           {{"path", "sub/b.png"}, {"size", -1}, {"mtime", 1}},
                           {{"path", "sub/c.png"}, {"size", 3}, {"mtime", "x"}},
                           "not an object",
                           {{"path", "sub/d.png"}, {"size", 4}, {"mtime", 2}}}}};
    json got;
    bool ended = false;
    list_kernel_files(
        [&](const std::string& type, json, std::vector<std::string>, KernelAnswered answered) {
            EXPECT_EQ(type, kKernelFileList);
            KernelAnswer a{listed, {}};
            answered(&a);
            return true;
        },
        [&](json reply, std::optional<FileRequestError> error) {
            ended = true;
            EXPECT_FALSE(error.has_value());
            got = std::move(reply);
        });
    ASSERT_TRUE(ended);
    ASSERT_EQ(got["files"].size(), 2u) << got.dump();
    EXPECT_EQ(got["files"][0]["path"], "a.csv");
    EXPECT_EQ(got["files"][0]["mtime"], 1);
    EXPECT_EQ(got["files"][1]["path"], "sub/d.png");
    EXPECT_EQ(got["truncated"], false);
}

}  // namespace
}  // namespace cellblock
