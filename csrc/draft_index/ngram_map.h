// KeyMap: open-addressing hash map from an exact n-gram key to a small value.
//
// A key packs up to four 32-bit tokens into two uint64 words (token i in
// bits 32*(i%2) of word i/2), so two different n-grams never share a key: the
// hash only picks the home slot, equality compares the whole key. Linear
// probing over a power-of-two table kept at most half full; erase shifts the
// following entries back (no tombstones), so the table never degrades.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace lookahead {

struct NgramKey {
  uint64_t lo = 0;  // tokens 0 and 1
  uint64_t hi = 0;  // tokens 2 and 3
  bool operator==(const NgramKey& o) const { return lo == o.lo && hi == o.hi; }
};

// The key of tokens[0:n] (n <= 4).
inline NgramKey make_key(const int32_t* tokens, int n) {
  NgramKey k;
  for (int i = 0; i < n; ++i) {
    const uint64_t word = static_cast<uint32_t>(tokens[i]);
    (i < 2 ? k.lo : k.hi) |= word << (32 * (i & 1));
  }
  return k;
}

inline uint64_t mix64(uint64_t x) {  // splitmix64 finalizer
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

inline uint64_t hash_key(const NgramKey& k) { return mix64(k.lo ^ mix64(k.hi + 0x9e3779b97f4a7c15ULL)); }

template <class V>
class KeyMap {
 public:
  struct Slot {
    NgramKey key;
    uint32_t used = 0;
    V value{};
  };

  // The value of `key`, or nullptr.
  const V* find(const NgramKey& key) const {
    if (size_ == 0) return nullptr;
    for (size_t i = home(key);; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (!s.used) return nullptr;
      if (s.key == key) return &s.value;
    }
  }
  V* find(const NgramKey& key) { return const_cast<V*>(static_cast<const KeyMap*>(this)->find(key)); }

  // The value of `key`, inserted as `fresh` if absent. Valid until the next insert.
  V& find_or_insert(const NgramKey& key, const V& fresh) {
    if (2 * (size_ + 1) > slots_.size()) grow(slots_.empty() ? 16 : 2 * slots_.size());
    size_t i = home(key);
    for (; slots_[i].used; i = (i + 1) & mask_) {
      if (slots_[i].key == key) return slots_[i].value;
    }
    slots_[i].used = 1;
    slots_[i].key = key;
    slots_[i].value = fresh;
    ++size_;
    return slots_[i].value;
  }

  // Removes `key` (which must be present).
  void erase(const NgramKey& key) {
    size_t i = home(key);
    while (!(slots_[i].key == key) || !slots_[i].used) i = (i + 1) & mask_;
    for (size_t j = i;;) {  // backward shift: pull later entries of the run into the hole
      j = (j + 1) & mask_;
      if (!slots_[j].used) break;
      const size_t h = home(slots_[j].key);
      if (((j - h) & mask_) >= ((j - i) & mask_)) {
        slots_[i] = slots_[j];
        i = j;
      }
    }
    slots_[i].used = 0;
    --size_;
  }

  // Room for `n` keys without rehashing.
  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < 2 * n) cap *= 2;
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
  size_t home(const NgramKey& key) const { return static_cast<size_t>(hash_key(key)) & mask_; }

  void grow(size_t cap) {
    std::vector<Slot> old(cap);
    old.swap(slots_);
    mask_ = cap - 1;
    size_ = 0;
    for (const Slot& s : old) {
      if (s.used) find_or_insert(s.key, s.value);
    }
  }

  std::vector<Slot> slots_;
  size_t size_ = 0;
  size_t mask_ = 0;
};

}  // namespace lookahead
