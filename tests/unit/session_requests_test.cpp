// The manager's session requests (session_list, _info, _close, _history)
// through the narrow SessionService, over a real SQLite registry: what each
// reply carries of a session's record, and each refusal by name.
#include "session_requests.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>

#include "cellblock/error_names.hpp"
#include "session_proxy.hpp"

namespace cellblock {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

// A service over a real registry; the table holds what a test adds, and
// the backend runs nothing.
class RegistryService : public SessionService {
  public:
    explicit RegistryService(const fs::path& db) : store(db) {}
    const SessionStore& registry() const override { return store; }
    SessionTable& sessions() override { return table; }
    json snapshot(const std::string& id) const override {
        return snapshots.contains(id) ? snapshots.at(id) : json();
    }
    json backend_inventory() const override {
        return {{"warm_sandboxes", json::array()},
                {"zygotes", json::array()},
                {"backend", "registry-only"},
                {"runtime_root", "/run/cellblock-test"}};
    }

    SessionStore store;
    SessionTable table;
    json snapshots = json::object();
};

class SessionRequestsTest : public ::testing::Test {
  protected:
    void SetUp() override {
        std::string pattern = (fs::temp_directory_path() / "cellblock-requests-XXXXXX").string();
        ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
        dir_ = pattern;
        service_ = std::make_unique<RegistryService>(dir_ / "sessions.db");
        requests_ = std::make_unique<SessionRequests>(*service_);
    }
    void TearDown() override {
        requests_.reset();
        service_.reset();
        std::error_code ec;
        fs::remove_all(dir_, ec);
    }
    void add(const std::string& id, double created_at, const std::string& state = "idle") {
        SessionRecord r;
        r.id = id;
        r.image = "python";
        r.image_id = "sha256:abc";
        r.state = state;
        r.created_at = created_at;
        r.limits = {{"exec_timeout_s", 30}};
        r.metadata = {{"owner", "eval-7"}};
        r.host_id_base = 1065536;
        r.host_id_count = 65536;
        service_->store.add_session(r);
    }
    // The ename and evalue of the RequestError `call` throws; empty when none.
    template <typename F>
    static std::pair<std::string, std::string> refusal(F call) {
        try {
            call();
        } catch (const RequestError& e) {
            return {e.ename, e.evalue};
        }
        return {};
    }

    fs::path dir_;
    std::unique_ptr<RegistryService> service_;
    std::unique_ptr<SessionRequests> requests_;
};

TEST_F(SessionRequestsTest, ListReadsTheRegistryNewestFirstAndOpenOnlyLeavesTheClosedOut) {
    add("old", 1700000000.0);
    add("new", 1700000100.0);
    service_->store.close_session("old", "idle_timeout", 1700000050.0, 3, 1 << 20, 40);
    // A session held with no relay in this process reads as its registry row.
    service_->table.add(Session("new", "python", nullptr));

    const json all = requests_->list(json::object());
    EXPECT_EQ(all["status"], "ok");
    EXPECT_EQ(all["backend"], "registry-only");
    EXPECT_EQ(all["runtime_root"], "/run/cellblock-test");
    ASSERT_EQ(all["sessions"].size(), 2u);
    EXPECT_EQ(all["sessions"][0]["session_id"], "new");
    EXPECT_EQ(all["sessions"][0]["state"], "idle");
    EXPECT_FALSE(all["sessions"][0].contains("container_id"));
    EXPECT_EQ(all["sessions"][1]["session_id"], "old");
    EXPECT_EQ(all["sessions"][1]["state"], "closed");
    EXPECT_EQ(all["sessions"][1]["close_reason"], "idle_timeout");
    EXPECT_EQ(all["sessions"][1]["executions"], 3);

    const json open = requests_->list({{"open_only", true}});
    ASSERT_EQ(open["sessions"].size(), 1u);
    EXPECT_EQ(open["sessions"][0]["session_id"], "new");
}

TEST_F(SessionRequestsTest, InfoOfAClosedSessionCarriesItsRecordWhatItUsedAndWhy) {
    add("s1", 1700000000.0);
    service_->store.close_session("s1", "execution_cap", 1700000300.0, 5, 123456789, 2500);
    const json info = requests_->info({{"session_id", "s1"}});
    EXPECT_EQ(info["status"], "ok");
    EXPECT_EQ(info["state"], "closed");
    EXPECT_EQ(info["close_reason"], "execution_cap");
    EXPECT_EQ(info["closed_at"], 1700000300.0);
    EXPECT_EQ(info["executions"], 5);
    EXPECT_EQ(info["usage"], json({{"memory_peak_bytes", 123456789}, {"cpu_ms", 2500}}));
    EXPECT_EQ(info["limits"], json({{"exec_timeout_s", 30}}));
    EXPECT_EQ(info["metadata"], json({{"owner", "eval-7"}}));
    EXPECT_EQ(info["host_ids"], json({{"base", 1065536}, {"count", 65536}}));
    EXPECT_EQ(info["image_id"], "sha256:abc");

    add("s2", 1700000400.0);  // open, not held here: no usage to read
    const json open = requests_->info({{"session_id", "s2"}});
    EXPECT_EQ(open["state"], "idle");
    EXPECT_FALSE(open.contains("usage"));
    EXPECT_FALSE(open.contains("executions_left"));
}

TEST_F(SessionRequestsTest, HistoryListsTheExecutionsAndEventsInOrder) {
    add("s1", 1700000000.0);
    for (int i = 1; i <= 2; ++i) {
        ExecutionRecord e;
        e.session_id = "s1";
        e.count = i;
        e.msg_id = "m" + std::to_string(i);
        e.code = "x = " + std::to_string(i);
        e.status = i == 1 ? "ok" : "error";
        e.ename = i == 1 ? "" : "ZeroDivisionError";
        e.started_at = 1700000000.0 + i;
        e.output_bytes = 10u * i;
        e.truncated = i == 2;
        service_->store.add_execution(e);
    }
    service_->store.add_event({"s1", 1700000000.5, "created", "warm"});
    service_->store.add_event({"s1", 1700000009.0, "interrupted", "by client"});

    const json h = requests_->history({{"session_id", "s1"}});
    EXPECT_EQ(h["status"], "ok");
    ASSERT_EQ(h["executions"].size(), 2u);
    EXPECT_EQ(h["executions"][0]["code"], "x = 1");
    EXPECT_EQ(h["executions"][0]["status"], "ok");
    EXPECT_EQ(h["executions"][1]["ename"], "ZeroDivisionError");
    EXPECT_EQ(h["executions"][1]["output_bytes"], 20);
    EXPECT_EQ(h["executions"][1]["truncated"], true);
    ASSERT_EQ(h["events"].size(), 2u);
    EXPECT_EQ(h["events"][0]["kind"], "created");
    EXPECT_EQ(h["events"][1]["kind"], "interrupted");
    EXPECT_EQ(h["events"][1]["detail"], "by client");
}

TEST_F(SessionRequestsTest, UnknownMalformedAndClosedSessionsAreRefusedByName) {
    add("gone", 1700000000.0);
    service_->store.close_session("gone", "closed_by_request", 1700000001.0, 0, 0, 0);

    for (const json& bad : {json::object(), json{{"session_id", 7}}, json{{"session_id", ""}}}) {
        EXPECT_EQ(refusal([&] { requests_->info(bad); }).first, ename::InvalidRequest) << bad;
        EXPECT_EQ(refusal([&] { requests_->close(bad); }).first, ename::InvalidRequest) << bad;
    }
    const json nobody = {{"session_id", "nobody"}};
    EXPECT_EQ(refusal([&] { requests_->info(nobody); }).first, ename::NoSuchSession);
    EXPECT_EQ(refusal([&] { requests_->history(nobody); }).first, ename::NoSuchSession);
    EXPECT_EQ(refusal([&] { requests_->close(nobody); }).first, ename::NoSuchSession);

    const auto [closed, why] = refusal([&] { requests_->close({{"session_id", "gone"}}); });
    EXPECT_EQ(closed, ename::SessionClosed);
    EXPECT_NE(why.find("closed_by_request"), std::string::npos) << why;
    EXPECT_EQ(refusal([&] {
                  requests_->live({{"session_id", "gone"}});
              }).first,
              ename::SessionClosed);
    // What is refused is only refused: the record still reads.
    EXPECT_EQ(requests_->info({{"session_id", "gone"}})["state"], "closed");
}

}  // namespace
}  // namespace cellblock
