// The session registry and audit trail in SQLite (SQLiteCpp, WAL mode).
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace cellblock {

// The registry's clock: seconds since the epoch, as every time it records.
inline double unix_now() {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
        .count();
}

struct SessionRecord {
    std::string id;
    std::string image;
    std::string image_id;      // content id of a built image's root; "" for host images
    std::string state;         // starting, idle, busy, closing, closed, failed
    std::string close_reason;  // "" while open
    double created_at = 0;     // unix seconds
    double closed_at = 0;      // 0 while open
    nlohmann::json limits = nlohmann::json::object();    // effective
    nlohmann::json metadata = nlohmann::json::object();  // the client's, as given
    std::int64_t execution_count = 0;
    std::uint64_t memory_peak_bytes = 0;
    std::uint64_t cpu_ms = 0;
    // The host ids its sandbox ran as: host_id_base.. (host_ids.hpp); 0, 0 if unknown.
    std::uint32_t host_id_base = 0;
    std::uint32_t host_id_count = 0;
};

struct ExecutionRecord {
    std::string session_id;
    std::int64_t count = 0;  // 1-based within the session
    std::string msg_id;
    std::string code;    // the code, or "sha256:<hex>" when the policy keeps hashes
    std::string status;  // ok, error, aborted, refused, timeout
    std::string ename;
    double started_at = 0;
    double wall_ms = 0;
    std::uint64_t cpu_ms = 0;
    std::uint64_t memory_peak_bytes = 0;
    std::uint64_t output_bytes = 0;
    bool truncated = false;
};

struct EventRecord {
    std::string session_id;
    double at = 0;
    std::string kind;  // created, closed, interrupted, killed, reaped, ...
    std::string detail;
};

// What a server hands the next one on the same state dir (docs/restarts.md):
// sealed bytes under a name (a session's id, or "@server").
struct HandoverRow {
    std::string name;
    std::string sealed;
    double made_at = 0;
};

class SessionStore {
  public:
    // Opens or creates the database (WAL, foreign keys, schema version checked).
    // Throws std::runtime_error("database <path>: <why>").
    explicit SessionStore(const std::filesystem::path& path);
    ~SessionStore();
    SessionStore(const SessionStore&) = delete;
    SessionStore& operator=(const SessionStore&) = delete;

    void add_session(const SessionRecord& record);
    void set_state(const std::string& id, const std::string& state);
    void close_session(const std::string& id, const std::string& reason, double at,
                       std::int64_t execution_count, std::uint64_t memory_peak_bytes,
                       std::uint64_t cpu_ms);
    void add_execution(const ExecutionRecord& record);
    void add_event(const EventRecord& record);

    std::optional<SessionRecord> session(const std::string& id) const;
    // Newest first; open_only filters closed and failed sessions out.
    std::vector<SessionRecord> sessions(bool open_only = false, std::size_t limit = 1000) const;
    std::vector<ExecutionRecord> executions(const std::string& session_id) const;
    std::vector<EventRecord> events(const std::string& session_id) const;

    // Marks every session not closed or failed as closed with `reason`
    // (crash recovery: "server_restart"), but those in `except` (handed
    // over), returning their ids.
    std::vector<std::string> close_all_open(const std::string& reason, double at,
                                            const std::set<std::string>& except = {});

    // The handover's rows (docs/restarts.md): written by a server that hands
    // its sessions over, read and removed by the next. A durable row is on
    // the disk when this returns (the WAL synced at its commit), not only in
    // the host's page cache: a hibernated session's, answered only once its
    // snapshot is on the disk too.
    void put_handover(const HandoverRow& row, bool durable = false);
    std::vector<HandoverRow> handovers() const;
    void remove_handover(const std::string& name);

  private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

// "sha256:<hex>" of the text.
std::string code_digest(const std::string& code);

}  // namespace cellblock
