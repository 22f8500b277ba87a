// cellblock::Frame: the relay's frame, owned bytes that no transport copies.
#include "cellblock/frame.hpp"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

namespace cellblock {
namespace {

TEST(Frame, SmallBytesAreHeldInline) {
    Frame f(std::string("<IDS|MSG>"));
    EXPECT_EQ(f.view(), "<IDS|MSG>");
    EXPECT_EQ(f.size(), 9u);
    EXPECT_FALSE(f.is_shared());
    EXPECT_TRUE(Frame().empty());
    EXPECT_EQ(Frame::copy_of("abc").view(), "abc");
}

TEST(Frame, ALargeStringIsTakenWithoutACopy) {
    std::string bytes(Frame::kSharedBytes, 'x');
    const char* where = bytes.data();
    Frame f(std::move(bytes));
    EXPECT_TRUE(f.is_shared());
    EXPECT_EQ(f.data(), where) << "the string's buffer moved in, its bytes did not";
    Frame moved = std::move(f);
    EXPECT_EQ(moved.data(), where);
    EXPECT_EQ(moved.size(), Frame::kSharedBytes);
}

TEST(Frame, SharingALargeFrameKeepsItsBytesAliveAndInPlace) {
    Frame shared;
    const char* where = nullptr;
    {
        Frame f(std::string(1 << 20, 'p'));
        where = f.data();
        shared = f.share();
    }
    EXPECT_EQ(shared.data(), where);
    EXPECT_EQ(shared.view(), std::string(1 << 20, 'p'));
    // A small frame's share is a copy of its bytes.
    const Frame small(std::string("hello"));
    const Frame copy = small.share();
    EXPECT_EQ(copy.view(), "hello");
    EXPECT_NE(copy.data(), small.data());
}

TEST(Frame, AdoptedStorageIsReleasedWithTheLastFrame) {
    auto storage = std::make_shared<std::vector<char>>(100, 'z');
    std::weak_ptr<std::vector<char>> alive = storage;
    const std::string_view bytes(storage->data(), storage->size());
    {
        Frame f(std::move(storage), bytes);
        EXPECT_TRUE(f.is_shared());
        EXPECT_EQ(f.data(), bytes.data());
        Frame other = f.share();
        EXPECT_FALSE(alive.expired());
    }
    EXPECT_TRUE(alive.expired());
}

TEST(Frame, EncodedFramesAreTakenAsTheyAre) {
    std::vector<std::string> encoded = {"a", std::string(10000, 'b')};
    const char* large = encoded[1].data();
    const auto frames = to_frames(std::move(encoded));
    ASSERT_EQ(frames.size(), 2u);
    EXPECT_EQ(frames[0].view(), "a");
    EXPECT_EQ(frames[1].data(), large);
}

TEST(Frame, AMultipartIsSeenAsViews) {
    Multipart m;
    m.frames = to_frames({"id", "<IDS|MSG>", std::string(5000, 'c')});
    const auto v = m.views();
    ASSERT_EQ(v.size(), 3u);
    EXPECT_EQ(v[0], "id");
    EXPECT_EQ(v[2].data(), m.frames[2].data());
    EXPECT_EQ(m.view(1), "<IDS|MSG>");
}

}  // namespace
}  // namespace cellblock
