#include "kernel_files.hpp"

#include "file_transfer_internal.hpp"
#include "wire_receive.hpp"

namespace cellblock {
using namespace transfer_detail;

namespace {

// What the kernel says is the sandbox's text: bounded before it reaches a
// reply or the log.
constexpr std::size_t kKernelTextMax = 512;

std::string kernel_text(const json& content, const char* key) {
    std::string text = json_string(content, key);
    if (text.size() > kKernelTextMax) text = text.substr(0, kKernelTextMax) + "...";
    return text;
}

// The client's ename for the kernel's refusal: its own names where the front
// has one, FileTooLarge for a full /data/input, FileError for anything else.
FileRequestError kernel_refused(const json& content, const std::string& doing) {
    const std::string name = kernel_text(content, "ename");
    const std::string why = "the kernel, " + doing + ": " + kernel_text(content, "evalue");
    if (name == ename::InvalidPath || name == ename::FileNotFound) return {name, why};
    if (name == "DiskFull") return {ename::FileTooLarge, why};
    return {ename::FileError, why};
}

FileRequestError no_answer(const std::string& doing) {
    return {ename::FileError, "no answer from the session's kernel while " + doing +
                                  " (the session closed, its kernel ended, or it did not "
                                  "answer in time)"};
}

std::optional<std::uint64_t> count_of(const json& content, const char* key) {
    const auto it = content.find(key);
    if (it == content.end() || !it->is_number_integer()) return std::nullopt;
    if (it->is_number_unsigned()) return it->get<std::uint64_t>();
    const auto n = it->get<std::int64_t>();
    return n < 0 ? std::nullopt : std::optional<std::uint64_t>(static_cast<std::uint64_t>(n));
}

// One move in flight: its state outlives each request (held by the answer's
// closure), and `done` is called once.
struct Move : std::enable_shared_from_this<Move> {
    AskKernel ask;
    KernelFilesDone done;
    std::string transfer = new_transfer_id();
    std::string path;
    bool started = false;  // the kernel holds a transfer to abort on failure

    void finish(std::optional<FileRequestError> error) {
        if (!done) return;
        if (error && started) {
            ask(kKernelFileAbort, {{"transfer", transfer}}, {}, [](const KernelAnswer*) {});
        }
        auto call = std::move(done);
        done = nullptr;
        call(std::move(error));
    }
};

struct Push : Move {
    Sha256 hash;  // of what was sent
    FileDescriptor fd;
    std::uint64_t size = 0;
    std::uint64_t queued = 0;  // bytes sent to the kernel
    std::uint64_t acked = 0;   // of them, answered
    bool all_queued = false;
    int in_flight = 0;

    void fill() {
        while (done && !all_queued && in_flight < kKernelFileWindow) {
            const std::size_t want =
                static_cast<std::size_t>(std::min<std::uint64_t>(kKernelFileChunk, size - queued));
            std::string chunk(want, '\0');
            const std::size_t n = read_into(fd.get(), queued, chunk.data(), want);
            if (n != want) {
                return finish(FileRequestError(
                    ename::FileError, "the staged copy of " + path + " shrank while it was sent"));
            }
            hash.update(chunk);
            const bool last = queued + n == size;
            json content = {
                {"transfer", transfer}, {"path", path}, {"offset", queued}, {"last", last}};
            std::vector<std::string> buffers;
            buffers.push_back(std::move(chunk));
            started = true;
            queued += n;
            all_queued = last;
            ++in_flight;
            auto self = std::static_pointer_cast<Push>(shared_from_this());
            if (!ask(kKernelFileWrite, std::move(content), std::move(buffers),
                     [self, n, last](const KernelAnswer* a) { self->answered(a, n, last); })) {
                return finish(no_answer("writing " + path));
            }
        }
    }

    void answered(const KernelAnswer* a, std::size_t n, bool last) {
        if (!done) return;  // ended already: the rest of the window is moot
        --in_flight;
        const std::string doing = "writing " + std::string(kSandboxInputDir) + "/" + path;
        if (!a) return finish(no_answer(doing));
        if (json_string(a->content, "status") != "ok") {
            started = false;  // the kernel dropped it already
            return finish(kernel_refused(a->content, doing));
        }
        acked += n;
        if (count_of(a->content, "written") != acked) {
            return finish(
                FileRequestError(ename::FileError, "the kernel, " + doing + ", says it holds " +
                                                       a->content.value("written", json()).dump() +
                                                       " bytes, not " + std::to_string(acked)));
        }
        if (!last) return fill();
        started = false;
        const std::string got = json_string(a->content, "sha256");
        if (const std::string mine = hash.hex(); got != mine) {
            return finish(FileRequestError(
                ename::FileError, "the kernel's copy of " + path + " hashes to '" +
                                      got.substr(0, 64) + "', not " + mine + "; put it again"));
        }
        finish(std::nullopt);
    }
};

struct Pull : Move {
    fs::path local, partial;
    std::uint64_t max_bytes = 0;
    std::string over_what;
    FileDescriptor out;
    Sha256 hash;
    std::uint64_t got = 0;    // received, in order
    std::uint64_t asked = 0;  // requested
    int in_flight = 0;
    std::optional<std::uint64_t> size;  // the kernel's, from its first answer

    void fill() {
        // One request until the first answer says how large the file is.
        while (done && (size ? in_flight < kKernelFileWindow && asked < *size : in_flight == 0)) {
            const std::uint64_t length =
                size ? std::min<std::uint64_t>(kKernelFileChunk, *size - asked) : kKernelFileChunk;
            json content = {
                {"transfer", transfer}, {"path", path}, {"offset", asked}, {"length", length}};
            started = true;
            asked += length;
            ++in_flight;
            auto self = std::static_pointer_cast<Pull>(shared_from_this());
            if (!ask(kKernelFileRead, std::move(content), {},
                     [self](const KernelAnswer* a) { self->answered(a); })) {
                return fail(no_answer("reading " + path));
            }
        }
    }

    void fail(FileRequestError error) {
        out.reset();
        ::unlink(partial.c_str());
        finish(std::move(error));
    }

    void answered(const KernelAnswer* a) {
        if (!done) return;  // ended already: the rest of the window is moot
        --in_flight;
        const std::string where = std::string(kSandboxOutputDir) + "/" + path;
        const std::string doing = "reading " + where;
        if (!a) return fail(no_answer(doing));
        if (json_string(a->content, "status") != "ok") {
            started = false;
            return fail(kernel_refused(a->content, doing));
        }
        const auto said_size = count_of(a->content, "size");
        const auto eof = a->content.find("eof");
        if (!said_size || (size && *said_size != *size) || a->buffers.size() != 1 ||
            eof == a->content.end() || !eof->is_boolean() ||
            count_of(a->content, "offset") != got ||
            a->buffers[0].size() > std::min<std::uint64_t>(kKernelFileChunk, *said_size - got)) {
            return fail(FileRequestError(ename::FileError,
                                         "the kernel's answer while " + doing + " is malformed"));
        }
        if (!size) {
            size = said_size;
            asked = a->buffers[0].size();  // the first request asked for a whole chunk
            if (*size > max_bytes) {
                return fail(
                    FileRequestError(ename::FileTooLarge,
                                     where + " is " + bytes_text(*size) + ", over " + over_what));
            }
        }
        const std::string& data = a->buffers[0];
        if (::pwrite(out.get(), data.data(), data.size(), static_cast<off_t>(got)) !=
            static_cast<ssize_t>(data.size())) {
            const int err = errno;
            return fail(FileRequestError(
                err == ENOSPC || err == EDQUOT ? ename::FileTooLarge : ename::FileError,
                "the front's copy of " + where + ": " + errno_text(err)));
        }
        hash.update(data);
        got += data.size();
        if (!eof->get<bool>()) {
            if (data.empty()) {
                return fail(
                    FileRequestError(ename::FileError, "the kernel sent nothing while " + doing));
            }
            return fill();
        }
        started = false;
        if (got != *size) {
            return fail(FileRequestError(
                ename::FileChanged, where + " changed while it was read (" + bytes_text(*size) +
                                        ", " + bytes_text(got) + " read); get it again"));
        }
        const std::string mine = hash.hex();
        if (json_string(a->content, "sha256") != mine) {
            return fail(FileRequestError(
                ename::FileError, "the bytes of " + where + " the front received hash to " + mine +
                                      ", not the kernel's; get it again"));
        }
        out.reset();
        if (::rename(partial.c_str(), local.c_str()) != 0) {
            return fail(FileRequestError(ename::FileError,
                                         "the front's copy of " + where + ": " + errno_text()));
        }
        finish(std::nullopt);
    }
};

}  // namespace

void push_to_kernel(AskKernel ask, fs::path local, std::string path, KernelFilesDone done) {
    auto push = std::make_shared<Push>();
    push->ask = std::move(ask);
    push->done = std::move(done);
    push->path = std::move(path);
    push->fd = FileDescriptor(::open(local.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
    struct stat st {};
    if (!push->fd || ::fstat(push->fd.get(), &st) != 0) {
        return push->finish(FileRequestError(
            ename::FileError, "the staged copy of " + push->path + ": " + errno_text()));
    }
    push->size = static_cast<std::uint64_t>(st.st_size);
    push->fill();
}

void pull_from_kernel(AskKernel ask, std::string path, fs::path local, std::uint64_t max_bytes,
                      std::string over_what, KernelFilesDone done) {
    auto pull = std::make_shared<Pull>();
    pull->ask = std::move(ask);
    pull->done = std::move(done);
    pull->path = std::move(path);
    pull->local = std::move(local);
    pull->partial = pull->local;
    // Its own name: two gets of one path at once write two files, each whole.
    pull->partial += ".pull-" + pull->transfer;
    pull->max_bytes = max_bytes;
    pull->over_what = std::move(over_what);
    std::error_code ec;
    fs::create_directories(pull->local.parent_path(), ec);
    pull->out = FileDescriptor(
        ::open(pull->partial.c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC | O_NOFOLLOW, 0600));
    if (!pull->out) {
        return pull->finish(FileRequestError(
            ename::FileError, "the front's copy of " + pull->path + ": " + errno_text()));
    }
    pull->fill();
}

void list_kernel_files(AskKernel ask,
                       std::function<void(json reply, std::optional<FileRequestError>)> done) {
    constexpr std::size_t kMaxFiles = 1000;
    auto shared_done = std::make_shared<decltype(done)>(std::move(done));
    const bool sent = ask(
        kKernelFileList, {{"max_files", kMaxFiles}, {"max_depth", 8}}, {},
        [shared_done](const KernelAnswer* a) {
            auto& call = *shared_done;
            const std::string doing = "listing " + std::string(kSandboxOutputDir);
            if (!a) return call(nullptr, no_answer(doing));
            if (json_string(a->content, "status") != "ok") {
                return call(nullptr, kernel_refused(a->content, doing));
            }
            // The sandbox wrote this: only well-formed entries pass, at most kMaxFiles.
            json files = json::array();
            bool truncated = a->content.value("truncated", false) == true;
            const auto listed = a->content.find("files");
            if (listed != a->content.end() && listed->is_array()) {
                for (const json& f : *listed) {
                    if (files.size() == kMaxFiles) {
                        truncated = true;
                        break;
                    }
                    if (!f.is_object()) continue;
                    const std::string path = json_string(f, "path");
                    const auto size = count_of(f, "size");
                    const auto mtime = f.find("mtime");
                    if (!size || mtime == f.end() || !mtime->is_number()) continue;
                    try {
                        if (checked_relative_path(path, kSandboxOutputDir) != path) continue;
                    } catch (const FileRequestError&) {
                        continue;
                    }
                    files.push_back({{"path", path},
                                     {"size", *size},
                                     {"mtime", static_cast<std::int64_t>(mtime->get<double>())}});
                }
            }
            call({{"status", "ok"}, {"files", files}, {"truncated", truncated}}, std::nullopt);
        });
    if (!sent) (*shared_done)(nullptr, no_answer("listing " + std::string(kSandboxOutputDir)));
}

}  // namespace cellblock
