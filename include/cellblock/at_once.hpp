// Waits that need not wait for each other (kernels answering, sandboxes
// being torn down), run side by side.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <thread>
#include <vector>

namespace cellblock {

// Calls work(i) for every i in [0, count) on up to `threads` threads, this
// one among them, and returns once every call has returned. `work` must not
// throw (a throw ends the process, as from any thread).
template <typename Work>
void for_each_at_once(std::size_t count, std::size_t threads, Work&& work) {
    std::atomic<std::size_t> next{0};
    const auto run = [&] {
        for (std::size_t i; (i = next++) < count;) work(i);
    };
    std::vector<std::thread> helpers;
    for (std::size_t t = 1; t < std::min(threads, count); ++t) helpers.emplace_back(run);
    run();
    for (auto& helper : helpers) helper.join();
}

}  // namespace cellblock
