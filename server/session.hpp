// One session as this server holds it, and the table of them. A Session
// owns everything the server knows of one conversation: its relay
// (SessionProxy: the rules, the sockets, the sandbox handle), its CPU
// fairness state and the image it runs. The registry's row (SessionStore)
// is its durable half. Nothing else keeps a table keyed by session id;
// what watches sessions (the audit trail, the metrics) is told of their
// events instead (session_events.hpp).
//
// Today a Session has a proxy from its creation until it expires; a session
// with no relay in this process (hibernated, or waiting to be adopted after
// a restart) will be a Session whose proxy is null, and every reader below
// already treats it so.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <string>

#include "cellblock/cpu_fairness.hpp"
#include "cellblock/image.hpp"
#include "cellblock/session_policy.hpp"
#include "cellblock/wire_message.hpp"
#include "egress_tunnel.hpp"
#include "session_events.hpp"
#include "session_proxy.hpp"

namespace cellblock {

// What a session was created with: a hibernated session wakes in a
// sandbox of the same kind (image version, runtime, limits).
struct SessionOrigin {
    Image image;  // resolved: the version it runs
    SessionLimits limits;
    std::string kind;       // PendingCreate::kind: which warm sandboxes fit
    bool poolable = false;  // the image's pool holds that kind
};

class Session {
  public:
    Session(std::string id, std::string image, std::unique_ptr<SessionProxy> proxy);
    Session(const Session&) = delete;
    Session& operator=(const Session&) = delete;
    Session(Session&&) = default;
    Session& operator=(Session&&) = default;

    const std::string& id() const { return id_; }
    const std::string& image() const { return image_; }
    // The relay in this process, or null.
    SessionProxy* proxy() { return proxy_.get(); }
    const SessionProxy* proxy() const { return proxy_.get(); }
    // A relay that still serves the client: not closed.
    bool live() const { return proxy_ && !proxy_->closed(); }
    // The sandbox of a live session, or null.
    Sandbox* sandbox() { return live() ? proxy_->sandbox() : nullptr; }
    // Where the CPU balancer keeps this session's samples (cpu_fairness.hpp).
    CpuFairness& fairness() { return fairness_; }
    // What the session used, as its close records it.
    SessionEnd end(const std::string& reason) const;
    SessionOrigin& origin() { return origin_; }
    const SessionOrigin& origin() const { return origin_; }
    // Manager requests answered when a hibernation or a wake ends
    // (session_hibernate_request, session_resume_request).
    std::vector<WireMessage>& waiting_sleep() { return waiting_sleep_; }
    std::vector<WireMessage>& waiting_wake() { return waiting_wake_; }
    // The way out of a Swarm task's session to the egress gateway, while its
    // sandbox lives (Server::open_egress); null for a local sandbox, whose
    // gateway listens in its own ipc dir.
    std::unique_ptr<EgressTunnel>& egress_tunnel() { return egress_tunnel_; }
    // Its sandbox is kept to serve --loud-cpus (Server::keep_loud_sessions_apart).
    bool& on_loud_cpus() { return on_loud_cpus_; }

  private:
    std::string id_;
    std::string image_;
    std::unique_ptr<SessionProxy> proxy_;
    CpuFairness fairness_;
    SessionOrigin origin_;
    std::vector<WireMessage> waiting_sleep_, waiting_wake_;
    std::unique_ptr<EgressTunnel> egress_tunnel_;
    bool on_loud_cpus_ = false;
};

class SessionTable {
  public:
    using Map = std::map<std::string, Session>;

    Session& add(Session session);
    // Null when this server holds no session of that id.
    Session* find(const std::string& id);
    const Session* find(const std::string& id) const;
    // The relay of a live session, or null (none, or closed).
    SessionProxy* live(const std::string& id);
    void erase(const std::string& id) { sessions_.erase(id); }
    void clear() { sessions_.clear(); }
    // Sessions held, live or closed and not yet expired.
    std::size_t size() const { return sessions_.size(); }
    bool empty() const { return sessions_.empty(); }
    // Live sessions: what max_sessions counts.
    std::size_t live_count() const;

    Map::iterator begin() { return sessions_.begin(); }
    Map::iterator end() { return sessions_.end(); }
    Map::const_iterator begin() const { return sessions_.begin(); }
    Map::const_iterator end() const { return sessions_.end(); }

  private:
    Map sessions_;
};

}  // namespace cellblock
