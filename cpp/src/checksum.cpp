// CRC-32C: the SSE 4.2 instruction where the CPU has it (chosen once, at the first call), else
// a byte table. The fused copy keeps three independent CRCs in flight (the instruction's
// latency is three cycles) and stores with non-temporal moves, so that checksumming costs no
// second pass over memory.
#include "elastic/checksum.hpp"

#include <algorithm>
#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#define ELASTIC_X86 1
#endif

namespace elastic {
namespace {

constexpr uint32_t kPolynomial = 0x82F63B78u;  // Castagnoli, reflected

constexpr std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPolynomial : c >> 1;
    table[i] = c;
  }
  return table;
}

constexpr std::array<uint32_t, 256> kTable = make_table();

uint32_t portable_raw(const unsigned char* p, size_t n, uint32_t c) noexcept {
  for (size_t i = 0; i < n; ++i) c = kTable[(c ^ p[i]) & 0xFFu] ^ (c >> 8);
  return c;
}

uint32_t copy_portable_raw(unsigned char* d, const unsigned char* s, size_t n,
                           uint32_t c) noexcept {
  std::memcpy(d, s, n);
  return portable_raw(d, n, c);
}

#if ELASTIC_X86
bool has_sse42() noexcept {
  static const bool yes = __builtin_cpu_supports("sse4.2");
  return yes;
}

// CRC of n bytes at s, 8 at a time, continuing from c; with kCopy they are also stored at d.
template <bool kCopy>
__attribute__((target("sse4.2"))) uint32_t hw_raw(unsigned char* d, const unsigned char* s,
                                                  size_t n, uint32_t c) noexcept {
  uint64_t c64 = c;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t x;
    std::memcpy(&x, s + i, 8);
    c64 = _mm_crc32_u64(c64, x);
    if constexpr (kCopy) std::memcpy(d + i, &x, 8);
  }
  auto c32 = static_cast<uint32_t>(c64);
  for (; i < n; ++i) {
    c32 = _mm_crc32_u8(c32, s[i]);
    if constexpr (kCopy) d[i] = s[i];
  }
  return c32;
}

// Three whole pieces of `chunk` bytes at once; `dst` 8-byte aligned (non-temporal stores).
__attribute__((target("sse4.2"))) void copy_three(unsigned char* d, const unsigned char* s,
                                                  size_t chunk, uint32_t* crcs) noexcept {
  uint64_t a = 0xFFFFFFFFu, b = 0xFFFFFFFFu, c = 0xFFFFFFFFu;
  const unsigned char* s1 = s + chunk;
  const unsigned char* s2 = s1 + chunk;
  unsigned char* d1 = d + chunk;
  unsigned char* d2 = d1 + chunk;
  for (size_t i = 0; i < chunk; i += 8) {
    uint64_t x, y, z;
    std::memcpy(&x, s + i, 8);
    std::memcpy(&y, s1 + i, 8);
    std::memcpy(&z, s2 + i, 8);
    a = _mm_crc32_u64(a, x);
    b = _mm_crc32_u64(b, y);
    c = _mm_crc32_u64(c, z);
    _mm_stream_si64(reinterpret_cast<long long*>(d + i), static_cast<long long>(x));
    _mm_stream_si64(reinterpret_cast<long long*>(d1 + i), static_cast<long long>(y));
    _mm_stream_si64(reinterpret_cast<long long*>(d2 + i), static_cast<long long>(z));
  }
  crcs[0] = ~static_cast<uint32_t>(a);
  crcs[1] = ~static_cast<uint32_t>(b);
  crcs[2] = ~static_cast<uint32_t>(c);
}
#endif

}  // namespace

namespace detail {
uint32_t crc32c_portable(const void* data, size_t n, uint32_t crc) noexcept {
  return ~portable_raw(static_cast<const unsigned char*>(data), n, ~crc);
}
}  // namespace detail

uint32_t crc32c(const void* data, size_t n, uint32_t crc) noexcept {
  auto p = static_cast<const unsigned char*>(data);
#if ELASTIC_X86
  if (has_sse42()) return ~hw_raw<false>(nullptr, p, n, ~crc);
#endif
  return ~portable_raw(p, n, ~crc);
}

uint32_t copy_crc32c(void* dst, const void* src, size_t n, uint32_t crc) noexcept {
  auto d = static_cast<unsigned char*>(dst);
  auto s = static_cast<const unsigned char*>(src);
#if ELASTIC_X86
  if (has_sse42()) return ~hw_raw<true>(d, s, n, ~crc);
#endif
  return ~copy_portable_raw(d, s, n, ~crc);
}

void copy_crc32c_chunks(void* dst, const void* src, size_t n, size_t chunk,
                        uint32_t* crcs) noexcept {
  auto d = static_cast<unsigned char*>(dst);
  auto s = static_cast<const unsigned char*>(src);
  size_t done = 0;
  size_t k = 0;
#if ELASTIC_X86
  if (has_sse42() && reinterpret_cast<uintptr_t>(d) % 8 == 0) {
    for (; done + 3 * chunk <= n; done += 3 * chunk, k += 3) {
      copy_three(d + done, s + done, chunk, crcs + k);
    }
    _mm_sfence();  // the non-temporal stores are visible before the caller seals the copy
  }
#endif
  for (; done < n; done += chunk, ++k) {
    size_t len = n - done < chunk ? n - done : chunk;
    crcs[k] = copy_crc32c(d + done, s + done, len, 0);
  }
}

namespace {

// The gathered payload's bytes in order, each piece of the chunk grid checksummed as it is
// written: a piece may come from several segments and gaps, so a running CRC carries over.
class GridWriter {
 public:
  GridWriter(unsigned char* dst, size_t chunk, uint32_t* crcs)
      : dst_(dst), chunk_(chunk), crcs_(crcs) {}

  void copy(const unsigned char* src, size_t n) {
    while (n > 0) {
      size_t into = pos_ % chunk_;
      if (into == 0 && n >= chunk_) {
        size_t whole = n / chunk_ * chunk_;
        if (src == dst_ + pos_) {  // in place: checksum only
          for (size_t i = 0; i < whole; i += chunk_) crcs_[k_++] = crc32c(src + i, chunk_, 0);
        } else {
          copy_crc32c_chunks(dst_ + pos_, src, whole, chunk_, crcs_ + k_);
          k_ += whole / chunk_;
        }
        pos_ += whole;
        src += whole;
        n -= whole;
        continue;
      }
      size_t take = std::min(n, chunk_ - into);
      running_ = src == dst_ + pos_ ? crc32c(src, take, running_)
                                    : copy_crc32c(dst_ + pos_, src, take, running_);
      advance(take);
      src += take;
      n -= take;
    }
  }

  void zeros(size_t n) {
    while (n > 0) {
      size_t take = std::min(n, chunk_ - pos_ % chunk_);
      std::memset(dst_ + pos_, 0, take);
      running_ = crc32c(dst_ + pos_, take, running_);
      advance(take);
      n -= take;
    }
  }

  void finish() {
    if (pos_ % chunk_ != 0) crcs_[k_++] = running_;
  }

  size_t pos() const { return pos_; }

 private:
  void advance(size_t n) {
    pos_ += n;
    if (pos_ % chunk_ == 0) {
      crcs_[k_++] = running_;
      running_ = 0;
    }
  }

  unsigned char* dst_;
  size_t chunk_;
  uint32_t* crcs_;
  size_t pos_ = 0;
  size_t k_ = 0;
  uint32_t running_ = 0;
};

}  // namespace

void copy_crc32c_gather(void* dst, size_t size, const CopySegment* segments, size_t count,
                        size_t chunk, uint32_t* crcs) noexcept {
  GridWriter out(static_cast<unsigned char*>(dst), chunk, crcs);
  for (size_t i = 0; i < count; ++i) {
    out.zeros(segments[i].offset - out.pos());
    out.copy(static_cast<const unsigned char*>(segments[i].src), segments[i].n);
  }
  out.zeros(size - out.pos());
  out.finish();
}

}  // namespace elastic
