// NgramMap: open-addressing hash map from an exact n-gram to a small value,
// storing no keys.
//
// A slot holds the n-gram's 32-bit hash (its tag) and the value; the value
// points at a place where the n-gram is written in a token text (the last
// position that followed it, or the newest corpus entry), so every lookup
// confirms a tag match by comparing the n tokens themselves (the caller's
// `same` predicate): two n-grams never share a slot, even when their tags
// collide. Linear probing over a power-of-two table kept at most 3/4 full
// (8-byte own slots: a probe run stays within a cache line or two);
// erase shifts the following entries back (no tombstones). A value type V
// tells an empty slot by `V::empty()`; a default-constructed V is empty.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace lookahead {

inline uint64_t mix64(uint64_t x) {  // splitmix64 finalizer
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

// Whether a[0:n] == b[0:n] (n <= 4: the index's keys), inlined (std::equal
// calls memcmp for every probe's confirmation).
inline bool same_tokens(const int32_t* a, const int32_t* b, int n) {
  for (int i = 0; i < n; ++i) {
    if (a[i] != b[i]) return false;
  }
  return true;
}

// Hash tag of tokens[0:n] (n <= 4): the tokens packed exactly into two words, mixed.
inline uint32_t ngram_tag(const int32_t* tokens, int n) {
  uint64_t lo = 0, hi = 0;
  for (int i = 0; i < n; ++i) {
    const uint64_t word = static_cast<uint32_t>(tokens[i]);
    (i < 2 ? lo : hi) |= word << (32 * (i & 1));
  }
  return static_cast<uint32_t>(mix64(lo ^ mix64(hi + 0x9e3779b97f4a7c15ULL)));
}

template <class V>
class NgramMap {
 public:
  static constexpr size_t npos = SIZE_MAX;
  struct Slot {
    uint32_t tag = 0;
    V value{};
  };

  // The slot of the n-gram with `tag` that `same(value)` confirms, or npos.
  template <class Same>
  size_t find(uint32_t tag, Same same) const {
    if (size_ == 0) return npos;
    for (size_t i = tag & mask_;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.value.empty()) return npos;
      if (s.tag == tag && same(s.value)) return i;
    }
  }

  // As find, but an absent n-gram gets a slot whose value is still empty:
  // the caller fills it in before any other call. Valid until the next insert.
  template <class Same>
  size_t find_or_insert(uint32_t tag, Same same) {
    if (4 * (size_ + 1) > 3 * slots_.size()) grow(slots_.empty() ? 16 : 2 * slots_.size());
    size_t i = tag & mask_;
    for (; !slots_[i].value.empty(); i = (i + 1) & mask_) {
      if (slots_[i].tag == tag && same(slots_[i].value)) return i;
    }
    slots_[i].tag = tag;
    ++size_;
    return i;
  }

  // Starts loading the slot where a lookup of `tag` begins (a hint only).
  void prefetch(uint32_t tag) const {
    if (!slots_.empty()) __builtin_prefetch(&slots_[tag & mask_]);
  }

  // The value in the slot where a lookup of `tag` begins if that slot holds
  // `tag` (most lookups end there), else null: a hint for prefetching only.
  const V* home(uint32_t tag) const {
    if (slots_.empty()) return nullptr;
    const Slot& s = slots_[tag & mask_];
    return !s.value.empty() && s.tag == tag ? &s.value : nullptr;
  }

  V& value(size_t slot) { return slots_[slot].value; }
  const V& value(size_t slot) const { return slots_[slot].value; }

  void erase(size_t i) {
    for (size_t j = i;;) {  // backward shift: pull later entries of the run into the hole
      j = (j + 1) & mask_;
      if (slots_[j].value.empty()) break;
      const size_t home = slots_[j].tag & mask_;
      if (((j - home) & mask_) >= ((j - i) & mask_)) {
        slots_[i] = slots_[j];
        i = j;
      }
    }
    slots_[i] = Slot{};
    --size_;
  }

  // Room for `n` n-grams without rehashing.
  void reserve(size_t n) {
    size_t cap = 16;
    while (3 * cap < 4 * n) cap *= 2;
    if (cap > slots_.size()) grow(cap);
  }

  void clear() {
    std::vector<Slot>().swap(slots_);
    size_ = 0;
    mask_ = 0;
  }

  size_t size() const { return size_; }
  size_t memory_bytes() const { return slots_.capacity() * sizeof(Slot); }

 private:
  void grow(size_t cap) {
    std::vector<Slot> old(cap);
    old.swap(slots_);
    mask_ = cap - 1;
    for (const Slot& s : old) {
      if (s.value.empty()) continue;
      size_t i = s.tag & mask_;
      while (!slots_[i].value.empty()) i = (i + 1) & mask_;
      slots_[i] = s;
    }
  }

  std::vector<Slot> slots_;
  size_t size_ = 0;
  size_t mask_ = 0;
};

}  // namespace lookahead
