#include "cellblock/frame.hpp"

namespace cellblock {

Frame::Frame(std::string bytes) {
    if (bytes.size() < kSharedBytes) {
        inline_ = std::move(bytes);
        return;
    }
    // The string's buffer moves into the storage: its bytes do not.
    auto owned = std::make_shared<const std::string>(std::move(bytes));
    shared_ = *owned;
    owner_ = std::move(owned);
}

Frame Frame::share() const {
    if (owner_) return Frame(owner_, shared_);
    return Frame(inline_);
}

std::vector<Frame> to_frames(std::vector<std::string> frames) {
    std::vector<Frame> out;
    out.reserve(frames.size());
    for (auto& f : frames) out.emplace_back(std::move(f));
    return out;
}

std::vector<std::string_view> Multipart::views() const {
    std::vector<std::string_view> v;
    v.reserve(frames.size());
    for (const auto& f : frames) v.push_back(f.view());
    return v;
}

}  // namespace cellblock
