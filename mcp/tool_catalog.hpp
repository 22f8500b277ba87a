// The tools `cellblock mcp` offers, as tools/list gives them: names,
// descriptions, and JSON Schemas for input and output. Data, not code.
#pragma once

#include <string_view>

#include <nlohmann/json.hpp>

namespace cellblock::mcp {

// The tools/list result's "tools" array.
const nlohmann::json& tool_catalog();

// One tool's entry, or nullptr when there is no tool of that name.
const nlohmann::json* find_tool(std::string_view name);

}  // namespace cellblock::mcp
