#include "tool_catalog.hpp"

namespace cellblock::mcp {
using nlohmann::json;

namespace {

// Kept as JSON text: it is what a client reads, and reviewing it as such is easiest.
constexpr const char* kCatalog = R"json([
{
  "name": "run_code",
  "title": "Run Python code",
  "description": "Runs Python code in a sandboxed Jupyter kernel and returns what it printed, the value of its last expression (text/plain and text/html), any error with its traceback, and every figure it displayed (PNG, JPEG, SVG) as images. Variables, imports and files persist between calls on the same session. Without session_id the code runs in this connection's own session, created on first use. Files given with upload_file are in /data/input (read-only); write files to /data/output to make them downloadable.",
  "inputSchema": {
    "type": "object",
    "properties": {
      "code": {"type": "string", "description": "Python source to execute (IPython syntax, e.g. %magics, works)."},
      "session_id": {"type": "string", "description": "A session from create_session; default: this connection's session."},
      "timeout_s": {"type": "number", "exclusiveMinimum": 0, "description": "This execution's timeout in seconds (default: the session's exec_timeout_s), up to the server's maximum."}
    },
    "required": ["code"],
    "additionalProperties": false
  },
  "outputSchema": {
    "type": "object",
    "properties": {
      "session_id": {"type": "string"},
      "status": {"type": "string", "description": "ok, error or aborted (the execute_reply's status)"},
      "execution_count": {"type": "integer", "description": "Absent when the kernel gave none (a refused execution)"},
      "stdout": {"type": "string"},
      "stderr": {"type": "string"},
      "results": {
        "type": "array",
        "description": "Rich outputs in order: the cell's value (is_main_result) and each display",
        "items": {
          "type": "object",
          "properties": {
            "is_main_result": {"type": "boolean"},
            "mime_types": {"type": "array", "items": {"type": "string"}},
            "text_plain": {"type": "string"},
            "text_html": {"type": "string"}
          },
          "required": ["is_main_result", "mime_types"]
        }
      },
      "images": {"type": "integer", "description": "How many image content items the result carries"},
      "error": {
        "type": "object",
        "description": "Present when the code raised or the server stopped or refused it",
        "properties": {
          "ename": {"type": "string"},
          "evalue": {"type": "string"},
          "traceback": {"type": "array", "items": {"type": "string"}},
          "by_server": {"type": "boolean", "description": "true when the server's policy stopped or refused the execution (ExecutionLimitExceeded, ExecutionTimeout, MemoryLimitExceeded, ...)"}
        },
        "required": ["ename", "evalue", "traceback", "by_server"]
      },
      "budget": {"type": "object", "description": "The server's figures: executions_used, executions_left, wall_ms, cpu_ms, memory_peak_bytes, output_truncated, ..."}
    },
    "required": ["session_id", "status", "stdout", "stderr", "results", "images", "budget"]
  },
  "annotations": {"readOnlyHint": false, "destructiveHint": false, "idempotentHint": false, "openWorldHint": false}
},
{
  "name": "create_session",
  "title": "Create a sandboxed session",
  "description": "Starts a new sandboxed Python session (a kernel in its own runc sandbox, no network unless the server allows it) and returns its id. The first session a connection creates becomes its default session for run_code. Limits are the cellblock server's: max_executions, exec_timeout_s, idle_timeout_s, memory_mb, cpus, disk_mb, ...",
  "inputSchema": {
    "type": "object",
    "properties": {
      "image": {"type": "string", "description": "Image name (default: the server's default image)."},
      "limits": {"type": "object", "description": "Session limits, e.g. {\"max_executions\": 50, \"exec_timeout_s\": 120, \"memory_mb\": 2048}."}
    },
    "additionalProperties": false
  },
  "outputSchema": {
    "type": "object",
    "properties": {
      "session_id": {"type": "string"},
      "image": {"type": "string"},
      "runtime": {"type": "string"},
      "warm": {"type": "boolean"},
      "default": {"type": "boolean", "description": "Whether run_code without session_id uses it"},
      "limits": {"type": "object"}
    },
    "required": ["session_id", "image", "limits", "default"]
  },
  "annotations": {"readOnlyHint": false, "destructiveHint": false, "idempotentHint": false, "openWorldHint": false}
},
{
  "name": "list_sessions",
  "title": "List sessions",
  "description": "Lists the server's sessions, newest first, marking those this connection created and its default session.",
  "inputSchema": {
    "type": "object",
    "properties": {
      "all": {"type": "boolean", "description": "Include closed sessions (default false)."}
    },
    "additionalProperties": false
  },
  "outputSchema": {
    "type": "object",
    "properties": {
      "default_session": {"type": "string", "description": "Absent until this connection has a session"},
      "sessions": {
        "type": "array",
        "items": {
          "type": "object",
          "properties": {
            "session_id": {"type": "string"},
            "image": {"type": "string"},
            "state": {"type": "string"},
            "created_at": {"type": "number", "description": "Unix seconds"},
            "executions": {"type": "integer"},
            "close_reason": {"type": "string", "description": "Absent while the session is open"},
            "attached": {"type": "boolean", "description": "Created by this connection: run_code can use it"}
          },
          "required": ["session_id", "state", "attached"]
        }
      }
    },
    "required": ["sessions"]
  },
  "annotations": {"readOnlyHint": true, "openWorldHint": false}
},
{
  "name": "close_session",
  "title": "Close a session",
  "description": "Closes a session: its sandbox is killed and its files are gone. Default: this connection's session (the next run_code then starts a fresh one).",
  "inputSchema": {
    "type": "object",
    "properties": {
      "session_id": {"type": "string"}
    },
    "additionalProperties": false
  },
  "outputSchema": {
    "type": "object",
    "properties": {
      "session_id": {"type": "string"},
      "closed": {"type": "boolean"}
    },
    "required": ["session_id", "closed"]
  },
  "annotations": {"readOnlyHint": false, "destructiveHint": true, "idempotentHint": true, "openWorldHint": false}
},
{
  "name": "interrupt",
  "title": "Interrupt the running code",
  "description": "Interrupts the code running in a session (KeyboardInterrupt in Python), as the stop button of a notebook does. Default: this connection's session.",
  "inputSchema": {
    "type": "object",
    "properties": {
      "session_id": {"type": "string"}
    },
    "additionalProperties": false
  },
  "outputSchema": {
    "type": "object",
    "properties": {
      "session_id": {"type": "string"},
      "status": {"type": "string"}
    },
    "required": ["session_id", "status"]
  },
  "annotations": {"readOnlyHint": false, "destructiveHint": false, "idempotentHint": true, "openWorldHint": false}
},
{
  "name": "upload_file",
  "title": "Upload a file",
  "description": "Writes a file into the session's /data/input/<path>, where code can read it (read-only). Give the bytes as text (content) or as base64 (content_base64). Default: this connection's session, created if needed.",
  "inputSchema": {
    "type": "object",
    "properties": {
      "path": {"type": "string", "description": "Path relative to /data/input, e.g. \"sales.csv\" or \"data/2026.csv\"."},
      "content": {"type": "string", "description": "The file's text (written as UTF-8)."},
      "content_base64": {"type": "string", "description": "The file's bytes, base64-encoded."},
      "session_id": {"type": "string"}
    },
    "required": ["path"],
    "additionalProperties": false
  },
  "outputSchema": {
    "type": "object",
    "properties": {
      "session_id": {"type": "string"},
      "path": {"type": "string", "description": "Where the code sees it, under /data/input"},
      "size": {"type": "integer"},
      "sha256": {"type": "string"}
    },
    "required": ["session_id", "path", "size", "sha256"]
  },
  "annotations": {"readOnlyHint": false, "destructiveHint": false, "idempotentHint": true, "openWorldHint": false}
},
{
  "name": "download_file",
  "title": "Download a file",
  "description": "Reads a file the code wrote to /data/output/<path>. Images come back as image content, text as text, anything else as an embedded resource (base64). Default: this connection's session.",
  "inputSchema": {
    "type": "object",
    "properties": {
      "path": {"type": "string", "description": "Path relative to /data/output, e.g. \"plot.png\"."},
      "session_id": {"type": "string"}
    },
    "required": ["path"],
    "additionalProperties": false
  },
  "outputSchema": {
    "type": "object",
    "properties": {
      "session_id": {"type": "string"},
      "path": {"type": "string"},
      "size": {"type": "integer"},
      "sha256": {"type": "string"},
      "mime_type": {"type": "string"},
      "uri": {"type": "string", "description": "The file as an MCP resource (resources/read)"}
    },
    "required": ["session_id", "path", "size", "sha256", "mime_type", "uri"]
  },
  "annotations": {"readOnlyHint": true, "openWorldHint": false}
}
])json";

}  // namespace

const json& tool_catalog() {
    static const json catalog = json::parse(kCatalog);
    return catalog;
}

const json* find_tool(std::string_view name) {
    for (const auto& tool : tool_catalog()) {
        if (tool["name"] == name) return &tool;
    }
    return nullptr;
}

}  // namespace cellblock::mcp
