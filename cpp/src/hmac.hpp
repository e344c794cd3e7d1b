// Internal: SHA-256 and HMAC-SHA256 (FIPS 180-4, RFC 2104), for the TCP barrier's challenge.
// Small and dependency-free: the library links nothing beyond libc.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace elastic::detail {

using Digest = std::array<unsigned char, 32>;

Digest sha256(const unsigned char* data, size_t size);
Digest hmac_sha256(const std::string& key, const unsigned char* data, size_t size);
/// Compares in time that does not depend on where the first difference is.
bool digests_equal(const unsigned char* a, const unsigned char* b) noexcept;
/// `n` bytes from the kernel's random source; false if it has none to give.
bool random_bytes(unsigned char* out, size_t n) noexcept;

}  // namespace elastic::detail
