// The session registry against real SQLite files in a scratch directory.
#include "cellblock/session_store.hpp"

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <stdexcept>
#include <string>

#include <SQLiteCpp/SQLiteCpp.h>
#include <gtest/gtest.h>

#include "error_of.hpp"

namespace cellblock {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

class SessionStoreTest : public ::testing::Test {
  protected:
    void SetUp() override {
        std::string pattern = (fs::temp_directory_path() / "cellblock-store-XXXXXX").string();
        ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
        dir_ = pattern;
        db_path_ = dir_ / "sessions.db";
    }
    void TearDown() override {
        std::error_code ec;
        fs::remove_all(dir_, ec);
    }

    fs::path dir_;
    fs::path db_path_;
};

SessionRecord make_session(const std::string& id, double created_at,
                           const std::string& state = "idle") {
    SessionRecord r;
    r.id = id;
    r.image = "host";
    r.state = state;
    r.created_at = created_at;
    return r;
}

ExecutionRecord make_execution(const std::string& session_id, std::int64_t count) {
    ExecutionRecord r;
    r.session_id = session_id;
    r.count = count;
    r.msg_id = "msg-" + std::to_string(count);
    r.code = "x = " + std::to_string(count);
    r.status = "ok";
    r.started_at = 1700000000.0 + static_cast<double>(count);
    return r;
}

std::vector<std::string> ids_of(const std::vector<SessionRecord>& records) {
    std::vector<std::string> ids;
    for (const auto& r : records) ids.push_back(r.id);
    return ids;
}

using cellblock::testing::error_of;

TEST_F(SessionStoreTest, SessionRoundtripsEveryField) {
    SessionStore store(db_path_);
    SessionRecord in;
    in.id = "s-0123";
    in.image = "python-3.11";
    in.state = "closed";
    in.close_reason = "idle_timeout";
    in.created_at = 1700000000.25;
    in.closed_at = 1700000360.5;
    in.limits = json{{"memory_mb", 512}, {"cpus", 0.5}, {"pids", 64}};
    in.metadata = json{{"user", "ada"}, {"tags", {"a", "b"}}, {"nested", {{"k", nullptr}}}};
    in.execution_count = 42;
    in.memory_peak_bytes = (std::uint64_t{1} << 40) + 7;
    in.cpu_ms = 123456789;
    store.add_session(in);

    const auto out = store.session("s-0123");
    ASSERT_TRUE(out.has_value());
    EXPECT_EQ(out->id, in.id);
    EXPECT_EQ(out->image, in.image);
    EXPECT_EQ(out->state, in.state);
    EXPECT_EQ(out->close_reason, in.close_reason);
    EXPECT_DOUBLE_EQ(out->created_at, in.created_at);
    EXPECT_DOUBLE_EQ(out->closed_at, in.closed_at);
    EXPECT_EQ(out->limits, in.limits);
    EXPECT_EQ(out->metadata, in.metadata);
    EXPECT_EQ(out->execution_count, in.execution_count);
    EXPECT_EQ(out->memory_peak_bytes, in.memory_peak_bytes);
    EXPECT_EQ(out->cpu_ms, in.cpu_ms);

    EXPECT_FALSE(store.session("no-such-session").has_value());
}

TEST_F(SessionStoreTest, ExecutionRoundtripsEveryField) {
    SessionStore store(db_path_);
    store.add_session(make_session("s1", 1.0));
    ExecutionRecord in;
    in.session_id = "s1";
    in.count = 3;
    in.msg_id = "0f1e2d3c-msg";
    in.code = "print('h\xc3\xa9llo')\n# a second line";
    in.code.append(std::string("\0tail", 5));
    in.status = "error";
    in.ename = "ExecutionTimeout";
    in.started_at = 1700000001.125;
    in.wall_ms = 2500.75;
    in.cpu_ms = 2400;
    in.memory_peak_bytes = 300u * 1024 * 1024;
    in.output_bytes = 1048577;
    in.truncated = true;
    store.add_execution(in);

    const auto out = store.executions("s1");
    ASSERT_EQ(out.size(), 1u);
    EXPECT_EQ(out[0].session_id, in.session_id);
    EXPECT_EQ(out[0].count, in.count);
    EXPECT_EQ(out[0].msg_id, in.msg_id);
    EXPECT_EQ(out[0].code, in.code);
    EXPECT_EQ(out[0].status, in.status);
    EXPECT_EQ(out[0].ename, in.ename);
    EXPECT_DOUBLE_EQ(out[0].started_at, in.started_at);
    EXPECT_DOUBLE_EQ(out[0].wall_ms, in.wall_ms);
    EXPECT_EQ(out[0].cpu_ms, in.cpu_ms);
    EXPECT_EQ(out[0].memory_peak_bytes, in.memory_peak_bytes);
    EXPECT_EQ(out[0].output_bytes, in.output_bytes);
    EXPECT_TRUE(out[0].truncated);

    auto untruncated = make_execution("s1", 4);
    store.add_execution(untruncated);
    EXPECT_FALSE(store.executions("s1").at(1).truncated);
}

TEST_F(SessionStoreTest, EventRoundtripsEveryFieldInInsertionOrder) {
    SessionStore store(db_path_);
    store.add_session(make_session("s1", 1.0));
    store.add_session(make_session("s2", 2.0));
    store.add_event({"s1", 10.5, "created", "image=host"});
    store.add_event({"s2", 11.0, "created", ""});
    store.add_event({"s1", 10.25, "interrupted", "SIGINT from client"});

    const auto events = store.events("s1");
    ASSERT_EQ(events.size(), 2u);
    EXPECT_EQ(events[0].session_id, "s1");
    EXPECT_DOUBLE_EQ(events[0].at, 10.5);
    EXPECT_EQ(events[0].kind, "created");
    EXPECT_EQ(events[0].detail, "image=host");
    // Recorded order, not timestamp order: the trail is what happened as it was written.
    EXPECT_EQ(events[1].kind, "interrupted");
    EXPECT_DOUBLE_EQ(events[1].at, 10.25);
    EXPECT_EQ(events[1].detail, "SIGINT from client");
    EXPECT_EQ(store.events("s2").size(), 1u);
    EXPECT_TRUE(store.events("nobody").empty());
}

TEST_F(SessionStoreTest, SetStateAndCloseSession) {
    SessionStore store(db_path_);
    store.add_session(make_session("s1", 1.0, "starting"));
    store.set_state("s1", "busy");
    EXPECT_EQ(store.session("s1")->state, "busy");

    store.close_session("s1", "client_shutdown", 99.5, 7, 4096, 250);
    const auto closed = store.session("s1");
    ASSERT_TRUE(closed.has_value());
    EXPECT_EQ(closed->state, "closed");
    EXPECT_EQ(closed->close_reason, "client_shutdown");
    EXPECT_DOUBLE_EQ(closed->closed_at, 99.5);
    EXPECT_EQ(closed->execution_count, 7);
    EXPECT_EQ(closed->memory_peak_bytes, 4096u);
    EXPECT_EQ(closed->cpu_ms, 250u);
}

TEST_F(SessionStoreTest, UpdatesOfAnUnknownSessionThrow) {
    SessionStore store(db_path_);
    const std::string set = error_of([&] { store.set_state("ghost", "idle"); });
    EXPECT_NE(set.find("set_state ghost"), std::string::npos) << set;
    const std::string close = error_of([&] { store.close_session("ghost", "x", 1, 0, 0, 0); });
    EXPECT_NE(close.find("close_session ghost"), std::string::npos) << close;
}

TEST_F(SessionStoreTest, WalModeIsOnForOtherConnections) {
    SessionStore store(db_path_);
    store.add_session(make_session("s1", 1.0));
    SQLite::Database other(db_path_.string(), SQLite::OPEN_READONLY);
    EXPECT_EQ(other.execAndGet("PRAGMA journal_mode").getString(), "wal");
    EXPECT_EQ(other.execAndGet("PRAGMA user_version").getInt(), 4);
    // A reader sees committed rows while the store stays open.
    EXPECT_EQ(other.execAndGet("SELECT count(*) FROM sessions").getInt(), 1);
}

TEST_F(SessionStoreTest, DataSurvivesReopen) {
    {
        SessionStore store(db_path_);
        auto s = make_session("s1", 5.0);
        s.metadata = json{{"k", "v"}};
        store.add_session(s);
        store.add_execution(make_execution("s1", 1));
        store.add_event({"s1", 5.0, "created", "first"});
    }
    SessionStore reopened(db_path_);
    const auto s = reopened.session("s1");
    ASSERT_TRUE(s.has_value());
    EXPECT_EQ(s->metadata, (json{{"k", "v"}}));
    ASSERT_EQ(reopened.executions("s1").size(), 1u);
    EXPECT_EQ(reopened.executions("s1")[0].code, "x = 1");
    ASSERT_EQ(reopened.events("s1").size(), 1u);
    EXPECT_EQ(reopened.events("s1")[0].detail, "first");
    // The reopened store still writes (schema left as it was, not recreated).
    reopened.add_execution(make_execution("s1", 2));
    EXPECT_EQ(reopened.executions("s1").size(), 2u);
}

TEST_F(SessionStoreTest, CloseAllOpenTouchesOnlyOpenSessions) {
    SessionStore store(db_path_);
    store.add_session(make_session("starting", 1.0, "starting"));
    store.add_session(make_session("idle", 2.0, "idle"));
    store.add_session(make_session("busy", 3.0, "busy"));
    store.add_session(make_session("closing", 4.0, "closing"));
    store.add_session(make_session("done", 5.0, "idle"));
    store.close_session("done", "client_shutdown", 6.0, 2, 10, 20);
    store.add_session(make_session("broken", 7.0, "failed"));

    const auto closed = store.close_all_open("server_restart", 100.0);
    EXPECT_EQ(closed, (std::vector<std::string>{"starting", "idle", "busy", "closing"}));

    for (const auto& id : closed) {
        const auto s = store.session(id);
        ASSERT_TRUE(s.has_value());
        EXPECT_EQ(s->state, "closed") << id;
        EXPECT_EQ(s->close_reason, "server_restart") << id;
        EXPECT_DOUBLE_EQ(s->closed_at, 100.0) << id;
        const auto events = store.events(id);
        ASSERT_EQ(events.size(), 1u) << id;
        EXPECT_EQ(events[0].kind, "closed");
        EXPECT_EQ(events[0].detail, "server_restart");
        EXPECT_DOUBLE_EQ(events[0].at, 100.0);
    }

    const auto done = store.session("done");
    EXPECT_EQ(done->close_reason, "client_shutdown");
    EXPECT_DOUBLE_EQ(done->closed_at, 6.0);
    EXPECT_EQ(done->execution_count, 2);
    EXPECT_TRUE(store.events("done").empty());
    const auto broken = store.session("broken");
    EXPECT_EQ(broken->state, "failed");
    EXPECT_EQ(broken->close_reason, "");
    EXPECT_TRUE(store.events("broken").empty());

    EXPECT_TRUE(store.close_all_open("server_restart", 200.0).empty());
}

TEST_F(SessionStoreTest, TheRegistryIsItsOwnersOnly) {
    // It holds every execution's code and the handover's rows.
    {
        SessionStore store(db_path_);
        store.add_session(make_session("s1", 1.0));
    }
    for (const char* suffix : {"", "-wal", "-shm"}) {
        const std::filesystem::path file = db_path_.string() + suffix;
        if (!std::filesystem::exists(file)) continue;
        EXPECT_EQ(std::filesystem::status(file).permissions(),
                  std::filesystem::perms::owner_read | std::filesystem::perms::owner_write)
            << file;
    }
    // A file an older cellblock left readable is made private at the next open.
    std::filesystem::permissions(db_path_, std::filesystem::perms::others_read,
                                 std::filesystem::perm_options::add);
    SessionStore again(db_path_);
    EXPECT_EQ(std::filesystem::status(db_path_).permissions(),
              std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
}

TEST_F(SessionStoreTest, HandedOverSessionsStayOpenAndTheirRowsRoundTrip) {
    SessionStore store(db_path_);
    store.add_session(make_session("asleep", 1.0, "hibernated"));
    store.add_session(make_session("other", 2.0, "idle"));
    // Rows are opaque bytes: NULs and high bytes come back whole.
    const std::string sealed("CBSEAL1\n\0\xff\x01 sealed", 18);
    store.put_handover({"asleep", sealed, 10.0});
    store.put_handover({"@server", "manager", 10.0});
    store.put_handover({"asleep", sealed + "!", 11.0});  // written again: replaced
    const auto rows = store.handovers();
    ASSERT_EQ(rows.size(), 2u);
    EXPECT_EQ(rows[0].name, "@server");
    EXPECT_EQ(rows[1].name, "asleep");
    EXPECT_EQ(rows[1].sealed, sealed + "!");
    EXPECT_DOUBLE_EQ(rows[1].made_at, 11.0);
    EXPECT_EQ(store.close_all_open("server_restart", 20.0, {"asleep"}),
              std::vector<std::string>{"other"});
    EXPECT_EQ(store.session("asleep")->state, "hibernated");
    store.remove_handover("asleep");
    store.remove_handover("@server");
    EXPECT_TRUE(store.handovers().empty());
}

TEST_F(SessionStoreTest, SessionsAreNewestFirstAndFilterable) {
    SessionStore store(db_path_);
    store.add_session(make_session("middle", 20.0));
    store.add_session(make_session("oldest", 10.0, "closed"));
    store.add_session(make_session("newest", 30.0, "busy"));
    store.add_session(make_session("failed", 25.0, "failed"));

    EXPECT_EQ(ids_of(store.sessions()),
              (std::vector<std::string>{"newest", "failed", "middle", "oldest"}));
    EXPECT_EQ(ids_of(store.sessions(true)), (std::vector<std::string>{"newest", "middle"}));
    EXPECT_EQ(ids_of(store.sessions(false, 2)), (std::vector<std::string>{"newest", "failed"}));
    EXPECT_EQ(ids_of(store.sessions(true, 1)), (std::vector<std::string>{"newest"}));
    EXPECT_EQ(store.sessions(false, std::numeric_limits<std::size_t>::max()).size(), 4u);
}

TEST_F(SessionStoreTest, ExecutionsAreOrderedByCount) {
    SessionStore store(db_path_);
    store.add_session(make_session("s1", 1.0));
    store.add_session(make_session("s2", 2.0));
    for (std::int64_t count : {3, 1, 10, 2}) store.add_execution(make_execution("s1", count));
    store.add_execution(make_execution("s2", 1));

    std::vector<std::int64_t> counts;
    for (const auto& e : store.executions("s1")) counts.push_back(e.count);
    EXPECT_EQ(counts, (std::vector<std::int64_t>{1, 2, 3, 10}));
    EXPECT_EQ(store.executions("s2").size(), 1u);
    EXPECT_TRUE(store.executions("nobody").empty());
}

TEST_F(SessionStoreTest, DuplicateExecutionThrowsWithContext) {
    SessionStore store(db_path_);
    store.add_session(make_session("s1", 1.0));
    store.add_execution(make_execution("s1", 1));
    const std::string error = error_of([&] { store.add_execution(make_execution("s1", 1)); });
    EXPECT_NE(error.find("database " + db_path_.string() + ": add_execution s1/1: "),
              std::string::npos)
        << error;
    EXPECT_NE(error.find("UNIQUE"), std::string::npos) << error;
    EXPECT_EQ(store.executions("s1").size(), 1u);
}

TEST_F(SessionStoreTest, ForeignKeysRejectUnknownSessions) {
    SessionStore store(db_path_);
    const std::string execution =
        error_of([&] { store.add_execution(make_execution("ghost", 1)); });
    EXPECT_NE(execution.find("add_execution ghost/1"), std::string::npos) << execution;
    EXPECT_NE(execution.find("FOREIGN KEY"), std::string::npos) << execution;

    const std::string event = error_of([&] { store.add_event({"ghost", 1.0, "created", ""}); });
    EXPECT_NE(event.find("FOREIGN KEY"), std::string::npos) << event;
    EXPECT_TRUE(store.executions("ghost").empty());
    EXPECT_TRUE(store.events("ghost").empty());
}

TEST_F(SessionStoreTest, DuplicateSessionIdThrows) {
    SessionStore store(db_path_);
    store.add_session(make_session("s1", 1.0));
    const std::string error = error_of([&] { store.add_session(make_session("s1", 2.0)); });
    EXPECT_NE(error.find("add_session s1"), std::string::npos) << error;
}

// Statements are prepared once and reused (session_store.cpp): a failed write
// must not poison the next use, a reused statement must not keep an earlier
// use's bindings, and a read must not keep its snapshot open afterwards.
TEST_F(SessionStoreTest, ReusedStatementsSurviveFailuresAndReleaseTheirSnapshot) {
    SessionStore store(db_path_);
    store.add_session(make_session("s1", 1.0));
    store.add_execution(make_execution("s1", 1));
    EXPECT_THROW(store.add_execution(make_execution("s1", 1)), std::runtime_error);
    EXPECT_THROW(store.add_execution(make_execution("ghost", 2)), std::runtime_error);
    store.add_execution(make_execution("s1", 2));  // the same statement, after two failures
    ExecutionRecord partial = make_execution("s1", 3);
    partial.ename.clear();
    store.add_execution(partial);
    const auto executions = store.executions("s1");
    ASSERT_EQ(executions.size(), 3u);
    EXPECT_EQ(executions[1].count, 2);
    EXPECT_EQ(executions[2].code, "x = 3");
    EXPECT_EQ(executions[2].ename, "");

    // session() stops at the first row; another connection's write is seen by
    // the next read, and a checkpoint can truncate the WAL (no reader left).
    ASSERT_TRUE(store.session("s1"));
    {
        SQLite::Database other(db_path_.string(), SQLite::OPEN_READWRITE);
        other.exec("UPDATE sessions SET state = 'busy' WHERE id = 's1'");
        SQLite::Statement checkpoint(other, "PRAGMA wal_checkpoint(TRUNCATE)");
        ASSERT_TRUE(checkpoint.executeStep());
        EXPECT_EQ(checkpoint.getColumn(0).getInt(), 0) << "checkpoint blocked by a reader";
    }
    EXPECT_EQ(store.session("s1")->state, "busy");
    EXPECT_FALSE(store.session("ghost"));
    EXPECT_EQ(store.session("s1")->id, "s1");
}

TEST_F(SessionStoreTest, KeepsTheImageContentId) {
    SessionStore store(db_path_);
    auto s = make_session("s1", 1.0);
    s.image = "python-minimal";
    s.image_id = std::string(64, 'a');
    store.add_session(s);
    store.add_session(make_session("s2", 2.0));
    EXPECT_EQ(store.session("s1")->image_id, std::string(64, 'a'));
    EXPECT_EQ(store.session("s2")->image_id, "");
}

TEST_F(SessionStoreTest, KeepsTheHostIdRange) {
    SessionStore store(db_path_);
    auto s = make_session("s1", 1.0);
    s.host_id_base = (1u << 30) + 3 * 65536;
    s.host_id_count = 65536;
    store.add_session(s);
    store.add_session(make_session("s2", 2.0));
    EXPECT_EQ(store.session("s1")->host_id_base, (1u << 30) + 3 * 65536);
    EXPECT_EQ(store.session("s1")->host_id_count, 65536u);
    EXPECT_EQ(store.session("s2")->host_id_base, 0u);
    EXPECT_EQ(store.sessions(true).front().host_id_base, 0u);  // newest first: s2
}

TEST_F(SessionStoreTest, UpgradesAVersion1Database) {
    {
        // The version 1 schema, as cellblock 0.1 wrote it, with one session.
        SQLite::Database db(db_path_.string(), SQLite::OPEN_READWRITE | SQLite::OPEN_CREATE);
        db.exec(
            "CREATE TABLE sessions (id TEXT PRIMARY KEY NOT NULL, image TEXT NOT NULL, state "
            "TEXT NOT NULL, close_reason TEXT NOT NULL DEFAULT '', created_at REAL NOT NULL, "
            "closed_at REAL NOT NULL DEFAULT 0, limits TEXT NOT NULL DEFAULT '{}', metadata TEXT "
            "NOT NULL DEFAULT '{}', execution_count INTEGER NOT NULL DEFAULT 0, "
            "memory_peak_bytes INTEGER NOT NULL DEFAULT 0, cpu_ms INTEGER NOT NULL DEFAULT 0)");
        db.exec(
            "INSERT INTO sessions (id, image, state, created_at) VALUES ('old', 'host', "
            "'closed', 1.0)");
        db.exec("PRAGMA user_version = 1");
    }
    SessionStore store(db_path_);
    ASSERT_TRUE(store.session("old").has_value());
    EXPECT_EQ(store.session("old")->image_id, "");
    auto s = make_session("new", 2.0);
    s.image_id = "abc";
    store.add_session(s);
    EXPECT_EQ(store.session("new")->image_id, "abc");
    EXPECT_EQ(store.session("old")->host_id_base, 0u);
    SQLite::Database db(db_path_.string(), SQLite::OPEN_READONLY);
    EXPECT_EQ(db.execAndGet("PRAGMA user_version").getInt(), 4);
}

TEST_F(SessionStoreTest, RefusesANewerSchema) {
    {
        SQLite::Database db(db_path_.string(), SQLite::OPEN_READWRITE | SQLite::OPEN_CREATE);
        db.exec("PRAGMA user_version = 7");
    }
    const std::string error = error_of([&] { SessionStore store(db_path_); });
    EXPECT_EQ(error, "database " + db_path_.string() +
                         ": schema version 7 is newer than this cellblock (4)");
    // The newer file is left alone: still version 7, not switched to WAL, no tables added.
    SQLite::Database db(db_path_.string(), SQLite::OPEN_READONLY);
    EXPECT_EQ(db.execAndGet("PRAGMA user_version").getInt(), 7);
    EXPECT_NE(db.execAndGet("PRAGMA journal_mode").getString(), "wal");
    EXPECT_FALSE(db.tableExists("sessions"));
}

TEST_F(SessionStoreTest, OpenFailuresNameTheDatabase) {
    const fs::path garbage = dir_ / "garbage.db";
    std::ofstream(garbage) << std::string(4096, 'x');
    const std::string not_db = error_of([&] { SessionStore store(garbage); });
    EXPECT_EQ(not_db.rfind("database " + garbage.string() + ": ", 0), 0u) << not_db;

    const fs::path missing_dir = dir_ / "no" / "such" / "dir" / "s.db";
    const std::string missing = error_of([&] { SessionStore store(missing_dir); });
    EXPECT_EQ(missing.rfind("database " + missing_dir.string() + ": ", 0), 0u) << missing;
}

TEST_F(SessionStoreTest, CountersBeyondSqliteIntegersAreRefused) {
    SessionStore store(db_path_);
    auto s = make_session("s1", 1.0);
    s.cpu_ms = std::numeric_limits<std::uint64_t>::max();
    const std::string error = error_of([&] { store.add_session(s); });
    EXPECT_NE(error.find("cpu_ms"), std::string::npos) << error;
    EXPECT_FALSE(store.session("s1").has_value());
}

TEST_F(SessionStoreTest, InjectionAttemptsAreStoredVerbatim) {
    SessionStore store(db_path_);
    const std::string id = "x'); DROP TABLE sessions; --";
    auto s = make_session(id, 1.0);
    s.image = "\" OR 1=1 --";
    s.metadata = json{{"name", "Robert'); DROP TABLE executions;--"}, {"q", "' OR ''='"}};
    store.add_session(s);
    auto e = make_execution(id, 1);
    e.code = "'; DELETE FROM events WHERE '1'='1";
    store.add_execution(e);
    store.add_event({id, 2.0, "created", "'); DROP TABLE events; --"});

    const auto out = store.session(id);
    ASSERT_TRUE(out.has_value());
    EXPECT_EQ(out->id, id);
    EXPECT_EQ(out->image, s.image);
    EXPECT_EQ(out->metadata, s.metadata);
    ASSERT_EQ(store.executions(id).size(), 1u);
    EXPECT_EQ(store.executions(id)[0].code, e.code);
    ASSERT_EQ(store.events(id).size(), 1u);
    EXPECT_EQ(store.events(id)[0].detail, "'); DROP TABLE events; --");
    EXPECT_EQ(store.sessions().size(), 1u);

    // A near-miss id must not match by pattern or by accident.
    EXPECT_FALSE(store.session("x'); DROP TABLE sessions; -- ").has_value());
    EXPECT_FALSE(store.session("' OR '1'='1").has_value());
}

TEST(CodeDigest, KnownAnswers) {
    // Expected values from `printf '<text>' | sha256sum`.
    EXPECT_EQ(code_digest(""),
              "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    EXPECT_EQ(code_digest("abc"),
              "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    EXPECT_EQ(code_digest("print(1 + 1)\n"),
              "sha256:e129241ca638617d9675c0206242cd9a3f2750f7014b1471adcbdfce3fdd7c0f");
}

}  // namespace
}  // namespace cellblock
