// Fuzzes the local file socket's datagram packing (unpack_frames, then the
// wire decoder on what it yields) and checks it against pack_frames.
//
// Input: one byte, the most frames the unpacker may accept, then the
// datagram as the socket would deliver it.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "cellblock/signer.hpp"
#include "cellblock/wire_message.hpp"
#include "fuzz_support.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    using namespace cellblock;
    if (size < 1) return 0;
    const std::size_t max_frames = data[0];
    const std::string_view datagram(reinterpret_cast<const char*>(data + 1), size - 1);

    const auto frames = unpack_frames(datagram, max_frames);
    if (frames) {
        FUZZ_CHECK(frames->size() <= max_frames, "%zu frames over %zu", frames->size(), max_frames);
        std::vector<std::string> copies;
        for (const auto& f : *frames) {
            FUZZ_CHECK(f.empty() || (f.data() >= datagram.data() &&
                                     f.data() + f.size() <= datagram.data() + datagram.size()),
                       "a frame outside the datagram");
            copies.emplace_back(f);
        }
        // The packing is canonical: what unpacks packs back to the same bytes.
        FUZZ_CHECK(pack_frames(copies) == datagram, "repacked bytes differ");
        static const Signer signer("5f9e1c2a-vector-key-0123456789abcdef");
        const auto decoded = decode(*frames, signer, nullptr, WireLimits{});
        FUZZ_CHECK(decoded.message || !decoded.error.empty(), "neither a message nor an error");
    }

    // Any frames pack into a datagram that unpacks to them.
    const auto split = fuzz::split_frames(data + 1, size - 1);
    const std::string packed = pack_frames(split);
    const auto back = unpack_frames(packed, split.size());
    FUZZ_CHECK(back && back->size() == split.size(), "a packing did not unpack");
    for (std::size_t i = 0; i < split.size(); ++i)
        FUZZ_CHECK((*back)[i] == split[i], "frame %zu changed", i);
    if (!split.empty()) FUZZ_CHECK(!unpack_frames(packed, split.size() - 1), "over max_frames");
    return 0;
}
