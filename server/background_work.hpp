// Work too long for the loop's thread, run on a thread of its own; what
// follows it runs back on the loop's thread. Sealing a hibernating session's
// snapshot of a GiB took the loop for about a second, and every other
// session's requests and heartbeats waited that long (docs/hibernation.md).
//
// The work must not touch what the loop's thread owns: it gets what it needs
// by value (descriptors, paths, a key held by shared_ptr) and leaves its
// result there for `then`, which may.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cellblock/unique_fd.hpp"
#include "event_loop.hpp"

namespace cellblock {

class BackgroundWork {
  public:
    // `then`'s argument: empty when the work returned, else what it threw
    // (its what()).
    using Then = std::function<void(const std::string& error)>;

    explicit BackgroundWork(EventLoop& loop);
    // Waits for the work still running; what would follow it does not run.
    ~BackgroundWork();
    BackgroundWork(const BackgroundWork&) = delete;
    BackgroundWork& operator=(const BackgroundWork&) = delete;

    // Starts `work` on a new thread; `then` runs on the loop's thread in the
    // turn after it ends.
    void run(std::function<void()> work, Then then);
    // Work started and not yet followed.
    std::size_t running() const { return jobs_.size(); }

  private:
    void on_ready();

    EventLoop& loop_;
    UniqueFd event_;
    EventLoop::WatchId watch_ = 0;
    std::uint64_t next_ = 0;
    struct Job {
        std::thread thread;
        Then then;
    };
    std::map<std::uint64_t, Job> jobs_;  // the loop's thread's
    std::mutex mutex_;
    std::vector<std::pair<std::uint64_t, std::string>> ended_;  // under mutex_
};

}  // namespace cellblock
