// The message of what a piece of test code throws: tests compare it with the
// error a user would read.
#pragma once

#include <exception>
#include <string>

namespace cellblock::testing {

// What `f` threw (any std::exception), or "" when it returned.
template <typename F>
std::string error_of(F&& f) {
    try {
        f();
    } catch (const std::exception& e) {
        return e.what();
    }
    return "";
}

}  // namespace cellblock::testing
