// The pool's hand-out (sessions/sandbox_pool.cpp) against a backend played
// in the test: a pooled sandbox that died or whose node is being drained is
// never handed out, the next ready one is, and each is replaced.
#include "cellblock/sandbox_pool.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace cellblock {
namespace {

// What the test sees of a played sandbox, which outlives it (the pool
// deletes the sandboxes it destroys).
struct Played {
    int number = 0;
    std::atomic<bool> gone{false}, drained{false}, destroyed{false};
};

class PlayedSandbox final : public Sandbox {
  public:
    explicit PlayedSandbox(std::shared_ptr<Played> played) : played_(std::move(played)) {
        container_id_ = "played-" + std::to_string(played_->number);
    }
    int number() const { return played_->number; }

    const std::string& runtime() const override { return name_; }
    int lifeline_fd() const override { return -1; }
    bool read_lifeline() override { return !played_->gone; }
    bool exited() const override { return played_->gone; }
    std::string exit_description() const override { return "played"; }
    bool memory_limit_hit() const override { return false; }
    std::string log_tail() const override { return {}; }
    bool node_lost() const override { return false; }
    bool moving() const override { return played_->drained; }
    SandboxUsage usage() const override { return {}; }
    bool interrupt() override { return false; }
    void kill() override { played_->gone = true; }
    void destroy() override { played_->destroyed = true; }
    void apply_limits(const SandboxLimits&) override {}

  private:
    std::string name_ = "played";
    std::shared_ptr<Played> played_;
};

class PlayedBackend final : public SandboxBackend {
  public:
    std::string name() const override { return "played"; }
    std::unique_ptr<Sandbox> start(const std::string&, const Image&, const SandboxLimits&,
                                   bool) override {
        std::lock_guard lock(mutex);
        auto played = std::make_shared<Played>();
        played->number = ++started;
        boxes.push_back(played);
        return std::make_unique<PlayedSandbox>(played);
    }
    std::optional<BackendRefusal> refuse(const Image&) const override { return std::nullopt; }
    bool can_serve(const Image&, const SandboxLimits&, const SandboxLimits&) const override {
        return true;
    }
    std::mutex mutex;
    int started = 0;
    std::vector<std::shared_ptr<Played>> boxes;  // every one started
};

TEST(SandboxPool, ASandboxThatDiedOrIsMovingIsSkippedForTheNextAndReplaced) {
    auto backend = std::make_shared<PlayedBackend>();
    Image image;
    image.name = "img";
    SandboxPool pool(
        backend, [](Sandbox&, bool) { return std::shared_ptr<InnerChannels>(); },
        {PoolImage{image, {}, 3}}, [] {}, 1);
    ASSERT_TRUE(pool.wait_until_full(std::chrono::seconds(10)));
    {
        std::lock_guard lock(backend->mutex);
        ASSERT_EQ(backend->boxes.size(), 3u);
        backend->boxes[0]->drained = true;  // its node is being drained
        backend->boxes[1]->gone = true;     // its kernel died
    }
    WarmSandbox warm = pool.take("img", {});
    ASSERT_TRUE(warm);
    EXPECT_EQ(static_cast<PlayedSandbox&>(*warm.sandbox).number(), 3);
    EXPECT_FALSE(backend->boxes[2]->destroyed);
    // The two skipped are destroyed and, with the one taken, replaced.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    for (;;) {
        bool skipped_destroyed = false;
        {
            std::lock_guard lock(backend->mutex);
            skipped_destroyed = backend->boxes[0]->destroyed && backend->boxes[1]->destroyed;
        }
        if (skipped_destroyed && pool.ready("img") == 3) break;
        ASSERT_LT(std::chrono::steady_clock::now(), deadline) << pool.state().dump();
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    std::lock_guard lock(backend->mutex);
    EXPECT_EQ(backend->started, 6);
}

TEST(SandboxPool, APoolWhoseEverySandboxIsUnusableHandsOutNothing) {
    auto backend = std::make_shared<PlayedBackend>();
    Image image;
    image.name = "img";
    SandboxPool pool(
        backend, [](Sandbox&, bool) { return std::shared_ptr<InnerChannels>(); },
        {PoolImage{image, {}, 2}}, [] {}, 1);
    ASSERT_TRUE(pool.wait_until_full(std::chrono::seconds(10)));
    {
        std::lock_guard lock(backend->mutex);
        for (auto& box : backend->boxes) box->drained = true;
    }
    EXPECT_FALSE(pool.take("img", {}));  // a cold start, then; never a drained one
}

}  // namespace
}  // namespace cellblock
