// The server's session record (session.hpp) and its observers
// (session_events.hpp): the table that replaces the per-feature side
// tables, and the audit trail against a real SQLite registry.
#include "session.hpp"

#include <stdlib.h>

#include <filesystem>
#include <vector>

#include <SQLiteCpp/SQLiteCpp.h>
#include <gtest/gtest.h>

#include "audit_trail.hpp"
#include "cellblock/session_store.hpp"
#include "egress_gateway.hpp"

namespace cellblock {
namespace {
namespace fs = std::filesystem;

// A Session without a relay in this process: what a hibernated session, or
// one waiting to be adopted after a restart, will be.
TEST(SessionTable, ASessionWithoutARelayIsHeldButNotLive) {
    SessionTable table;
    table.add(Session("s1", "host", nullptr));
    ASSERT_NE(table.find("s1"), nullptr);
    EXPECT_EQ(table.find("s1")->image(), "host");
    EXPECT_FALSE(table.find("s1")->live());
    EXPECT_EQ(table.find("s1")->sandbox(), nullptr);
    EXPECT_EQ(table.live("s1"), nullptr);
    EXPECT_EQ(table.find("s2"), nullptr);
    EXPECT_EQ(table.live("s2"), nullptr);
    EXPECT_EQ(table.size(), 1u);
    EXPECT_EQ(table.live_count(), 0u);
    table.erase("s1");
    EXPECT_TRUE(table.empty());
}

TEST(SessionTable, EachSessionKeepsItsOwnFairness) {
    SessionTable table;
    table.add(Session("a", "host", nullptr));
    table.add(Session("b", "host", nullptr));
    CpuSample busy;
    busy.at = CpuFairness::Clock::now();
    busy.cpu_ns = 0;
    busy.executed = true;
    table.find("a")->fairness().observe(busy);
    EXPECT_EQ(table.find("a")->fairness().last_sample(), busy.at);
    EXPECT_NE(table.find("b")->fairness().last_sample(), busy.at);
    // Erasing one leaves the other's state where it was.
    table.erase("b");
    EXPECT_EQ(table.find("a")->fairness().last_sample(), busy.at);
}

TEST(SessionTable, EndNamesTheSessionItsImageAndReason) {
    const Session s("s1", "data", nullptr);
    const SessionEnd end = s.end("idle_timeout");
    EXPECT_EQ(end.id, "s1");
    EXPECT_EQ(end.image, "data");
    EXPECT_EQ(end.reason, "idle_timeout");
    EXPECT_EQ(end.executions, 0);
    EXPECT_EQ(end.memory_peak_bytes, 0u);
}

class AuditTrailTest : public ::testing::Test {
  protected:
    void SetUp() override {
        std::string pattern = (fs::temp_directory_path() / "cellblock-audit-XXXXXX").string();
        ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
        dir_ = pattern;
        store_ = std::make_unique<SessionStore>(dir_ / "sessions.db");
        SessionRecord r;
        r.id = id_;
        r.image = image_;
        r.state = "idle";
        r.created_at = 1700000000.0;
        store_->add_session(r);
    }
    void TearDown() override {
        store_.reset();
        std::error_code ec;
        fs::remove_all(dir_, ec);
    }
    std::vector<std::string> kinds() const {
        std::vector<std::string> out;
        for (const auto& e : store_->events(id_)) out.push_back(e.kind);
        return out;
    }

    fs::path dir_;
    std::unique_ptr<SessionStore> store_;
    const std::string id_ = "s1", image_ = "host";
};

TEST_F(AuditTrailTest, ExecutionsWaitForTheFlush) {
    AuditTrail audit(*store_);
    ExecutionRecord r;
    r.session_id = id_;
    r.count = 1;
    r.msg_id = "m1";
    r.status = "ok";
    audit.execution({id_, image_}, r);
    EXPECT_EQ(audit.queued(), 1u);
    EXPECT_TRUE(store_->executions(id_).empty());
    audit.flush();
    EXPECT_EQ(audit.queued(), 0u);
    ASSERT_EQ(store_->executions(id_).size(), 1u);
    EXPECT_EQ(store_->executions(id_)[0].msg_id, "m1");
}

TEST_F(AuditTrailTest, OnlyStatesThatOutliveTheProcessAreWritten) {
    AuditTrail audit(*store_);
    audit.state({id_, image_}, "busy");
    EXPECT_EQ(store_->session(id_)->state, "idle");
    audit.state({id_, image_}, "hibernated");
    EXPECT_EQ(store_->session(id_)->state, "hibernated");
    audit.state({id_, image_}, "idle");  // served from memory, not written
    EXPECT_EQ(store_->session(id_)->state, "hibernated");
}

TEST_F(AuditTrailTest, EventsEgressAndTheCloseGoToTheHistory) {
    AuditTrail audit(*store_);
    audit.event({id_, image_}, "cpu_demoted", "a fork storm");
    EgressEvent e;
    e.session_id = id_;
    e.detail = {{"verdict", "refused"}, {"host", "example.test"}};
    audit.egress({id_, image_}, e);
    audit.closed({id_, image_, "idle_timeout", 3, 1 << 20, 40});
    EXPECT_EQ(kinds(), (std::vector<std::string>{"cpu_demoted", "egress", "closed"}));
    EXPECT_NE(store_->events(id_)[1].detail.find("example.test"), std::string::npos);
    const auto record = store_->session(id_);
    EXPECT_EQ(record->state, "closed");
    EXPECT_EQ(record->close_reason, "idle_timeout");
    EXPECT_EQ(record->execution_count, 3);
    EXPECT_EQ(record->memory_peak_bytes, 1u << 20);
    EXPECT_EQ(record->cpu_ms, 40u);
}

// The relay must not see the registry's failure: a write that fails is
// logged and the trail goes on with the next.
TEST_F(AuditTrailTest, AFailedWriteIsLoggedNotThrown) {
    AuditTrail audit(*store_);
    {
        SQLite::Database db((dir_ / "sessions.db").string(), SQLite::OPEN_READWRITE);
        db.exec("DROP TABLE events");
    }
    EXPECT_NO_THROW(audit.event({id_, image_}, "cpu_demoted", "lost"));
    EXPECT_THROW(store_->events(id_), std::exception);  // the write did fail
    ExecutionRecord r;
    r.session_id = id_;
    r.count = 1;
    r.msg_id = "m1";
    audit.execution({id_, image_}, r);
    audit.flush();  // executions are another table: still written
    EXPECT_EQ(store_->executions(id_).size(), 1u);
}

}  // namespace
}  // namespace cellblock
