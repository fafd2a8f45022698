// TokenSource: a batch's token table as sync reads it (DraftIndex::sync,
// TokenTrie::sync): rows of committed tokens, read in place.
#pragma once

#include <cstdint>
#include <vector>

namespace lookahead {

class TokenSource {
 public:
  virtual ~TokenSource() = default;
  // Row `row`'s tokens [begin, end) into `out`.
  virtual void read(int64_t row, int64_t begin, int64_t end, std::vector<int32_t>& out) const = 0;
  // Where row `row`'s token `col` lies (a prefetch hint only).
  virtual const void* address(int64_t row, int64_t col) const = 0;
};

}  // namespace lookahead
