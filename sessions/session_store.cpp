// The session registry and audit trail: one SQLite file in WAL mode.
//
// Thread-safety: a SessionStore is owned and used by one thread, the server loop.
// It takes no locks of its own; other processes (an operator's sqlite3 shell, a
// report script) may read the file concurrently, which WAL allows, and writers
// from elsewhere wait up to the busy timeout.
//
// Over 500 lines with a reason: the schema (four versions and their upgrade),
// the row readers that name each column by position and the queries that
// select those columns are one contract with the file on disk, and read best
// side by side: a column added to one and not the others is read as the
// wrong field, not refused.
#include "cellblock/session_store.hpp"

#include <sys/stat.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>

#include <SQLiteCpp/SQLiteCpp.h>

#include "cellblock/sha256.hpp"

namespace cellblock {
namespace {

using nlohmann::json;

// Bump when the schema changes, and teach open() to upgrade each older version.
constexpr int kSchemaVersion = 4;
constexpr int kBusyTimeoutMs = 5000;

constexpr const char* kSchemaV1 = R"sql(
CREATE TABLE IF NOT EXISTS sessions (
    id                TEXT PRIMARY KEY NOT NULL,
    image             TEXT NOT NULL,
    state             TEXT NOT NULL,
    close_reason      TEXT NOT NULL DEFAULT '',
    created_at        REAL NOT NULL,
    closed_at         REAL NOT NULL DEFAULT 0,
    limits            TEXT NOT NULL DEFAULT '{}',
    metadata          TEXT NOT NULL DEFAULT '{}',
    execution_count   INTEGER NOT NULL DEFAULT 0,
    memory_peak_bytes INTEGER NOT NULL DEFAULT 0 CHECK (memory_peak_bytes >= 0),
    cpu_ms            INTEGER NOT NULL DEFAULT 0 CHECK (cpu_ms >= 0)
);
CREATE INDEX IF NOT EXISTS sessions_by_created_at ON sessions (created_at);

CREATE TABLE IF NOT EXISTS executions (
    session_id        TEXT NOT NULL REFERENCES sessions (id),
    count             INTEGER NOT NULL,
    msg_id            TEXT NOT NULL,
    code              TEXT NOT NULL,
    status            TEXT NOT NULL,
    ename             TEXT NOT NULL DEFAULT '',
    started_at        REAL NOT NULL,
    wall_ms           REAL NOT NULL DEFAULT 0,
    cpu_ms            INTEGER NOT NULL DEFAULT 0 CHECK (cpu_ms >= 0),
    memory_peak_bytes INTEGER NOT NULL DEFAULT 0 CHECK (memory_peak_bytes >= 0),
    output_bytes      INTEGER NOT NULL DEFAULT 0 CHECK (output_bytes >= 0),
    truncated         INTEGER NOT NULL DEFAULT 0 CHECK (truncated IN (0, 1)),
    PRIMARY KEY (session_id, count)
);

CREATE TABLE IF NOT EXISTS events (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    session_id TEXT NOT NULL REFERENCES sessions (id),
    at         REAL NOT NULL,
    kind       TEXT NOT NULL,
    detail     TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS events_by_session ON events (session_id, id);
)sql";

// Version 2: which built root a session ran on (image_builder.hpp's content id).
constexpr const char* kSchemaV2 = R"sql(
ALTER TABLE sessions ADD COLUMN image_id TEXT NOT NULL DEFAULT '';
)sql";

// Version 3: the host id range the session's sandbox ran as (host_ids.hpp);
// 0, 0 for sessions recorded before ranges were leased.
constexpr const char* kSchemaV3 = R"sql(
ALTER TABLE sessions ADD COLUMN host_id_base INTEGER NOT NULL DEFAULT 0 CHECK (host_id_base >= 0);
ALTER TABLE sessions ADD COLUMN host_id_count INTEGER NOT NULL DEFAULT 0 CHECK (host_id_count >= 0);
)sql";

// Version 4: what a server hands its successor (docs/restarts.md): one row
// per hibernated session, and one named "@server" for the manager socket,
// each sealed under the server key (the rows are opaque here).
constexpr const char* kSchemaV4 = R"sql(
CREATE TABLE IF NOT EXISTS handover (
    name    TEXT PRIMARY KEY NOT NULL,
    sealed  BLOB NOT NULL,
    made_at REAL NOT NULL
);
)sql";

constexpr const char* kSessionColumns =
    "id, image, state, close_reason, created_at, closed_at, limits, metadata, "
    "execution_count, memory_peak_bytes, cpu_ms, image_id, host_id_base, host_id_count";

// SQLite integers are signed 64-bit; a counter past that is a bug upstream, not data.
std::int64_t to_sql(std::uint64_t value, const char* field) {
    if (value > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
        throw std::runtime_error(std::string(field) + " " + std::to_string(value) +
                                 " does not fit in a SQLite integer");
    }
    return static_cast<std::int64_t>(value);
}

// The CHECK constraints keep these columns non-negative.
std::uint64_t from_sql(const SQLite::Column& column) {
    return static_cast<std::uint64_t>(column.getInt64());
}

std::string to_text(const json& value, const char* field) {
    try {
        return value.dump();
    } catch (const json::exception& e) {
        throw std::runtime_error(std::string(field) + ": " + e.what());
    }
}

json from_text(const SQLite::Column& column, const char* field) {
    try {
        return json::parse(column.getString());
    } catch (const json::exception& e) {
        throw std::runtime_error(std::string("stored ") + field + " is not JSON: " + e.what());
    }
}

SessionRecord read_session(const SQLite::Statement& row) {
    SessionRecord r;
    r.id = row.getColumn(0).getString();
    r.image = row.getColumn(1).getString();
    r.state = row.getColumn(2).getString();
    r.close_reason = row.getColumn(3).getString();
    r.created_at = row.getColumn(4).getDouble();
    r.closed_at = row.getColumn(5).getDouble();
    r.limits = from_text(row.getColumn(6), "limits");
    r.metadata = from_text(row.getColumn(7), "metadata");
    r.execution_count = row.getColumn(8).getInt64();
    r.memory_peak_bytes = from_sql(row.getColumn(9));
    r.cpu_ms = from_sql(row.getColumn(10));
    r.image_id = row.getColumn(11).getString();
    r.host_id_base = static_cast<std::uint32_t>(from_sql(row.getColumn(12)));
    r.host_id_count = static_cast<std::uint32_t>(from_sql(row.getColumn(13)));
    return r;
}

// A write that must touch exactly one session row.
void update_one(SQLite::Statement& st) {
    if (st.exec() != 1) throw std::runtime_error("no such session");
}

}  // namespace

struct SessionStore::Impl {
    std::string path;
    SQLite::Database db;

    explicit Impl(const std::filesystem::path& p)
        : path(p.string()),
          db(p.string(), SQLite::OPEN_READWRITE | SQLite::OPEN_CREATE, kBusyTimeoutMs) {
        // The registry holds every execution's code and the handover's rows:
        // its owner's only. SQLite makes the -wal and -shm files with the
        // database's mode, so this comes before WAL is turned on.
        for (const char* suffix : {"", "-wal", "-shm"}) {
            const std::string file = path + suffix;
            if (::chmod(file.c_str(), 0600) != 0 && errno != ENOENT) {
                throw std::runtime_error("chmod 600 " + file + ": " + std::strerror(errno));
            }
        }
    }

    // Runs `body`, turning any failure into "database <path>: <what>: <why>".
    template <typename Body>
    auto guarded(const std::string& what, Body&& body) const -> decltype(body()) {
        try {
            return body();
        } catch (const std::exception& e) {
            throw std::runtime_error("database " + path + ": " + what + ": " + e.what());
        }
    }

    // Statements are prepared once and reused: parsing SQL was a tenth of the
    // server's CPU per execution when every write prepared its statement anew.
    std::unordered_map<std::string, std::unique_ptr<SQLite::Statement>> statements;

    // A cached statement, reset with its bindings cleared; reset again when the
    // use ends, so that a SELECT does not hold its read snapshot open.
    class Use {
      public:
        explicit Use(SQLite::Statement& st) : st_(st) {
            st_.tryReset();
            st_.clearBindings();
        }
        ~Use() { st_.tryReset(); }
        Use(const Use&) = delete;
        Use& operator=(const Use&) = delete;
        SQLite::Statement& operator*() const { return st_; }

      private:
        SQLite::Statement& st_;
    };

    SQLite::Statement& statement(const std::string& sql) {
        auto& slot = statements[sql];
        if (!slot) slot = std::make_unique<SQLite::Statement>(db, sql);
        return *slot;
    }

    int schema_version() { return db.execAndGet("PRAGMA user_version").getInt(); }

    void refuse_newer(int version) const {
        if (version > kSchemaVersion) {
            throw std::runtime_error("database " + path + ": schema version " +
                                     std::to_string(version) + " is newer than this cellblock (" +
                                     std::to_string(kSchemaVersion) + ")");
        }
    }

    void open() {
        // Check before changing anything: a newer cellblock's file is left as it is.
        refuse_newer(guarded("read schema version", [&] { return schema_version(); }));
        guarded("configure", [&] {
            const std::string mode = db.execAndGet("PRAGMA journal_mode = WAL").getString();
            if (mode != "wal") throw std::runtime_error("journal_mode is " + mode + ", not wal");
            db.exec("PRAGMA synchronous = NORMAL");
            db.exec("PRAGMA foreign_keys = ON");
        });
        const int found = guarded("create schema", [&] {
            // IMMEDIATE: two processes opening a fresh file at once serialize here.
            SQLite::Transaction tx(db, SQLite::TransactionBehavior::IMMEDIATE);
            const int version = schema_version();
            if (version > kSchemaVersion) return version;  // rolled back, refused below
            if (version < kSchemaVersion) {
                if (version < 1) db.exec(kSchemaV1);
                if (version < 2) db.exec(kSchemaV2);
                if (version < 3) db.exec(kSchemaV3);
                if (version < 4) db.exec(kSchemaV4);
                db.exec("PRAGMA user_version = " + std::to_string(kSchemaVersion));
            }
            tx.commit();
            return version;
        });
        refuse_newer(found);
    }
};

SessionStore::SessionStore(const std::filesystem::path& path) {
    try {
        impl_ = std::make_unique<Impl>(path);
    } catch (const std::exception& e) {
        throw std::runtime_error("database " + path.string() + ": open: " + e.what());
    }
    impl_->open();
}

SessionStore::~SessionStore() = default;

void SessionStore::add_session(const SessionRecord& r) {
    impl_->guarded("add_session " + r.id, [&] {
        Impl::Use st_use(
            impl_->statement("INSERT INTO sessions (id, image, state, close_reason, created_at, "
                             "closed_at, limits, metadata, execution_count, memory_peak_bytes, "
                             "cpu_ms, image_id, host_id_base, host_id_count) "
                             "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"));
        SQLite::Statement& st = *st_use;
        st.bind(1, r.id);
        st.bind(2, r.image);
        st.bind(3, r.state);
        st.bind(4, r.close_reason);
        st.bind(5, r.created_at);
        st.bind(6, r.closed_at);
        st.bind(7, to_text(r.limits, "limits"));
        st.bind(8, to_text(r.metadata, "metadata"));
        st.bind(9, r.execution_count);
        st.bind(10, to_sql(r.memory_peak_bytes, "memory_peak_bytes"));
        st.bind(11, to_sql(r.cpu_ms, "cpu_ms"));
        st.bind(12, r.image_id);
        st.bind(13, static_cast<std::int64_t>(r.host_id_base));
        st.bind(14, static_cast<std::int64_t>(r.host_id_count));
        st.exec();
    });
}

void SessionStore::set_state(const std::string& id, const std::string& state) {
    impl_->guarded("set_state " + id, [&] {
        Impl::Use st_use(impl_->statement("UPDATE sessions SET state = ? WHERE id = ?"));
        SQLite::Statement& st = *st_use;
        st.bind(1, state);
        st.bind(2, id);
        update_one(st);
    });
}

// Records the final figures only; the caller adds the "closed" event it wants
// (close_all_open adds its own because nobody else is there to).
void SessionStore::close_session(const std::string& id, const std::string& reason, double at,
                                 std::int64_t execution_count, std::uint64_t memory_peak_bytes,
                                 std::uint64_t cpu_ms) {
    impl_->guarded("close_session " + id, [&] {
        Impl::Use st_use(
            impl_->statement("UPDATE sessions SET state = 'closed', close_reason = ?, "
                             "closed_at = ?, execution_count = ?, memory_peak_bytes = ?, "
                             "cpu_ms = ? WHERE id = ?"));
        SQLite::Statement& st = *st_use;
        st.bind(1, reason);
        st.bind(2, at);
        st.bind(3, execution_count);
        st.bind(4, to_sql(memory_peak_bytes, "memory_peak_bytes"));
        st.bind(5, to_sql(cpu_ms, "cpu_ms"));
        st.bind(6, id);
        update_one(st);
    });
}

void SessionStore::add_execution(const ExecutionRecord& r) {
    impl_->guarded("add_execution " + r.session_id + "/" + std::to_string(r.count), [&] {
        Impl::Use st_use(impl_->statement(
            "INSERT INTO executions (session_id, count, msg_id, code, status, "
            "ename, started_at, wall_ms, cpu_ms, memory_peak_bytes, "
            "output_bytes, truncated) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"));
        SQLite::Statement& st = *st_use;
        st.bind(1, r.session_id);
        st.bind(2, r.count);
        st.bind(3, r.msg_id);
        st.bind(4, r.code);
        st.bind(5, r.status);
        st.bind(6, r.ename);
        st.bind(7, r.started_at);
        st.bind(8, r.wall_ms);
        st.bind(9, to_sql(r.cpu_ms, "cpu_ms"));
        st.bind(10, to_sql(r.memory_peak_bytes, "memory_peak_bytes"));
        st.bind(11, to_sql(r.output_bytes, "output_bytes"));
        st.bind(12, r.truncated ? 1 : 0);
        st.exec();
    });
}

void SessionStore::add_event(const EventRecord& r) {
    impl_->guarded("add_event " + r.session_id + " " + r.kind, [&] {
        Impl::Use st_use(impl_->statement(
            "INSERT INTO events (session_id, at, kind, detail) VALUES (?, ?, ?, ?)"));
        SQLite::Statement& st = *st_use;
        st.bind(1, r.session_id);
        st.bind(2, r.at);
        st.bind(3, r.kind);
        st.bind(4, r.detail);
        st.exec();
    });
}

std::optional<SessionRecord> SessionStore::session(const std::string& id) const {
    return impl_->guarded("session " + id, [&]() -> std::optional<SessionRecord> {
        Impl::Use st_use(impl_->statement(std::string("SELECT ") + kSessionColumns +
                                          " FROM sessions WHERE id = ?"));
        SQLite::Statement& st = *st_use;
        st.bind(1, id);
        if (!st.executeStep()) return std::nullopt;
        return read_session(st);
    });
}

std::vector<SessionRecord> SessionStore::sessions(bool open_only, std::size_t limit) const {
    return impl_->guarded("sessions", [&] {
        // rowid breaks ties between sessions created in the same instant: later insert first.
        Impl::Use st_use(impl_->statement(std::string("SELECT ") + kSessionColumns +
                                          " FROM sessions WHERE (? = 0 OR state NOT IN "
                                          "('closed', 'failed')) ORDER BY created_at DESC, "
                                          "rowid DESC LIMIT ?"));
        SQLite::Statement& st = *st_use;
        st.bind(1, open_only ? 1 : 0);
        const auto max = static_cast<std::size_t>(std::numeric_limits<std::int64_t>::max());
        st.bind(2, static_cast<std::int64_t>(limit < max ? limit : max));
        std::vector<SessionRecord> out;
        while (st.executeStep()) out.push_back(read_session(st));
        return out;
    });
}

std::vector<ExecutionRecord> SessionStore::executions(const std::string& session_id) const {
    return impl_->guarded("executions " + session_id, [&] {
        Impl::Use st_use(
            impl_->statement("SELECT session_id, count, msg_id, code, status, ename, started_at, "
                             "wall_ms, cpu_ms, memory_peak_bytes, output_bytes, truncated "
                             "FROM executions WHERE session_id = ? ORDER BY count"));
        SQLite::Statement& st = *st_use;
        st.bind(1, session_id);
        std::vector<ExecutionRecord> out;
        while (st.executeStep()) {
            ExecutionRecord r;
            r.session_id = st.getColumn(0).getString();
            r.count = st.getColumn(1).getInt64();
            r.msg_id = st.getColumn(2).getString();
            r.code = st.getColumn(3).getString();
            r.status = st.getColumn(4).getString();
            r.ename = st.getColumn(5).getString();
            r.started_at = st.getColumn(6).getDouble();
            r.wall_ms = st.getColumn(7).getDouble();
            r.cpu_ms = from_sql(st.getColumn(8));
            r.memory_peak_bytes = from_sql(st.getColumn(9));
            r.output_bytes = from_sql(st.getColumn(10));
            r.truncated = st.getColumn(11).getInt() != 0;
            out.push_back(std::move(r));
        }
        return out;
    });
}

std::vector<EventRecord> SessionStore::events(const std::string& session_id) const {
    return impl_->guarded("events " + session_id, [&] {
        Impl::Use st_use(
            impl_->statement("SELECT session_id, at, kind, detail FROM events "
                             "WHERE session_id = ? ORDER BY id"));
        SQLite::Statement& st = *st_use;
        st.bind(1, session_id);
        std::vector<EventRecord> out;
        while (st.executeStep()) {
            EventRecord r;
            r.session_id = st.getColumn(0).getString();
            r.at = st.getColumn(1).getDouble();
            r.kind = st.getColumn(2).getString();
            r.detail = st.getColumn(3).getString();
            out.push_back(std::move(r));
        }
        return out;
    });
}

void SessionStore::put_handover(const HandoverRow& row, bool durable) {
    impl_->guarded("put_handover " + row.name, [&] {
        // NORMAL (the store's setting) leaves a WAL commit to the next
        // checkpoint's sync; FULL syncs the WAL at this commit (0.3-4 ms here).
        if (durable) impl_->db.exec("PRAGMA synchronous = FULL");
        struct Normal {
            SQLite::Database* db;
            ~Normal() {
                if (!db) return;
                try {
                    db->exec("PRAGMA synchronous = NORMAL");
                } catch (const std::exception&) {
                }
            }
        } normal{durable ? &impl_->db : nullptr};
        Impl::Use st_use(impl_->statement(
            "INSERT OR REPLACE INTO handover (name, sealed, made_at) VALUES (?, ?, ?)"));
        SQLite::Statement& st = *st_use;
        st.bind(1, row.name);
        st.bind(2, row.sealed.data(), static_cast<int>(row.sealed.size()));
        st.bind(3, row.made_at);
        st.exec();
    });
}

std::vector<HandoverRow> SessionStore::handovers() const {
    return impl_->guarded("handovers", [&] {
        Impl::Use st_use(
            impl_->statement("SELECT name, sealed, made_at FROM handover ORDER BY made_at, name"));
        SQLite::Statement& st = *st_use;
        std::vector<HandoverRow> rows;
        while (st.executeStep()) {
            HandoverRow row;
            row.name = st.getColumn(0).getString();
            const SQLite::Column blob = st.getColumn(1);
            row.sealed.assign(static_cast<const char*>(blob.getBlob()),
                              static_cast<std::size_t>(blob.getBytes()));
            row.made_at = st.getColumn(2).getDouble();
            rows.push_back(std::move(row));
        }
        return rows;
    });
}

void SessionStore::remove_handover(const std::string& name) {
    impl_->guarded("remove_handover " + name, [&] {
        Impl::Use st_use(impl_->statement("DELETE FROM handover WHERE name = ?"));
        (*st_use).bind(1, name);
        (*st_use).exec();
    });
}

std::vector<std::string> SessionStore::close_all_open(const std::string& reason, double at,
                                                      const std::set<std::string>& except) {
    return impl_->guarded("close_all_open", [&] {
        // IMMEDIATE takes the write lock before the read, so the set cannot change under us.
        SQLite::Transaction tx(impl_->db, SQLite::TransactionBehavior::IMMEDIATE);
        std::vector<std::string> ids;
        {
            Impl::Use open_use(
                impl_->statement("SELECT id FROM sessions WHERE state NOT IN ('closed', "
                                 "'failed') ORDER BY created_at, rowid"));
            SQLite::Statement& open = *open_use;
            while (open.executeStep()) {
                std::string id = open.getColumn(0).getString();
                if (!except.count(id)) ids.push_back(std::move(id));
            }
        }
        Impl::Use close_use(
            impl_->statement("UPDATE sessions SET state = 'closed', close_reason = ?, "
                             "closed_at = ? WHERE id = ?"));
        SQLite::Statement& close = *close_use;
        Impl::Use event_use(
            impl_->statement("INSERT INTO events (session_id, at, kind, detail) "
                             "VALUES (?, ?, 'closed', ?)"));
        SQLite::Statement& event = *event_use;
        for (const auto& id : ids) {
            close.reset();
            close.bind(1, reason);
            close.bind(2, at);
            close.bind(3, id);
            close.exec();
            event.reset();
            event.bind(1, id);
            event.bind(2, at);
            event.bind(3, reason);
            event.exec();
        }
        tx.commit();
        return ids;
    });
}

std::string code_digest(const std::string& code) { return "sha256:" + sha256_hex(code); }

}  // namespace cellblock
