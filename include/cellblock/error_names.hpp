// Every ename the server sends, in one place: the sites that send one use
// these constants, `cellblock errors --json` prints the catalogue, and a test
// checks the Python client's classes (clients/python/cellblock/errors.py) and
// docs/manager-api.md against it. To add a name: one line in the list below.
#pragma once

#include <string_view>

namespace cellblock {

// Where a client meets an error: a manager reply, a reply on the session's
// own channels (execute_reply and other shell/control replies), or both.
enum class ErrorChannel { manager, session, both };

// X(name, channel, what it means)
#define CELLBLOCK_ERROR_NAMES(X)                                                                \
    X(ExecutionLimitExceeded, session,                                                          \
      "the session's max_executions are used; the code never ran")                              \
    X(ExecutionTimeout, session, "the execution passed its timeout (interrupted, then killed)") \
    X(InterruptIgnored, session,                                                                \
      "the code ignored an interrupt_request past its grace; the kernel was killed")            \
    X(SessionClosed, both, "the session is closed; evalue names the reason")                    \
    X(MemoryLimitExceeded, session, "the kernel was killed at the session's memory limit")      \
    X(KernelDied, session, "the kernel exited without a memory kill; the session is closed")    \
    X(SessionBusy, session, "too many requests are queued on the session")                      \
    X(InvalidLimits, both, "an unknown, mistyped or non-positive limit")                        \
    X(LimitAboveMaximum, both, "a limit above the server's maximum")                            \
    X(UnknownImage, manager, "no image of that name; evalue lists the known images")            \
    X(ImageNotBuilt, manager, "the image is defined but `cellblock image build` never ran")     \
    X(UnknownRuntime, manager, "not runc, runsc or crun, or not installed on this host")        \
    X(TooManySessions, manager, "the server holds --max-sessions open (or starting) sessions")  \
    X(ServerBusy, manager, "a session_create waited past its bound in the queue of creates")    \
    X(SandboxStartFailed, manager, "the sandbox or its kernel did not start")                   \
    X(NoSuchSession, manager, "no session of that id")                                          \
    X(InvalidRequest, manager, "a required field is missing or mistyped")                       \
    X(InvalidPath, manager, "a file path is absolute, has '..' or empty components")            \
    X(FileNotFound, manager, "no such file in /data/output")                                    \
    X(FileTooLarge, manager, "a file is over the server's or the session's limit")              \
    X(FileError, manager, "a file could not be read or written (not a regular file, ...)")      \
    X(ChecksumMismatch, manager, "an upload's bytes do not hash to the sha256 it declared")     \
    X(FileChanged, manager, "the sandbox changed a file while it was being downloaded")         \
    X(TransferNotFound, manager, "no open transfer of that id (finished, aborted or expired)")  \
    X(TooManyTransfers, manager, "the session's or the server's open transfers are at the cap") \
    X(InvalidOffset, manager, "a chunk's offset is not where the transfer stands")              \
    X(MessageTooLarge, manager, "a manager message is over the frame limit; stream instead")    \
    X(UnknownRequest, both,                                                                     \
      "the manager does not know the message type, or a client sent a session one of the "      \
      "server's own messages to its kernel (cellblock_*)")                                      \
    X(ServerShuttingDown, both,                                                                 \
      "the server is stopping (a signal): the request was not carried out, or its session "     \
      "closed; evalue names the signal")                                                        \
    X(ServerRestarting, both,                                                                   \
      "the server is handing its sessions to its next start (SIGHUP, an upgrade), or (on a "    \
      "session) restarted after a crash while the request ran and its reply was lost: send "    \
      "the request again; cellblock's clients do for manager requests")                         \
    X(HibernateFailed, manager,                                                                 \
      "the session did not hibernate (busy, or its snapshot could not be taken or kept); it "   \
      "stays awake with everything; evalue says why")                                           \
    X(StorageFull, manager,                                                                     \
      "a snapshot would pass the session's or the server's snapshot cap or the disk's free "    \
      "space; evalue has the numbers; the session stays awake with everything")                 \
    X(ServerError, manager, "the server failed; evalue says where")

namespace ename {
#define CELLBLOCK_ERROR_NAME_CONSTANT(name, channel, meaning) inline constexpr char name[] = #name;
CELLBLOCK_ERROR_NAMES(CELLBLOCK_ERROR_NAME_CONSTANT)
#undef CELLBLOCK_ERROR_NAME_CONSTANT
}  // namespace ename

struct ErrorName {
    std::string_view name;
    ErrorChannel channel;
    std::string_view meaning;
};

inline constexpr ErrorName kErrorNames[] = {
#define CELLBLOCK_ERROR_NAME_ENTRY(name, channel, meaning) \
    {ename::name, ErrorChannel::channel, meaning},
    CELLBLOCK_ERROR_NAMES(CELLBLOCK_ERROR_NAME_ENTRY)
#undef CELLBLOCK_ERROR_NAME_ENTRY
};

inline constexpr std::string_view error_channel_name(ErrorChannel channel) {
    switch (channel) {
        case ErrorChannel::manager:
            return "manager";
        case ErrorChannel::session:
            return "session";
        case ErrorChannel::both:
            return "both";
    }
    return "";
}

}  // namespace cellblock
