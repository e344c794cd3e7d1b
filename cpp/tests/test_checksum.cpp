// CRC-32C and the fused copy: the known check value, continuation, and every fast path equal to
// the table-driven one on unaligned pointers and odd lengths.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "elastic/checksum.hpp"

namespace {

std::vector<unsigned char> random_bytes(size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(gen());
  return v;
}

TEST(Checksum, KnownCheckValue) {
  // The CRC-32C of "123456789" (RFC 3720's catalogue value).
  const char* text = "123456789";
  EXPECT_EQ(elastic::crc32c(text, 9), 0xE3069283u);
  EXPECT_EQ(elastic::detail::crc32c_portable(text, 9, 0), 0xE3069283u);
  EXPECT_EQ(elastic::crc32c(text, 0), 0u);
}

TEST(Checksum, ContinuesAcrossPieces) {
  auto data = random_bytes(10007, 1);
  uint32_t whole = elastic::crc32c(data.data(), data.size());
  uint32_t first = elastic::crc32c(data.data(), 4321);
  EXPECT_EQ(elastic::crc32c(data.data() + 4321, data.size() - 4321, first), whole);
  EXPECT_EQ(elastic::detail::crc32c_portable(data.data(), data.size(), 0), whole);
}

TEST(Checksum, CopyChecksumsWhatItCopiesAtAnyAlignment) {
  auto src = random_bytes(5000, 2);
  for (size_t shift : {0, 1, 3, 7}) {
    for (size_t n : {0, 1, 7, 8, 9, 4093}) {
      std::vector<unsigned char> dst(n + 16, 0xAB);
      uint32_t crc = elastic::copy_crc32c(dst.data() + shift, src.data() + 1, n, 0);
      EXPECT_EQ(std::memcmp(dst.data() + shift, src.data() + 1, n), 0);
      EXPECT_EQ(crc, elastic::detail::crc32c_portable(src.data() + 1, n, 0)) << n;
      if (shift > 0) {
        EXPECT_EQ(dst[shift - 1], 0xAB) << "wrote before the destination";
      }
      EXPECT_EQ(dst[shift + n], 0xAB) << "wrote past the destination";
    }
  }
}

TEST(Checksum, ChunksAreTheChecksumsOfTheirPieces) {
  const size_t chunk = 4096;
  for (size_t n : {size_t{0}, chunk, 3 * chunk, 7 * chunk + 100, 9 * chunk}) {
    auto src = random_bytes(n + 1, 3);
    std::vector<uint64_t> aligned((n + 8) / 8 + 1);  // 8-byte aligned: the fast path
    auto* dst = reinterpret_cast<unsigned char*>(aligned.data());
    std::vector<uint32_t> crcs((n + chunk - 1) / chunk + 1, 0xDEADBEEFu);
    elastic::copy_crc32c_chunks(dst, src.data() + 1, n, chunk, crcs.data());
    EXPECT_EQ(std::memcmp(dst, src.data() + 1, n), 0);
    size_t pieces = (n + chunk - 1) / chunk;
    for (size_t k = 0; k < pieces; ++k) {
      size_t len = std::min(chunk, n - k * chunk);
      EXPECT_EQ(crcs[k], elastic::detail::crc32c_portable(src.data() + 1 + k * chunk, len, 0))
          << "piece " << k << " of " << n;
    }
    EXPECT_EQ(crcs[pieces], 0xDEADBEEFu) << "wrote a checksum too many";
  }
}

TEST(Checksum, ChunksToAnUnalignedDestination) {
  const size_t chunk = 64, n = 10 * chunk + 5;
  auto src = random_bytes(n, 4);
  std::vector<unsigned char> dst(n + 1);
  std::vector<uint32_t> crcs(11);
  elastic::copy_crc32c_chunks(dst.data() + 1, src.data(), n, chunk, crcs.data());
  EXPECT_EQ(std::memcmp(dst.data() + 1, src.data(), n), 0);
  EXPECT_EQ(crcs[10], elastic::detail::crc32c_portable(src.data() + 10 * chunk, 5, 0));
}

}  // namespace

namespace {

TEST(Checksum, GatherBuildsThePayloadAndChecksumsItsGrid) {
  const size_t chunk = 256;
  auto a = random_bytes(1000, 5);
  auto b = random_bytes(3 * 256 + 10, 6);
  std::vector<uint64_t> aligned(4096 / 8);
  auto* dst = reinterpret_cast<unsigned char*>(aligned.data());
  std::memset(dst, 0xEE, 4096);
  // Two copied segments and one already in place, with gaps (zeros) between and after.
  std::memcpy(dst + 2600, a.data(), 300);
  const elastic::CopySegment segs[] = {
      {5, a.data(), 1000}, {1024, b.data(), b.size()}, {2600, dst + 2600, 300}};
  const size_t size = 3000;
  std::vector<uint32_t> crcs((size + chunk - 1) / chunk + 1, 0xDEADBEEFu);
  elastic::copy_crc32c_gather(dst, size, segs, 3, chunk, crcs.data());

  std::vector<unsigned char> expected(size, 0);
  std::memcpy(expected.data() + 5, a.data(), 1000);
  std::memcpy(expected.data() + 1024, b.data(), b.size());
  std::memcpy(expected.data() + 2600, a.data(), 300);
  EXPECT_EQ(std::memcmp(dst, expected.data(), size), 0);
  EXPECT_EQ(dst[size], 0xEE) << "wrote past the payload";
  size_t pieces = (size + chunk - 1) / chunk;
  for (size_t k = 0; k < pieces; ++k) {
    size_t len = std::min(chunk, size - k * chunk);
    EXPECT_EQ(crcs[k], elastic::detail::crc32c_portable(expected.data() + k * chunk, len, 0))
        << "piece " << k;
  }
  EXPECT_EQ(crcs[pieces], 0xDEADBEEFu) << "wrote a checksum too many";
}

}  // namespace
