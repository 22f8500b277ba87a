// The relay's rules, driven through SessionCore with a recording SessionIo and
// a clock of the test's own: the ordering cases the integration tests can
// only reach through real sandboxes and wall-clock windows.
#include "session_core.hpp"

#include <gtest/gtest.h>

#include "cellblock/signer.hpp"

// The pure core holds the project's frames, never libzmq's.
#ifdef ZMQ_VERSION
#error "session_core.hpp must not include libzmq"
#endif

namespace cellblock {
namespace {
using nlohmann::json;
using namespace std::chrono_literals;

const Signer kSigner("test-key");

// One thing the core asked for.
struct Action {
    explicit Action(std::string k, Channel c = Channel::shell, std::string type = "",
                    std::string parent = "")
        : kind(std::move(k)), channel(c), msg_type(std::move(type)), parent_id(std::move(parent)) {}
    std::string kind;  // forward, send, kernel, interrupt, kill, release, rejected, log
    Channel channel = Channel::shell;
    std::string msg_type;
    std::string parent_id;
    std::vector<std::string> identities;
    json metadata, content;
    std::size_t frames = 0;
    std::string why;
};

class RecordingIo final : public SessionIo {
  public:
    std::vector<Action> actions;
    SandboxUsage usage;
    KernelExit exit;
    bool queue_full = false;

    void forward_reply(Channel channel, const std::vector<std::string>& identities,
                       InboundMessage& msg, const std::string* new_metadata) override {
        forwarded(channel, identities, msg, new_metadata, nullptr);
    }
    void forward_output(InboundMessage& msg, const std::string* new_content) override {
        forwarded(Channel::iopub, msg.identities(), msg, nullptr, new_content);
    }
    void send_reply(Channel channel, const std::vector<std::string>& identities, const json& parent,
                    const std::string& msg_type, json content) override {
        sent(channel, identities, parent, msg_type, std::move(content));
    }
    void publish(const json& parent, const std::string& msg_type, json content) override {
        sent(Channel::iopub, {}, parent, msg_type, std::move(content));
    }
    bool forward_to_kernel(Channel channel, InboundMessage& msg) override {
        Action a("kernel", channel, msg.msg_type, msg.parent_id);
        a.metadata = json::parse(msg.frame(msg.layout.metadata()));
        a.content = json::parse(msg.frame(msg.layout.content()));
        actions.push_back(std::move(a));
        return !queue_full;
    }
    void interrupt_kernel() override { actions.emplace_back("interrupt"); }
    void kill_kernel() override { actions.emplace_back("kill"); }
    SandboxUsage kernel_usage() override { return usage; }
    // As a Swarm sandbox when `takes_reports`: the report becomes the usage.
    bool takes_reports = false;
    bool kernel_reported_usage(const SandboxUsage& reported) override {
        if (takes_reports) usage = reported;
        return takes_reports;
    }
    KernelExit kernel_exit() override { return exit; }
    void release_kernel() override { actions.emplace_back("release"); }
    // Hibernation: the relay's own requests, the sleep and the wake.
    bool keep_snapshot = true;
    std::string keep_refusal = "the disk is full";
    int own_requests = 0;
    std::string send_to_kernel(Channel channel, const std::string& msg_type,
                               json content) override {
        Action a("own", channel, msg_type);
        a.content = std::move(content);
        a.parent_id = "own-" + std::to_string(++own_requests);
        actions.push_back(a);
        return a.parent_id;
    }
    void saving_snapshot() override { actions.emplace_back("saving"); }
    void snapshot_unsaved() override { actions.emplace_back("unsaved"); }
    // Index of the first action of a kind, or -1.
    int first(const std::string& kind) const {
        for (std::size_t i = 0; i < actions.size(); ++i) {
            if (actions[i].kind == kind) return static_cast<int>(i);
        }
        return -1;
    }
    // Kept at once, or when the test says (`keeps`) when `keeps_later`.
    bool keeps_later = false;
    std::vector<Moved> keeps;
    void put_to_sleep(const json& report, Moved done) override {
        Action a("sleep");
        a.content = report;
        actions.push_back(std::move(a));
        if (keeps_later) return keeps.push_back(std::move(done));
        done(keep_snapshot ? nullptr : &keep_refusal);
    }
    // As a Swarm sandbox when `moves_later`: the snapshot moves through the
    // kernel, answered when the test says (`fetches`, `places`).
    bool moves_later = false;
    std::vector<Moved> fetches, places;
    void fetch_snapshot(Moved done) override {
        actions.emplace_back("fetch");
        if (!moves_later) return done(nullptr);
        fetches.push_back(std::move(done));
    }
    void place_snapshot(Moved done) override {
        actions.emplace_back("place");
        if (!moves_later) return done(nullptr);
        places.push_back(std::move(done));
    }
    bool sleep_possible = true;
    bool can_sleep(std::string& why) const override {
        if (!sleep_possible) why = "the swarm backend's sandboxes keep no files on this host";
        return sleep_possible;
    }
    void wake() override { actions.emplace_back("wake"); }
    bool listening = true;
    bool clients_listening() const override { return listening; }
    std::optional<std::chrono::milliseconds> outputs_held_for;
    void hold_outputs_for_listener(std::chrono::milliseconds for_at_most) override {
        outputs_held_for = for_at_most;
    }
    std::set<std::string> gone;  // routing identities not connected on shell
    bool client_connected(const std::string& identity) const override {
        return gone.count(identity) == 0;
    }
    void rejected(std::string_view where, std::string_view, const std::string& why) override {
        Action a("rejected");
        a.why = std::string(where) + ": " + why;
        actions.push_back(std::move(a));
    }
    void log(const std::string& what) override {
        Action a("log");
        a.why = what;
        actions.push_back(std::move(a));
    }

    void forwarded(Channel channel, const std::vector<std::string>& identities, InboundMessage& msg,
                   const std::string* new_metadata, const std::string* new_content) {
        Action a("forward", channel, msg.msg_type, msg.parent_id);
        a.identities = identities;
        a.metadata = json::parse(new_metadata ? std::string_view(*new_metadata)
                                              : msg.frame(msg.layout.metadata()));
        a.content = json::parse(new_content ? std::string_view(*new_content)
                                            : msg.frame(msg.layout.content()));
        a.frames = msg.frames.size();
        actions.push_back(std::move(a));
    }
    void sent(Channel channel, const std::vector<std::string>& identities, const json& parent,
              const std::string& msg_type, json content) {
        Action a("send", channel, msg_type, parent.value("msg_id", ""));
        a.identities = identities;
        a.content = std::move(content);
        actions.push_back(std::move(a));
    }

    // The actions of one kind (and message type), in order.
    std::vector<Action> of(const std::string& kind, const std::string& msg_type = "") const {
        std::vector<Action> out;
        for (const auto& a : actions) {
            if (a.kind == kind && (msg_type.empty() || a.msg_type == msg_type)) out.push_back(a);
        }
        return out;
    }
    // Client-bound messages (forwarded or written by the server) of a type.
    std::vector<Action> to_client(const std::string& msg_type) const {
        std::vector<Action> out;
        for (const auto& a : actions) {
            if ((a.kind == "forward" || a.kind == "send") && a.msg_type == msg_type) {
                out.push_back(a);
            }
        }
        return out;
    }
    bool any_rejected_with(const std::string& text) const {
        for (const auto& a : actions) {
            if (a.kind == "rejected" && a.why.find(text) != std::string::npos) return true;
        }
        return false;
    }
};

// A message as the relay receives it: encoded, signed and verified.
InboundMessage inbound(const std::vector<std::string>& identities, const std::string& msg_type,
                       const std::string& msg_id, const std::string& parent_id,
                       json content = json::object(), json metadata = json::object(),
                       std::vector<std::string> buffers = {}) {
    WireMessage msg;
    msg.identities = identities;
    msg.header = make_header(msg_type, "test-session");
    msg.header["msg_id"] = msg_id;
    // One date for all: a request built twice is the same request sent again
    // (SessionCore::request_key), as a client sends it.
    msg.header["date"] = "2026-11-28T12:00:00.000000Z";
    msg.parent_header =
        parent_id.empty() ? json::object() : json{{"msg_id", parent_id}, {"msg_type", "x"}};
    msg.metadata = std::move(metadata);
    msg.content = std::move(content);
    msg.buffers = std::move(buffers);
    Multipart parts;
    for (auto& f : encode(msg, kSigner)) {
        parts.total_bytes += f.size();
        parts.frames.emplace_back(std::move(f));
    }
    InboundMessage out;
    std::string why;
    // As SessionProxy's: a client's four JSON frames parsed, a kernel's two.
    const ReceiveRules rules{&kSigner, nullptr, {}, !identities.empty()};
    EXPECT_TRUE(verify_frames(parts, rules, out, why)) << why;
    return out;
}

const std::vector<std::string> kClient = {"client-a"};

InboundMessage request(const std::string& msg_type, const std::string& msg_id,
                       json content = json::object(), json metadata = json::object()) {
    return inbound(kClient, msg_type, msg_id, "", std::move(content), std::move(metadata));
}

InboundMessage execute(const std::string& msg_id, json content = {{"code", "1+1"}},
                       json metadata = json::object()) {
    return request("execute_request", msg_id, std::move(content), std::move(metadata));
}

InboundMessage from_kernel(const std::string& msg_type, const std::string& parent_id,
                           json content = json::object(), std::vector<std::string> buffers = {}) {
    static int n = 0;
    return inbound({}, msg_type, "k" + std::to_string(++n), parent_id, std::move(content),
                   json::object(), std::move(buffers));
}

InboundMessage status(const std::string& parent_id, const char* state) {
    return from_kernel("status", parent_id, {{"execution_state", state}});
}

InboundMessage stream(const std::string& parent_id, const std::string& text) {
    return from_kernel("stream", parent_id, {{"name", "stdout"}, {"text", text}});
}

InboundMessage execute_reply(const std::string& parent_id, const char* status_text = "ok") {
    return from_kernel("execute_reply", parent_id,
                       {{"status", status_text}, {"execution_count", 1}});
}

class Recorder final : public SessionObserver {
  public:
    std::vector<ExecutionRecord> executions;
    std::vector<std::string> states, events, closed;
    int requests_changed = 0;
    void on_execution(const ExecutionRecord& r) override { executions.push_back(r); }
    void on_requests_changed(const std::string&) override { ++requests_changed; }
    void on_state(const std::string&, const std::string& s) override { states.push_back(s); }
    void on_event(const std::string&, const std::string& kind, const std::string& d) override {
        events.push_back(kind + " " + d);
    }
    void on_closed(const std::string&, const std::string& reason) override {
        closed.push_back(reason);
    }
};

// A session under serve's policy, attached to a kernel, at t0.
class CoreTest : public ::testing::Test {
  protected:
    Clock::time_point t0 = Clock::time_point() + 1000s;
    ServerPolicy policy;
    RecordingIo io;
    Recorder audit;
    std::unique_ptr<SessionCore> core;

    void start(SessionLimits limits = {}, bool governed = true) {
        CoreOptions options;
        options.session_id = "s1";
        if (governed) {
            options.policy = &policy;
            options.limits = limits;
        }
        options.observer = &audit;
        core = std::make_unique<SessionCore>(options, io, t0);
        core->on_kernel_attached(t0, {"probe-1"});
    }
    void SetUp() override { start(); }

    // An execute answered in the kernel's usual order: busy, output, idle, reply.
    void run_cell(const std::string& id, Clock::time_point at) {
        core->on_client_request(at, Channel::shell, execute(id));
        core->on_kernel_iopub(at, status(id, "busy"));
        core->on_kernel_iopub(at, status(id, "idle"));
        core->on_kernel_reply(at, Channel::shell, execute_reply(id));
    }
};

TEST_F(CoreTest, ForwardsARequestAndItsReplyToTheClientThatAsked) {
    core->on_client_request(t0, Channel::shell, request("kernel_info_request", "r1"));
    ASSERT_EQ(io.of("kernel").size(), 1u);
    core->on_kernel_reply(t0, Channel::shell, from_kernel("kernel_info_reply", "r1"));
    const auto replies = io.to_client("kernel_info_reply");
    ASSERT_EQ(replies.size(), 1u);
    EXPECT_EQ(replies[0].identities, kClient);
}

TEST_F(CoreTest, AReplyToARequestNotOpenIsDropped) {
    // Another session's request id, and a second reply to one answered.
    core->on_kernel_reply(t0, Channel::shell, from_kernel("kernel_info_reply", "other-session"));
    core->on_client_request(t0, Channel::shell, request("kernel_info_request", "r1"));
    core->on_kernel_reply(t0, Channel::shell, from_kernel("kernel_info_reply", "r1"));
    core->on_kernel_reply(t0, Channel::shell, from_kernel("kernel_info_reply", "r1"));
    EXPECT_EQ(io.to_client("kernel_info_reply").size(), 1u);
    EXPECT_TRUE(io.any_rejected_with("not open: 'other-session'"));
}

TEST_F(CoreTest, AReplyOfTheWrongTypeOrOnTheWrongChannelIsDropped) {
    core->on_client_request(t0, Channel::shell, request("kernel_info_request", "r1"));
    core->on_kernel_reply(t0, Channel::shell, from_kernel("complete_reply", "r1"));
    core->on_kernel_reply(t0, Channel::control, from_kernel("kernel_info_reply", "r1"));
    EXPECT_TRUE(io.to_client("complete_reply").empty());
    EXPECT_TRUE(io.to_client("kernel_info_reply").empty());
    EXPECT_TRUE(io.any_rejected_with("does not answer kernel_info_request"));
    // Still open: the right reply goes through.
    core->on_kernel_reply(t0, Channel::shell, from_kernel("kernel_info_reply", "r1"));
    EXPECT_EQ(io.to_client("kernel_info_reply").size(), 1u);
}

TEST_F(CoreTest, AMessageThatIsNotARequestIsRejected) {
    core->on_client_request(t0, Channel::shell, request("execute_reply", "r1"));
    EXPECT_TRUE(io.of("kernel").empty());
    EXPECT_TRUE(io.any_rejected_with("'execute_reply' is not a request"));
}

TEST_F(CoreTest, TheExecuteReplyIsHeldUntilTheKernelsIdle) {
    core->on_client_request(t0, Channel::shell, execute("e1"));
    core->on_kernel_iopub(t0, status("e1", "busy"));
    core->on_kernel_reply(t0, Channel::shell, execute_reply("e1"));
    EXPECT_TRUE(io.to_client("execute_reply").empty()) << "released before idle";
    core->on_kernel_iopub(t0 + 1ms, status("e1", "idle"));
    const auto replies = io.to_client("execute_reply");
    ASSERT_EQ(replies.size(), 1u);
    // The budget rides on the reply.
    EXPECT_EQ(replies[0].metadata["cellblock"]["executions_left"], 999);
    ASSERT_EQ(audit.executions.size(), 1u);
    EXPECT_EQ(audit.executions[0].status, "ok");
    EXPECT_EQ(core->state(), "idle");
}

TEST_F(CoreTest, AnIdleBeforeTheReplyLetsTheReplyGoOnArrival) {
    core->on_client_request(t0, Channel::shell, execute("e1"));
    core->on_kernel_iopub(t0, status("e1", "idle"));
    EXPECT_TRUE(io.to_client("execute_reply").empty());
    core->on_kernel_reply(t0, Channel::shell, execute_reply("e1"));
    EXPECT_EQ(io.to_client("execute_reply").size(), 1u);
}

TEST_F(CoreTest, AKernelThatNeverSendsIdleHasItsReplyReleasedAtTheHoldLimit) {
    core->on_client_request(t0, Channel::shell, execute("e1"));
    core->on_kernel_reply(t0, Channel::shell, execute_reply("e1"));
    EXPECT_EQ(core->next_deadline(t0), t0 + 30s);
    core->on_tick(t0 + 30s - 1ms);
    EXPECT_TRUE(io.to_client("execute_reply").empty());
    core->on_tick(t0 + 30s);
    EXPECT_EQ(io.to_client("execute_reply").size(), 1u);
}

TEST_F(CoreTest, ExecutesSentWhileOneRunsAreQueuedAndSentInOrder) {
    core->on_client_request(t0, Channel::shell, execute("e1"));
    core->on_client_request(t0, Channel::shell, execute("e2"));
    core->on_client_request(t0, Channel::shell, execute("e3"));
    ASSERT_EQ(io.of("kernel").size(), 1u) << "only the first reaches the kernel";
    core->on_kernel_iopub(t0, status("e1", "idle"));
    core->on_kernel_reply(t0, Channel::shell, execute_reply("e1"));
    auto sent = io.of("kernel");
    ASSERT_EQ(sent.size(), 2u);
    EXPECT_EQ(sent[1].msg_type, "execute_request");
    EXPECT_EQ(core->running_since(), t0);
    core->on_kernel_iopub(t0, status("e2", "idle"));
    core->on_kernel_reply(t0, Channel::shell, execute_reply("e2"));
    EXPECT_EQ(io.of("kernel").size(), 3u);
}

TEST_F(CoreTest, AnErrorAbortsQueuedExecutesUnlessTheyAskNotToStop) {
    core->on_client_request(t0, Channel::shell, execute("e1"));
    core->on_client_request(t0, Channel::shell, execute("e2"));
    core->on_client_request(t0, Channel::shell,
                            execute("e3", {{"code", "2"}, {"stop_on_error", false}}));
    core->on_kernel_iopub(t0, status("e1", "idle"));
    core->on_kernel_reply(t0, Channel::shell, execute_reply("e1", "error"));
    const auto replies = io.to_client("execute_reply");
    ASSERT_EQ(replies.size(), 2u);
    EXPECT_EQ(replies[1].parent_id, "e2");
    EXPECT_EQ(replies[1].content["status"], "aborted");
    const auto sent = io.of("kernel");
    ASSERT_EQ(sent.size(), 2u);
    EXPECT_EQ(sent[1].content["code"], "2") << "e3 runs despite the error";
}

TEST_F(CoreTest, TheQueueIsBounded) {
    core->on_client_request(t0, Channel::shell, execute("e0"));
    for (int i = 1; i <= 257; ++i) {
        core->on_client_request(t0, Channel::shell, execute("q" + std::to_string(i)));
    }
    const auto replies = io.to_client("execute_reply");
    ASSERT_EQ(replies.size(), 1u);
    EXPECT_EQ(replies[0].parent_id, "q257");
    EXPECT_EQ(replies[0].content["ename"], "SessionBusy");
}

TEST_F(CoreTest, TheExecutionCapRefusesWithoutReachingTheKernel) {
    SessionLimits limits;
    limits.max_executions = 2;
    start(limits);
    run_cell("e1", t0);
    run_cell("e2", t0);
    core->on_client_request(t0, Channel::shell, execute("e3"));
    EXPECT_EQ(io.of("kernel").size(), 2u);
    const auto replies = io.to_client("execute_reply");
    ASSERT_EQ(replies.size(), 3u);
    EXPECT_EQ(replies[2].content["ename"], "ExecutionLimitExceeded");
    EXPECT_EQ(replies[2].content["cellblock"]["executions_left"], 0);
    // A refusal is busy, error, reply, idle on the client's side.
    EXPECT_EQ(io.to_client("error").size(), 1u);
    ASSERT_FALSE(audit.events.empty());
    EXPECT_NE(audit.events.back().find("refused e3 ExecutionLimitExceeded"), std::string::npos);
}

TEST_F(CoreTest, ATimeoutInterruptsAtTheDeadlineAndKillsAfterTheGrace) {
    SessionLimits limits;
    limits.exec_timeout_s = 10;
    start(limits);
    core->on_client_request(t0, Channel::shell, execute("e1"));
    EXPECT_EQ(core->next_deadline(t0), t0 + 10s);
    core->on_tick(t0 + 10s - 1ms);
    EXPECT_TRUE(io.of("interrupt").empty());
    core->on_tick(t0 + 10s);
    EXPECT_EQ(io.of("interrupt").size(), 1u);
    EXPECT_EQ(core->next_deadline(t0 + 10s), t0 + 13s);  // kill_grace_s 3
    core->on_tick(t0 + 13s - 1ms);
    EXPECT_TRUE(io.of("kill").empty());
    core->on_tick(t0 + 13s);
    EXPECT_EQ(io.of("kill").size(), 1u);
    const auto replies = io.to_client("execute_reply");
    ASSERT_EQ(replies.size(), 1u);
    EXPECT_EQ(replies[0].content["ename"], "ExecutionTimeout");
    EXPECT_TRUE(core->closed());
    EXPECT_EQ(core->close_reason(), "exec_timeout");
    EXPECT_EQ(io.of("release").size(), 1u);
    ASSERT_EQ(audit.executions.size(), 1u);
    EXPECT_EQ(audit.executions[0].status, "timeout");
}

TEST_F(CoreTest, TheObserverSeesEveryMoveOfTheLifecycleInOrder) {
    EXPECT_EQ(audit.states, (std::vector<std::string>{"idle"}));  // attached in start()
    run_cell("e1", t0);
    EXPECT_EQ(audit.states, (std::vector<std::string>{"idle", "busy", "idle"}));
    core->close(t0 + 1s, "closed by the client");
    EXPECT_EQ(audit.states,
              (std::vector<std::string>{"idle", "busy", "idle", "closing", "closed"}));
    EXPECT_EQ(core->lifecycle_state(), SessionState::closed);
    EXPECT_EQ(core->state(), "closed");
    ASSERT_EQ(audit.closed.size(), 1u);
}

TEST_F(CoreTest, AKilledExecutionEndsBeforeItsSessionCloses) {
    SessionLimits limits;
    limits.exec_timeout_s = 10;
    start(limits);
    audit.states.clear();
    core->on_client_request(t0, Channel::shell, execute("e1"));
    EXPECT_EQ(core->state(), "busy");
    core->on_tick(t0 + 10s);
    core->on_tick(t0 + 13s);  // killed after the grace: recorded as ended, then closed
    EXPECT_EQ(audit.states, (std::vector<std::string>{"busy", "idle", "closing", "closed"}));
    ASSERT_EQ(audit.executions.size(), 1u);
    EXPECT_EQ(audit.executions[0].status, "timeout");
}

TEST(CoreLifecycle, ASessionClosedWhileStartingNeverAttachesAndRefusesAsClosed) {
    RecordingIo io;
    Recorder audit;
    CoreOptions options;
    options.session_id = "s1";
    options.observer = &audit;
    const Clock::time_point t0 = Clock::time_point() + 1000s;
    SessionCore core(options, io, t0);
    EXPECT_EQ(core.state(), "starting");
    core.on_client_request(t0, Channel::shell, request("kernel_info_request", "r1"));
    ASSERT_EQ(io.to_client("kernel_info_reply").size(), 1u);
    EXPECT_EQ(io.to_client("kernel_info_reply")[0].content["evalue"], "this session is starting");
    core.close(t0, "the pool gave no sandbox");
    EXPECT_EQ(audit.states, (std::vector<std::string>{"closing", "closed"}));
    core.on_kernel_attached(t0, {});  // a probe that answers too late changes nothing
    EXPECT_EQ(core.state(), "closed");
    EXPECT_FALSE(core.kernel_live());
}

TEST_F(CoreTest, AnExecutionThatStopsWhenInterruptedIsNotKilled) {
    SessionLimits limits;
    limits.exec_timeout_s = 10;
    start(limits);
    core->on_client_request(t0, Channel::shell, execute("e1"));
    core->on_tick(t0 + 10s);
    core->on_kernel_iopub(t0 + 11s, status("e1", "idle"));
    core->on_kernel_reply(t0 + 11s, Channel::shell, execute_reply("e1", "error"));
    core->on_tick(t0 + 20s);
    EXPECT_TRUE(io.of("kill").empty());
    EXPECT_FALSE(core->closed());
}

TEST_F(CoreTest, ARequestedTimeoutAboveTheMaximumIsRefused) {
    policy.maxima.exec_timeout_s = 60;
    start();
    core->on_client_request(t0, Channel::shell,
                            execute("e1", {{"code", "1"}}, {{"cellblock", {{"timeout_s", 61}}}}));
    core->on_client_request(t0, Channel::shell,
                            execute("e2", {{"code", "1"}}, {{"cellblock", {{"timeout_s", "x"}}}}));
    EXPECT_TRUE(io.of("kernel").empty());
    const auto replies = io.to_client("execute_reply");
    ASSERT_EQ(replies.size(), 2u);
    EXPECT_EQ(replies[0].content["ename"], "LimitAboveMaximum");
    EXPECT_EQ(replies[1].content["ename"], "InvalidLimits");
}

TEST_F(CoreTest, AnInterruptIsAnsweredByTheServerAndAnIgnoredOneEndsInAKill) {
    core->on_client_request(t0, Channel::shell, execute("e1"));
    core->on_client_request(t0 + 1s, Channel::control, request("interrupt_request", "i1"));
    EXPECT_EQ(io.of("interrupt").size(), 1u);
    const auto replies = io.to_client("interrupt_reply");
    ASSERT_EQ(replies.size(), 1u);
    EXPECT_EQ(replies[0].channel, Channel::control);
    EXPECT_EQ(io.of("kernel").size(), 1u) << "the interrupt never reaches the kernel";
    core->on_tick(t0 + 6s - 1ms);  // interrupt_grace_s 5
    EXPECT_TRUE(io.of("kill").empty());
    core->on_tick(t0 + 6s);
    EXPECT_EQ(io.of("kill").size(), 1u);
    EXPECT_EQ(io.to_client("execute_reply")[0].content["ename"], "InterruptIgnored");
    EXPECT_EQ(core->close_reason(), "interrupt_ignored");
}

TEST_F(CoreTest, AnInterruptWhileIdleStartsNoGrace) {
    core->on_client_request(t0, Channel::control, request("interrupt_request", "i1"));
    core->on_tick(t0 + 60s);
    EXPECT_TRUE(io.of("kill").empty());
    EXPECT_FALSE(core->closed());
}

TEST_F(CoreTest, InputRequestsGoToTheExecutesClientOnStdin) {
    core->on_client_request(t0, Channel::shell, execute("e1"));
    core->on_kernel_input_request(t0, from_kernel("input_request", "e1", {{"prompt", "? "}}));
    const auto asks = io.to_client("input_request");
    ASSERT_EQ(asks.size(), 1u);
    EXPECT_EQ(asks[0].channel, Channel::stdin_);
    EXPECT_EQ(asks[0].identities, kClient);
    // One for a request not open (or not an execute) is dropped.
    core->on_client_request(t0, Channel::shell, request("kernel_info_request", "r1"));
    core->on_kernel_input_request(t0, from_kernel("input_request", "r1"));
    core->on_kernel_input_request(t0, from_kernel("input_request", "nobody"));
    EXPECT_EQ(io.to_client("input_request").size(), 1u);
    // The client's answer goes to the kernel's stdin.
    core->on_client_input(t0, inbound(kClient, "input_reply", "in1", "", {{"value", "x"}}));
    EXPECT_EQ(io.of("kernel", "input_reply").size(), 1u);
    EXPECT_EQ(io.of("kernel", "input_reply")[0].channel, Channel::stdin_);
}

TEST_F(CoreTest, OutputOfAnUnknownParentOrTheProbeIsNotRelayed) {
    core->on_kernel_iopub(t0, stream("stranger", "x"));
    core->on_kernel_iopub(t0, status("probe-1", "idle"));
    core->on_kernel_iopub(t0, status("", "starting"));
    EXPECT_TRUE(io.of("forward").empty());
    EXPECT_TRUE(io.any_rejected_with("parent is not a request of this session: 'stranger'"));
}

TEST_F(CoreTest, StreamOutputIsCutAtTheBudgetWithOneMarker) {
    SessionLimits limits;
    limits.output_bytes = 10;
    start(limits);
    core->on_client_request(t0, Channel::shell, execute("e1"));
    core->on_kernel_iopub(t0, stream("e1", "12345678"));
    core->on_kernel_iopub(t0, stream("e1", "abcdefgh"));
    core->on_kernel_iopub(t0, stream("e1", "dropped"));
    const auto streams = io.to_client("stream");
    ASSERT_EQ(streams.size(), 2u);
    EXPECT_EQ(streams[0].content["text"], "12345678");
    const std::string second = streams[1].content["text"];
    EXPECT_EQ(second.substr(0, 2), "ab");
    EXPECT_NE(second.find("cellblock"), std::string::npos) << second;
}

TEST_F(CoreTest, LateOutputOfTheLastExecutionIsShapedAsItsOutput) {
    SessionLimits limits;
    limits.output_bytes = 4;
    start(limits);
    core->on_client_request(t0, Channel::shell, execute("e1"));
    core->on_kernel_reply(t0, Channel::shell, execute_reply("e1"));
    core->on_tick(t0 + 30s);  // the reply went out at the hold limit, before idle
    core->on_kernel_iopub(t0 + 31s, stream("e1", "abcdefgh"));
    const auto streams = io.to_client("stream");
    ASSERT_EQ(streams.size(), 1u);
    EXPECT_EQ(std::string(streams[0].content["text"]).substr(0, 5), "abcd\n");
}

TEST_F(CoreTest, BackgroundOutputSharesOneCappedBudgetAndGetsOneMarker) {
    SessionLimits limits;
    limits.output_bytes = 2000;
    start(limits);
    run_cell("e1", t0);
    run_cell("e2", t0);  // e1's thread keeps printing while nothing runs
    const std::string line(600, 'x');
    for (int i = 0; i < 6; ++i) core->on_kernel_iopub(t0, stream("e1", line));
    const auto streams = io.to_client("stream");
    ASSERT_GE(streams.size(), 2u);
    EXPECT_LE(streams.size(), 4u);
    EXPECT_NE(std::string(streams.back().content["text"]).find("outside a running execution"),
              std::string::npos);
    EXPECT_EQ(io.of("send", "stream").size(), 1u);
}

TEST_F(CoreTest, ARichMessagePastTheLimitIsReplacedWithItsBuffers) {
    policy.max_message_bytes = 4096;
    start();
    core->on_client_request(t0, Channel::shell, execute("e1"));
    core->on_kernel_iopub(t0, from_kernel("display_data", "e1",
                                          {{"data", {{"image/png", std::string(8000, 'A')}}},
                                           {"metadata", json::object()}},
                                          {"buffer"}));
    core->on_kernel_iopub(
        t0, from_kernel("display_data", "e1",
                        {{"data", {{"text/plain", "small"}}}, {"metadata", json::object()}}));
    const auto shown = io.to_client("display_data");
    ASSERT_EQ(shown.size(), 2u);
    EXPECT_NE(std::string(shown[0].content["data"]["text/plain"]).find("was replaced"),
              std::string::npos);
    EXPECT_FALSE(shown[0].content["data"].contains("image/png"));
    EXPECT_EQ(shown[0].frames, 6u) << "the buffer goes with the content";
    EXPECT_EQ(shown[1].content["data"]["text/plain"], "small");
}

TEST_F(CoreTest, ADisplayLoopSharesTheOutputBudgetAndGetsOneNotice) {
    SessionLimits limits;
    limits.output_bytes = 4000;
    start(limits);
    core->on_client_request(t0, Channel::shell, execute("e1"));
    const json png = {{"data", {{"image/png", std::string(1000, 'A')}}},
                      {"metadata", json::object()}};
    for (int i = 0; i < 50; ++i) core->on_kernel_iopub(t0, from_kernel("display_data", "e1", png));
    core->on_kernel_iopub(t0, stream("e1", "after"));
    const auto shown = io.to_client("display_data");
    ASSERT_GE(shown.size(), 2u);
    ASSERT_LE(shown.size(), 4u) << "about 1,300 bytes each against 4,000";
    for (std::size_t i = 0; i + 1 < shown.size(); ++i) {
        EXPECT_TRUE(shown[i].content["data"].contains("image/png"));
    }
    const std::string notice = shown.back().content["data"]["text/plain"];
    EXPECT_NE(notice.find("passed its output_bytes budget of 4000"), std::string::npos) << notice;
    EXPECT_TRUE(io.to_client("stream").empty()) << "nothing resumes after the cut";
    core->on_kernel_iopub(t0, status("e1", "idle"));
    core->on_kernel_reply(t0, Channel::shell, execute_reply("e1"));
    const auto reply = io.to_client("execute_reply");
    ASSERT_EQ(reply.size(), 1u);
    EXPECT_EQ(reply[0].metadata["cellblock"]["output_truncated"], true);
    EXPECT_GT(reply[0].metadata["cellblock"]["output_dropped_bytes"], 40000);
}

// A Swarm sandbox (on another node) takes the kernel's reading of its own
// cgroup; a local one ignores the kernel's claim and keeps the host's.
TEST_F(CoreTest, OnlyASandboxTheServerCannotReadTakesTheKernelsReportOfItsCgroup) {
    const json usage = {{"cpu_ns", 2500000000ull},
                        {"cpu_ns_at_start", 1000000000ull},
                        {"memory_bytes", 50ull << 20},
                        {"memory_peak_bytes", 80ull << 20}};
    auto run = [&](const std::string& id) {
        core->on_client_request(t0, Channel::shell, execute(id, {{"code", "sum(range(10**8))"}}));
        core->on_kernel_iopub(t0, status(id, "busy"));
        core->on_kernel_iopub(t0, status(id, "idle"));
        core->on_kernel_reply(
            t0, Channel::shell,
            inbound({}, "execute_reply", "k-" + id, id, {{"status", "ok"}, {"execution_count", 1}},
                    {{"cellblock_source", {{"usage", usage}}}}));
        const auto replies = io.to_client("execute_reply");
        EXPECT_FALSE(replies.back().metadata.contains("cellblock_source"));
        return replies.back().metadata["cellblock"];
    };
    io.takes_reports = true;
    json md = run("e1");
    EXPECT_EQ(md["cpu_ms"], 1500);  // the kernel's own start and end
    EXPECT_EQ(md["memory_peak_bytes"], 80ull << 20);
    EXPECT_EQ(io.usage.cpu_ns, 2500000000ull);
    EXPECT_EQ(io.usage.memory_bytes, 50ull << 20);

    // A local sandbox: the host's cgroup says 300 ms and 7 MB, whatever the kernel claims.
    io.takes_reports = false;
    io.usage = SandboxUsage{};
    io.usage.cpu_ns = 100000000;
    core->on_client_request(t0, Channel::shell, execute("e2", {{"code", "1"}}));
    io.usage.cpu_ns = 400000000;
    io.usage.memory_peak_bytes = 7 << 20;
    core->on_kernel_iopub(t0, status("e2", "busy"));
    core->on_kernel_iopub(t0, status("e2", "idle"));
    core->on_kernel_reply(
        t0, Channel::shell,
        inbound({}, "execute_reply", "k-e2", "e2", {{"status", "ok"}, {"execution_count", 2}},
                {{"cellblock_source", {{"usage", usage}}}}));
    md = io.to_client("execute_reply").back().metadata["cellblock"];
    EXPECT_EQ(md["cpu_ms"], 300);
    EXPECT_EQ(md["memory_peak_bytes"], 7 << 20);

    // A report whose start is after its end is not a reading.
    io.takes_reports = true;
    io.usage = SandboxUsage{};
    json bad = usage;
    bad["cpu_ns_at_start"] = 3000000000ull;
    core->on_client_request(t0, Channel::shell, execute("e3", {{"code", "1"}}));
    core->on_kernel_iopub(t0, status("e3", "idle"));
    core->on_kernel_reply(
        t0, Channel::shell,
        inbound({}, "execute_reply", "k-e3", "e3", {{"status", "ok"}, {"execution_count", 3}},
                {{"cellblock_source", {{"usage", bad}}}}));
    EXPECT_EQ(io.usage.cpu_ns, 0u);
    EXPECT_EQ(io.to_client("execute_reply").back().metadata["cellblock"]["cpu_ms"], 0);
}

TEST_F(CoreTest, TheKernelIsToldTheBudgetAndWhatItDroppedIsCounted) {
    SessionLimits limits;
    limits.output_bytes = 100;
    start(limits);
    // A client's own figure is replaced with the session's.
    core->on_client_request(
        t0, Channel::shell,
        execute("e1", {{"code", "1+1"}}, {{"cellblock", {{"output_bytes", 1 << 30}}}}));
    const auto sent = io.of("kernel", "execute_request");
    ASSERT_EQ(sent.size(), 1u);
    EXPECT_EQ(sent[0].metadata["cellblock"]["output_bytes"], 100);
    core->on_kernel_iopub(t0, stream("e1", std::string(101, 'x')));  // as the kernel cuts
    core->on_kernel_iopub(t0, status("e1", "idle"));
    core->on_kernel_reply(
        t0, Channel::shell,
        inbound({}, "execute_reply", "k-reply", "e1", {{"status", "ok"}, {"execution_count", 1}},
                {{"cellblock_source", {{"dropped_bytes", 5000}, {"dropped_messages", 3}}}}));
    const auto reply = io.to_client("execute_reply");
    ASSERT_EQ(reply.size(), 1u);
    const json& md = reply[0].metadata;
    EXPECT_FALSE(md.contains("cellblock_source"));
    EXPECT_EQ(md["cellblock"]["output_dropped_bytes"], 5001);
    EXPECT_EQ(md["cellblock"]["output_dropped_in_kernel_bytes"], 5000);
    EXPECT_EQ(md["cellblock"]["output_truncated"], true);
}

TEST_F(CoreTest, AnUnansweredShutdownIsAnsweredByTheServerAfterTheGrace) {
    core->on_client_request(t0, Channel::control, request("shutdown_request", "sd"));
    EXPECT_EQ(io.of("kernel", "shutdown_request").size(), 1u);
    core->on_tick(t0 + 3s - 1ms);
    EXPECT_FALSE(core->closed());
    core->on_tick(t0 + 3s);
    const auto replies = io.to_client("shutdown_reply");
    ASSERT_EQ(replies.size(), 1u);
    EXPECT_EQ(replies[0].content["status"], "ok");
    EXPECT_EQ(core->close_reason(), "shutdown requested by the client");
    // The kernel's answer after that finds nothing open.
    core->on_kernel_reply(t0 + 4s, Channel::control, from_kernel("shutdown_reply", "sd"));
    EXPECT_EQ(io.to_client("shutdown_reply").size(), 1u);
}

TEST_F(CoreTest, TheKernelsShutdownReplyClosesTheSession) {
    core->on_client_request(t0, Channel::control, request("shutdown_request", "sd"));
    core->on_kernel_reply(t0, Channel::control,
                          from_kernel("shutdown_reply", "sd", {{"status", "ok"}}));
    EXPECT_EQ(io.to_client("shutdown_reply").size(), 1u);
    EXPECT_TRUE(core->closed());
    EXPECT_EQ(audit.closed, std::vector<std::string>{"shutdown requested by the client"});
}

TEST_F(CoreTest, AKernelExitDrainsThenAnswersWhatIsPending) {
    core->on_client_request(t0, Channel::shell, execute("e1"));
    io.exit = {true, "killed by the OOM killer"};
    core->on_kernel_exit(t0);
    EXPECT_EQ(core->next_deadline(t0), t0 + 200ms);
    // A reply sent just before the exit still counts.
    core->on_client_request(t0, Channel::shell, request("kernel_info_request", "r1"));
    core->on_kernel_reply(t0 + 100ms, Channel::shell, from_kernel("kernel_info_reply", "r1"));
    EXPECT_EQ(io.to_client("kernel_info_reply").size(), 1u);
    core->on_tick(t0 + 200ms);
    const auto replies = io.to_client("execute_reply");
    ASSERT_EQ(replies.size(), 1u);
    EXPECT_EQ(replies[0].content["ename"], "MemoryLimitExceeded");
    EXPECT_EQ(core->close_reason(), "memory_limit: killed by the OOM killer");
}

TEST_F(CoreTest, ALostNodeClosesTheSessionAsNodeLostNeverKernelDied) {
    core->on_client_request(t0, Channel::shell, execute("e1"));
    core->on_client_request(t0, Channel::shell, request("kernel_info_request", "r1"));
    io.exit = {false, "node worker-2 is down", true};
    core->on_kernel_exit(t0);
    core->on_tick(t0 + 200ms);
    const auto replies = io.to_client("execute_reply");
    ASSERT_EQ(replies.size(), 1u);
    EXPECT_EQ(replies[0].content["ename"], "SessionClosed");
    EXPECT_EQ(core->close_reason(), "node_lost: node worker-2 is down");
    EXPECT_EQ(audit.closed, std::vector<std::string>{"node_lost: node worker-2 is down"});
    EXPECT_TRUE(core->closed());
}

TEST_F(CoreTest, AClosedSessionAnswersSessionClosedAndQueuedExecutesToo) {
    core->on_client_request(t0, Channel::shell, execute("e1"));
    core->on_client_request(t0, Channel::shell, execute("e2"));
    core->close(t0, "closed by the manager");
    auto replies = io.to_client("execute_reply");
    ASSERT_EQ(replies.size(), 2u);
    for (const auto& r : replies) EXPECT_EQ(r.content["ename"], "SessionClosed");
    core->on_client_request(t0, Channel::shell, request("kernel_info_request", "r1"));
    const auto info = io.to_client("kernel_info_reply");
    ASSERT_EQ(info.size(), 1u);
    EXPECT_EQ(info[0].content["ename"], "SessionClosed");
    // Still readable by jupyter_client's wait_for_ready.
    EXPECT_TRUE(info[0].content.contains("protocol_version"));
    EXPECT_FALSE(core->expired(t0 + 29s));
    EXPECT_TRUE(core->expired(t0 + 30s));
}

// A server that stops answers everything in flight with its own name: the
// running execution, the one queued behind it and another open request.
TEST_F(CoreTest, AShutdownAnswersEveryRequestInFlightServerShuttingDown) {
    core->on_client_request(t0, Channel::shell, execute("e1"));
    core->on_client_request(t0, Channel::shell, execute("e2"));
    core->on_client_request(t0, Channel::shell, request("complete_request", "c1"));
    core->close(t0, "server_shutdown", ename::ServerShuttingDown,
                "the server is shutting down (SIGHUP)");
    const auto replies = io.to_client("execute_reply");
    ASSERT_EQ(replies.size(), 2u);
    for (const auto& r : replies) {
        EXPECT_EQ(r.content["ename"], "ServerShuttingDown");
        EXPECT_EQ(r.content["evalue"], "the server is shutting down (SIGHUP): server_shutdown");
    }
    const auto complete = io.to_client("complete_reply");
    ASSERT_EQ(complete.size(), 1u);
    EXPECT_EQ(complete[0].content["ename"], "ServerShuttingDown");
    EXPECT_EQ(io.to_client("error").size(), 2u) << "each execution shows its error on iopub";
    EXPECT_EQ(audit.closed, std::vector<std::string>{"server_shutdown"});
}

TEST_F(CoreTest, AStartingSessionRefusesRequests) {
    CoreOptions options;
    options.policy = &policy;
    options.limits = SessionLimits{};
    SessionCore starting(options, io, t0);
    starting.on_client_request(t0, Channel::shell, execute("e1"));
    const auto replies = io.to_client("execute_reply");
    ASSERT_EQ(replies.size(), 1u);
    EXPECT_EQ(replies[0].content["evalue"], "this session is starting");
    EXPECT_TRUE(io.of("kernel").empty());
}

TEST_F(CoreTest, TheIdleTimeoutClosesTheSession) {
    SessionLimits limits;
    limits.idle_timeout_s = 60;
    start(limits);
    run_cell("e1", t0 + 10s);
    core->on_tick(t0 + 69s);
    EXPECT_FALSE(core->closed());
    core->on_tick(t0 + 70s);
    EXPECT_EQ(core->close_reason(), "idle_timeout");
}

TEST_F(CoreTest, KernelModeForwardsWithoutAPolicy) {
    start({}, /*governed=*/false);
    core->on_client_request(t0, Channel::shell, execute("e1"));
    core->on_client_request(t0, Channel::shell, execute("e2"));
    EXPECT_EQ(io.of("kernel").size(), 2u) << "the kernel queues them itself";
    core->on_kernel_iopub(t0, stream("e1", std::string(5000, 'x')));
    core->on_kernel_reply(t0, Channel::shell, execute_reply("e1"));
    EXPECT_EQ(io.to_client("execute_reply").size(), 1u) << "no reply is held";
    EXPECT_EQ(std::string(io.to_client("stream")[0].content["text"]).size(), 5000u);
}

// --- hibernation (session_sleep.cpp) ---

// The kernel's answer to one of the relay's own snapshot requests.
InboundMessage own_reply(const std::string& own_id, json report, const char* status = "ok") {
    json content = {{"status", status}, {"execution_count", 0}};
    if (std::string(status) == "ok") {
        content["user_expressions"] = {
            {"cellblock_snapshot",
             {{"status", "ok"}, {"data", {{"application/json", std::move(report)}}}}}};
    } else {
        content["ename"] = "OSError";
        content["evalue"] = "No space left on device";
    }
    return from_kernel("execute_reply", own_id, std::move(content));
}

class SleepTest : public CoreTest {
  protected:
    // Hibernates an idle session through to hibernated.
    void sleep_at(Clock::time_point at) {
        std::string why;
        ASSERT_TRUE(core->hibernate(at, why)) << why;
        const auto own = io.of("own");
        ASSERT_FALSE(own.empty());
        core->on_kernel_iopub(at, status(own.back().parent_id, "busy"));
        core->on_kernel_iopub(at, status(own.back().parent_id, "idle"));
        core->on_kernel_reply(at, Channel::shell,
                              own_reply(own.back().parent_id,
                                        {{"saved", 3}, {"bytes", 4096}, {"lost", json::array()}}));
    }
    // The sandbox it woke for is attached and the restore answers.
    // A new core, as a restarted server makes one: `max_executions`, the audit observing.
    void restart_core(int max_executions) {
        SessionLimits limits;
        limits.max_executions = max_executions;
        CoreOptions options;
        options.session_id = "s1";
        options.policy = &policy;
        options.limits = limits;
        options.observer = &audit;
        audit.states.clear();
        core = std::make_unique<SessionCore>(options, io, t0);
    }
    // A fresh session asleep, woken by execute c2 at t0 + 1s into a sandbox
    // whose snapshot of `bytes` is still being opened (placing_snapshot),
    // attached at t0 + 2s.
    void wake_while_opening(std::uint64_t bytes) {
        start();
        io.actions.clear();
        sleep_at(t0);
        core->on_client_request(t0 + 1s, Channel::shell, execute("c2"));
        core->placing_snapshot(bytes);
        core->on_kernel_attached(t0 + 2s, {});
    }
    void attach_and_restore(Clock::time_point at, json lost = json::array()) {
        core->on_kernel_attached(at, {"probe-2"});
        const auto own = io.of("own");
        ASSERT_FALSE(own.empty());
        EXPECT_NE(json_string(own.back().content, "code").find("restore"), std::string::npos);
        core->on_kernel_reply(
            at, Channel::shell,
            own_reply(own.back().parent_id, {{"saved", 3}, {"bytes", 4096}, {"lost", lost}}));
    }
};

TEST_F(SleepTest, TheKernelSavesSilentlyThenTheSandboxGoes) {
    run_cell("c1", t0);
    sleep_at(t0 + 1s);
    const auto own = io.of("own", "execute_request");
    ASSERT_EQ(own.size(), 1u);
    EXPECT_EQ(own[0].content["silent"], true);
    EXPECT_EQ(own[0].content["store_history"], false);
    EXPECT_NE(json_string(own[0].content, "code").find("save"), std::string::npos);
    // The server may keep the snapshot as it is written: told before the save.
    ASSERT_GE(io.first("saving"), 0);
    EXPECT_LT(io.first("saving"), io.first("own"));
    EXPECT_EQ(io.of("saving").size(), 1u);
    EXPECT_TRUE(io.of("unsaved").empty());
    // Its statuses are the relay's own: the client sees none of them.
    for (const auto& a : io.to_client("status")) EXPECT_NE(a.parent_id, own[0].parent_id);
    ASSERT_EQ(io.of("sleep").size(), 1u);
    EXPECT_EQ(io.of("sleep")[0].content["bytes"], 4096);
    EXPECT_EQ(core->lifecycle_state(), SessionState::hibernated);
    EXPECT_EQ(core->state(), "hibernated");
    EXPECT_TRUE(core->asleep());
    EXPECT_TRUE(io.of("release").empty());  // the client's channels stay
    EXPECT_EQ(audit.states,
              (std::vector<std::string>{"idle", "busy", "idle", "hibernating", "hibernated"}));
}

TEST_F(SleepTest, ASnapshotMovedThroughTheKernelIsWaitedForBothWays) {
    io.moves_later = true;
    sleep_at(t0 + 1s);
    // Saved, not yet fetched: still hibernating, the sandbox kept.
    ASSERT_EQ(io.fetches.size(), 1u);
    EXPECT_TRUE(io.of("sleep").empty());
    EXPECT_EQ(core->lifecycle_state(), SessionState::hibernating);
    // A request meanwhile waits, as during the save.
    core->on_client_request(t0 + 2s, Channel::shell, execute("c2"));
    EXPECT_TRUE(io.of("kernel", "execute_request").empty());
    io.fetches[0](nullptr);
    ASSERT_EQ(io.of("sleep").size(), 1u);
    // Asleep, and woken at once by the request that came meanwhile.
    EXPECT_EQ(std::count(audit.states.begin(), audit.states.end(), "hibernated"), 1);
    EXPECT_EQ(core->lifecycle_state(), SessionState::resuming);
    ASSERT_EQ(io.of("wake").size(), 1u);
    // Woken: no restore until the snapshot is placed in the new kernel.
    core->on_kernel_attached(t0 + 3s, {"probe-2"});
    ASSERT_EQ(io.places.size(), 1u);
    const auto owns = io.of("own").size();
    io.places[0](nullptr);
    ASSERT_EQ(io.of("own").size(), owns + 1);
    EXPECT_NE(json_string(io.of("own").back().content, "code").find("restore"), std::string::npos);
}

TEST_F(SleepTest, ASnapshotSealedInALaterTurnHoldsRequestsUntilItIsKept) {
    io.keeps_later = true;
    sleep_at(t0 + 1s);
    // Saved, being sealed: still hibernating, the sandbox kept.
    ASSERT_EQ(io.keeps.size(), 1u);
    EXPECT_EQ(core->lifecycle_state(), SessionState::hibernating);
    core->on_client_request(t0 + 2s, Channel::shell, execute("c2"));
    EXPECT_TRUE(io.of("kernel", "execute_request").empty());
    io.keeps[0](nullptr);
    // Asleep, and woken at once by the request that came meanwhile.
    EXPECT_EQ(std::count(audit.states.begin(), audit.states.end(), "hibernated"), 1);
    EXPECT_EQ(core->lifecycle_state(), SessionState::resuming);
    EXPECT_EQ(io.of("wake").size(), 1u);
}

TEST_F(SleepTest, ASealThatFailsInALaterTurnLeavesTheSessionAwake) {
    io.keeps_later = true;
    sleep_at(t0 + 1s);
    ASSERT_EQ(io.keeps.size(), 1u);
    const std::string why = "StorageFull: the disk of the store has 1 MB free";
    io.keeps[0](&why);
    EXPECT_EQ(core->lifecycle_state(), SessionState::idle);
    bool told = false;
    for (const auto& e : audit.events) told |= e == "hibernate_failed " + why;
    EXPECT_TRUE(told);
}

TEST_F(SleepTest, ASessionClosedWhileItsSnapshotIsSealedStaysClosed) {
    io.keeps_later = true;
    sleep_at(t0 + 1s);
    ASSERT_EQ(io.keeps.size(), 1u);
    core->close(t0 + 2s, "closed by the manager");
    io.keeps[0](nullptr);  // the server would not call it; a core must not care
    EXPECT_TRUE(core->closed());
    EXPECT_EQ(std::count(audit.states.begin(), audit.states.end(), "hibernated"), 0);
    EXPECT_TRUE(io.of("wake").empty());
}

TEST_F(SleepTest, ASessionOnADrainedNodeMovesOnceItsCellEndsAndWakesAtOnce) {
    // Busy when its node is drained: nothing is saved under a running cell.
    core->on_client_request(t0, Channel::shell, execute("c1"));
    core->on_kernel_iopub(t0, status("c1", "busy"));
    core->move_away(t0 + 1s);
    EXPECT_EQ(audit.events.back(), "moving its sandbox's node is being drained");
    EXPECT_TRUE(io.of("own").empty());
    EXPECT_NE(core->next_deadline(t0 + 1s), std::optional<Clock::time_point>(t0 + 1s));
    // Told again (the watcher's every look): once is enough.
    core->move_away(t0 + 1s);
    EXPECT_EQ(std::count(audit.events.begin(), audit.events.end(),
                         "moving its sandbox's node is being drained"),
              1);
    // The cell ends: due at once, and saved.
    core->on_kernel_iopub(t0 + 2s, status("c1", "idle"));
    core->on_kernel_reply(t0 + 2s, Channel::shell, execute_reply("c1"));
    ASSERT_EQ(core->next_deadline(t0 + 2s), std::optional<Clock::time_point>(t0 + 2s));
    core->on_tick(t0 + 2s);
    const auto own = io.of("own");
    ASSERT_EQ(own.size(), 1u);
    EXPECT_NE(json_string(own[0].content, "code").find("save"), std::string::npos);
    core->on_kernel_reply(t0 + 3s, Channel::shell,
                          own_reply(own[0].parent_id, {{"saved", 3}, {"bytes", 4096}}));
    // Asleep, and woken at once with no request waiting: in a new sandbox.
    ASSERT_EQ(io.of("sleep").size(), 1u);
    EXPECT_EQ(std::count(audit.states.begin(), audit.states.end(), "hibernated"), 1);
    ASSERT_EQ(io.of("wake").size(), 1u);
    EXPECT_EQ(core->lifecycle_state(), SessionState::resuming);
    attach_and_restore(t0 + 4s);
    EXPECT_EQ(core->lifecycle_state(), SessionState::idle);
    // Moved: a later drain moves it again.
    core->move_away(t0 + 5s);
    EXPECT_EQ(io.of("own").size(), 3u);  // save, restore, save
}

TEST_F(SleepTest, ASessionThatCannotSaveStaysOnItsDrainedNodeAndSaysSo) {
    core->move_away(t0);
    const auto own = io.of("own");
    ASSERT_EQ(own.size(), 1u);  // idle: saved at once
    core->on_kernel_reply(t0 + 1s, Channel::shell,
                          from_kernel("execute_reply", own[0].parent_id,
                                      {{"status", "error"},
                                       {"ename", "MemoryError"},
                                       {"evalue", "no room"},
                                       {"traceback", json::array()}}));
    EXPECT_EQ(core->lifecycle_state(), SessionState::idle);
    EXPECT_TRUE(io.of("sleep").empty());
    const auto logs = io.of("log");
    EXPECT_TRUE(std::any_of(logs.begin(), logs.end(), [](const auto& a) {
        return a.why == "it cannot move off its drained node";
    }));
    // Not tried again at every tick.
    core->on_tick(t0 + 2s);
    EXPECT_EQ(io.of("own").size(), 1u);
}

TEST_F(SleepTest, ASnapshotThatCannotBeMovedLeavesItAwakeOrClosesTheWake) {
    io.moves_later = true;
    sleep_at(t0 + 1s);
    ASSERT_EQ(io.fetches.size(), 1u);
    const std::string why = "fetching the snapshot from the kernel: no answer";
    io.fetches[0](&why);
    EXPECT_TRUE(io.of("sleep").empty());
    EXPECT_EQ(core->lifecycle_state(), SessionState::idle);
    EXPECT_EQ(audit.events.back(), "hibernate_failed " + why);
    // Asleep for good this time, then a wake whose placing fails: closed, saying why.
    io.moves_later = false;
    sleep_at(t0 + 200s);
    ASSERT_EQ(core->lifecycle_state(), SessionState::hibernated);
    std::string no;
    ASSERT_TRUE(core->resume(t0 + 201s, no)) << no;
    io.moves_later = true;
    core->on_kernel_attached(t0 + 202s, {"probe-2"});
    ASSERT_EQ(io.places.size(), 1u);
    const std::string failed = "placing /data/input/a.csv: the kernel: full";
    io.places[0](&failed);
    EXPECT_TRUE(core->closed());
    EXPECT_EQ(core->close_reason(), "resume_failed: " + failed);
}

TEST_F(SleepTest, TheSaveAndTheRestoreCountAsRunningForTheCpuBalancer) {
    // Else the balancer takes the kernel's busy CPU outside any execution
    // for background use and caps it (measured: a 500 MB restore held at 5%
    // of a core for minutes).
    std::string why;
    ASSERT_TRUE(core->hibernate(t0, why));
    EXPECT_EQ(core->running_since(), t0);
    core->on_kernel_reply(t0 + 2s, Channel::shell,
                          own_reply(io.of("own")[0].parent_id, {{"saved", 1}}));
    EXPECT_FALSE(core->running_since().has_value());
    core->on_client_request(t0 + 5s, Channel::shell, execute("c1"));
    core->on_kernel_attached(t0 + 6s, {"probe-2"});
    EXPECT_EQ(core->running_since(), t0 + 6s) << "the restore runs";
}

TEST_F(SleepTest, OnlyAnIdleSessionWithNothingOpenHibernates) {
    core->on_client_request(t0, Channel::shell, execute("c1"));
    std::string why;
    EXPECT_FALSE(core->hibernate(t0, why));
    EXPECT_NE(why.find("busy"), std::string::npos) << why;
    core->on_kernel_iopub(t0, status("c1", "idle"));
    core->on_kernel_reply(t0, Channel::shell, execute_reply("c1"));
    core->on_client_request(t0, Channel::shell, request("comm_info_request", "r1"));
    EXPECT_FALSE(core->hibernate(t0, why));
    EXPECT_NE(why.find("open at the kernel"), std::string::npos) << why;
    core->on_kernel_reply(t0, Channel::shell, from_kernel("comm_info_reply", "r1"));
    EXPECT_TRUE(core->hibernate(t0, why)) << why;
}

TEST_F(SleepTest, ARequestWakesItAndIsAnsweredAfterTheRestoreInOrder) {
    sleep_at(t0);
    core->on_client_request(t0 + 5s, Channel::shell, execute("c2"));
    core->on_client_request(t0 + 5s, Channel::shell, request("kernel_info_request", "r3"));
    EXPECT_EQ(io.of("wake").size(), 1u);
    EXPECT_EQ(core->lifecycle_state(), SessionState::resuming);
    EXPECT_TRUE(io.of("kernel").empty());  // nothing reaches a kernel before the restore
    attach_and_restore(t0 + 5s + 80ms);
    EXPECT_EQ(core->lifecycle_state(), SessionState::busy);
    const auto sent = io.of("kernel");
    ASSERT_EQ(sent.size(), 2u);
    EXPECT_EQ(sent[0].msg_type, "execute_request");
    EXPECT_EQ(sent[1].msg_type, "kernel_info_request");
}

TEST_F(SleepTest, AConsolesIsCompleteIsAnsweredAtOnceAndStartsTheWake) {
    // jupyter_console waits 1 s for is_complete_reply, then stops asking for
    // good (every later line then needs an extra Enter): a wake takes longer.
    sleep_at(t0);
    core->on_client_request(t0 + 5s, Channel::shell,
                            request("is_complete_request", "ic1", {{"code", "x = 1"}}));
    const auto replies = io.to_client("is_complete_reply");
    ASSERT_EQ(replies.size(), 1u);
    EXPECT_EQ(replies[0].content["status"], "unknown");
    EXPECT_EQ(replies[0].parent_id, "ic1");
    EXPECT_EQ(io.of("wake").size(), 1u);
    EXPECT_TRUE(io.of("kernel").empty());
    attach_and_restore(t0 + 7s);
    EXPECT_TRUE(io.of("kernel").empty()) << "answered already: not replayed to the kernel";
    // Awake, the kernel answers it again.
    core->on_client_request(t0 + 8s, Channel::shell, request("is_complete_request", "ic2"));
    EXPECT_EQ(io.of("kernel").size(), 1u);
}

TEST_F(SleepTest, TheFirstReplyAfterAResumeSaysSoAndNamesWhatWasLost) {
    sleep_at(t0);
    core->on_client_request(t0 + 5s, Channel::shell, execute("c2"));
    attach_and_restore(t0 + 5s + 120ms, json::array({json::array({"gen", "TypeError: x"})}));
    core->on_kernel_iopub(t0 + 6s, status("c2", "busy"));
    core->on_kernel_iopub(t0 + 6s, status("c2", "idle"));
    core->on_kernel_reply(t0 + 6s, Channel::shell, execute_reply("c2"));
    const auto replies = io.to_client("execute_reply");
    ASSERT_EQ(replies.size(), 1u);
    const json& cb = replies[0].metadata["cellblock"];
    EXPECT_NEAR(cb["resumed_ms"].get<double>(), 120.0, 0.5);
    EXPECT_EQ(cb["lost"], json::array({json::array({"gen", "TypeError: x"})}));
    bool named = false;
    for (const auto& s : io.to_client("stream")) {
        named |= s.content.value("name", "") == "stderr" &&
                 s.content.value("text", "").find("gen: TypeError: x") != std::string::npos;
    }
    EXPECT_TRUE(named);
    // Only the first.
    run_cell("c3", t0 + 7s);
    EXPECT_FALSE(io.to_client("execute_reply").back().metadata["cellblock"].contains("resumed_ms"));
}

TEST_F(SleepTest, ASnapshotThatCannotBeKeptLeavesTheSessionAwake) {
    io.keep_snapshot = false;
    std::string why;
    ASSERT_TRUE(core->hibernate(t0, why));
    core->on_client_request(t0, Channel::shell, execute("c1"));  // waits meanwhile
    core->on_kernel_reply(t0, Channel::shell, own_reply(io.of("own")[0].parent_id, json::object()));
    EXPECT_EQ(core->lifecycle_state(), SessionState::busy);  // awake, and the waiting cell runs
    EXPECT_EQ(io.of("kernel").size(), 1u);
    EXPECT_EQ(io.of("unsaved").size(), 1u);
    bool told = false;
    for (const auto& e : audit.events) told |= e == "hibernate_failed the disk is full";
    EXPECT_TRUE(told);
}

TEST_F(SleepTest, AKernelThatCannotSaveLeavesTheSessionAwake) {
    std::string why;
    ASSERT_TRUE(core->hibernate(t0, why));
    core->on_kernel_reply(t0, Channel::shell,
                          own_reply(io.of("own")[0].parent_id, json::object(), "error"));
    EXPECT_EQ(core->lifecycle_state(), SessionState::idle);
    EXPECT_TRUE(io.of("sleep").empty());
    EXPECT_NE(audit.events.back().find("No space left on device"), std::string::npos);
    EXPECT_EQ(io.of("unsaved").size(), 1u) << "a keep begun as the save was sent would wait on";
}

TEST_F(SleepTest, ASaveThatTakesTooLongIsGivenUp) {
    std::string why;
    ASSERT_TRUE(core->hibernate(t0, why));
    const auto deadline = core->next_deadline(t0);
    ASSERT_TRUE(deadline.has_value());
    EXPECT_LE(*deadline, t0 + 300s);
    core->on_tick(t0 + 301s);
    EXPECT_EQ(core->lifecycle_state(), SessionState::idle);
    EXPECT_EQ(io.of("unsaved").size(), 1u);
    // Its late reply is not taken for anything.
    core->on_kernel_reply(t0 + 302s, Channel::shell,
                          own_reply(io.of("own")[0].parent_id, json::object()));
    EXPECT_TRUE(io.of("sleep").empty());
}

TEST_F(SleepTest, TheLostAreNamedBetweenBusyAndIdleEvenWhenIdleOutrunsTheReply) {
    // A client collects a cell's output until its idle status: the notice
    // must come before it, also when iopub's idle arrives before the reply.
    sleep_at(t0);
    core->on_client_request(t0 + 5s, Channel::shell, execute("c2"));
    attach_and_restore(t0 + 5s, json::array({json::array({"gen", "TypeError: x"})}));
    core->on_kernel_iopub(t0 + 6s, status("c2", "busy"));
    core->on_kernel_iopub(t0 + 6s, status("c2", "idle"));
    core->on_kernel_reply(t0 + 6s, Channel::shell, execute_reply("c2"));
    std::vector<std::string> seen;
    for (const auto& a : io.actions) {
        if ((a.kind != "forward" && a.kind != "send") || a.parent_id != "c2") continue;
        seen.push_back(a.msg_type == "status" ? a.content.value("execution_state", "")
                                              : a.msg_type);
    }
    EXPECT_EQ(seen, (std::vector<std::string>{"busy", "stream", "idle", "execute_reply"}));
}

TEST_F(SleepTest, TheFirstReplyOfAnyKindSaysResumedAndTheFirstCellNamesTheLost) {
    sleep_at(t0);
    core->on_client_request(t0 + 5s, Channel::shell, request("kernel_info_request", "k1"));
    attach_and_restore(t0 + 5s + 90ms, json::array({json::array({"sock", "TypeError: y"})}));
    core->on_kernel_reply(t0 + 6s, Channel::shell, from_kernel("kernel_info_reply", "k1"));
    const auto info = io.to_client("kernel_info_reply");
    ASSERT_EQ(info.size(), 1u);
    EXPECT_NEAR(info[0].metadata["cellblock"]["resumed_ms"].get<double>(), 90.0, 0.5);
    EXPECT_EQ(info[0].metadata["cellblock"]["lost"].size(), 1u);
    run_cell("c2", t0 + 7s);
    const auto replies = io.to_client("execute_reply");
    ASSERT_EQ(replies.size(), 1u);
    EXPECT_FALSE(replies[0].metadata["cellblock"].contains("resumed_ms")) << "only the first";
    bool named = false;
    for (const auto& s : io.to_client("stream")) {
        named |= s.parent_id == "c2" &&
                 s.content.value("text", "").find("sock: TypeError: y") != std::string::npos;
    }
    EXPECT_TRUE(named) << "the first cell still names what was lost";
}

TEST_F(SleepTest, AFailedRestoreClosesTheSessionAndAnswersWhatWaited) {
    sleep_at(t0);
    core->on_client_request(t0 + 1s, Channel::shell, execute("c2"));
    core->on_kernel_attached(t0 + 2s, {});
    core->on_kernel_reply(t0 + 2s, Channel::shell,
                          own_reply(io.of("own").back().parent_id, json::object(), "error"));
    EXPECT_TRUE(core->closed());
    ASSERT_EQ(audit.closed.size(), 1u);
    EXPECT_EQ(audit.closed[0].rfind("resume_failed: OSError", 0), 0u) << audit.closed[0];
    const auto replies = io.to_client("execute_reply");
    ASSERT_EQ(replies.size(), 1u);
    EXPECT_EQ(replies[0].content["ename"], ename::SessionClosed);
}

// A followed opening (SessionCore::placing_snapshot): the restore tells the
// kernel the snapshot's final size, and the session is awake only once both
// the kernel answered and the opening ended well, whichever comes first.
TEST_F(SleepTest, AFollowedOpeningTellsTheKernelTheSizeAndWakesOnlyOnceBothEnded) {
    for (const bool opening_first : {false, true}) {
        wake_while_opening(123456789);
        const auto own = io.of("own");
        ASSERT_FALSE(own.empty());
        EXPECT_NE(json_string(own.back().content, "code").find("size=123456789)"),
                  std::string::npos)
            << own.back().content.dump();
        const auto reply = [&] {
            core->on_kernel_reply(t0 + 2s, Channel::shell,
                                  own_reply(own.back().parent_id,
                                            {{"saved", 3}, {"bytes", 9}, {"lost", json::array()}}));
        };
        if (opening_first) {
            core->snapshot_placed(t0 + 2s, nullptr);
            EXPECT_EQ(core->lifecycle_state(), SessionState::resuming)
                << "the kernel is still reading";
            reply();
        } else {
            reply();
            EXPECT_EQ(core->lifecycle_state(), SessionState::resuming)
                << "awake before the opening ended (the input files come after)";
            EXPECT_TRUE(io.of("kernel", "execute_request").empty())
                << "c2 went to the kernel early";
            core->snapshot_placed(t0 + 2s, nullptr);
        }
        EXPECT_EQ(core->lifecycle_state(), SessionState::busy) << opening_first;
        EXPECT_EQ(io.of("kernel", "execute_request").size(), 1u) << "c2 replayed once awake";
    }
}

TEST_F(SleepTest, AFollowedOpeningThatFailsClosesTheSessionWhateverTheKernelSaid) {
    for (const bool kernel_answered : {false, true}) {
        wake_while_opening(4096);
        if (kernel_answered) {
            core->on_kernel_reply(t0 + 2s, Channel::shell,
                                  own_reply(io.of("own").back().parent_id,
                                            {{"saved", 3}, {"bytes", 9}, {"lost", json::array()}}));
        }
        const std::string failed = "placing the snapshot: snapshot: it failed its integrity check";
        core->snapshot_placed(t0 + 3s, &failed);
        EXPECT_TRUE(core->closed());
        ASSERT_FALSE(audit.closed.empty());
        EXPECT_EQ(audit.closed.back(), "resume_failed: " + failed);
        const auto replies = io.to_client("execute_reply");
        ASSERT_FALSE(replies.empty());
        EXPECT_EQ(replies.back().content["ename"], ename::SessionClosed);
    }
}

TEST_F(SleepTest, HeartbeatsAndTimeDoNotWakeItButTheIdleTimeoutStillCloses) {
    SessionLimits limits;
    limits.idle_timeout_s = 60;
    start(limits);
    sleep_at(t0);
    core->on_tick(t0 + 30s);
    EXPECT_TRUE(io.of("wake").empty());
    EXPECT_EQ(core->lifecycle_state(), SessionState::hibernated);
    core->on_tick(t0 + 61s);
    EXPECT_TRUE(core->closed());
    EXPECT_EQ(audit.closed.back().rfind("idle_timeout", 0), 0u) << audit.closed.back();
}

TEST_F(SleepTest, ResumeWakesAHibernatedSessionWithoutARequest) {
    sleep_at(t0);
    std::string why;
    EXPECT_TRUE(core->resume(t0 + 1s, why));
    EXPECT_EQ(io.of("wake").size(), 1u);
    attach_and_restore(t0 + 2s);
    EXPECT_EQ(core->lifecycle_state(), SessionState::idle);
    run_cell("c9", t0 + 3s);
    EXPECT_EQ(io.to_client("execute_reply").size(), 1u);
}

// --- hibernate_after_s: the session hibernates on its own when idle ---

TEST_F(SleepTest, IdleForHibernateAfterItHibernatesOnItsOwn) {
    SessionLimits limits;
    limits.hibernate_after_s = 60;
    start(limits);
    run_cell("c1", t0);
    // Due 60 s after the last reply, not before.
    const auto due = core->next_deadline(t0 + 1s);
    ASSERT_TRUE(due.has_value());
    EXPECT_LE(*due, t0 + 60s);
    core->on_tick(t0 + 59s);
    EXPECT_TRUE(io.of("own").empty());
    core->on_tick(t0 + 60s);
    const auto own = io.of("own", "execute_request");
    ASSERT_EQ(own.size(), 1u);
    EXPECT_NE(json_string(own[0].content, "code").find("save"), std::string::npos);
    EXPECT_EQ(core->lifecycle_state(), SessionState::hibernating);
    core->on_kernel_reply(t0 + 61s, Channel::shell,
                          own_reply(own[0].parent_id, {{"saved", 1}, {"lost", json::array()}}));
    EXPECT_EQ(core->lifecycle_state(), SessionState::hibernated);
    // Asleep, it sets no hibernation deadline of its own (no busy ticking).
    const auto next = core->next_deadline(t0 + 62s);
    ASSERT_TRUE(next.has_value());
    EXPECT_GT(*next, t0 + 62s);
    // A client request still wakes it as usual.
    core->on_client_request(t0 + 100s, Channel::shell, execute("c2"));
    EXPECT_EQ(io.of("wake").size(), 1u);
}

TEST_F(SleepTest, ABusySessionDoesNotHibernateOnItsOwn) {
    SessionLimits limits;
    limits.hibernate_after_s = 60;
    limits.exec_timeout_s = 600;
    start(limits);
    core->on_client_request(t0, Channel::shell, execute("c1"));
    core->on_kernel_iopub(t0, status("c1", "busy"));
    core->on_tick(t0 + 120s);
    EXPECT_TRUE(io.of("own").empty());
    EXPECT_EQ(core->lifecycle_state(), SessionState::busy);
}

TEST_F(SleepTest, ASessionThatCannotSleepIsNotTriedAndSaysWhy) {
    SessionLimits limits;
    limits.hibernate_after_s = 60;
    start(limits);
    io.sleep_possible = false;
    core->on_tick(t0 + 61s);
    EXPECT_TRUE(io.of("own").empty()) << "no save is run for a snapshot nobody can keep";
    EXPECT_EQ(core->lifecycle_state(), SessionState::idle);
    // Nor does its deadline come round again and again.
    const auto next = core->next_deadline(t0 + 61s);
    ASSERT_TRUE(next.has_value());
    EXPECT_GT(*next, t0 + 61s);
    // Asked by hand, it says why.
    std::string why;
    EXPECT_FALSE(core->hibernate(t0 + 62s, why));
    EXPECT_NE(why.find("keep no files"), std::string::npos) << why;
}

TEST_F(SleepTest, ARequestStillOpenWhenHibernationIsDuePutsItOffUntilAnswered) {
    // Under load a frontend's kernel_info_request can take longer than
    // hibernate_after_s to be answered: seen in CI, a Notebook page's kernel
    // never slept (it was declined for good, and the page sent nothing more).
    SessionLimits limits;
    limits.hibernate_after_s = 3;
    start(limits);
    run_cell("c1", t0);
    core->on_client_request(t0 + 1s, Channel::shell, request("kernel_info_request", "r1"));
    core->on_tick(t0 + 5s);
    EXPECT_TRUE(io.of("own").empty()) << "no save while r1 is open";
    EXPECT_EQ(core->lifecycle_state(), SessionState::idle);
    const auto next = core->next_deadline(t0 + 5s);
    EXPECT_TRUE(!next || *next > t0 + 5s) << "no ticking while it waits for the answer";
    core->on_kernel_reply(t0 + 6s, Channel::shell, from_kernel("kernel_info_reply", "r1"));
    const auto due = core->next_deadline(t0 + 6s);
    ASSERT_TRUE(due.has_value());
    EXPECT_LE(*due, t0 + 6s) << "due as soon as the answer is in";
    core->on_tick(t0 + 6s);
    ASSERT_EQ(io.of("own").size(), 1u);
    EXPECT_EQ(core->lifecycle_state(), SessionState::hibernating);
}

TEST_F(SleepTest, AFailedAutomaticHibernationIsTriedAgainEachTimeLaterAndAfreshAfterARequest) {
    SessionLimits limits;
    limits.hibernate_after_s = 60;
    start(limits);
    io.keep_snapshot = false;  // "the disk is full": every save fails
    auto fail_last = [&](Clock::time_point at) {
        core->on_kernel_reply(at, Channel::shell,
                              own_reply(io.of("own").back().parent_id, json::object()));
        EXPECT_EQ(core->lifecycle_state(), SessionState::idle);
    };
    core->on_tick(t0 + 60s);
    ASSERT_EQ(io.of("own").size(), 1u);
    fail_last(t0 + 61s);
    // Not every tick: the next try max(hibernate_after_s, 60 s) after the failure.
    const auto next = core->next_deadline(t0 + 62s);
    ASSERT_TRUE(next.has_value());
    EXPECT_GT(*next, t0 + 62s);
    EXPECT_LE(*next, t0 + 121s);
    core->on_tick(t0 + 120s);
    EXPECT_EQ(io.of("own").size(), 1u);
    core->on_tick(t0 + 121s);
    ASSERT_EQ(io.of("own").size(), 2u) << "tried again on its own (a transient cause may be gone)";
    fail_last(t0 + 122s);
    core->on_tick(t0 + 241s);
    EXPECT_EQ(io.of("own").size(), 2u) << "twice as long after the second failure";
    core->on_tick(t0 + 242s);
    ASSERT_EQ(io.of("own").size(), 3u);
    fail_last(t0 + 243s);
    // A client's request starts afresh: due again after one idle stretch.
    run_cell("c2", t0 + 300s);
    core->on_tick(t0 + 359s);
    EXPECT_EQ(io.of("own").size(), 3u);
    core->on_tick(t0 + 360s);
    EXPECT_EQ(io.of("own").size(), 4u);
}

// A planned restart (docs/restarts.md): the session stops taking work,
// hibernates once free, and carries its counters and the requests that came
// meanwhile to the next server's core.
TEST_F(SleepTest, HandingOverHoldsNewWorkAndHibernatesOnceTheRunningCellEnds) {
    SessionLimits limits;
    limits.max_executions = 5;
    start(limits);
    run_cell("c0", t0);
    core->on_client_request(t0 + 1s, Channel::shell, execute("c1"));
    core->hand_over(t0 + 2s);
    EXPECT_TRUE(core->handing_over());
    EXPECT_FALSE(core->handover_settled());
    core->on_client_request(t0 + 3s, Channel::shell, request("kernel_info_request", "r2"));
    core->on_client_request(t0 + 3s, Channel::shell, execute("c3"));
    EXPECT_EQ(io.of("kernel").size(), 2u) << "c0 and c1 only: the rest waits for the next server";
    // An interrupt of the running cell still reaches this kernel.
    core->on_client_request(t0 + 3s, Channel::control, request("interrupt_request", "i1"));
    EXPECT_EQ(io.of("interrupt").size(), 1u);
    core->on_kernel_iopub(t0 + 4s, status("c1", "busy"));
    core->on_kernel_iopub(t0 + 4s, status("c1", "idle"));
    core->on_kernel_reply(t0 + 4s, Channel::shell, execute_reply("c1"));
    EXPECT_TRUE(io.of("own").empty());
    const auto due = core->next_deadline(t0 + 4s);
    ASSERT_TRUE(due.has_value());
    EXPECT_LE(*due, t0 + 4s) << "free now: it settles at once";
    EXPECT_EQ(core->next_deadline(t0 + 4s + 1ms), due) << "a fixed time, not always ahead";
    core->on_tick(t0 + 4s + 50ms);
    const auto own = io.of("own");
    ASSERT_EQ(own.size(), 1u);
    core->on_kernel_reply(t0 + 5s, Channel::shell,
                          own_reply(own[0].parent_id, {{"saved", 2}, {"bytes", 100}}));
    EXPECT_EQ(core->lifecycle_state(), SessionState::hibernated);
    EXPECT_TRUE(io.of("wake").empty()) << "the requests that wait do not wake it here";
    EXPECT_TRUE(core->handover_settled());
    const HandoverState state = core->handover_state(t0 + 6s);
    EXPECT_EQ(state.executions, 2);
    EXPECT_DOUBLE_EQ(state.age_s, 6.0);
    EXPECT_DOUBLE_EQ(state.idle_s, 2.0) << "since c1's reply, which restarts the idle clock";
    ASSERT_EQ(state.requests.size(), 2u);
    EXPECT_EQ(state.requests[0].channel, Channel::shell);
    ASSERT_GE(state.requests[0].frames.size(), 4u);
    EXPECT_NE(state.requests[0].frames[3].find("kernel_info_request"), std::string::npos)
        << state.requests[0].frames[3];
    EXPECT_NE(state.requests[1].frames[3].find("execute_request"), std::string::npos);
    EXPECT_EQ(state.requests[0].frames[0], kClient[0]) << "the client's routing identity goes too";
}

// SIGHUP with adoption on: the session is left running for the next start.
// It holds new work as a hibernating handover does, but never hibernates: it
// is settled once its running cell has been answered, and its in_flight()
// (what its live row names) carries the requests that waited.
TEST_F(SleepTest, HandingOverToBeAdoptedHoldsNewWorkAndSettlesIdleWithoutHibernating) {
    start(SessionLimits{});
    run_cell("c0", t0);
    core->on_client_request(t0 + 1s, Channel::shell, execute("c1"));
    core->hand_over(t0 + 2s, false);
    EXPECT_TRUE(core->handing_over());
    EXPECT_FALSE(core->handover_settled()) << "c1 runs";
    core->on_client_request(t0 + 3s, Channel::shell, execute("c2"));
    EXPECT_EQ(io.of("kernel").size(), 2u) << "c0 and c1 only: c2 waits for the next start";
    EXPECT_EQ(core->in_flight().in_kernel.size(), 1u) << "c1";
    const int changes = audit.requests_changed;
    core->on_client_request(t0 + 3s, Channel::shell, execute("c2b"));
    EXPECT_GT(audit.requests_changed, changes) << "a crash now must find c2b in the row";
    core->on_kernel_iopub(t0 + 4s, status("c1", "busy"));
    core->on_kernel_iopub(t0 + 4s, status("c1", "idle"));
    core->on_kernel_reply(t0 + 4s, Channel::shell, execute_reply("c1"));
    EXPECT_TRUE(core->handover_settled());
    // Nothing more happens to it: no snapshot is asked for, however long it waits.
    const auto due = core->next_deadline(t0 + 4s);
    EXPECT_TRUE(!due || *due > t0 + 4s) << "no deadline that is always due";
    core->on_tick(t0 + 100s);
    EXPECT_TRUE(io.of("own").empty());
    EXPECT_EQ(core->lifecycle_state(), SessionState::idle);
    const HandoverState open = core->in_flight();
    EXPECT_TRUE(open.in_kernel.empty());
    ASSERT_EQ(open.requests.size(), 2u);
    ASSERT_GE(open.requests[0].frames.size(), 4u);
    EXPECT_NE(open.requests[0].frames[3].find("execute_request"), std::string::npos);
}

TEST_F(SleepTest, TheNextServersCoreGoesOnFromTheCountersItWasHanded) {
    restart_core(5);
    HandoverState state;
    state.executions = 4;
    state.age_s = 100;
    state.idle_s = 10;
    state.cpu_ms = 700;
    core->take_over(t0, state);
    EXPECT_EQ(core->lifecycle_state(), SessionState::hibernated);
    EXPECT_EQ(core->cpu_ms(), 700u);
    EXPECT_EQ(core->governor()->executions(), 4);
    EXPECT_EQ(audit.states, (std::vector<std::string>{"hibernated"}));
    core->on_client_request(t0 + 1s, Channel::shell, execute("c5"));
    EXPECT_EQ(io.of("wake").size(), 1u);
    attach_and_restore(t0 + 2s);
    core->on_kernel_iopub(t0 + 3s, status("c5", "busy"));
    core->on_kernel_iopub(t0 + 3s, status("c5", "idle"));
    core->on_kernel_reply(t0 + 3s, Channel::shell, execute_reply("c5"));
    const auto replies = io.to_client("execute_reply");
    ASSERT_EQ(replies.size(), 1u);
    EXPECT_EQ(replies[0].metadata["cellblock"]["executions_left"], 0);
    core->on_client_request(t0 + 4s, Channel::shell, execute("c6"));
    ASSERT_EQ(io.to_client("execute_reply").size(), 2u);
    EXPECT_EQ(io.to_client("execute_reply").back().content["ename"], "ExecutionLimitExceeded");
}

// A planned restart's requests that waited (carried in the live row, handed
// to the core as they come back) are answered to their senders: the adoption
// waits for them to be back on shell too, not only for a subscriber on iopub.
TEST_F(SleepTest, AnAdoptedSessionHoldsTheRequestsThatWaitedUntilTheirSendersAreBack) {
    restart_core(5);
    core->adopt(t0, HandoverState{});
    io.listening = false;
    core->on_kernel_attached(t0, {});
    io.gone.insert(kClient[0]);
    core->on_client_request(t0 + 10ms, Channel::shell, execute("c4"));
    io.listening = true;
    core->on_tick(t0 + 100ms);
    EXPECT_TRUE(io.of("kernel", "execute_request").empty()) << "its sender is not back on shell";
    EXPECT_EQ(core->lifecycle_state(), SessionState::adopting);
    io.gone.clear();
    core->on_tick(t0 + 200ms);
    EXPECT_EQ(io.of("kernel", "execute_request").size(), 1u);
}

// After a crash (docs/restarts.md, phase 2): the sandbox ran on; the core
// goes on from the counters, and requests wait until a client subscribes
// again (or adopt_settle passes), so the first one's outputs reach it.
TEST_F(SleepTest, AnAdoptedSessionHoldsRequestsUntilItsClientsListen) {
    restart_core(5);
    HandoverState state;
    state.executions = 3;
    state.age_s = 100;
    core->adopt(t0, state);
    EXPECT_EQ(core->lifecycle_state(), SessionState::adopting);
    io.listening = false;
    core->on_kernel_attached(t0, {"probe-1"});
    EXPECT_EQ(core->lifecycle_state(), SessionState::adopting) << "no subscriber yet";
    EXPECT_EQ(io.outputs_held_for, std::chrono::milliseconds(30000))
        << "what is published before a client subscribes is kept for it past adopt_settle";
    core->on_client_request(t0 + 100ms, Channel::shell, execute("c4"));
    EXPECT_TRUE(io.of("kernel").empty()) << "held until its client listens";
    const auto poll = core->next_deadline(t0 + 100ms);
    ASSERT_TRUE(poll.has_value());
    EXPECT_LE(*poll, t0 + 120ms) << "a subscription is looked for, not waited on";
    EXPECT_LE(*core->next_deadline(*poll), *poll)
        << "the look is due when its time comes (it does not move on with the clock)";
    core->on_tick(t0 + 200ms);
    EXPECT_TRUE(io.of("kernel").empty());
    io.listening = true;
    core->on_tick(t0 + 300ms);
    EXPECT_EQ(core->lifecycle_state(), SessionState::busy) << "c4, which waited, runs";
    ASSERT_EQ(io.of("kernel", "execute_request").size(), 1u);
    EXPECT_EQ(audit.states, (std::vector<std::string>{"adopting", "idle", "busy"}));
    core->on_kernel_iopub(t0 + 1s, status("c4", "busy"));
    core->on_kernel_iopub(t0 + 1s, status("c4", "idle"));
    core->on_kernel_reply(t0 + 1s, Channel::shell, execute_reply("c4"));
    ASSERT_EQ(io.to_client("execute_reply").size(), 1u);
    EXPECT_EQ(io.to_client("execute_reply")[0].metadata["cellblock"]["executions_left"], 1)
        << "the cap goes on from the executions before the crash";
}

// Requests open at the kernel when the server died (docs/restarts.md): c1
// finished while no server ran, and the kernel kept its reply
// (cellblock_unrelayed.KeptReplies) but its idle status went to no one; c2
// still ran; c3's reply was lost. Each is answered once, and each client
// waiting for an idle status gets one: c1's published by the relay once the
// fence's idle shows the kernel's went by, c2's the kernel's own.
TEST_F(SleepTest, AnAdoptedSessionAnswersEachCarriedRequestAndOwesNoIdleStatus) {
    restart_core(5);
    HandoverState state;
    for (const char* id : {"c1", "c2", "c3"}) {
        state.in_kernel.push_back({Channel::shell, kClient, "execute_request", execute(id).header});
    }
    core->adopt(t0, state);
    core->on_kernel_attached(t0, {"probe-1"});
    const auto fence = io.of("own", "kernel_info_request");
    ASSERT_EQ(fence.size(), 1u) << "a fence on shell, behind the carried requests";
    EXPECT_EQ(core->lifecycle_state(), SessionState::idle) << "its clients are back at once";
    // Kept, with what the kernel published to no one meanwhile (Unheard).
    core->on_kernel_reply(
        t0 + 10ms, Channel::shell,
        inbound({}, "execute_reply", "k-c1", "c1", {{"status", "ok"}, {"execution_count", 1}},
                {{"cellblock_source", {{"unheard_messages", 2}, {"unheard_bytes", 7}}}}));
    core->on_kernel_iopub(t0 + 20ms, status("c2", "idle"));
    core->on_kernel_reply(t0 + 20ms, Channel::shell, execute_reply("c2"));
    core->on_kernel_iopub(t0 + 30ms, status(fence[0].parent_id, "busy"));
    core->on_kernel_iopub(t0 + 30ms, status(fence[0].parent_id, "idle"));
    core->on_kernel_reply(t0 + 30ms, Channel::shell,
                          from_kernel("kernel_info_reply", fence[0].parent_id));
    const auto replies = io.to_client("execute_reply");
    ASSERT_EQ(replies.size(), 3u);
    EXPECT_EQ(replies[0].parent_id, "c1");
    EXPECT_EQ(replies[0].metadata["cellblock"]["server_restarted"]["outputs_lost"],
              json({{"messages", 2}, {"bytes", 7}, {"at_least", true}}))
        << replies[0].metadata;
    EXPECT_FALSE(replies[0].metadata.contains("cellblock_source"));
    EXPECT_EQ(replies[1].parent_id, "c2");
    EXPECT_TRUE(replies[1].metadata["cellblock"]["server_restarted"]["outputs_lost"].is_string())
        << "no count from the kernel: " << replies[1].metadata;
    EXPECT_EQ(replies[2].parent_id, "c3");
    EXPECT_EQ(replies[2].content["ename"], "ServerRestarting");
    std::map<std::string, int> idles;
    for (const auto& a : io.to_client("status")) {
        if (a.content.value("execution_state", "") == "idle") ++idles[a.parent_id];
    }
    EXPECT_EQ(idles, (std::map<std::string, int>{{"c1", 1}, {"c2", 1}, {"c3", 1}}))
        << "one idle each, none for the fence";
    std::vector<std::string> lost;
    for (const auto& e : audit.events) {
        if (e.rfind("reply_lost", 0) == 0) lost.push_back(e);
    }
    ASSERT_EQ(lost.size(), 1u);
    EXPECT_NE(lost[0].find("c3"), std::string::npos) << lost[0];
}

// A client that saw its connection drop (a server restart) sends what it had
// open again, under the same msg_id: never run twice. Still open, or answered
// by this server: dropped (its reply comes, or came). Answered by the server
// before the crash (its record's `answered`), whose reply may have died with
// it: answered by the kernel's copy (cellblock's kernel sends its last
// replies again at the fence), else ServerRestarting; never run again.
TEST_F(SleepTest, ARequestSentAgainAfterARestartIsNeverRunTwice) {
    restart_core(5);
    HandoverState state;
    for (const char* id : {"a0", "a1", "a2", "a3"}) {
        state.answered.push_back(SessionCore::request_key(execute(id).header));
    }
    core->adopt(t0, state);
    core->on_kernel_attached(t0, {});
    EXPECT_EQ(core->lifecycle_state(), SessionState::idle);
    const auto fence = io.of("own", "kernel_info_request");
    ASSERT_EQ(fence.size(), 1u) << "the last replies asked for again";
    EXPECT_EQ(fence[0].content["cellblock"]["resend_replies"], true);
    // a0 asked again before the kernel's copy came, a1 after it.
    core->on_client_request(t0 + 10ms, Channel::shell, execute("a0"));
    core->on_kernel_reply(t0 + 20ms, Channel::shell, execute_reply("a0"));
    core->on_kernel_reply(t0 + 20ms, Channel::shell, execute_reply("a1"));
    core->on_kernel_reply(t0 + 20ms, Channel::shell, execute_reply("a3"));
    core->on_client_request(t0 + 30ms, Channel::shell, execute("a1"));
    core->on_kernel_iopub(t0 + 40ms, status(fence[0].parent_id, "idle"));
    core->on_kernel_reply(t0 + 40ms, Channel::shell,
                          from_kernel("kernel_info_reply", fence[0].parent_id));
    // a2: no copy came before the fence passed; a3's did, asked for after.
    core->on_client_request(t0 + 50ms, Channel::shell, execute("a2"));
    core->on_client_request(t0 + 60ms, Channel::shell, execute("a3"));
    EXPECT_TRUE(io.of("kernel", "execute_request").empty()) << "none runs again";
    auto replies = io.to_client("execute_reply");
    ASSERT_EQ(replies.size(), 4u);
    EXPECT_EQ(replies[0].parent_id, "a0");
    EXPECT_EQ(replies[0].content["status"], "ok");
    EXPECT_TRUE(replies[0].metadata["cellblock"]["server_restarted"].contains("outputs_lost"));
    EXPECT_EQ(replies[1].parent_id, "a1");
    EXPECT_EQ(replies[1].content["status"], "ok");
    EXPECT_EQ(replies[2].parent_id, "a2");
    EXPECT_EQ(replies[2].content["ename"], "ServerRestarting");
    EXPECT_EQ(replies[3].parent_id, "a3");
    EXPECT_EQ(replies[3].content["status"], "ok");
    std::map<std::string, int> idles;
    for (const auto& a : io.to_client("status")) {
        if (a.content.value("execution_state", "") == "idle") ++idles[a.parent_id];
    }
    EXPECT_EQ(idles, (std::map<std::string, int>{{"a0", 1}, {"a1", 1}, {"a2", 1}, {"a3", 1}}));
    EXPECT_EQ(std::count_if(audit.events.begin(), audit.events.end(),
                            [](const std::string& e) { return e.rfind("reply_lost", 0) == 0; }),
              1);

    core->on_client_request(t0 + 1s, Channel::shell, execute("c1"));
    core->on_client_request(t0 + 1s, Channel::shell, execute("c1"));
    EXPECT_EQ(io.of("kernel", "execute_request").size(), 1u) << "open: the copy is dropped";
    core->on_kernel_iopub(t0 + 2s, status("c1", "busy"));
    core->on_kernel_iopub(t0 + 2s, status("c1", "idle"));
    core->on_kernel_reply(t0 + 2s, Channel::shell, execute_reply("c1"));
    ASSERT_EQ(io.to_client("execute_reply").size(), 5u);
    core->on_client_request(t0 + 3s, Channel::shell, execute("c1"));
    EXPECT_EQ(io.of("kernel", "execute_request").size(), 1u) << "answered: dropped too";
    EXPECT_EQ(io.to_client("execute_reply").size(), 5u);
    std::vector<std::string> answered;
    for (const auto& key : core->in_flight().answered) answered.push_back(key.substr(0, 2));
    EXPECT_EQ(std::vector<std::string>(answered.end() - 5, answered.end()),
              (std::vector<std::string>{"a0", "a1", "a2", "a3", "c1"}))
        << "the next record names what was answered";

    // jupyter_client's KernelManager and its client count msg_ids apart
    // under one session id: the same id on another request is no copy.
    auto other = request("interrupt_request", "c1");
    core->on_client_request(t0 + 4s, Channel::control, std::move(other));
    EXPECT_EQ(io.of("interrupt").size(), 1u) << "not taken for c1 sent again";
}

TEST_F(SleepTest, AnAdoptedSessionWhoseClientsNeverSubscribeIsServedAfterTheBound) {
    CoreOptions options;
    options.session_id = "s1";
    options.policy = &policy;
    options.limits = SessionLimits{};
    core = std::make_unique<SessionCore>(options, io, t0);
    core->adopt(t0, HandoverState{});
    io.listening = false;
    core->on_kernel_attached(t0, {});
    core->on_client_request(t0 + 10ms, Channel::shell, execute("c1"));
    core->on_tick(t0 + options.adopt_settle - 1ms);
    EXPECT_TRUE(io.of("kernel").empty());
    core->on_tick(t0 + options.adopt_settle);
    EXPECT_EQ(io.of("kernel", "execute_request").size(), 1u);
}

TEST_F(SleepTest, ASessionThatCannotSleepFailsItsHandoverWithWhy) {
    io.sleep_possible = false;
    core->hand_over(t0);
    EXPECT_TRUE(core->handover_settled());
    EXPECT_TRUE(io.of("own").empty());
    EXPECT_EQ(core->lifecycle_state(), SessionState::idle);
    ASSERT_FALSE(audit.events.empty());
    EXPECT_EQ(audit.events.back(),
              "hibernate_failed the swarm backend's sandboxes keep no files on this host");
}

TEST(HibernateAfter, IsALimitLikeTheOthers) {
    const ServerPolicy policy;
    EXPECT_GE(policy.defaults.hibernate_after_s, policy.defaults.idle_timeout_s)
        << "off by default: the idle timeout comes first";
    const SessionLimits limits = policy.effective(json::object(), {{"hibernate_after_s", 30}});
    EXPECT_EQ(limits.hibernate_after_s, 30);
    EXPECT_EQ(limits.to_json()["hibernate_after_s"], 30);
    try {
        policy.effective(json::object(), {{"hibernate_after_s", 0}});
        ADD_FAILURE() << "0 was taken";
    } catch (const PolicyError& e) {
        EXPECT_EQ(e.ename(), ename::InvalidLimits);
    }
    try {
        policy.effective(json::object(), {{"hibernate_after_s", 1e9}});
        ADD_FAILURE() << "above the maximum was taken";
    } catch (const PolicyError& e) {
        EXPECT_EQ(e.ename(), ename::LimitAboveMaximum);
    }
}

}  // namespace
}  // namespace cellblock
