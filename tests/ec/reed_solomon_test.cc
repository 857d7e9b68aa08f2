// Tests for farmem::ec::ReedSolomon.
//
// The reference is a deliberately plain GF(2^8) Reed-Solomon written here from the field's
// definition (log/exp tables for polynomial 0x11d, Cauchy generator: identity on top, row i >= k
// column j = 1 / (i XOR j)). ISA-L's output must match it byte for byte, and every erasure pattern
// the code promises to survive must give back the original bytes.
#include "farmem/ec/reed_solomon.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <climits>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace farmem::ec {
namespace {

// ---- Reference GF(2^8) arithmetic and RS encoder, independent of ISA-L ----

class PlainGf {
 public:
  PlainGf() {
    unsigned x = 1;
    for (int i = 0; i < 255; ++i) {
      exp_[i] = static_cast<uint8_t>(x);
      log_[x] = i;
      x <<= 1;
      if (x & 0x100) x ^= 0x11d;
    }
    for (int i = 255; i < 512; ++i) exp_[i] = exp_[i - 255];
  }
  uint8_t Mul(uint8_t a, uint8_t b) const {
    if (a == 0 || b == 0) return 0;
    return exp_[log_[a] + log_[b]];
  }
  uint8_t Inv(uint8_t a) const { return exp_[255 - log_[a]]; }  // a != 0

 private:
  uint8_t exp_[512] = {};
  int log_[256] = {};
};

const PlainGf& Gf() {
  static const PlainGf gf;
  return gf;
}

// (k + r) x k generator, row-major.
std::vector<uint8_t> PlainCauchyMatrix(int k, int r) {
  std::vector<uint8_t> m(static_cast<size_t>(k + r) * k, 0);
  for (int i = 0; i < k; ++i) m[i * k + i] = 1;
  for (int i = k; i < k + r; ++i) {
    for (int j = 0; j < k; ++j) m[i * k + j] = Gf().Inv(static_cast<uint8_t>(i ^ j));
  }
  return m;
}

std::vector<std::vector<uint8_t>> PlainEncode(int k, int r,
                                              const std::vector<std::vector<uint8_t>>& data) {
  const std::vector<uint8_t> m = PlainCauchyMatrix(k, r);
  const size_t len = data.empty() ? 0 : data[0].size();
  std::vector<std::vector<uint8_t>> parity(r, std::vector<uint8_t>(len, 0));
  for (int p = 0; p < r; ++p) {
    for (int j = 0; j < k; ++j) {
      const uint8_t c = m[(k + p) * k + j];
      for (size_t b = 0; b < len; ++b) parity[p][b] ^= Gf().Mul(c, data[j][b]);
    }
  }
  return parity;
}

// ---- helpers ----

struct Shape {
  int k;
  int r;
};

std::string Name(Shape s) { return "RS(" + std::to_string(s.k) + "," + std::to_string(s.r) + ")"; }

std::unique_ptr<ReedSolomon> MakeCode(Shape s) {
  auto rs = ReedSolomon::Create(s.k, s.r);
  EXPECT_TRUE(rs.has_value()) << Name(s) << ": " << rs.error().ToString();
  return rs.has_value() ? std::move(*rs) : nullptr;
}

std::vector<uint8_t> RandomBytes(std::mt19937& rng, size_t len) {
  std::vector<uint8_t> v(len);
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto& b : v) b = static_cast<uint8_t>(byte(rng));
  return v;
}

// k data fragments of random bytes plus their parity from the plain reference encoder.
std::vector<std::vector<uint8_t>> PlainStripe(Shape s, size_t len, std::mt19937& rng) {
  std::vector<std::vector<uint8_t>> frags;
  for (int i = 0; i < s.k; ++i) frags.push_back(RandomBytes(rng, len));
  for (auto& p : PlainEncode(s.k, s.r, frags)) frags.push_back(std::move(p));
  return frags;
}

std::vector<uint8_t*> Pointers(std::vector<std::vector<uint8_t>>& frags) {
  std::vector<uint8_t*> ptrs;
  for (auto& f : frags) ptrs.push_back(f.data());
  return ptrs;
}

// Calls fn(subset) for every subset of {0..n-1} with at most max_size elements.
template <typename Fn>
int ForEachSubset(int n, int max_size, Fn fn) {
  int count = 0;
  for (uint32_t mask = 0; mask < (1u << n); ++mask) {
    if (std::popcount(mask) > max_size) continue;
    std::vector<int> subset;
    for (int i = 0; i < n; ++i) {
      if (mask & (1u << i)) subset.push_back(i);
    }
    fn(subset);
    ++count;
  }
  return count;
}

int Binomial(int n, int m) {
  long long c = 1;
  for (int i = 1; i <= m; ++i) c = c * (n - m + i) / i;
  return static_cast<int>(c);
}

// ---- Create ----

TEST(ReedSolomonCreate, RejectsBadShapesWithClearMessages) {
  struct Case {
    int k, r;
    const char* mentions;
  } cases[] = {{0, 2, "k must be at least 1"},  {-3, 2, "k must be at least 1"},
               {4, -1, "must be >= 0"},         {30, 3, "k + r = 33"},
               {33, 0, "at most 32"},           {1, 32, "at most 32"},
               {INT_MAX, INT_MAX, "at most 32"}};
  for (const Case& c : cases) {
    auto rs = ReedSolomon::Create(c.k, c.r);
    ASSERT_FALSE(rs.has_value()) << c.k << "," << c.r;
    EXPECT_EQ(rs.error().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(rs.error().message().find(c.mentions), std::string::npos) << rs.error().message();
  }
}

TEST(ReedSolomonCreate, AcceptsEdgeShapes) {
  for (Shape s : {Shape{1, 0}, Shape{32, 0}, Shape{1, 31}, Shape{16, 16}, Shape{4, 2}}) {
    auto rs = MakeCode(s);
    ASSERT_NE(rs, nullptr);
    EXPECT_EQ(rs->data_fragments(), s.k);
    EXPECT_EQ(rs->parity_fragments(), s.r);
    EXPECT_EQ(rs->total_fragments(), s.k + s.r);
  }
}

// ---- Encode vs the plain reference ----

TEST(ReedSolomonEncode, MatchesPlainGf256ByteForByte) {
  std::mt19937 rng(1);
  const Shape shapes[] = {{1, 0},  {3, 0}, {1, 1}, {2, 1},   {4, 2},  {8, 2},
                          {10, 4}, {6, 3}, {1, 5}, {16, 16}, {31, 1}, {12, 20}};
  // Odd lengths exercise ISA-L's scalar tails and its small-length fallbacks.
  const size_t lengths[] = {1, 7, 16, 31, 32, 33, 63, 64, 65, 100, 512, 1024, 4096, 4099};
  for (Shape s : shapes) {
    auto rs = MakeCode(s);
    ASSERT_NE(rs, nullptr);
    for (size_t len : lengths) {
      auto expected = PlainStripe(s, len, rng);
      std::vector<const uint8_t*> data;
      for (int i = 0; i < s.k; ++i) data.push_back(expected[i].data());
      std::vector<std::vector<uint8_t>> parity(s.r, std::vector<uint8_t>(len, 0xEE));
      std::vector<uint8_t*> parity_ptrs = Pointers(parity);
      ASSERT_TRUE(rs->Encode(data, parity_ptrs, len).ok());
      for (int p = 0; p < s.r; ++p) {
        ASSERT_EQ(parity[p], expected[s.k + p]) << Name(s) << " len " << len << " parity " << p;
      }
    }
  }
}

// ---- Decode: every erasure pattern ----

struct DecodeCase {
  Shape shape;
  size_t len;
};

void PrintTo(const DecodeCase& c, std::ostream* os) { *os << Name(c.shape) << " len " << c.len; }

class ReedSolomonEveryPattern : public ::testing::TestWithParam<DecodeCase> {};

TEST_P(ReedSolomonEveryPattern, DecodeRebuildsErasedFragments) {
  const Shape s = GetParam().shape;
  const size_t len = GetParam().len;
  const int n = s.k + s.r;
  auto rs = MakeCode(s);
  ASSERT_NE(rs, nullptr);
  std::mt19937 rng(s.k * 100 + s.r);
  const auto original = PlainStripe(s, len, rng);

  int failures = 0;
  const int patterns = ForEachSubset(n, s.r, [&](const std::vector<int>& erased) {
    auto frags = original;
    for (int e : erased) std::fill(frags[e].begin(), frags[e].end(), 0xA5);
    std::vector<uint8_t*> ptrs = Pointers(frags);
    Status st = rs->Decode(ptrs, erased, len);
    if (!st.ok() || frags != original) {
      ADD_FAILURE() << Name(s) << " len " << len << " erased " << ::testing::PrintToString(erased)
                    << ": " << st.ToString();
      ++failures;
    }
  });
  int expected_patterns = 0;
  for (int e = 0; e <= s.r; ++e) expected_patterns += Binomial(n, e);
  EXPECT_EQ(patterns, expected_patterns);
  EXPECT_EQ(failures, 0);
  // One cached plan per non-empty pattern.
  EXPECT_EQ(rs->cached_decode_plans(), static_cast<size_t>(expected_patterns - 1));
}

TEST_P(ReedSolomonEveryPattern, ReconstructDataFromAnyKSurvivorsInAnyOrder) {
  const Shape s = GetParam().shape;
  const size_t len = GetParam().len;
  const int n = s.k + s.r;
  auto rs = MakeCode(s);
  ASSERT_NE(rs, nullptr);
  std::mt19937 rng(s.k * 7 + s.r);
  const auto original = PlainStripe(s, len, rng);

  int survivor_sets = 0;
  for (uint32_t mask = 0; mask < (1u << n); ++mask) {
    if (std::popcount(mask) != s.k) continue;
    ++survivor_sets;
    std::vector<int> present;
    for (int i = 0; i < n; ++i) {
      if (mask & (1u << i)) present.push_back(i);
    }
    std::shuffle(present.begin(), present.end(), rng);  // arrival order
    // Sometimes one more fragment arrived after the first k: it must not be read if it is
    // parity (we poison it), and it must be left alone if it is data.
    int late = -1;
    if (std::popcount(mask) < n && (rng() & 1)) {
      for (int i = n - 1; i >= 0; --i) {
        if (!(mask & (1u << i))) {
          late = i;
          break;
        }
      }
      present.push_back(late);
    }

    auto frags = original;
    std::vector<uint8_t*> ptrs = Pointers(frags);
    for (int i = 0; i < n; ++i) {
      const bool listed = std::find(present.begin(), present.end(), i) != present.end();
      if (!listed && i >= s.k) ptrs[i] = nullptr;  // parity still in flight: no buffer at all
      if (!listed && i < s.k) std::fill(frags[i].begin(), frags[i].end(), 0x5A);
    }
    if (late >= s.k) std::fill(frags[late].begin(), frags[late].end(), 0xC3);

    Status st = rs->ReconstructData(ptrs, present, len);
    ASSERT_TRUE(st.ok()) << st.ToString();
    for (int i = 0; i < s.k; ++i) {
      ASSERT_EQ(frags[i], original[i])
          << Name(s) << " data " << i << " present " << ::testing::PrintToString(present);
    }
    for (int i = s.k; i < n; ++i) {  // parity buffers are never written
      if (ptrs[i] != nullptr && i != late) {
        ASSERT_EQ(frags[i], original[i]);
      }
    }
  }
  EXPECT_EQ(survivor_sets, Binomial(n, s.k));
}

INSTANTIATE_TEST_SUITE_P(Shapes, ReedSolomonEveryPattern,
                         ::testing::Values(DecodeCase{{4, 2}, 1024}, DecodeCase{{8, 2}, 512},
                                           DecodeCase{{10, 4}, 1024}, DecodeCase{{10, 4}, 77},
                                           DecodeCase{{2, 1}, 2048}, DecodeCase{{1, 0}, 4096},
                                           DecodeCase{{5, 0}, 100}, DecodeCase{{1, 3}, 33},
                                           DecodeCase{{6, 3}, 4096}, DecodeCase{{3, 5}, 512}),
                         [](const ::testing::TestParamInfo<DecodeCase>& info) {
                           return "k" + std::to_string(info.param.shape.k) + "r" +
                                  std::to_string(info.param.shape.r) + "len" +
                                  std::to_string(info.param.len);
                         });

TEST(ReedSolomonDecode, ReadsOnlyTheFirstKSurvivors) {
  auto rs = MakeCode({4, 2});
  ASSERT_NE(rs, nullptr);
  std::mt19937 rng(3);
  const auto original = PlainStripe({4, 2}, 1024, rng);
  auto frags = original;
  std::fill(frags[1].begin(), frags[1].end(), 0);
  std::vector<uint8_t*> ptrs = Pointers(frags);
  ptrs[5] = nullptr;  // survivors are 0, 2, 3, 4; parity 1 (index 5) is not needed
  const int erased[] = {1};
  ASSERT_TRUE(rs->Decode(ptrs, erased, 1024).ok());
  EXPECT_EQ(frags[1], original[1]);
}

TEST(ReedSolomonDecode, NothingErasedIsANoOp) {
  auto rs = MakeCode({4, 2});
  ASSERT_NE(rs, nullptr);
  std::vector<std::vector<uint8_t>> frags(6, std::vector<uint8_t>(64, 1));
  std::vector<uint8_t*> ptrs = Pointers(frags);
  EXPECT_TRUE(rs->Decode(ptrs, {}, 64).ok());
  EXPECT_EQ(rs->cached_decode_plans(), 0u);
}

TEST(ReedSolomonDecode, DecodesStripesWrittenByThePlainEncoder) {
  // Interoperability in the other direction: parity made outside ISA-L decodes through it.
  const Shape s{8, 2};
  auto rs = MakeCode(s);
  ASSERT_NE(rs, nullptr);
  std::mt19937 rng(11);
  auto original = PlainStripe(s, 512, rng);
  auto frags = original;
  std::fill(frags[0].begin(), frags[0].end(), 0);
  std::fill(frags[9].begin(), frags[9].end(), 0);
  std::vector<uint8_t*> ptrs = Pointers(frags);
  const int erased[] = {9, 0};
  ASSERT_TRUE(rs->Decode(ptrs, erased, 512).ok());
  EXPECT_EQ(frags, original);
}

// ---- Parity update ----

TEST(ReedSolomonUpdateParity, EqualsFullReencode) {
  std::mt19937 rng(5);
  const Shape shapes[] = {{4, 2}, {8, 2}, {10, 4}, {2, 1}, {1, 3}, {16, 16}};
  // 5000 and 3 * 4096 + 5 cross UpdateParity's internal 4 KiB chunking.
  const size_t lengths[] = {1, 31, 512, 1024, 4096, 5000, 3 * 4096 + 5};
  for (Shape s : shapes) {
    auto rs = MakeCode(s);
    ASSERT_NE(rs, nullptr);
    for (size_t len : lengths) {
      auto frags = PlainStripe(s, len, rng);
      std::vector<uint8_t*> ptrs = Pointers(frags);
      std::span<uint8_t* const> parity(ptrs.data() + s.k, s.r);
      // Several successive updates, each to a random data fragment.
      for (int step = 0; step < 2 * s.k; ++step) {
        const int index = static_cast<int>(rng() % s.k);
        std::vector<uint8_t> new_data = RandomBytes(rng, len);
        ASSERT_TRUE(
            rs->UpdateParity(index, frags[index].data(), new_data.data(), parity, len).ok());
        frags[index] = new_data;
        ptrs[index] = frags[index].data();

        std::vector<std::vector<uint8_t>> data(frags.begin(), frags.begin() + s.k);
        auto expected = PlainEncode(s.k, s.r, data);
        for (int p = 0; p < s.r; ++p) {
          ASSERT_EQ(frags[s.k + p], expected[p])
              << Name(s) << " len " << len << " step " << step << " parity " << p;
        }
      }
    }
  }
}

TEST(ReedSolomonUpdateParity, DeltaFormMatchesAndIsItsOwnInverse) {
  const Shape s{4, 2};
  const size_t len = 1024;
  auto rs = MakeCode(s);
  ASSERT_NE(rs, nullptr);
  std::mt19937 rng(9);
  auto frags = PlainStripe(s, len, rng);
  const auto before = frags;
  std::vector<uint8_t*> ptrs = Pointers(frags);
  std::span<uint8_t* const> parity(ptrs.data() + s.k, s.r);

  std::vector<uint8_t> new_data = RandomBytes(rng, len);
  std::vector<uint8_t> delta(len);
  for (size_t i = 0; i < len; ++i) delta[i] = frags[2][i] ^ new_data[i];
  ASSERT_TRUE(rs->UpdateParityWithDelta(2, delta.data(), parity, len).ok());

  std::vector<std::vector<uint8_t>> data(frags.begin(), frags.begin() + s.k);
  data[2] = new_data;
  auto expected = PlainEncode(s.k, s.r, data);
  EXPECT_EQ(frags[4], expected[0]);
  EXPECT_EQ(frags[5], expected[1]);

  ASSERT_TRUE(rs->UpdateParityWithDelta(2, delta.data(), parity, len).ok());
  EXPECT_EQ(frags, before);
}

// What farmemd's PARITY_ENCODE does: one parity fragment, from zero, one data fragment at a
// time (any order), must equal that fragment of the plain reference encoder.
TEST(ReedSolomonUpdateParity, OneFragmentFromZeroEqualsEncode) {
  for (Shape s : {Shape{4, 2}, Shape{1, 1}, Shape{10, 4}, Shape{3, 5}}) {
    auto rs = MakeCode(s);
    ASSERT_NE(rs, nullptr);
    std::mt19937 rng(17);
    for (size_t len : {size_t{1}, size_t{63}, size_t{4096}, size_t{65537}}) {
      auto frags = PlainStripe(s, len, rng);
      for (int p = 0; p < s.r; ++p) {
        std::vector<uint8_t> parity(len, 0);
        for (int i = s.k - 1; i >= 0; --i) {  // order does not matter: XOR sums
          ASSERT_TRUE(
              rs->UpdateParityFragmentWithDelta(i, p, frags[i].data(), parity.data(), len).ok());
        }
        EXPECT_EQ(parity, frags[s.k + p]) << Name(s) << " parity " << p << " len " << len;
      }
    }
  }
  auto rs = MakeCode({4, 2});
  std::vector<uint8_t> buf(8, 0);
  EXPECT_EQ(rs->UpdateParityFragmentWithDelta(4, 0, buf.data(), buf.data(), 8).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(rs->UpdateParityFragmentWithDelta(0, 2, buf.data(), buf.data(), 8).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(rs->UpdateParityFragmentWithDelta(0, -1, buf.data(), buf.data(), 8).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(rs->UpdateParityFragmentWithDelta(0, 0, nullptr, buf.data(), 8).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(rs->UpdateParityFragmentWithDelta(0, 0, buf.data(), buf.data(), 0).code(),
            StatusCode::kInvalidArgument);
}

TEST(ReedSolomonUpdateParity, SameBufferForOldAndNewChangesNothing) {
  const Shape s{4, 2};
  auto rs = MakeCode(s);
  ASSERT_NE(rs, nullptr);
  std::mt19937 rng(10);
  auto frags = PlainStripe(s, 512, rng);
  const auto before = frags;
  std::vector<uint8_t*> ptrs = Pointers(frags);
  ASSERT_TRUE(rs->UpdateParity(0, ptrs[0], ptrs[0], {ptrs.data() + 4, 2}, 512).ok());
  EXPECT_EQ(frags, before);
}

// ---- Bad arguments are errors, never crashes ----

class ReedSolomonBadArgs : public ::testing::Test {
 protected:
  void SetUp() override {
    rs_ = MakeCode({4, 2});
    ASSERT_NE(rs_, nullptr);
    frags_.assign(6, std::vector<uint8_t>(kLen, 7));
    ptrs_ = Pointers(frags_);
    cptrs_.assign(ptrs_.begin(), ptrs_.begin() + 4);
  }
  std::span<uint8_t* const> Parity() { return {ptrs_.data() + 4, 2}; }

  static constexpr size_t kLen = 512;
  std::unique_ptr<ReedSolomon> rs_;
  std::vector<std::vector<uint8_t>> frags_;
  std::vector<uint8_t*> ptrs_;
  std::vector<const uint8_t*> cptrs_;
};

TEST_F(ReedSolomonBadArgs, Encode) {
  EXPECT_EQ(rs_->Encode(cptrs_, Parity(), 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(rs_->Encode(cptrs_, Parity(), size_t{INT_MAX} + 1).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(rs_->Encode({cptrs_.data(), 3}, Parity(), kLen).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(rs_->Encode(cptrs_, {ptrs_.data() + 4, 1}, kLen).code(), StatusCode::kInvalidArgument);
  cptrs_[2] = nullptr;
  Status st = rs_->Encode(cptrs_, Parity(), kLen);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("data fragment 2 is null"), std::string::npos) << st.message();
  cptrs_[2] = frags_[2].data();
  ptrs_[5] = nullptr;
  EXPECT_EQ(rs_->Encode(cptrs_, Parity(), kLen).code(), StatusCode::kInvalidArgument);
}

TEST_F(ReedSolomonBadArgs, Decode) {
  const int three[] = {0, 1, 2};
  Status st = rs_->Decode(ptrs_, three, kLen);
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_NE(st.message().find("at most 2"), std::string::npos) << st.message();
  const int negative[] = {-1};
  EXPECT_EQ(rs_->Decode(ptrs_, negative, kLen).code(), StatusCode::kInvalidArgument);
  const int too_big[] = {6};
  EXPECT_EQ(rs_->Decode(ptrs_, too_big, kLen).code(), StatusCode::kInvalidArgument);
  const int huge[] = {INT_MAX};
  EXPECT_EQ(rs_->Decode(ptrs_, huge, kLen).code(), StatusCode::kInvalidArgument);
  const int twice[] = {3, 3};
  EXPECT_EQ(rs_->Decode(ptrs_, twice, kLen).code(), StatusCode::kInvalidArgument);
  const int one[] = {1};
  EXPECT_EQ(rs_->Decode(ptrs_, one, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(rs_->Decode({ptrs_.data(), 5}, one, kLen).code(), StatusCode::kInvalidArgument);
  ptrs_[1] = nullptr;  // the buffer to rebuild into
  EXPECT_EQ(rs_->Decode(ptrs_, one, kLen).code(), StatusCode::kInvalidArgument);
  ptrs_[1] = frags_[1].data();
  ptrs_[0] = nullptr;  // a survivor that must be read
  EXPECT_EQ(rs_->Decode(ptrs_, one, kLen).code(), StatusCode::kInvalidArgument);
}

TEST_F(ReedSolomonBadArgs, DecodeWithoutParityRejectsAnyErasure) {
  auto rs = MakeCode({3, 0});
  ASSERT_NE(rs, nullptr);
  std::vector<std::vector<uint8_t>> frags(3, std::vector<uint8_t>(kLen, 1));
  std::vector<uint8_t*> ptrs = Pointers(frags);
  const int one[] = {0};
  EXPECT_EQ(rs->Decode(ptrs, one, kLen).code(), StatusCode::kDataLoss);
  EXPECT_TRUE(rs->Decode(ptrs, {}, kLen).ok());
}

TEST_F(ReedSolomonBadArgs, ReconstructData) {
  const int three[] = {0, 4, 5};
  EXPECT_EQ(rs_->ReconstructData(ptrs_, three, kLen).code(), StatusCode::kDataLoss);
  const int dup[] = {0, 4, 5, 4};
  EXPECT_EQ(rs_->ReconstructData(ptrs_, dup, kLen).code(), StatusCode::kInvalidArgument);
  const int out_of_range[] = {0, 4, 5, 6};
  EXPECT_EQ(rs_->ReconstructData(ptrs_, out_of_range, kLen).code(), StatusCode::kInvalidArgument);
  const int ok_set[] = {0, 4, 5, 1};
  EXPECT_EQ(rs_->ReconstructData(ptrs_, ok_set, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(rs_->ReconstructData({ptrs_.data(), 4}, ok_set, kLen).code(),
            StatusCode::kInvalidArgument);
  ptrs_[4] = nullptr;  // listed as present but no buffer
  EXPECT_EQ(rs_->ReconstructData(ptrs_, ok_set, kLen).code(), StatusCode::kInvalidArgument);
}

TEST_F(ReedSolomonBadArgs, UpdateParity) {
  std::vector<uint8_t> new_data(kLen, 9);
  EXPECT_EQ(rs_->UpdateParity(-1, ptrs_[0], new_data.data(), Parity(), kLen).code(),
            StatusCode::kInvalidArgument);
  // Index 4 is a parity fragment, not data.
  EXPECT_EQ(rs_->UpdateParity(4, ptrs_[0], new_data.data(), Parity(), kLen).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(rs_->UpdateParity(0, nullptr, new_data.data(), Parity(), kLen).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(rs_->UpdateParity(0, ptrs_[0], new_data.data(), Parity(), 0).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(rs_->UpdateParity(0, ptrs_[0], new_data.data(), {ptrs_.data() + 4, 1}, kLen).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(rs_->UpdateParityWithDelta(0, nullptr, Parity(), kLen).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(rs_->UpdateParityWithDelta(7, new_data.data(), Parity(), kLen).code(),
            StatusCode::kInvalidArgument);
  // Nothing above touched the buffers.
  for (const auto& f : frags_) EXPECT_EQ(f, std::vector<uint8_t>(kLen, 7));
}

// ---- Concurrency ----

TEST(ReedSolomonConcurrency, ThreadsDecodingDifferentPatternsGetRightResults) {
  const Shape s{10, 4};
  const int n = s.k + s.r;
  const size_t len = 1024;
  auto rs = MakeCode(s);
  ASSERT_NE(rs, nullptr);
  std::mt19937 rng(42);
  const auto original = PlainStripe(s, len, rng);

  std::vector<std::vector<int>> patterns;
  ForEachSubset(n, s.r, [&](const std::vector<int>& e) {
    if (!e.empty()) patterns.push_back(e);
  });

  constexpr int kThreads = 4;
  constexpr int kRounds = 3;
  std::atomic<int> failures{0};
  std::atomic<int> decodes{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto frags = original;
      std::vector<uint8_t*> ptrs = Pointers(frags);
      // Each thread walks the patterns from a different start, so at any moment the threads are
      // decoding different patterns, while the cache is being filled and read concurrently.
      const size_t start = t * patterns.size() / kThreads;
      for (int round = 0; round < kRounds; ++round) {
        for (size_t i = 0; i < patterns.size(); ++i) {
          const std::vector<int>& erased = patterns[(start + i) % patterns.size()];
          for (int e : erased) std::memset(ptrs[e], 0xFF, len);
          if (round % 2 == 0) {
            if (!rs->Decode(ptrs, erased, len).ok()) ++failures;
          } else {
            // Same pattern via the "first k to arrive" path: survivors in reverse order.
            std::vector<int> present;
            for (int j = n - 1; j >= 0; --j) {
              if (std::find(erased.begin(), erased.end(), j) == erased.end()) present.push_back(j);
            }
            if (!rs->ReconstructData(ptrs, present, len).ok()) ++failures;
            for (int e : erased) {  // parity is not rebuilt on this path; restore it
              if (e >= s.k) std::memcpy(ptrs[e], original[e].data(), len);
            }
          }
          if (frags != original) {
            ++failures;
            frags = original;
            ptrs = Pointers(frags);
          }
          ++decodes;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(decodes.load(), kThreads * kRounds * static_cast<int>(patterns.size()));
}

}  // namespace
}  // namespace farmem::ec
