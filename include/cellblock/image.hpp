// An image: where a sandbox's root filesystem comes from and which kernel it runs.
#pragma once

#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace cellblock {

// Resource limits of one sandbox, applied by the OCI runtime.
struct SandboxLimits {
    int memory_mb = 1024;  // cgroup memory limit (swap disabled)
    int pids = 256;        // cgroup pids limit
    int disk_mb = 256;     // each of the tmpfs mounts /tmp and the home directory
    int shm_mb = 64;       // /dev/shm
    int output_mb = 256;   // /data/output
    double cpus = 1.0;     // CFS quota, in cores
    int nofile = 4096;     // RLIMIT_NOFILE

    nlohmann::json to_json() const;
    // Fields absent from `j` keep the values of `base`; throws on a mistyped field.
    static SandboxLimits from_json(const nlohmann::json& j, const SandboxLimits& base);
};

struct Image {
    std::string name;  // "host"
    std::string display_name = "Python 3 (cellblock)";
    std::string language = "python";
    std::string runtime = "runc";  // runc, crun or runsc
    // "host": a skeleton root plus read-only binds of the host's /usr and the
    // few /etc entries named in `host_binds`; "store": the root built from
    // the "build" section (or imported) into the image store, see
    // image_builder.hpp (the default when there is a "build" section);
    // otherwise the path of an unpacked root filesystem.
    std::string rootfs = "host";
    std::vector<std::string> host_binds;     // read-only, same path inside
    std::vector<std::string> hidden_paths;   // covered by an empty read-only tmpfs
    std::vector<std::string> kernel_argv;    // "{connection_file}" is substituted
    std::map<std::string, std::string> env;  // the kernel's environment additions
    // Modules a pooled kernel imports before it is handed out (names only,
    // checked to be dotted identifiers), so a session's first import is free.
    std::vector<std::string> preload;
    // Modules the zygote imports once and does not bind in a session's
    // namespace: every fork finds them in sys.modules, so a cell's `import
    // pandas`, and a hibernated session's wake (which imports by name what
    // its snapshot held), costs nothing. One that fails to import is skipped
    // with a line in the zygote's log (a host without pandas still serves).
    // A booted kernel (no zygote, or one the host refused) does not import
    // them: that would cost each session their memory, not share it.
    std::vector<std::string> warm_imports;
    // Sessions are forked from a zygote that imported the kernel and the
    // preload once (docs/zygote.md), instead of booting an interpreter each.
    // runc only; the kernel must be cellblock's ipykernel launcher.
    bool zygote = false;
    // How its sessions hibernate (docs/hibernation.md): "namespace", the
    // kernel's variables pickled into a fresh kernel at the wake (what
    // cannot be pickled is named as lost); "exact", the whole sandbox
    // checkpointed by the runtime and restored (runsc only: the kernel's
    // channels then pass through the shim's bridge, and nothing is lost).
    std::string hibernate_level = "namespace";
    SandboxLimits limits;
    // The image's "limits" object as written (session and sandbox fields),
    // layered between the server's defaults and a session request.
    nlohmann::json limits_json = nlohmann::json::object();
    // The "build" section as written (checked by BuildSpec::from_json), null if none.
    nlohmann::json build;
    // The whole definition as written: hashed into a built image's content id.
    nlohmann::json definition = nlohmann::json::object();
    // The folder of image.json (extra files are read relative to it); empty if none.
    std::filesystem::path definition_dir;
    // Set once a "store" image is resolved to the root it runs on: the content
    // id of that root (see image_builder.hpp); empty for "host" images.
    std::string content_id;

    // Reads images/<name>/image.json; throws std::runtime_error naming the file and field.
    static Image load(const std::filesystem::path& image_json);
    static Image from_json(const nlohmann::json& j);
};

// The rules an image definition must pass, each named (as runc validates a
// config: a list of checks, not one long function). from_json runs them in
// order; the first complaint throws "image NAME: <complaint> (check NAME)".
struct ImageCheck {
    std::string_view name;
    std::optional<std::string> (*check)(const Image& image);
};
const std::vector<ImageCheck>& image_checks();

// Finds an image by name under the given directories (first match wins).
Image find_image(const std::string& name, const std::vector<std::filesystem::path>& image_dirs);

}  // namespace cellblock
