// Declarative images: the "build" section of an image.json, the
// content-addressed image store, and what `cellblock image build | ls | rm |
// import` do with them.
//
// The store (STATE/images, STATE being /var/lib/cellblock unless told):
//   store/<content id>/rootfs/         the root filesystem, read-only once built
//   store/<content id>/image.json      the definition it was built from
//   store/<content id>/manifest.json   name, content id, packages, size, when, how
//   names/<NAME> -> ../store/<id>      the current version of NAME (replaced atomically)
//   tmp/<pid>.<NAME>.<random>/         builds in progress; nothing else looks here
//   cache/apt/                         downloaded .debs, reused by later builds
// A build only ever adds a version and then moves the name: sandboxes running
// on an older version keep their root until `image rm` finds it unused.
#pragma once

#include <filesystem>
#include <map>
#include <optional>
#include <ostream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "cellblock/image.hpp"
#include "cellblock/sha256.hpp"

namespace cellblock {

// A file the build writes into the root: read from the definition's folder
// (`source`) or given inline (`content`).
struct ExtraFile {
    std::string path;     // absolute, inside the image
    std::string source;   // relative to the definition's folder, or
    std::string content;  // the text itself (exactly one of the two)
    int mode = 0644;
};

// The "build" section of an image.json.
struct BuildSpec {
    std::string suite = "bookworm";
    std::string mirror = "http://deb.debian.org/debian";
    // mmdebstrap's variant: "essential" (Essential: yes packages only, no apt)
    // or "apt", "minbase", ... The packages come on top, with their dependencies.
    std::string variant = "essential";
    std::vector<std::string> packages;
    std::vector<ExtraFile> files;
    // Leave /usr/share/{doc,man,info,locale} out (copyright files stay).
    bool strip_docs = true;

    // Throws std::runtime_error naming the field ("build: package 'x y' is not
    // a Debian package name").
    static BuildSpec from_json(const nlohmann::json& j);
};

// A stored image's failure to resolve: the name has no built version.
class ImageNotBuilt : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

// The content id of a root: SHA-256 over the definition as written
// (canonical JSON: sorted keys, no spaces), the SHA-256 of every extra file's
// bytes (by path inside the image) and the installed packages
// ("name:arch=version", sorted). The same definition built from the same
// package versions gives the same id; anything else another.
std::string image_content_id(const nlohmann::json& definition,
                             const std::map<std::string, std::string>& file_digests,
                             const std::vector<std::string>& packages);

struct StoredImage {
    std::string name;
    std::string content_id;
    std::filesystem::path dir;  // STORE/store/<id>
    nlohmann::json manifest = nlohmann::json::object();
    std::filesystem::path rootfs() const { return dir / "rootfs"; }
    std::uint64_t size_bytes() const { return manifest.value("size_bytes", std::uint64_t{0}); }
};

class ImageStore {
  public:
    explicit ImageStore(std::filesystem::path root);  // STATE/images
    const std::filesystem::path& root() const { return root_; }

    // The current version of NAME, or nullopt if it has none.
    std::optional<StoredImage> current(const std::string& name) const;
    // Its content id only ("" if none): a readlink and a stat, no manifest
    // read (the server polls it).
    std::string current_id(const std::string& name) const;
    // Every stored version (current or not) whose manifest names NAME.
    std::vector<StoredImage> versions(const std::string& name) const;
    // The names that have a current version, sorted.
    std::vector<std::string> names() const;
    // The definition a stored version was built from, resolved to its root:
    // rootfs is the stored root, content_id is set.
    Image image(const StoredImage& stored) const;

  private:
    std::filesystem::path root_;
};

// What a sandbox runs: a "store" image becomes its current stored version (the
// definition it was built from, rootfs and content_id set); any other image is
// returned as it is. Throws ImageNotBuilt.
Image resolve_image(const Image& image, const ImageStore& store);

// Where a stored root must have a directory (or file) for the runtime to
// mount on, as the mapped user cannot create them in a read-only root owned by
// root: every mount point of the image's sandboxes.
std::vector<std::string> image_mount_points(const Image& image);

// Builds `definition` (an image with a build section) with mmdebstrap into a
// temporary dir of the store, checks the kernel starts there (python imports
// ipykernel and the preload modules), makes it read-only, moves it into place
// under its content id and points the name at it. Progress lines go to
// `progress`. On failure or SIGINT/SIGTERM nothing is left behind; throws
// std::runtime_error naming the step.
StoredImage build_image(const Image& definition, const ImageStore& store, std::ostream& progress);

// The same from an existing root filesystem tarball (`tar -x`), with
// `definition` (the folder's image.json if NAME has one, or a default Python
// one) describing how to run it. The content id hashes the tarball's bytes.
StoredImage import_image(const Image& definition, const std::filesystem::path& tarball,
                         const ImageStore& store, std::ostream& progress);

// The definition `import` uses for a name without an image.json: python3
// running cellblock's ipykernel launcher, the store's root.
Image default_import_definition(const std::string& name);

// Host processes whose root lies in this stored version (sandboxes on it).
std::vector<int> processes_using(const StoredImage& stored);

// A sandbox on a stored version holds a shared flock on the version's
// manifest.json from before its runtime starts until it is destroyed; `image
// rm` takes the lock exclusively (without waiting) and keeps a version it
// cannot lock. So a session that is still starting (no process has the root
// yet, processes_using sees nothing) keeps its version too. Returns the open
// fd (the caller closes it to let go), or throws std::runtime_error when the
// version is being removed or gone. `rootfs` is the version's rootfs dir.
int hold_stored_version(const std::filesystem::path& rootfs);

// Removes NAME from the store: the name, and every version of it no process
// runs on. Returns the versions kept because they are in use (removed by a
// later `rm`). Throws if NAME is not in the store.
std::vector<StoredImage> remove_image(const std::string& name, const ImageStore& store);

// Removes what builds killed outright left in STORE/tmp (their pid is gone).
void sweep_abandoned_builds(const ImageStore& store);

}  // namespace cellblock
