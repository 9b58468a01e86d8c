// RankSet: a set of ranks of one world (bit r for rank r), for the host's destination sets, rank masks and
// agreements. A value type of a fixed kMaxWorld bits (no allocation: the cpu backend keeps one per token); what it
// stores in shared memory is sized from the world (words_for).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "ferry/error.hpp"
#include "ferry/limits.hpp"

namespace ferry::detail {

class RankSet {
 public:
  static constexpr int kWords = kMaxWorld / 64;
  static_assert(kMaxWorld % 64 == 0, "RankSet keeps whole 64-bit words");

  // 64-bit words that hold a set of `world` ranks (what a shared-memory record of one needs).
  static constexpr int words_for(int world) { return (world + 63) / 64; }
  // Ranks [first, first + count): every rank of a world (first 0), or of one node.
  static RankSet range(int first, int count) {
    RankSet out;
    for (int r = first; r < first + count; ++r) out.set(r);
    return out;
  }
  // The ranks of the low bits of a 32-bit mask (the cuda kernels' words: bit r for rank r).
  static RankSet from_mask32(uint32_t bits) {
    RankSet out;
    out.words_[0] = bits;
    return out;
  }
  // The ranks of 32-bit words (the cuda kernels' sets: bit r % 32 of word r / 32), num_words of them.
  static RankSet from_words32(uint32_t const* words, int num_words) {
    RankSet out;
    for (int w = 0; w < num_words && w < 2 * kWords; ++w)
      out.words_[w / 2] |= static_cast<uint64_t>(words[w]) << (32 * (w % 2));
    return out;
  }
  // A set stored with store(): num_words words (words_for(world)).
  static RankSet load(uint64_t const* words, int num_words) {
    RankSet out;
    for (int w = 0; w < num_words && w < kWords; ++w) out.words_[w] = words[w];
    return out;
  }
  void store(uint64_t* words, int num_words) const {
    for (int w = 0; w < num_words && w < kWords; ++w) words[w] = words_[w];
  }

  // rank in [0, kMaxWorld): a rank outside is a bug of the caller
  void set(int rank) {
    FERRY_CHECK(rank >= 0 && rank < kMaxWorld, "RankSet::set(", rank, "): ranks are in [0, ", kMaxWorld, ")");
    words_[rank >> 6] |= uint64_t{1} << (rank & 63);
  }
  void reset(int rank) {
    if (rank >= 0 && rank < kMaxWorld) words_[rank >> 6] &= ~(uint64_t{1} << (rank & 63));
  }
  // false for a rank outside [0, kMaxWorld)
  bool test(int rank) const { return rank >= 0 && rank < kMaxWorld && ((words_[rank >> 6] >> (rank & 63)) & 1U) != 0; }

  bool empty() const {
    for (uint64_t w : words_)
      if (w != 0) return false;
    return true;
  }
  int count() const {
    int n = 0;
    for (uint64_t w : words_) n += std::popcount(w);
    return n;
  }
  // the lowest rank, -1 when empty
  int lowest() const {
    for (int w = 0; w < kWords; ++w)
      if (words_[w] != 0) return w * 64 + std::countr_zero(words_[w]);
    return -1;
  }
  bool intersects(RankSet const& other) const { return !(*this & other).empty(); }

  RankSet& operator|=(RankSet const& other) {
    for (int w = 0; w < kWords; ++w) words_[w] |= other.words_[w];
    return *this;
  }
  RankSet& operator&=(RankSet const& other) {
    for (int w = 0; w < kWords; ++w) words_[w] &= other.words_[w];
    return *this;
  }
  // removes the ranks of `other` (a & ~b)
  RankSet& operator-=(RankSet const& other) {
    for (int w = 0; w < kWords; ++w) words_[w] &= ~other.words_[w];
    return *this;
  }
  friend RankSet operator|(RankSet a, RankSet const& b) { return a |= b; }
  friend RankSet operator&(RankSet a, RankSet const& b) { return a &= b; }
  friend RankSet operator-(RankSet a, RankSet const& b) { return a -= b; }
  friend bool operator==(RankSet const& a, RankSet const& b) = default;

  // Ascending iteration over the ranks of the set: for (int r : set).
  class Iterator {
   public:
    Iterator(uint64_t const* words, int word) : words_(words), word_(word), bits_(word < kWords ? words[word] : 0) {
      skip_empty();
    }
    int operator*() const { return word_ * 64 + std::countr_zero(bits_); }
    Iterator& operator++() {
      bits_ &= bits_ - 1;
      skip_empty();
      return *this;
    }
    bool operator==(Iterator const& other) const { return word_ == other.word_ && bits_ == other.bits_; }

   private:
    void skip_empty() {
      while (bits_ == 0 && word_ + 1 < kWords) bits_ = words_[++word_];
      if (bits_ == 0) word_ = kWords;
    }
    uint64_t const* words_;
    int word_;
    uint64_t bits_;
  };
  Iterator begin() const { return Iterator(words_, 0); }
  Iterator end() const { return Iterator(words_, kWords); }

  std::vector<int> ranks() const {
    std::vector<int> out;
    for (int r : *this) out.push_back(r);
    return out;
  }
  // "1, 5, 33" (ascending)
  std::string text() const {
    std::string out;
    for (int r : *this) out += concat(out.empty() ? "" : ", ", r);
    return out;
  }

 private:
  uint64_t words_[kWords] = {};
};

}  // namespace ferry::detail
