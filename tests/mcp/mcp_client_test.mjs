// Drives `cellblock mcp` with the official MCP TypeScript SDK, over stdio or
// Streamable HTTP, and checks what a demanding client expects. Prints one
// line "ok <check>" per passed check; exits non-zero at the first failure.
//
//   node mcp_client_test.mjs stdio CELLBLOCK_BIN STATE_DIR
//   node mcp_client_test.mjs http URL TOKEN
import assert from "node:assert/strict";
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import { EmptyResultSchema, LATEST_PROTOCOL_VERSION } from "@modelcontextprotocol/sdk/types.js";

const [mode, target, extra] = process.argv.slice(2);

function ok(name) {
  console.log(`ok ${name}`);
}

function text(result) {
  return result.content.filter((c) => c.type === "text").map((c) => c.text).join("\n");
}

async function run(client, code, args = {}, options = {}) {
  return client.callTool({ name: "run_code", arguments: { code, ...args } }, undefined, {
    timeout: 120000,
    ...options,
  });
}

async function main() {
  let transport;
  if (mode === "stdio") {
    transport = new StdioClientTransport({
      command: target,
      args: ["mcp", "--state-dir", extra],
      stderr: "inherit",
    });
  } else {
    transport = new StreamableHTTPClientTransport(new URL(target), {
      requestInit: { headers: { Authorization: `Bearer ${extra}` } },
    });
  }
  const client = new Client({ name: "cellblock-test", version: "1.0.0" });
  await client.connect(transport);
  const server = client.getServerVersion();
  assert.equal(server.name, "cellblock");
  assert.ok(client.getServerCapabilities().tools);
  if (mode === "http") assert.ok(transport.sessionId, "Mcp-Session-Id was given");
  ok(`initialize (protocol ${LATEST_PROTOCOL_VERSION}, server ${server.name} ${server.version})`);

  const { tools } = await client.listTools();
  const names = tools.map((t) => t.name).sort();
  assert.deepEqual(names, ["close_session", "create_session", "download_file", "interrupt",
    "list_sessions", "run_code", "upload_file"]);
  for (const t of tools) {
    assert.equal(t.inputSchema.type, "object");
    assert.equal(t.outputSchema.type, "object");
  }
  ok("tools/list: 7 tools with input and output schemas");

  // State persists: a variable defined in one call is used by the next.
  let r = await run(client, "x = 20\nprint('defined')");
  assert.equal(r.isError, false);
  assert.equal(r.structuredContent.stdout, "defined\n");
  const session = r.structuredContent.session_id;
  r = await run(client, "x * 2 + 2");
  assert.equal(r.structuredContent.session_id, session);
  assert.equal(r.structuredContent.results[0].text_plain, "42");
  assert.ok(text(r).includes("42"));
  ok("run_code: state persists across calls (x*2+2 = 42)");

  // HTML and plain text of a value.
  r = await run(client, "from IPython.display import HTML\nHTML('<b>bold</b>')");
  assert.equal(r.structuredContent.results[0].text_html, "<b>bold</b>");
  ok("run_code: text/html result");

  // A matplotlib figure comes back as PNG image content.
  r = await run(client,
    "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.title('cellblock')\nplt.show()");
  assert.equal(r.isError, false, text(r));
  const images = r.content.filter((c) => c.type === "image");
  assert.equal(images.length, 1);
  assert.equal(images[0].mimeType, "image/png");
  const png = Buffer.from(images[0].data, "base64");
  assert.deepEqual([...png.subarray(0, 8)], [0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a]);
  assert.equal(png.readUInt32BE(8), 13);
  assert.equal(png.subarray(12, 16).toString("ascii"), "IHDR");
  const width = png.readUInt32BE(16), height = png.readUInt32BE(20);
  assert.ok(width > 100 && height > 100, `${width}x${height}`);
  assert.equal(r.structuredContent.images, 1);
  ok(`run_code: matplotlib figure as image/png (${png.length} bytes, ${width}x${height})`);

  // An SVG display is image content too.
  r = await run(client, "from IPython.display import SVG\nSVG('<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"10\" height=\"10\"><rect width=\"10\" height=\"10\"/></svg>')");
  const svg = r.content.find((c) => c.type === "image");
  assert.equal(svg.mimeType, "image/svg+xml");
  assert.ok(Buffer.from(svg.data, "base64").toString().startsWith("<svg"));
  ok("run_code: SVG as image/svg+xml");

  // An error with its traceback.
  r = await run(client, "def f():\n    return 1 / 0\nf()");
  assert.equal(r.isError, true);
  const err = r.structuredContent.error;
  assert.equal(err.ename, "ZeroDivisionError");
  assert.equal(err.by_server, false);
  assert.ok(err.traceback.join("\n").includes("return 1 / 0"), err.traceback.join("\n"));
  assert.ok(!err.traceback.join("").includes("\x1b["), "ANSI colours are stripped");
  assert.ok(text(r).includes("ZeroDivisionError"));
  ok("run_code: ZeroDivisionError with its traceback");

  // stderr apart from stdout.
  r = await run(client, "import sys\nprint('out')\nprint('err', file=sys.stderr)");
  assert.equal(r.structuredContent.stdout, "out\n");
  assert.equal(r.structuredContent.stderr, "err\n");
  ok("run_code: stdout and stderr");

  // Progress notifications while a cell runs (over HTTP: an SSE response).
  const progress = [];
  r = await run(client, "import time\ntime.sleep(2.5)\n'slept'", {}, {
    onprogress: (p) => progress.push(p),
  });
  assert.equal(r.structuredContent.results[0].text_plain, "'slept'");
  assert.ok(progress.length >= 1, "no progress notification");
  for (let i = 1; i < progress.length; i++) assert.ok(progress[i].progress > progress[i - 1].progress);
  ok(`progress: ${progress.length} notifications during a 2.5 s cell`);

  // A file round trip: upload, the code copies it, download equal bytes.
  const bytes = Buffer.alloc(300000);
  for (let i = 0; i < bytes.length; i++) bytes[i] = (i * 7919 + (i >> 8)) & 0xff;
  r = await client.callTool({ name: "upload_file",
    arguments: { path: "blob.bin", content_base64: bytes.toString("base64") } });
  assert.equal(r.isError, false, text(r));
  assert.equal(r.structuredContent.path, "/data/input/blob.bin");
  assert.equal(r.structuredContent.size, bytes.length);
  r = await run(client, "import shutil\nshutil.copy('/data/input/blob.bin', '/data/output/copy.bin')\n" +
    "open('/data/output/notes.txt', 'w').write('héllo\\n')");
  assert.equal(r.isError, false, text(r));
  r = await client.callTool({ name: "download_file", arguments: { path: "copy.bin" } });
  assert.equal(r.isError, false, text(r));
  const blob = r.content.find((c) => c.type === "resource");
  assert.ok(Buffer.from(blob.resource.blob, "base64").equals(bytes));
  assert.equal(r.structuredContent.size, bytes.length);
  r = await client.callTool({ name: "download_file", arguments: { path: "notes.txt" } });
  assert.equal(r.content.find((c) => c.type === "resource").resource.text, "héllo\n");
  ok(`files: ${bytes.length} bytes uploaded and downloaded equal; text as text`);

  // The output files are resources.
  const { resources } = await client.listResources();
  const copy = resources.find((x) => x.name === "copy.bin");
  assert.ok(copy, JSON.stringify(resources));
  const read = await client.readResource({ uri: copy.uri });
  assert.ok(Buffer.from(read.contents[0].blob, "base64").equals(bytes));
  ok(`resources: ${resources.length} output files listed, copy.bin read back equal`);

  // A missing file is a tool error with its ename.
  r = await client.callTool({ name: "download_file", arguments: { path: "nope.txt" } });
  assert.equal(r.isError, true);
  assert.ok(text(r).startsWith("FileNotFound: "), text(r));
  r = await client.callTool({ name: "upload_file", arguments: { path: "../escape", content: "x" } });
  assert.equal(r.isError, true);
  assert.ok(text(r).startsWith("InvalidPath: "), text(r));
  ok("files: FileNotFound and InvalidPath are tool errors");

  // Cancellation interrupts a long loop; the session lives on. Its exec
  // timeout is 120 s: without the interrupt the next cell would wait for it.
  r = await client.callTool({ name: "create_session",
    arguments: { limits: { exec_timeout_s: 120 } } });
  assert.equal(r.isError, false, text(r));
  const loopSession = r.structuredContent.session_id;
  const controller = new AbortController();
  const started = Date.now();
  const looping = run(client, "n = 0\nwhile True:\n    n += 1", { session_id: loopSession },
    { signal: controller.signal });
  setTimeout(() => controller.abort("enough"), 3000);
  await assert.rejects(looping);
  r = await run(client, "n > 0", { session_id: loopSession }, { timeout: 30000 });
  assert.equal(r.isError, false, text(r));
  assert.equal(r.structuredContent.results[0].text_plain, "True");
  const waited = (Date.now() - started) / 1000;
  assert.ok(waited < 60, `the loop was not interrupted (${waited} s)`);
  ok(`cancellation: the loop was interrupted, the session answered ${waited.toFixed(1)} s after the start`);

  // The interrupt tool on a running cell.
  const interrupted = run(client, "import time\ntime.sleep(60)", { session_id: loopSession });
  await new Promise((resolve) => setTimeout(resolve, 2000));
  r = await client.callTool({ name: "interrupt", arguments: { session_id: loopSession } });
  assert.equal(r.isError, false, text(r));
  r = await interrupted;
  assert.equal(r.structuredContent.error.ename, "KeyboardInterrupt");
  ok("interrupt: KeyboardInterrupt in a sleeping cell");

  // The execution cap: the third execution is refused by the server.
  r = await client.callTool({ name: "create_session", arguments: { limits: { max_executions: 2 } } });
  const capped = r.structuredContent.session_id;
  assert.equal(r.structuredContent.default, false);
  for (const code of ["1", "2"]) {
    r = await run(client, code, { session_id: capped });
    assert.equal(r.isError, false, text(r));
  }
  r = await run(client, "3", { session_id: capped });
  assert.equal(r.isError, true);
  assert.equal(r.structuredContent.error.ename, "ExecutionLimitExceeded");
  assert.equal(r.structuredContent.error.by_server, true);
  assert.ok(text(r).includes("ExecutionLimitExceeded"));
  ok("limits: ExecutionLimitExceeded as a tool error");

  // A bad limit is a tool error, not a crash.
  r = await client.callTool({ name: "create_session", arguments: { limits: { max_executions: "many" } } });
  assert.equal(r.isError, true);
  assert.ok(text(r).startsWith("InvalidLimits: "), text(r));
  r = await client.callTool({ name: "run_code", arguments: { code: "1", session_id: "nosuch" } });
  assert.equal(r.isError, true);
  assert.ok(text(r).startsWith("NoSuchSession: "), text(r));
  ok("errors: InvalidLimits and NoSuchSession as tool errors");

  r = await client.callTool({ name: "list_sessions", arguments: {} });
  const mine = r.structuredContent.sessions.filter((s) => s.attached).map((s) => s.session_id);
  assert.ok(mine.includes(session) && mine.includes(loopSession) && mine.includes(capped));
  assert.equal(r.structuredContent.default_session, session);
  ok(`list_sessions: ${mine.length} of this connection's sessions, ${session} the default`);

  // Unknown methods and tools are JSON-RPC errors.
  await assert.rejects(client.request({ method: "cellblock/nope", params: {} }, EmptyResultSchema),
    (e) => e.code === -32601);
  await assert.rejects(client.callTool({ name: "no_such_tool", arguments: {} }),
    (e) => e.code === -32602);
  await client.ping();
  ok("JSON-RPC errors: -32601 for an unknown method, -32602 for an unknown tool; ping");

  // close_session, then the default session is made anew.
  r = await client.callTool({ name: "close_session", arguments: { session_id: capped } });
  assert.equal(r.structuredContent.closed, true);
  ok("close_session");

  // The sessions this connection made, for the caller to check they close with it.
  console.log(`sessions ${JSON.stringify([session, loopSession])}`);
  if (mode === "http") await transport.terminateSession();
  await client.close();
  ok("closed");
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
