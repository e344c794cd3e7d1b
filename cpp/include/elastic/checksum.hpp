// CRC-32C (Castagnoli) checksums, and a copy that checksums what it copies in the same pass:
// for the memory tier of checkpoints, which must copy a state and prove it whole at about the
// speed of a plain copy.
#pragma once

#include <cstddef>
#include <cstdint>

namespace elastic {

/// CRC-32C of `n` bytes at `data`, continuing from `crc` (0 to start): crc32c(b, crc32c(a))
/// is the checksum of a followed by b. SSE 4.2 when the CPU has it, else a table.
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0) noexcept;

/// Copies `n` bytes from `src` to `dst` (not overlapping) and returns the CRC-32C of the bytes
/// copied, continuing from `crc`.
uint32_t copy_crc32c(void* dst, const void* src, size_t n, uint32_t crc = 0) noexcept;

/// Copies `n` bytes from `src` to `dst` (not overlapping) and writes the CRC-32C of each
/// `chunk` bytes (the last piece may be shorter) to `crcs[0 .. ceil(n / chunk))`. Three pieces
/// are checksummed at once and the stores bypass the cache: about as fast as memcpy for copies
/// larger than the cache. `chunk` must be a positive multiple of 8.
void copy_crc32c_chunks(void* dst, const void* src, size_t n, size_t chunk,
                        uint32_t* crcs) noexcept;

/// A piece of a gathered copy: `n` bytes from `src` to `offset` in the destination.
struct CopySegment {
  size_t offset;
  const void* src;
  size_t n;
};

/// Builds `size` bytes at `dst` from `segments` (sorted by offset, not overlapping, inside
/// `size`; a segment whose `src` is its own destination is checksummed in place), with zeros
/// in the gaps, and writes the CRC-32C of each `chunk` bytes of the result (the last piece may
/// be shorter) to `crcs[0 .. ceil(size / chunk))`: one pass, at the fused copy's speed.
/// `chunk` must be a positive multiple of 8.
void copy_crc32c_gather(void* dst, size_t size, const CopySegment* segments, size_t count,
                        size_t chunk, uint32_t* crcs) noexcept;

namespace detail {
/// The table-driven CRC-32C, whatever the CPU: what the fast paths are tested against.
uint32_t crc32c_portable(const void* data, size_t n, uint32_t crc) noexcept;
}  // namespace detail

}  // namespace elastic
