// IOPub messages and an execute_reply collected into an MCP tool result.
#include <gtest/gtest.h>

#include "base64.hpp"
#include "conversation.hpp"
#include "execution.hpp"
#include "tool_catalog.hpp"

namespace cellblock::mcp {
namespace {
using nlohmann::json;

WireMessage message(const std::string& type, const std::string& parent, json content,
                    json metadata = json::object()) {
    WireMessage m;
    m.header = make_header(type, "s");
    m.parent_header = {{"msg_id", parent}};
    m.content = std::move(content);
    m.metadata = std::move(metadata);
    return m;
}

const std::string kPng = base64_encode(std::string("\x89PNG\r\n\x1a\n....", 12));

TEST(McpExecution, CollectsStreamsResultsImagesInOrder) {
    Execution ex("m1");
    ex.on_iopub(message("status", "m1", {{"execution_state", "busy"}}));
    ex.on_iopub(message("stream", "m1", {{"name", "stdout"}, {"text", "a\n"}}));
    ex.on_iopub(message("stream", "other", {{"name", "stdout"}, {"text", "not ours\n"}}));
    ex.on_iopub(message("stream", "m1", {{"name", "stderr"}, {"text", "warn\n"}}));
    ex.on_iopub(message("stream", "m1", {{"name", "stdout"}, {"text", "b\n"}}));
    ex.on_iopub(message("display_data", "m1",
                        {{"data", {{"image/png", kPng + "\n"}, {"text/plain", "<Figure>"}}},
                         {"metadata", json::object()}}));
    ex.on_iopub(message(
        "execute_result", "m1",
        {{"data", {{"text/plain", "42"}, {"text/html", "<b>42</b>"}}}, {"execution_count", 3}}));
    EXPECT_FALSE(ex.done());
    ex.on_reply(message("execute_reply", "m1", {{"status", "ok"}, {"execution_count", 3}},
                        {{"cellblock", {{"executions_left", 7}, {"wall_ms", 5}}}}));
    ex.on_iopub(message("status", "m1", {{"execution_state", "idle"}}));
    ASSERT_TRUE(ex.done());

    const json r = execution_result(ex, "sid");
    EXPECT_FALSE(r["isError"]);
    const json& c = r["content"];
    ASSERT_EQ(c.size(), 4u);
    EXPECT_EQ(c[0], json({{"type", "text"}, {"text", "a\nb\n"}}));
    EXPECT_EQ(c[1]["text"], "[stderr]\nwarn\n");
    EXPECT_EQ(c[2], json({{"type", "image"}, {"data", kPng}, {"mimeType", "image/png"}}));
    EXPECT_EQ(c[3]["text"], "42");
    const json& s = r["structuredContent"];
    EXPECT_EQ(s["session_id"], "sid");
    EXPECT_EQ(s["status"], "ok");
    EXPECT_EQ(s["execution_count"], 3);
    EXPECT_EQ(s["stdout"], "a\nb\n");
    EXPECT_EQ(s["images"], 1);
    EXPECT_EQ(s["results"][1]["text_html"], "<b>42</b>");
    EXPECT_TRUE(s["results"][1]["is_main_result"]);
    EXPECT_EQ(s["budget"]["executions_left"], 7);
    EXPECT_FALSE(s.contains("error"));  // absent, not null: portable schemas
}

TEST(McpExecution, SvgAndJpegAreImagesToo) {
    Execution ex("m");
    ex.on_iopub(message("display_data", "m", {{"data", {{"image/svg+xml", "<svg/>"}}}}));
    ex.on_iopub(message("display_data", "m", {{"data", {{"image/jpeg", "/9j/"}}}}));
    const json c = execution_result(ex, "s")["content"];
    EXPECT_EQ(c[0]["mimeType"], "image/svg+xml");
    EXPECT_EQ(base64_decode(c[0]["data"].get<std::string>()), "<svg/>");
    EXPECT_EQ(c[1]["mimeType"], "image/jpeg");
    EXPECT_EQ(c[1]["data"], "/9j/");
}

TEST(McpExecution, TheCodesErrorKeepsItsTracebackWithoutColours) {
    Execution ex("m");
    ex.on_iopub(message("error", "m",
                        {{"ename", "ZeroDivisionError"},
                         {"evalue", "division by zero"},
                         {"traceback", {"\x1b[0;31mZeroDivisionError\x1b[0m", "line 2"}}}));
    ex.on_reply(message(
        "execute_reply", "m",
        {{"status", "error"}, {"ename", "ZeroDivisionError"}, {"evalue", "division by zero"}},
        {{"cellblock", {{"wall_ms", 3}}}}));
    const json r = execution_result(ex, "s");
    EXPECT_TRUE(r["isError"]);
    const json& e = r["structuredContent"]["error"];
    EXPECT_EQ(e["ename"], "ZeroDivisionError");
    EXPECT_EQ(e["traceback"], json({"ZeroDivisionError", "line 2"}));
    EXPECT_FALSE(e["by_server"]);
    EXPECT_EQ(r["content"].back()["text"], "ZeroDivisionError\nline 2");
}

TEST(McpExecution, APolicyRefusalIsTheServers) {
    Execution ex("m");
    ex.on_reply(message("execute_reply", "m",
                        {{"status", "error"},
                         {"ename", "ExecutionLimitExceeded"},
                         {"evalue", "2 of 2 executions used"}},
                        {{"cellblock", {{"executions_left", 0}}}}));
    const json r = execution_result(ex, "s");
    EXPECT_TRUE(r["isError"]);
    EXPECT_EQ(r["structuredContent"]["error"]["ename"], "ExecutionLimitExceeded");
    EXPECT_TRUE(r["structuredContent"]["error"]["by_server"]);
    EXPECT_NE(r["content"][0]["text"].get<std::string>().find("ExecutionLimitExceeded: 2 of 2"),
              std::string::npos);
}

TEST(McpExecution, AReplyBeforeItsIopubErrorStillSaysWhoStoppedIt) {
    Execution ex("m");
    ex.on_reply(message("execute_reply", "m",
                        {{"status", "error"},
                         {"ename", "ExecutionLimitExceeded"},
                         {"evalue", "all 1 are used"},
                         {"cellblock", {{"executions_left", 0}}}}));
    ex.on_iopub(message("error", "m",
                        {{"ename", "ExecutionLimitExceeded"},
                         {"evalue", "all 1 are used"},
                         {"traceback", {"ExecutionLimitExceeded: all 1 are used"}}}));
    ASSERT_TRUE(ex.error);
    EXPECT_TRUE(ex.error->by_server);
    EXPECT_EQ(ex.budget["executions_left"], 0);
}

TEST(McpExecution, ClearOutputDropsWhatCameBefore) {
    Execution ex("m");
    ex.on_iopub(message("stream", "m", {{"name", "stdout"}, {"text", "old"}}));
    ex.on_iopub(message("clear_output", "m", {{"wait", false}}));
    ex.on_iopub(message("stream", "m", {{"name", "stdout"}, {"text", "new"}}));
    EXPECT_EQ(ex.stdout_text, "new");
}

TEST(McpExecution, StripAnsi) {
    EXPECT_EQ(strip_ansi("\x1b[1;32mok\x1b[0m done"), "ok done");
    EXPECT_EQ(strip_ansi("plain"), "plain");
    EXPECT_EQ(strip_ansi("cut \x1b["), "cut ");
}

TEST(McpBase64, RoundTripsAndRefusesJunk) {
    for (const std::string& s :
         std::vector<std::string>{"", "a", "ab", "abc", "abcd", std::string("\0\xff\x10", 3)}) {
        EXPECT_EQ(base64_decode(base64_encode(s)), s);
    }
    EXPECT_EQ(base64_encode("hello"), "aGVsbG8=");
    EXPECT_EQ(base64_decode("aGVs\nbG8="), "hello");
    EXPECT_FALSE(base64_decode("a$b="));
    EXPECT_FALSE(base64_decode("aGVsbG8=x"));
}

TEST(McpTools, EveryToolHasSchemasAndErrorsKeepTheirNames) {
    for (const auto& tool : tool_catalog()) {
        EXPECT_EQ(tool["inputSchema"]["type"], "object") << tool["name"];
        EXPECT_EQ(tool["outputSchema"]["type"], "object") << tool["name"];
        EXPECT_FALSE(tool["description"].get<std::string>().empty());
    }
    EXPECT_NE(find_tool("run_code"), nullptr);
    EXPECT_EQ(find_tool("rm_rf"), nullptr);
    const auto named =
        tool_error_from(std::runtime_error("FileNotFound: /data/output/x: gone"), "X");
    EXPECT_EQ(named.ename, "FileNotFound");
    EXPECT_EQ(named.evalue, "/data/output/x: gone");
    EXPECT_EQ(tool_error_from(std::runtime_error("Weird: thing"), "FileError").ename, "FileError");
    const json r = tool_error_result({"SessionClosed", "closed by request"});
    EXPECT_TRUE(r["isError"]);
    EXPECT_FALSE(r.contains("structuredContent"));  // it would be checked against the output schema
}

TEST(McpResources, UrisMimeTypesAndText) {
    EXPECT_EQ(output_uri("abc", "d/plot.png"), "cellblock://sessions/abc/output/d/plot.png");
    const auto parsed = parse_output_uri("cellblock://sessions/abc/output/d/plot.png");
    ASSERT_TRUE(parsed);
    EXPECT_EQ(parsed->first, "abc");
    EXPECT_EQ(parsed->second, "d/plot.png");
    EXPECT_FALSE(parse_output_uri("file:///etc/passwd"));
    EXPECT_FALSE(parse_output_uri("cellblock://sessions/abc/output/"));
    EXPECT_FALSE(parse_output_uri("cellblock://sessions//output/x"));
    EXPECT_EQ(mime_type_of("a/PLOT.PNG"), "image/png");
    EXPECT_EQ(mime_type_of("data.csv"), "text/csv");
    EXPECT_EQ(mime_type_of("x.tar.zst"), "application/octet-stream");
    EXPECT_EQ(mime_type_of("dir.png/file"), "application/octet-stream");
    EXPECT_TRUE(is_utf8_text("héllo ✓ 𝄞"));
    EXPECT_FALSE(is_utf8_text(std::string("a\0b", 3)));
    EXPECT_FALSE(is_utf8_text("\xc3"));
    EXPECT_FALSE(is_utf8_text("\xc0\xaf"));      // overlong
    EXPECT_FALSE(is_utf8_text("\xed\xa0\x80"));  // a surrogate
}

}  // namespace
}  // namespace cellblock::mcp
