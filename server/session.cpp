#include "session.hpp"

#include <algorithm>

namespace cellblock {

Session::Session(std::string id, std::string image, std::unique_ptr<SessionProxy> proxy)
    : id_(std::move(id)), image_(std::move(image)), proxy_(std::move(proxy)) {}

SessionEnd Session::end(const std::string& reason) const {
    SessionEnd end{id_, image_, reason};
    if (!proxy_) return end;
    if (const auto* governor = proxy_->governor()) end.executions = governor->executions();
    end.memory_peak_bytes = proxy_->memory_peak_bytes();
    end.cpu_ms = proxy_->cpu_ms();
    return end;
}

Session& SessionTable::add(Session session) {
    const std::string id = session.id();
    return sessions_.insert_or_assign(id, std::move(session)).first->second;
}

Session* SessionTable::find(const std::string& id) {
    const auto it = sessions_.find(id);
    return it == sessions_.end() ? nullptr : &it->second;
}

const Session* SessionTable::find(const std::string& id) const {
    const auto it = sessions_.find(id);
    return it == sessions_.end() ? nullptr : &it->second;
}

SessionProxy* SessionTable::live(const std::string& id) {
    Session* session = find(id);
    return session && session->live() ? session->proxy() : nullptr;
}

std::size_t SessionTable::live_count() const {
    return static_cast<std::size_t>(std::count_if(
        sessions_.begin(), sessions_.end(), [](const auto& entry) { return entry.second.live(); }));
}

}  // namespace cellblock
