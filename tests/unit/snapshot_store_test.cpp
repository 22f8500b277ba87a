// SnapshotStore and the seal of snapshots at rest (session_snapshots.hpp,
// snapshot_cipher.hpp), on real files in a temporary directory.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <random>
#include <string>
#include <thread>

#include "../../server/server_key.hpp"
#include "../../server/session_snapshots.hpp"
#include "error_of.hpp"

namespace cellblock {
namespace {
namespace fs = std::filesystem;

std::string read_file(const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_file(const fs::path& p, const std::string& text) {
    fs::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << text;
}

using cellblock::testing::error_of;

// Every byte of every file under `dir`.
std::string all_bytes_under(const fs::path& dir) {
    std::string all;
    for (const auto& e : fs::recursive_directory_iterator(dir)) {
        if (e.is_regular_file()) all += read_file(e.path());
    }
    return all;
}

class SnapshotStoreTest : public ::testing::Test {
  protected:
    void SetUp() override {
        base = fs::temp_directory_path() /
               ("cellblock-snapshot-test-" + std::to_string(::getpid()) + "-" +
                ::testing::UnitTest::GetInstance()->current_test_info()->name());
        fs::remove_all(base);
        output = base / "output";
        input = base / "input";
        fs::create_directories(output);
        fs::create_directories(input);
    }
    void TearDown() override { fs::remove_all(base); }

    // What a kernel leaves behind before its sandbox goes.
    void kernel_wrote(const std::string& snapshot) {
        write_file(output / kSnapshotFile, snapshot);
        write_file(input / "data.csv", "a,b\nsecret-input-row,2\n");
        write_file(input / "sub" / "deep.txt", "secret-deep-file");
    }

    fs::path base, output, input;
};

TEST_F(SnapshotStoreTest, KeptFilesRevealNothingAndComeBackWhole) {
    SnapshotStore store(base / "store");
    std::string snapshot = "secret-namespace-bytes ";
    for (int i = 0; i < 200000; ++i) snapshot += std::to_string(i);  // past one 1 MiB chunk
    kernel_wrote(snapshot);
    const std::uint64_t bytes = store.keep("s1", output, input);
    EXPECT_EQ(bytes, snapshot.size());
    EXPECT_FALSE(fs::exists(output / kSnapshotFile)) << "moved, not copied";
    EXPECT_TRUE(store.holds("s1"));
    EXPECT_EQ(fs::status(base / "store" / "s1").permissions() & fs::perms::all,
              fs::perms::owner_all);
    // A copy of the state dir: none of the session's bytes in the clear.
    const std::string at_rest = all_bytes_under(base / "store");
    for (const char* secret : {"secret-namespace-bytes", "secret-input-row", "secret-deep-file"}) {
        EXPECT_EQ(at_rest.find(secret), std::string::npos) << secret;
    }
    const auto info = store.info("s1");
    ASSERT_TRUE(info.has_value());
    EXPECT_GT(info->bytes, snapshot.size());
    EXPECT_GT(info->kept_at, 0);
    EXPECT_EQ(store.total_bytes(), info->bytes);

    const fs::path next = base / "next-input";
    fs::create_directories(next);
    store.place("s1", next);
    EXPECT_EQ(read_file(next / kSnapshotFile), snapshot);
    EXPECT_EQ(read_file(next / "data.csv"), "a,b\nsecret-input-row,2\n");
    EXPECT_EQ(read_file(next / "sub" / "deep.txt"), "secret-deep-file");

    store.remove("s1");
    EXPECT_FALSE(store.holds("s1"));
    EXPECT_FALSE(fs::exists(base / "store" / "s1"));
}

TEST_F(SnapshotStoreTest, AChangedByteIsRefusedNotRestored) {
    SnapshotStore store(base / "store");
    kernel_wrote(std::string(5000, 'x'));
    store.keep("s1", output, input);
    const fs::path kept = base / "store" / "s1" / "snapshot";
    {
        // Flipped, not overwritten: a constant equals the random ciphertext's
        // byte once in 256 runs, and then nothing had changed.
        std::fstream f(kept, std::ios::in | std::ios::out | std::ios::binary);
        f.seekg(100);
        const char was = static_cast<char>(f.get());
        f.seekp(100);
        f.put(static_cast<char>(was ^ 0x5a));
    }
    const fs::path next = base / "next-input";
    fs::create_directories(next);
    try {
        store.place("s1", next);
        ADD_FAILURE() << "a changed snapshot was placed";
    } catch (const SnapshotError& e) {
        EXPECT_NE(std::string(e.what()).find("integrity"), std::string::npos) << e.what();
    }
    EXPECT_FALSE(fs::exists(next / kSnapshotFile)) << "nothing half written is left";
}

TEST_F(SnapshotStoreTest, AFileMovedBetweenSessionsFailsItsCheck) {
    SnapshotStore store(base / "store");
    kernel_wrote("session one");
    store.keep("s1", output, input);
    kernel_wrote("session two");
    store.keep("s2", output, input);
    // s1's sealed snapshot put in s2's place: another key, another label.
    fs::copy_file(base / "store" / "s1" / "snapshot", base / "store" / "s2" / "snapshot",
                  fs::copy_options::overwrite_existing);
    const fs::path next = base / "next-input";
    fs::create_directories(next);
    EXPECT_THROW(store.place("s2", next), SnapshotError);
}

TEST_F(SnapshotStoreTest, ASecondStoreOnTheSameDirHoldsNoKey) {
    // A restarted server (or a copied state dir) cannot open what it did not seal.
    fs::path next = base / "next-input";
    fs::create_directories(next);
    {
        SnapshotStore store(base / "store");
        kernel_wrote("kept by the first server");
        store.keep("s1", output, input);
    }
    SnapshotStore again(base / "store");
    EXPECT_FALSE(again.holds("s1"));
    EXPECT_THROW(again.place("s1", next), SnapshotError);
}

TEST_F(SnapshotStoreTest, ThePerSessionCapRefusesWithTheNumbers) {
    SnapshotCaps caps;
    caps.per_session = 1 << 20;
    SnapshotStore store(base / "store", caps);
    kernel_wrote(std::string(2 << 20, 'x'));
    try {
        store.keep("s1", output, input);
        ADD_FAILURE() << "over the cap was kept";
    } catch (const StorageFull& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("3 MB"), std::string::npos) << what;
        EXPECT_NE(what.find("cap of 1 MB"), std::string::npos) << what;
        EXPECT_NE(what.find("--snapshot-max-mb"), std::string::npos) << what;
    }
    EXPECT_FALSE(store.holds("s1"));
    EXPECT_FALSE(fs::exists(base / "store" / "s1"));
    EXPECT_TRUE(fs::exists(output / kSnapshotFile)) << "the kernel's file is left for the next try";
}

TEST_F(SnapshotStoreTest, TheServerCapCountsEverySessionsSnapshot) {
    SnapshotCaps caps;
    caps.total = 3 << 20;
    SnapshotStore store(base / "store", caps);
    kernel_wrote(std::string(2 << 20, 'a'));
    store.keep("s1", output, input);
    kernel_wrote(std::string(2 << 20, 'b'));
    try {
        store.keep("s2", output, input);
        ADD_FAILURE() << "over the server's cap was kept";
    } catch (const StorageFull& e) {
        EXPECT_NE(std::string(e.what()).find("--snapshots-max-mb"), std::string::npos) << e.what();
    }
    // Keeping s1 again replaces its own: only the others count.
    EXPECT_NO_THROW(store.keep("s1", output, input));
    store.remove("s1");
    kernel_wrote(std::string(2 << 20, 'b'));
    EXPECT_NO_THROW(store.keep("s2", output, input));
}

// The server's way (Server::keep_snapshot): begun and finished on the
// loop's thread, sealed on another.
TEST_F(SnapshotStoreTest, AKeepSealedOnAnotherThreadIsKeptOnceFinished) {
    SnapshotStore store(base / "store");
    kernel_wrote("secret-namespace-bytes");
    const auto keeping = store.begin_keep("s1", output, input);
    EXPECT_FALSE(store.holds("s1")) << "held before it is sealed";
    std::thread([keeping] { keeping->seal(); }).join();
    EXPECT_EQ(store.finish_keep(*keeping), std::string("secret-namespace-bytes").size());
    ASSERT_TRUE(store.holds("s1"));
    const fs::path next = base / "next-input";
    fs::create_directories(next);
    const auto placing = store.begin_place("s1", next);
    std::thread([&placing] { placing->open(); }).join();
    EXPECT_EQ(read_file(next / kSnapshotFile), "secret-namespace-bytes");
    EXPECT_EQ(read_file(next / "sub" / "deep.txt"), "secret-deep-file");
    // A second keep of the same session while one is under way is refused.
    kernel_wrote("again");
    const auto first = store.begin_keep("s1", output, input);
    EXPECT_THROW(store.begin_keep("s1", output, input), SnapshotError);
    store.abandon(*first);
    EXPECT_FALSE(fs::exists(base / "store" / "s1"));
}

// A followed place (SnapshotPlacing::follow): the snapshot's file stands in
// the new input dir, empty and of its final mode, before open() writes it,
// and follow() names its final size; open() fills it and places the input
// files after it.
TEST_F(SnapshotStoreTest, AFollowedPlaceMakesTheSnapshotsFileFirstAndNamesItsSize) {
    SnapshotStore store(base / "store");
    const std::string snapshot = "secret-namespace-bytes, many of them";
    kernel_wrote(snapshot);
    const auto keeping = store.begin_keep("s1", output, input);
    keeping->seal();
    store.finish_keep(*keeping);
    const fs::path next = base / "next-input";
    fs::create_directories(next);
    const auto placing = store.begin_place("s1", next);
    EXPECT_EQ(placing->follow(), snapshot.size());
    ASSERT_TRUE(fs::exists(next / kSnapshotFile));
    EXPECT_EQ(fs::file_size(next / kSnapshotFile), 0u);
    EXPECT_EQ(fs::status(next / kSnapshotFile).permissions(),
              fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read |
                  fs::perms::others_read);
    EXPECT_FALSE(fs::exists(next / "data.csv")) << "the input files come after";
    placing->open();
    EXPECT_EQ(read_file(next / kSnapshotFile), snapshot);
    EXPECT_EQ(read_file(next / "sub" / "deep.txt"), "secret-deep-file");
}

TEST_F(SnapshotStoreTest, ASessionRemovedWhileItsKeepIsSealedLeavesNothing) {
    SnapshotStore store(base / "store");
    kernel_wrote("secret-namespace-bytes");
    const auto keeping = store.begin_keep("s1", output, input);
    store.remove("s1");  // closed while the seal runs
    keeping->seal();
    EXPECT_TRUE(fs::exists(base / "store" / "s1")) << "not removed under the seal";
    EXPECT_THROW(store.finish_keep(*keeping), SnapshotError);
    EXPECT_FALSE(store.holds("s1"));
    EXPECT_FALSE(fs::exists(base / "store" / "s1"));
    // And the next keep of another session is not counted against it.
    kernel_wrote("next");
    EXPECT_NO_THROW(store.keep("s2", output, input));
}

TEST_F(SnapshotStoreTest, KeepsNeverFinishedAreDroppedWhenTheServerStops) {
    SnapshotStore store(base / "store");
    kernel_wrote("secret-namespace-bytes");
    const auto keeping = store.begin_keep("s1", output, input);
    keeping->seal();  // sealed, then the server stopped before finishing it
    store.abandon_unfinished();
    EXPECT_FALSE(fs::exists(base / "store" / "s1"));
    EXPECT_FALSE(store.holds("s1"));
    kernel_wrote("next");
    EXPECT_NO_THROW(store.keep("s1", output, input)) << "nothing of it is under way any more";
}

TEST_F(SnapshotStoreTest, TheServerCapCountsKeepsUnderWay) {
    SnapshotCaps caps;
    caps.total = 3 << 20;
    SnapshotStore store(base / "store", caps);
    kernel_wrote(std::string(2 << 20, 'a'));
    const auto first = store.begin_keep("s1", output, input);
    const fs::path output2 = base / "output2";
    fs::create_directories(output2);
    write_file(output2 / kSnapshotFile, std::string(2 << 20, 'b'));
    EXPECT_THROW(store.begin_keep("s2", output2, input), StorageFull)
        << "two keeps under way passed the server's cap together";
    store.abandon(*first);
    EXPECT_NO_THROW(store.keep("s2", output2, input));
}

// A kernel writing its snapshot in pieces, as a streamed keep reads it.
void write_in_pieces(const fs::path& file, const std::string& content, std::size_t piece) {
    const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600);
    ASSERT_GE(fd, 0);
    for (std::size_t at = 0; at < content.size(); at += piece) {
        const std::size_t n = std::min(piece, content.size() - at);
        ASSERT_EQ(::write(fd, content.data() + at, n), static_cast<ssize_t>(n));
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    ::close(fd);
}

constexpr auto kWait = std::chrono::seconds(60);

TEST_F(SnapshotStoreTest, AStreamedKeepSealsTheSnapshotWhileTheKernelWritesIt) {
    SnapshotStore store(base / "store");
    write_file(input / "data.csv", "secret-input-row");
    write_file(output / kSnapshotFile, "a failed save's leftovers");
    const auto keeping = store.begin_streamed_keep("s1", output, input, kWait);
    EXPECT_FALSE(fs::exists(output / kSnapshotFile)) << "the old file would be read as this one";
    std::string snapshot;
    for (int i = 0; i < 400000; ++i) snapshot += std::to_string(i);  // a few 1 MiB chunks
    std::thread sealing([keeping] { keeping->seal(); });
    write_in_pieces(output / kSnapshotFile, snapshot, 100000);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_GT(keeping->sealed.load(), 0u) << "nothing was sealed before the kernel answered";
    keeping->written = true;  // the kernel answered
    sealing.join();
    EXPECT_EQ(store.finish_keep(*keeping), snapshot.size());
    EXPECT_EQ(all_bytes_under(base / "store").find("secret-input-row"), std::string::npos);
    const fs::path next = base / "next-input";
    fs::create_directories(next);
    store.place("s1", next);
    EXPECT_EQ(read_file(next / kSnapshotFile), snapshot);
    EXPECT_EQ(read_file(next / "data.csv"), "secret-input-row");
}

TEST_F(SnapshotStoreTest, AStreamedKeepWhoseKernelWroteNothingSaysSo) {
    SnapshotStore store(base / "store");
    const auto keeping = store.begin_streamed_keep("s1", output, input, kWait);
    std::thread sealing([keeping] {
        try {
            keeping->seal();
            ADD_FAILURE() << "sealed a snapshot that was never written";
        } catch (const SnapshotError& e) {
            EXPECT_NE(std::string(e.what()).find("left no snapshot file"), std::string::npos)
                << e.what();
        }
    });
    keeping->written = true;
    sealing.join();
    store.abandon(*keeping);
    EXPECT_FALSE(fs::exists(base / "store" / "s1"));
}

TEST_F(SnapshotStoreTest, AStreamedKeepNobodyWaitsForStopsAndLeavesNothing) {
    SnapshotStore store(base / "store");
    const auto keeping = store.begin_streamed_keep("s1", output, input, kWait);
    std::thread sealing([keeping] { EXPECT_THROW(keeping->seal(), SnapshotError); });
    write_file(output / kSnapshotFile, "half a snapshot");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    keeping->cancelled = true;  // the save failed, or the session ended
    sealing.join();
    store.abandon(*keeping);
    EXPECT_FALSE(fs::exists(base / "store" / "s1"));
    EXPECT_FALSE(fs::exists(output / kSnapshotFile)) << "the session stays awake: no snapshot left "
                                                        "in its files";
}

TEST_F(SnapshotStoreTest, AStreamedKeepThatOutgrowsItsCapIsRefusedWithTheNumbers) {
    SnapshotCaps caps;
    caps.per_session = 1 << 20;
    SnapshotStore store(base / "store", caps);
    const auto keeping = store.begin_streamed_keep("s1", output, input, kWait);
    write_file(output / kSnapshotFile, std::string(3 << 20, 'x'));  // a kernel that never stops
    try {
        keeping->seal();
        ADD_FAILURE() << "sealed past the cap";
    } catch (const StorageFull& e) {
        EXPECT_NE(std::string(e.what()).find("1 MB"), std::string::npos) << e.what();
    }
    EXPECT_LE(keeping->sealed.load(), std::uint64_t{3} << 20);
    store.abandon(*keeping);
    EXPECT_FALSE(fs::exists(base / "store" / "s1"));
}

TEST_F(SnapshotStoreTest, AStreamedKeepOfAFileReplacedWhileReadIsNotKept) {
    SnapshotStore store(base / "store");
    const auto keeping = store.begin_streamed_keep("s1", output, input, kWait);
    write_file(output / kSnapshotFile, "what was read first");
    std::thread sealing([keeping] {
        try {
            keeping->seal();
            ADD_FAILURE() << "kept bytes of a file the kernel did not answer for";
        } catch (const SnapshotError& e) {
            EXPECT_NE(std::string(e.what()).find("replaced or changed"), std::string::npos)
                << e.what();
        }
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    fs::remove(output / kSnapshotFile);  // the session's own process, meanwhile
    write_file(output / kSnapshotFile, "another file");
    keeping->written = true;
    sealing.join();
    store.abandon(*keeping);
    EXPECT_FALSE(store.holds("s1"));
}

TEST_F(SnapshotStoreTest, AStreamedKeepDoesNotFollowALinkToAHostFile) {
    SnapshotStore store(base / "store");
    write_file(base / "host-secret", "host-secret-bytes");
    const auto keeping = store.begin_streamed_keep("s1", output, input, kWait);
    fs::create_symlink(base / "host-secret", output / kSnapshotFile);
    keeping->written = true;
    EXPECT_THROW(keeping->seal(), SnapshotError);
    store.abandon(*keeping);
    EXPECT_EQ(read_file(base / "host-secret"), "host-secret-bytes");
    EXPECT_FALSE(fs::exists(base / "store" / "s1"));
}

TEST_F(SnapshotStoreTest, AStreamedKeepDoesNotTakeASecondNameOfAHostFile) {
    SnapshotStore store(base / "store");
    write_file(base / "host-secret", "host-secret-bytes");
    const auto keeping = store.begin_streamed_keep("s1", output, input, kWait);
    fs::create_hard_link(base / "host-secret", output / kSnapshotFile);
    keeping->written = true;
    try {
        keeping->seal();
        ADD_FAILURE() << "sealed a file with a second name";
    } catch (const SnapshotError& e) {
        EXPECT_NE(std::string(e.what()).find("one name"), std::string::npos) << e.what();
    }
    store.abandon(*keeping);
    EXPECT_EQ(read_file(base / "host-secret"), "host-secret-bytes");
    EXPECT_FALSE(fs::exists(base / "store" / "s1"));
}

TEST_F(SnapshotStoreTest, TheServerCapCountsWhatAStreamedKeepSealedSoFar) {
    SnapshotCaps caps;
    caps.total = 3 << 20;
    SnapshotStore store(base / "store", caps);
    const auto keeping = store.begin_streamed_keep("s1", output, input, kWait);
    write_file(output / kSnapshotFile, std::string(2 << 20, 'a'));
    keeping->written = true;
    keeping->seal();
    const fs::path output2 = base / "output2";
    fs::create_directories(output2);
    write_file(output2 / kSnapshotFile, std::string(2 << 20, 'b'));
    EXPECT_THROW(store.begin_keep("s2", output2, input), StorageFull)
        << "a streamed keep's bytes were not counted while it was under way";
    EXPECT_NO_THROW(store.finish_keep(*keeping));
}

TEST_F(SnapshotStoreTest, ASnapshotRemovedLaterLeavesTheStoresNamesAtOnce) {
    SnapshotStore store(base / "store");
    kernel_wrote("secret-namespace-bytes");
    store.keep("s1", output, input);
    const auto gone = store.remove_later("s1");
    ASSERT_TRUE(gone.has_value());
    EXPECT_FALSE(store.holds("s1"));
    EXPECT_FALSE(fs::exists(base / "store" / "s1")) << "a new keep of s1 would meet it";
    EXPECT_TRUE(fs::exists(*gone / "snapshot")) << "left for the caller to delete";
    EXPECT_EQ(gone->parent_path(), base / "store");
    EXPECT_EQ(gone->filename().string()[0], '.') << "a name no session can have";
    kernel_wrote("again");
    EXPECT_NO_THROW(store.keep("s1", output, input));
    fs::remove_all(*gone);
    EXPECT_TRUE(store.holds("s1"));
    EXPECT_FALSE(store.remove_later("nobody").has_value());
    // A keep under way: removed when it ends, as remove() does.
    kernel_wrote("third");
    store.remove("s1");
    const auto keeping = store.begin_keep("s1", output, input);
    EXPECT_FALSE(store.remove_later("s1").has_value());
    keeping->seal();
    EXPECT_THROW(store.finish_keep(*keeping), SnapshotError);
    EXPECT_FALSE(fs::exists(base / "store" / "s1"));
}

TEST_F(SnapshotStoreTest, APlaceOfASnapshotTheStoreDoesNotHoldIsRefusedAtOnce) {
    SnapshotStore store(base / "store");
    EXPECT_THROW(store.begin_place("nobody", base), SnapshotError);
}

TEST_F(SnapshotStoreTest, TheDisksFreeSpaceIsLeftFree) {
    SnapshotCaps caps;
    caps.keep_free = std::uint64_t{1} << 60;  // more than any disk has
    SnapshotStore store(base / "store", caps);
    kernel_wrote("small");
    try {
        store.keep("s1", output, input);
        ADD_FAILURE() << "kept past the disk's free space";
    } catch (const StorageFull& e) {
        EXPECT_NE(std::string(e.what()).find("free"), std::string::npos) << e.what();
    }
}

TEST_F(SnapshotStoreTest, LinksAndOddFilesFromTheSandboxAreNotFollowed) {
    SnapshotStore store(base / "store");
    write_file(base / "host-secret", "host-only");
    kernel_wrote("snap");
    fs::create_symlink(base / "host-secret", input / "link");
    store.keep("s1", output, input);
    const fs::path next = base / "next-input";
    fs::create_directories(next);
    store.place("s1", next);
    EXPECT_FALSE(fs::exists(next / "link"));
    // A snapshot the kernel left as a link is refused, not followed.
    fs::remove(output / kSnapshotFile);
    fs::create_symlink(base / "host-secret", output / kSnapshotFile);
    EXPECT_THROW(store.keep("s2", output, input), SnapshotError);
}

TEST_F(SnapshotStoreTest, AHandedOverSnapshotOpensInTheNextStoreWithItsKey) {
    // A planned restart (docs/restarts.md): the key leaves with the handover
    // row, and the next server's store opens the same files with it.
    fs::path next = base / "next-input";
    fs::create_directories(next);
    std::string key;
    {
        SnapshotStore store(base / "store");
        kernel_wrote("kept across the restart");
        store.keep("s1", output, input);
        key = store.key_bytes("s1");
        EXPECT_EQ(key.size(), SnapshotKey::kBytes);
    }
    SnapshotStore again(base / "store");
    again.clear({"s1"});
    EXPECT_TRUE(fs::exists(base / "store" / "s1" / "snapshot")) << "kept by clear()'s except";
    EXPECT_THROW(again.adopt("s2", key, {}), SnapshotError) << "no such snapshot on disk";
    again.adopt("s1", key, {123, 4.0});
    EXPECT_EQ(again.bytes("s1"), 123u);
    again.place("s1", next);
    EXPECT_EQ(read_file(next / kSnapshotFile), "kept across the restart");
    EXPECT_EQ(read_file(next / "sub" / "deep.txt"), "secret-deep-file");
    // With another key it is refused, not opened.
    SnapshotStore third(base / "store");
    third.adopt("s1", std::string(SnapshotKey::kBytes, 'k'), {});
    fs::remove_all(next);
    fs::create_directories(next);
    EXPECT_THROW(third.place("s1", next), SnapshotError);
}

// The exact level (runsc checkpoint): the runtime's image, /data/output
// and /data/input, and the wake's secrets, kept and placed back.
class ExactSnapshotTest : public SnapshotStoreTest {
  protected:
    void SetUp() override {
        SnapshotStoreTest::SetUp();
        image = base / "image";
        memory = "secret-memory-page ";
        for (int i = 0; i < 300000; ++i) memory += std::to_string(i * 7);  // past a 1 MiB chunk
        write_file(image / kCheckpointImage, memory);
        write_file(output / "result.txt", "secret-output-file");
        write_file(output / "plots" / "a.png", "secret-output-plot");
        write_file(input / "data.csv", "secret-input-row");
    }
    std::uint64_t keep_exact(SnapshotStore& store, const std::string& secrets) {
        const auto keeping = store.begin_exact_keep("s1", image, output, input, secrets);
        keeping->seal();
        return store.finish_keep(*keeping);
    }
    fs::path image;
    std::string memory;
};

TEST_F(ExactSnapshotTest, KeepsImageOutputInputAndSecretsSealedAndPlacesThemBack) {
    SnapshotStore store(base / "store");
    EXPECT_EQ(keep_exact(store, "secret-kernel-key"), memory.size());
    ASSERT_TRUE(store.info("s1"));
    EXPECT_TRUE(store.info("s1")->exact);
    EXPECT_TRUE(fs::exists(image / kCheckpointImage))
        << "the caller removes the image with its dir";
    const std::string at_rest = all_bytes_under(base / "store");
    for (const char* secret : {"secret-memory-page", "secret-output-file", "secret-output-plot",
                               "secret-input-row", "secret-kernel-key"}) {
        EXPECT_EQ(at_rest.find(secret), std::string::npos) << secret;
    }

    const fs::path image2 = base / "image2", output2 = base / "output2", input2 = base / "input2";
    for (const auto& d : {image2, output2, input2}) fs::create_directories(d);
    EXPECT_THROW(store.begin_exact_place("s2", image2, output2, input2, 1, 1), SnapshotError);
    const uid_t user = 123456;
    const auto placing = store.begin_exact_place("s1", image2, output2, input2, user, user);
    placing->open();
    EXPECT_EQ(read_file(image2 / kCheckpointImage), memory);
    struct stat st {};
    ASSERT_EQ(::stat((image2 / kCheckpointImage).c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 07777, 0600u) << "the image holds the whole session: the server's alone";
    EXPECT_EQ(read_file(output2 / "result.txt"), "secret-output-file");
    EXPECT_EQ(read_file(output2 / "plots" / "a.png"), "secret-output-plot");
    for (const auto& owned :
         {output2 / "result.txt", output2 / "plots", output2 / "plots" / "a.png"}) {
        ASSERT_EQ(::stat(owned.c_str(), &st), 0);
        EXPECT_EQ(st.st_uid, user) << owned << ": the sandbox's own files, as they were";
        EXPECT_EQ(st.st_gid, user) << owned;
    }
    EXPECT_EQ(read_file(input2 / "data.csv"), "secret-input-row");
    EXPECT_EQ(placing->secrets(), "secret-kernel-key");

    // The next server (a handover) knows the level from the files.
    const std::string key = store.key_bytes("s1");
    SnapshotStore again(base / "store");
    again.adopt("s1", key, {});
    ASSERT_TRUE(again.info("s1"));
    EXPECT_TRUE(again.info("s1")->exact);
}

TEST_F(ExactSnapshotTest, AChangedByteOfTheImageIsRefusedNotRestored) {
    SnapshotStore store(base / "store");
    keep_exact(store, "k");
    const fs::path kept = base / "store" / "s1" / "snapshot";
    std::string bytes = read_file(kept);
    bytes[bytes.size() / 2] ^= 1;
    write_file(kept, bytes);
    const fs::path image2 = base / "image2", output2 = base / "output2", input2 = base / "input2";
    for (const auto& d : {image2, output2, input2}) fs::create_directories(d);
    EXPECT_THROW(store.begin_exact_place("s1", image2, output2, input2, 1, 1)->open(),
                 SnapshotError);
}

TEST_F(ExactSnapshotTest, ThePerSessionCapCountsTheImageAndTheOutputBeforeWriting) {
    SnapshotCaps caps;
    caps.per_session = 2 << 20;
    SnapshotStore store(base / "store", caps);
    write_file(output / "big.bin", std::string(2 << 20, 'o'));  // the image alone fits
    const auto keep = [&] { store.begin_exact_keep("s1", image, output, input, "k"); };
    EXPECT_THROW(keep(), StorageFull);
    const std::string what = error_of(keep);
    EXPECT_NE(what.find("cap of 2 MB"), std::string::npos) << what;
    EXPECT_FALSE(store.holds("s1"));
    EXPECT_FALSE(fs::exists(base / "store" / "s1"));
}

TEST_F(ExactSnapshotTest, AnImageDirWithoutTheImageIsRefused) {
    SnapshotStore store(base / "store");
    fs::remove(image / kCheckpointImage);
    fs::create_symlink(base / "host-secret", image / kCheckpointImage);
    const std::string what =
        error_of([&] { store.begin_exact_keep("s1", image, output, input, "k"); });
    EXPECT_NE(what.find("the runtime left no image"), std::string::npos) << what;
}

TEST(SnapshotCipher, SealedBytesRoundTripAndRefuseAnotherKeyOrLabel) {
    const SnapshotKey key;
    const std::string plain("the client's key\0and its ports", 31);
    const std::string sealed = seal(plain, key, "handover/s1");
    EXPECT_EQ(sealed.size(), plain.size() + kSealOverhead);
    EXPECT_EQ(sealed.find("client"), std::string::npos);
    EXPECT_EQ(open_sealed(sealed, key, "handover/s1"), plain);
    EXPECT_THROW(open_sealed(sealed, key, "handover/s2"), std::runtime_error);
    EXPECT_THROW(open_sealed(sealed, SnapshotKey(), "handover/s1"), std::runtime_error);
    std::string changed = sealed;
    changed[20] ^= 1;
    EXPECT_THROW(open_sealed(changed, key, "handover/s1"), std::runtime_error);
    EXPECT_THROW(open_sealed(sealed.substr(0, 10), key, "handover/s1"), std::runtime_error);
    EXPECT_EQ(open_sealed(seal("", key, "x"), key, "x"), "");
}

TEST(ServerKey, IsMadeOnceOwnerOnlyAndRefusedWhenOthersCouldReadIt) {
    const fs::path dir =
        fs::temp_directory_path() / ("cellblock-server-key-" + std::to_string(::getpid()));
    fs::remove_all(dir);
    const fs::path path = dir / "keys" / "server.key";
    EXPECT_NE(error_of([&] { load_server_key(path, false); }).find("No such file"),
              std::string::npos);
    const auto made = load_server_key(path, true);
    EXPECT_EQ(fs::status(path).permissions(), fs::perms::owner_read | fs::perms::owner_write);
    EXPECT_EQ(fs::status(path.parent_path()).permissions(), fs::perms::owner_all);
    const auto again = load_server_key(path, true);  // read, not made anew
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(made->bytes()), SnapshotKey::kBytes),
              std::string(reinterpret_cast<const char*>(again->bytes()), SnapshotKey::kBytes));
    fs::permissions(path, fs::perms::group_read, fs::perm_options::add);
    EXPECT_NE(error_of([&] { load_server_key(path, false); }).find("mode 0640 lets others read it"),
              std::string::npos);
    fs::permissions(path, fs::perms::owner_read | fs::perms::owner_write);
    write_file(dir / "short.key", "too short");
    fs::permissions(dir / "short.key", fs::perms::owner_read);
    EXPECT_NE(error_of([&] { load_server_key(dir / "short.key", false); }).find("9 bytes, not 32"),
              std::string::npos);
    fs::create_symlink(path, dir / "link.key");
    EXPECT_FALSE(error_of([&] { load_server_key(dir / "link.key", false); }).empty())
        << "a link is not followed";
    fs::remove_all(dir);
}

// A new directory of its own for one test.
fs::path scratch_dir(const std::string& name) {
    const fs::path dir =
        fs::temp_directory_path() / ("cellblock-" + name + "-" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
    return dir;
}

// `n` bytes from a generator seeded with `seed`.
std::string random_bytes(std::size_t n, unsigned seed) {
    std::string bytes(n, '\0');
    std::mt19937 rng(seed);
    for (auto& c : bytes) c = static_cast<char>(rng() & 0xff);
    return bytes;
}

// The file `from` sealed into `to` (made or emptied); seal_stream()'s count.
std::uint64_t seal_file(const fs::path& from, const fs::path& to, const SnapshotKey& key) {
    const int in = ::open(from.c_str(), O_RDONLY);
    const int out = ::open(to.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    const std::uint64_t sealed = seal_stream(in, out, key, "s/label");
    ::close(in);
    ::close(out);
    return sealed;
}

// The sealed file `from` opened into `to` (made or emptied); what it threw,
// or "".
std::string open_file(const fs::path& from, const fs::path& to, const SnapshotKey& key,
                      const std::string& label = "s/label") {
    const int in = ::open(from.c_str(), O_RDONLY);
    const int out = ::open(to.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    const std::string error = error_of([&] { open_sealed_stream(in, out, key, label); });
    ::close(in);
    ::close(out);
    return error;
}

// What write(fd) wrote into a pipe, read on a thread as it came; the write
// end is closed after.
template <typename Write>
std::string through_pipe(Write&& write) {
    int pipe_fds[2];
    if (::pipe(pipe_fds) != 0) return "(no pipe)";
    std::string through;
    std::thread reader([&] {
        char buf[1 << 16];
        for (ssize_t n; (n = ::read(pipe_fds[0], buf, sizeof buf)) > 0;) through.append(buf, n);
    });
    write(pipe_fds[1]);
    ::close(pipe_fds[1]);
    reader.join();
    ::close(pipe_fds[0]);
    return through;
}

TEST(SnapshotCipher, SealedStreamsRoundTripAndCarryNoPlainText) {
    const fs::path dir = scratch_dir("seal");
    const std::string plain = random_bytes((3 << 20) + 17, 7);
    write_file(dir / "plain", plain);
    const SnapshotKey key;
    EXPECT_EQ(seal_file(dir / "plain", dir / "sealed", key), plain.size());
    EXPECT_EQ(fs::file_size(dir / "sealed"), sealed_size(plain.size()));
    EXPECT_EQ(open_file(dir / "sealed", dir / "opened", key), "");
    EXPECT_EQ(read_file(dir / "opened"), plain);
    EXPECT_NE(open_file(dir / "sealed", dir / "opened", key, "s/other-label"), "");
    const SnapshotKey other;
    EXPECT_NE(open_file(dir / "sealed", dir / "opened", other), "");
    fs::resize_file(dir / "sealed", plain.size());  // cut short
    EXPECT_NE(open_file(dir / "sealed", dir / "opened", key), "");
    fs::remove_all(dir);
}

// Format 2 (snapshot_cipher.hpp): chunks sealed one by one and opened on
// several threads, each at its place; every size comes back exact, and a
// file cut at a chunk's end, chunks swapped or a changed byte in any chunk
// are refused. Into a pipe (no place to write at) the chunks go in order.
TEST(SnapshotCipher, ChunksOpenOnlyWholeInTheirOrderAndAtTheirPlace) {
    const fs::path dir = scratch_dir("seal-chunks");
    const SnapshotKey key;
    const auto open_checked = [&] {
        const int in = ::open((dir / "sealed").c_str(), O_RDONLY);
        const int out = ::open((dir / "opened").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
        const std::string error = error_of([&] {
            const std::uint64_t opened = open_sealed_stream(in, out, key, "s/label");
            // The descriptor is left where a sequential write would leave it.
            EXPECT_EQ(opened, static_cast<std::uint64_t>(::lseek(out, 0, SEEK_CUR)));
        });
        ::close(in);
        ::close(out);
        return error;
    };
    const std::size_t chunk = kSealChunk;
    for (const std::size_t size :
         {std::size_t{0}, std::size_t{1}, chunk - 1, chunk, chunk + 1, 3 * chunk, 5 * chunk + 7}) {
        const std::string plain = random_bytes(size, 11 + static_cast<unsigned>(size));
        write_file(dir / "plain", plain);
        EXPECT_EQ(seal_file(dir / "plain", dir / "sealed", key), size);
        EXPECT_EQ(fs::file_size(dir / "sealed"), sealed_size(size)) << size;
        EXPECT_EQ(open_checked(), "") << size;
        EXPECT_EQ(read_file(dir / "opened"), plain) << size;
    }
    // 5 chunks and 7 bytes: six chunks, the last of 7 bytes.
    const std::string whole = read_file(dir / "sealed");
    const std::size_t header = kSealHeader, piece = chunk + kSealTag;
    const auto refused = [&](const std::string& sealed) {
        write_file(dir / "sealed", sealed);
        return open_checked();
    };
    EXPECT_NE(refused(whole.substr(0, header + 5 * piece)).find("last chunk is missing"),
              std::string::npos);
    EXPECT_NE(refused(whole.substr(0, header + 3 * piece)).find("last chunk is missing"),
              std::string::npos);
    EXPECT_NE(refused(whole.substr(0, whole.size() - 20)).find("cut short"), std::string::npos);
    std::string swapped = whole;
    std::copy_n(whole.begin() + header, piece, swapped.begin() + header + piece);
    std::copy_n(whole.begin() + header + piece, piece, swapped.begin() + header);
    EXPECT_NE(refused(swapped).find("integrity check"), std::string::npos);
    for (const std::size_t at : {header + 1, header + 2 * piece + 100, whole.size() - 1}) {
        std::string changed = whole;
        changed[at] = static_cast<char>(changed[at] ^ 1);
        EXPECT_NE(refused(changed).find("integrity check"), std::string::npos) << at;
    }
    // Into a pipe: in order, on one thread.
    write_file(dir / "sealed", whole);
    const int in = ::open((dir / "sealed").c_str(), O_RDONLY);
    const std::string through = through_pipe(
        [&](int out) { EXPECT_EQ(open_sealed_stream(in, out, key, "s/label"), 5 * chunk + 7); });
    ::close(in);
    EXPECT_EQ(through, read_file(dir / "plain"));
    fs::remove_all(dir);
}

// A file sealed in format 1 (one GCM stream, as servers before 2026-12-04
// sealed snapshots; seal() in memory still writes it) opens as before, and
// a changed byte in it is refused: a session hibernated by an earlier
// server wakes under this one.
TEST(SnapshotCipher, AFormatOneFileStillOpens) {
    const fs::path dir = scratch_dir("seal-v1");
    const SnapshotKey key;
    const std::string plain = random_bytes((2 << 20) + 5, 3);
    const std::string v1 = seal(plain, key, "s/label");
    ASSERT_EQ(v1.substr(0, 8), "CBSEAL1\n");
    const auto open_v1 = [&](const std::string& sealed) {
        write_file(dir / "sealed", sealed);
        const int in = ::open((dir / "sealed").c_str(), O_RDONLY);
        const int out = ::open((dir / "opened").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
        const std::string error =
            error_of([&] { EXPECT_EQ(open_sealed_stream(in, out, key, "s/label"), plain.size()); });
        ::close(in);
        ::close(out);
        return error;
    };
    EXPECT_EQ(open_v1(v1), "");
    EXPECT_EQ(read_file(dir / "opened"), plain);
    std::string changed = v1;
    changed[100] = static_cast<char>(changed[100] ^ 1);
    EXPECT_NE(open_v1(changed).find("integrity check"), std::string::npos);
    fs::remove_all(dir);
}

// The chunks are written on a thread of their own (snapshot_cipher.cpp,
// WriteBehind): a write that fails there is the seal's or the opening's
// error, for a file of one chunk (written on the caller's thread) as for one
// of many, never a seal that returns as if whole.
TEST(SnapshotCipher, AWriteThatFailsIsThrownWhateverTheFilesSize) {
    const fs::path dir = scratch_dir("seal-full");
    const SnapshotKey key;
    for (const std::size_t size : {std::size_t{100}, std::size_t{(5 << 20) + 3}}) {
        write_file(dir / "plain", std::string(size, 'p'));
        const int in = ::open((dir / "plain").c_str(), O_RDONLY);
        const int full = ::open("/dev/full", O_WRONLY);
        ASSERT_GE(full, 0);
        const std::string error = error_of([&] { seal_stream(in, full, key, "s/label"); });
        EXPECT_NE(error.find(std::strerror(ENOSPC)), std::string::npos) << size << ": " << error;
        ::close(in);

        const int plain = ::open((dir / "plain").c_str(), O_RDONLY);
        const int sealed = ::open((dir / "sealed").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
        EXPECT_EQ(seal_stream(plain, sealed, key, "s/label"), size);
        ::close(plain);
        ::close(sealed);
        const int back = ::open((dir / "sealed").c_str(), O_RDONLY);
        const std::string opening =
            error_of([&] { open_sealed_stream(back, full, key, "s/label"); });
        EXPECT_NE(opening.find(std::strerror(ENOSPC)), std::string::npos)
            << size << ": " << opening;
        ::close(back);
        ::close(full);
    }
    fs::remove_all(dir);
}

// A seal longer than the flusher's step (snapshot_cipher.cpp, kFlushEvery)
// has the disk keep it as it goes: into a file it comes back whole, and into
// a pipe (which cannot be synced) the flusher stands aside and the seal is
// whole too.
TEST(SnapshotCipher, ASealFlushedAsItGoesComesBackWholeFromAFileOrAPipe) {
    const fs::path dir = scratch_dir("seal-flush");
    const SnapshotKey key;
    const std::string plain = random_bytes((40 << 20) + 11, 13);
    write_file(dir / "plain", plain);
    EXPECT_EQ(seal_file(dir / "plain", dir / "sealed", key), plain.size());
    EXPECT_EQ(fs::file_size(dir / "sealed"), sealed_size(plain.size()));
    EXPECT_EQ(open_file(dir / "sealed", dir / "opened", key), "");
    EXPECT_TRUE(read_file(dir / "opened") == plain);

    const int in = ::open((dir / "plain").c_str(), O_RDONLY);
    std::string error;
    write_file(dir / "piped", through_pipe([&](int out) {
                   error = error_of(
                       [&] { EXPECT_EQ(seal_stream(in, out, key, "s/label"), plain.size()); });
               }));
    ::close(in);
    EXPECT_EQ(error, "");
    EXPECT_EQ(open_file(dir / "piped", dir / "opened", key), "");
    EXPECT_TRUE(read_file(dir / "opened") == plain);
    fs::remove_all(dir);
}

// A wake's kernel reads the snapshot while it is opened (docs/hibernation.md,
// "The wake"): the opening writes its chunks in order, each checked first,
// so a reader looking at the file at any moment finds a whole prefix of the
// content, never a hole (which would read as zeros) nor an unchecked byte.
// followable_plain_size() names the size the reader waits for.
TEST(SnapshotCipher, AReaderFollowingAnOpeningOnlyEverSeesAPrefixOfTheContent) {
    const fs::path dir = scratch_dir("seal-follow");
    const SnapshotKey key;
    const std::string plain = random_bytes((24 << 20) + 5, 17);
    write_file(dir / "plain", plain);
    seal_file(dir / "plain", dir / "sealed", key);
    const int in = ::open((dir / "sealed").c_str(), O_RDONLY);
    ASSERT_GE(in, 0);
    EXPECT_EQ(followable_plain_size(in), plain.size());
    EXPECT_EQ(::lseek(in, 0, SEEK_CUR), 0) << "the header is read where it stands";
    // Looks taken while an opening is under way; rounds until enough came
    // (one round is over in milliseconds; a busy host may give few looks).
    std::size_t looks = 0, partial = 0, bad = 0;
    std::string seen(plain.size(), '\0');
    for (int round = 0; round < 50 && partial < 20; ++round) {
        const int out = ::open((dir / "opened").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
        const int look = ::open((dir / "opened").c_str(), O_RDONLY);
        ASSERT_EQ(::lseek(in, 0, SEEK_SET), 0);
        std::atomic<bool> done{false};
        std::string error;
        std::thread opening([&] {
            error = error_of([&] { open_sealed_stream(in, out, key, "s/label"); });
            done = true;
        });
        for (bool last = false; !last;) {
            last = done.load();
            struct stat st {};
            ASSERT_EQ(::fstat(look, &st), 0);
            const auto size = static_cast<std::size_t>(st.st_size);
            ASSERT_LE(size, plain.size());
            const ssize_t n = ::pread(look, seen.data(), size, 0);
            ASSERT_GE(n, 0);
            if (std::memcmp(seen.data(), plain.data(), static_cast<std::size_t>(n)) != 0) ++bad;
            ++looks;
            if (size > 0 && size < plain.size()) ++partial;
        }
        opening.join();
        EXPECT_EQ(error, "");
        EXPECT_TRUE(read_file(dir / "opened") == plain);
        ::close(out);
        ::close(look);
    }
    EXPECT_EQ(bad, 0u) << "of " << looks << " looks, some saw bytes that were not the content's";
    EXPECT_GT(partial, 0u) << "no look came while an opening was under way (" << looks << ")";
    ::close(in);

    // Format 1 is checked only at its end: not followed. What is not sealed,
    // or cut inside a chunk, is refused.
    const auto size_of = [&](const std::string& bytes) {
        write_file(dir / "other", bytes);
        const int fd = ::open((dir / "other").c_str(), O_RDONLY);
        std::optional<std::uint64_t> size;
        const std::string why = error_of([&] { size = followable_plain_size(fd); });
        ::close(fd);
        return std::make_pair(size, why);
    };
    EXPECT_EQ(size_of(seal("v1 content", key, "s/label")),
              std::make_pair(std::optional<std::uint64_t>{}, std::string()));
    EXPECT_NE(size_of(std::string(64, 'x')).second.find("not a sealed snapshot"),
              std::string::npos);
    const std::string whole = read_file(dir / "sealed");
    EXPECT_NE(size_of(whole.substr(0, whole.size() - 20)).second.find("cut short"),
              std::string::npos);
    fs::remove_all(dir);
}

}  // namespace
}  // namespace cellblock
