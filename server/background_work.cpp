#include "background_work.hpp"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace cellblock {

BackgroundWork::BackgroundWork(EventLoop& loop) : loop_(loop) {
    event_.reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (!event_) throw std::runtime_error(std::string("eventfd: ") + std::strerror(errno));
    watch_ = loop_.watch_fd(event_.get(), [this] { on_ready(); });
}

BackgroundWork::~BackgroundWork() {
    loop_.unwatch(watch_);
    for (auto& [id, job] : jobs_) {
        if (job.thread.joinable()) job.thread.join();
    }
}

void BackgroundWork::run(std::function<void()> work, Then then) {
    const std::uint64_t id = next_++;
    Job& job = jobs_[id];
    job.then = std::move(then);
    job.thread = std::thread([this, id, work = std::move(work)] {
        std::string error;
        try {
            work();
        } catch (const std::exception& e) {
            error = e.what();
            if (error.empty()) error = "failed";
        } catch (...) {
            error = "failed";
        }
        {
            std::lock_guard<std::mutex> lock(mutex_);
            ended_.emplace_back(id, std::move(error));
        }
        const std::uint64_t one = 1;
        [[maybe_unused]] auto n = ::write(event_.get(), &one, sizeof one);
    });
}

void BackgroundWork::on_ready() {
    std::uint64_t count = 0;
    [[maybe_unused]] auto n = ::read(event_.get(), &count, sizeof count);
    std::vector<std::pair<std::uint64_t, std::string>> ended;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        ended.swap(ended_);
    }
    for (auto& [id, error] : ended) {
        auto job = jobs_.find(id);
        if (job == jobs_.end()) continue;
        job->second.thread.join();
        Then then = std::move(job->second.then);
        jobs_.erase(job);
        then(error);
    }
}

}  // namespace cellblock
