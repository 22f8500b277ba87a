// `serve --metrics`: the server's side of the metrics endpoint (its thread
// reads the pool and renders; the loop counts and takes a snapshot each
// second), and the creates counted by how they were answered.
#include "server.hpp"

namespace cellblock {

void Server::start_metrics() {
    metrics_ = std::make_unique<ServerMetrics>(kVersion);
    observers_.push_back(metrics_.get());
    MetricsEndpoints endpoints;
    // The endpoint's thread: the pool's state and the backend's extras are
    // read under the pool's own locks, never through the loop.
    endpoints.metrics = [this](MetricsFormat format) {
        return metrics_->render(format, pool_->state(), pool_->extras());
    };
    endpoints.healthz = [this] { return metrics_->healthz(Clock::now()); };
    endpoints.readyz = [this] {
        return metrics_->readyz(Clock::now(), options_.default_image, pool_->state());
    };
    metrics_http_ = std::make_unique<MetricsHttpServer>(
        parse_listen_address(options_.metrics_address), std::move(endpoints));
    spdlog::info("metrics: http://{}/metrics (and /healthz, /readyz)", metrics_http_->address());
}

void Server::tick_metrics(Clock::time_point now, bool stopping) {
    ServerMetrics::Snapshot snapshot;
    for (const auto& [name, image] : images_) snapshot.images.push_back(name);
    for (const auto& [id, session] : sessions_) {
        if (session.live()) ++snapshot.sessions[{session.image(), session.proxy()->state()}];
    }
    for (const auto& [order, pending] : creating_) ++snapshot.waiting[pending.image];
    snapshot.max_sessions = static_cast<std::size_t>(std::max(0, options_.policy.max_sessions));
    if (snapshots_) {
        snapshot.snapshot_bytes = snapshots_->total_bytes();
        snapshot.snapshot_max_bytes = snapshots_->caps().total;
    }
    snapshot.stopping = stopping;
    metrics_->tick(now, snapshot);
}

void Server::count_create_reply(const WireMessage& request, const json& content) {
    // Created sessions are counted at their hand-out, with their latency.
    if (request.msg_type() != "session_create_request" || content.value("status", "") != "error") {
        return;
    }
    const json& c = request.content;
    std::string image = options_.default_image;
    if (const auto it = c.find("image"); it != c.end() && it->is_string()) {
        image = images_.count(it->get<std::string>()) ? it->get<std::string>() : "";
    }
    metrics_->create_refused(image, content.value("ename", ""));
}

}  // namespace cellblock
