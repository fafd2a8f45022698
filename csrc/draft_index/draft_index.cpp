// DraftIndex core (see draft_index.h and docs/how-it-works.md, "The draft index").
#include "draft_index.h"

#include <thread>

#include <algorithm>

namespace lookahead {

namespace {

constexpr int kOwn = 0;
constexpr int kCorpus = 1;
// Tokens match() compares at once.
constexpr int64_t kMatchBlock = 8;
// Continuation tokens gather_occurrences starts loading past an occurrence.
constexpr size_t kPrefetchAhead = 16;
// New tokens per row whose own-table slots sync starts loading before its appends.
constexpr int64_t kSyncAhead = 16;
// How far ahead the upkeep starts loading a push's corpus slot.
constexpr size_t kPushAhead = 16;
// Candidates of a row sorted by insertion up to this many (collect_candidates).
constexpr size_t kInsertionSortMax = 64;

std::string sid_str(int64_t sid) { return std::to_string(sid); }

int64_t output_charge(size_t tokens) { return kSequenceCharge + kTokenCharge * static_cast<int64_t>(tokens); }

// A node's confidence (W / W_root) * q(M) ** depth, q(m) = m / (m + 1), the
// power as repeated products (as the reference computes it).
double path_confidence(int64_t weight, int32_t max_m, int64_t depth, int64_t root_weight) {
  const double q = max_m / (max_m + 1.0);
  double c = static_cast<double>(weight) / static_cast<double>(root_weight);
  for (int64_t d = 0; d < depth; ++d) c *= q;
  return c;
}

}  // namespace

DraftIndex::DraftIndex(const DraftIndexConfig& config, bool upkeep_thread)
    : cfg_(config), upkeep_thread_(upkeep_thread) {
  // A finished output's fixed charge covers its record, its slot pointer,
  // its id's entry in by_sid_ (an 8-byte slot in a table at least 3/8
  // full), its place in its partition's `finished`, and the allocator's
  // headers of the record and its two arrays.
  static_assert(sizeof(Sequence) + 8 + 48 + 4 + 3 * 16 <= kSequenceCharge, "kSequenceCharge too small");
}

DraftIndex::~DraftIndex() {
  if (!worker_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(worker_mu_);
    worker_stop_ = true;
  }
  worker_cv_.notify_all();
  worker_.join();
}

// --------------------------------------------------------------------- upkeep
void DraftIndex::upkeep() {
  // Each push's corpus slot starts loading kPushAhead pushes ahead, its
  // list's newest entry half as far ahead (their misses overlap).
  const size_t n = pending_.size();
  for (size_t k = 0; k < n; ++k) {
    if (k + kPushAhead < n) corpus_.prefetch(push_tag(pending_[k + kPushAhead]));
    if (k + kPushAhead / 2 < n) {
      if (const CorpusList* list = corpus_.home(push_tag(pending_[k + kPushAhead / 2]))) {
        __builtin_prefetch(&entries_[list->tail]);
      }
    }
    push_corpus(pending_[k].first, pending_[k].second);
  }
  pending_.clear();
  while (over_cap()) {
    Partition& p = parts_[fullest_partition()];
    const uint32_t old = p.finished.front();
    p.finished.pop_front();
    const int64_t charge = output_charge(seqs_[old]->out_len());
    p.finished_charge -= charge;
    --num_finished_;
    finished_tokens_ -= static_cast<int64_t>(seqs_[old]->out_len());
    finished_charge_ -= charge;
    evict_corpus(old);
    release(old);
  }
}

int32_t DraftIndex::fullest_partition() const {
  // One pass over the partitions per eviction: a handful to a few thousand.
  int32_t best = -1;
  int64_t most = -1;
  for (size_t i = 0; i < parts_.size(); ++i) {
    if (parts_[i].finished.empty()) continue;
    const int64_t c = parts_[i].charge();
    if (c > most) {  // strictly: ties keep the lowest id
      most = c;
      best = static_cast<int32_t>(i);
    }
  }
  return best;
}

DraftIndex::Partition& DraftIndex::partition(int32_t part) {
  if (static_cast<size_t>(part) >= parts_.size()) parts_.resize(static_cast<size_t>(part) + 1);
  return parts_[part];
}

void DraftIndex::settle() {
  wait_upkeep();
  upkeep();
}

void DraftIndex::start_upkeep() {
  if (!upkeep_due()) return;
  if (!upkeep_thread_) {
    upkeep();
    return;
  }
  if (!worker_.joinable()) worker_ = std::thread(&DraftIndex::upkeep_loop, this);
  {
    std::lock_guard<std::mutex> lock(worker_mu_);
    worker_busy_ = true;
  }
  worker_cv_.notify_all();
}

void DraftIndex::wait_upkeep() {
  if (!worker_.joinable()) return;
  std::unique_lock<std::mutex> lock(worker_mu_);
  worker_cv_.wait(lock, [this] { return !worker_busy_; });
  if (worker_error_) std::rethrow_exception(std::exchange(worker_error_, nullptr));
}

void DraftIndex::upkeep_loop() {
  std::unique_lock<std::mutex> lock(worker_mu_);
  for (;;) {
    worker_cv_.wait(lock, [this] { return worker_busy_ || worker_stop_; });
    if (worker_stop_) return;
    lock.unlock();
    std::exception_ptr error;
    try {
      upkeep();
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    worker_error_ = error;
    worker_busy_ = false;
    worker_cv_.notify_all();
  }
}

// ------------------------------------------------------------------ lifecycle
uint32_t DraftIndex::slot_of(int64_t sid) const {
  const size_t i = by_sid_.find(sid_tag(sid), is_sid(sid));
  return i == by_sid_.npos ? kNone : by_sid_.value(i).slot;
}

DraftIndex::Sequence* DraftIndex::live_seq(int64_t sid) {
  const uint32_t slot = running_slot(sid);
  if (slot == kNone) throw SequenceKeyError("sequence " + sid_str(sid) + " is not running");
  return seqs_[slot].get();
}

uint32_t DraftIndex::new_slot(int64_t sid, uint32_t prompt_len, int32_t part) {
  uint32_t slot;
  if (!free_slots_.empty()) {
    slot = free_slots_.back();
    free_slots_.pop_back();
  } else {
    slot = static_cast<uint32_t>(seqs_.size());
    seqs_.emplace_back();
  }
  seqs_[slot] = std::make_unique<Sequence>();
  seqs_[slot]->sid = sid;
  seqs_[slot]->live = true;
  seqs_[slot]->prompt_len = prompt_len;
  seqs_[slot]->part = part;
  if (part != kPrivate) ++partition(part).live;
  by_sid_.value(by_sid_.find_or_insert(sid_tag(sid), is_sid(sid))).slot = slot;
  ++num_live_;
  return slot;
}

void DraftIndex::release(uint32_t slot) {
  const int64_t sid = seqs_[slot]->sid;
  by_sid_.erase(by_sid_.find(sid_tag(sid), is_sid(sid)));
  seqs_[slot].reset();
  free_slots_.push_back(slot);
}

void DraftIndex::add(int64_t sid, const int32_t* tokens, size_t n, int64_t prompt_len, int64_t part) {
  wait_upkeep();
  if (slot_of(sid) != kNone) throw SequenceKeyError("sequence " + sid_str(sid) + " is already in the index");
  if (prompt_len < 0 || static_cast<uint64_t>(prompt_len) > n) {
    throw std::invalid_argument("prompt_len=" + std::to_string(prompt_len) + ": must be in [0, " +
                                std::to_string(n) + "]");
  }
  if (part < kPrivate || part > kMaxPartition) {
    throw std::invalid_argument("partition=" + std::to_string(part) + ": must be an int in [" +
                                std::to_string(kPrivate) + ", " + std::to_string(kMaxPartition) + "]");
  }
  if (n >= kNone) throw std::length_error("a sequence must hold fewer than 2**32 - 1 tokens");
  const uint32_t slot = new_slot(sid, static_cast<uint32_t>(prompt_len), static_cast<int32_t>(part));
  Sequence& s = *seqs_[slot];
  // Room for the output too: a batch admitted together would otherwise
  // reallocate every sequence's text in the same step (the first one).
  const size_t room = n + n / 2 + 64;
  s.tokens.reserve(room);
  s.own_prev.reserve(room);
  s.own.reserve(n);
  s.out_entry.reserve(room - prompt_len);
  append(slot, tokens, n);
}

void DraftIndex::extend(int64_t sid, const int32_t* tokens, size_t n) {
  wait_upkeep();
  Sequence* s = live_seq(sid);
  if (s->tokens.size() + n >= kNone) throw std::length_error("a sequence must hold fewer than 2**32 - 1 tokens");
  append(running_slot(sid), tokens, n);
}

uint32_t DraftIndex::running_slot(int64_t sid) const {
  const uint32_t slot = slot_of(sid);
  return slot == kNone || !seqs_[slot]->live ? kNone : slot;
}

int64_t DraftIndex::sync(const int64_t* sids, const int64_t* rows, const int64_t* num, const int64_t* prompt_lens,
                         int64_t batch, const TokenSource& table, const int64_t* parts, const int64_t* sampled) {
  settle();
  // Four passes start loading what the updates touch, each from what the
  // previous one loaded: the sequences' records; the ends of their texts
  // and the table's new tokens; the own-table slots of the keys the new
  // tokens complete; the text positions those slots name.
  // The lookups of a pass do not depend on each other, so their misses
  // overlap. Then the updates, in row order (pending_ keeps that order).
  std::vector<uint32_t>& slot = sync_slots_;
  slot.resize(batch);
  // Before those, the ids' slots in by_sid_, then the slot table's entries
  // they name, then the records: each pass loads what the next one reads.
  for (int64_t i = 0; i < batch; ++i) by_sid_.prefetch(sid_tag(sids[i]));
  for (int64_t i = 0; i < batch; ++i) {
    if (const SlotRef* r = by_sid_.home(sid_tag(sids[i]))) __builtin_prefetch(&seqs_[r->slot]);
  }
  for (int64_t i = 0; i < batch; ++i) {
    if (const SlotRef* r = by_sid_.home(sid_tag(sids[i]))) __builtin_prefetch(seqs_[r->slot].get());
  }
  for (int64_t i = 0; i < batch; ++i) slot[i] = running_slot(sids[i]);
  for (int64_t i = 0; i < batch; ++i) {
    if (slot[i] == kNone) continue;
    const Sequence& s = *seqs_[slot[i]];
    const size_t n = s.tokens.size();
    if (n > 0) __builtin_prefetch(s.tokens.data() + n - 1);
    __builtin_prefetch(s.own_prev.data() + n);
    __builtin_prefetch(s.out_entry.data() + (n - s.prompt_len));
    if (num[i] > static_cast<int64_t>(n)) __builtin_prefetch(table.address(rows[i], static_cast<int64_t>(n)));
  }
  // The third reads each row's new tokens (up to kSyncAhead of them) and
  // starts loading the own-table slot of every key the appends will insert;
  // the fourth, from those slots, the text each names (an append confirms a
  // key against the text at its last position: a random place in the text).
  const int ng = cfg_.ngram;
  std::vector<int32_t> buf;
  int32_t window[kSyncAhead + 4];
  std::vector<std::pair<uint32_t, uint32_t>>& keys = sync_keys_;  // (slot, tag) of each key pass 3 loads
  keys.clear();
  for (int64_t i = 0; i < batch; ++i) {
    if (slot[i] == kNone) continue;
    const Sequence& s = *seqs_[slot[i]];
    const int64_t n = static_cast<int64_t>(s.tokens.size());
    if (n < ng || num[i] <= n) continue;
    const int64_t count = std::min<int64_t>(num[i] - n, kSyncAhead);
    table.read(rows[i], n, n + count, buf);
    std::copy(s.tokens.end() - ng, s.tokens.end(), window);
    std::copy(buf.begin(), buf.begin() + (count - 1), window + ng);
    for (int64_t j = 0; j < count; ++j) {
      const uint32_t tag = ngram_tag(window + j, ng);
      s.own.prefetch(tag);
      keys.emplace_back(slot[i], tag);
    }
  }
  for (const auto& [at, tag] : keys) {
    const Sequence& s = *seqs_[at];
    if (const OwnLast* last = s.own.home(tag)) __builtin_prefetch(s.tokens.data() + last->pos - ng);
  }
  int64_t rewound = 0;
  for (int64_t i = 0; i < batch; ++i) {
    // A sequence added by an earlier row of this batch (its id repeated) is found anew.
    const uint32_t at = slot[i] != kNone ? slot[i] : running_slot(sids[i]);
    if (at == kNone) {
      table.read(rows[i], 0, num[i], buf);
      add(sids[i], buf.data(), buf.size(), std::min(prompt_lens[i], num[i]),
          parts != nullptr ? parts[i] : kDefaultPartition);
      continue;
    }
    int64_t have = static_cast<int64_t>(seqs_[at]->tokens.size());
    const int64_t kept = sampled != nullptr ? num[i] - sampled[i] : num[i];  // tokens from before this step
    if (kept < have) {  // rewind keeps the sequence's slot
      rewind(sids[i], kept);
      have = kept;
      ++rewound;
    }
    if (num[i] > have) {
      table.read(rows[i], have, num[i], buf);
      if (static_cast<size_t>(have) + buf.size() >= kNone) {
        throw std::length_error("a sequence must hold fewer than 2**32 - 1 tokens");
      }
      append(at, buf.data(), buf.size());
    }
  }
  return rewound;
}

void DraftIndex::append(uint32_t slot, const int32_t* tokens, size_t n) {
  Sequence& s = *seqs_[slot];
  const int ng = cfg_.ngram;
  if (n > 1 && n <= 64 && s.tokens.size() >= static_cast<size_t>(ng)) {
    // Start loading the own-table slots of a few tokens' keys together (their misses overlap).
    int32_t window[4 + 64];
    std::copy(s.tokens.end() - ng, s.tokens.end(), window);
    std::copy(tokens, tokens + n - 1, window + ng);
    for (size_t i = 0; i < n; ++i) s.own.prefetch(ngram_tag(window + i, ng));
  }
  for (size_t i = 0; i < n; ++i) {
    const uint32_t p = static_cast<uint32_t>(s.tokens.size());  // follows tokens[p-ng:p]
    s.tokens.push_back(tokens[i]);
    s.own_prev.push_back(kNone);
    if (p >= static_cast<uint32_t>(ng)) {
      const int32_t* text = s.tokens.data();
      const int32_t* key = text + p - ng;
      const size_t i = s.own.find_or_insert(ngram_tag(key, ng), [&](const OwnLast& v) {
        return same_tokens(key, text + v.pos - ng, ng);
      });
      OwnLast& last = s.own.value(i);
      s.own_prev[p] = last.pos;
      last.pos = p;
    }
    if (p >= s.prompt_len) {
      const uint32_t q = p - s.prompt_len;
      s.out_entry.push_back(kNone);
      if (q >= static_cast<uint32_t>(ng) && s.part != kPrivate) pending_.emplace_back(slot, q);
    }
  }
}

uint32_t DraftIndex::push_tag(const std::pair<uint32_t, uint32_t>& push) const {
  const Sequence& s = *seqs_[push.first];
  return partition_tag(ngram_tag(s.out() + push.second - cfg_.ngram, cfg_.ngram), s.part);
}

void DraftIndex::push_corpus(uint32_t slot, uint32_t q) {
  uint32_t e;
  if (!free_entries_.empty()) {
    e = free_entries_.back();
    free_entries_.pop_back();
  } else {
    if (entries_.size() >= kNone) throw std::length_error("corpus holds 2**32 - 1 entries");
    e = static_cast<uint32_t>(entries_.size());
    entries_.emplace_back();
  }
  Sequence& s = *seqs_[slot];
  const int ng = cfg_.ngram;
  const int32_t* key = s.out() + q - ng;
  const int32_t part = s.part;
  const size_t i = corpus_.find_or_insert(partition_tag(ngram_tag(key, ng), part), [&](const CorpusList& l) {
    const Entry& newest = entries_[l.tail];
    const Sequence& other = *seqs_[newest.seq];
    return other.part == part && same_tokens(key, other.out() + newest.pos - ng, ng);
  });
  CorpusList& list = corpus_.value(i);
  Partition& p = parts_[part];
  if (list.empty()) ++p.keys;
  ++p.entries;
  entries_[e] = Entry{slot, q, list.tail, kNone};
  if (list.tail != kNone) {
    entries_[list.tail].next = e;
  } else {
    list.head = e;
  }
  list.tail = e;
  ++list.size;
  s.out_entry[q] = e;
  if (list.size > static_cast<uint32_t>(cfg_.max_occurrences)) {  // drop the oldest
    const uint32_t h = list.head;
    const Entry old = entries_[h];
    list.head = old.next;
    entries_[old.next].prev = kNone;
    seqs_[old.seq]->out_entry[old.pos] = kNone;
    free_entries_.push_back(h);
    --list.size;
    --p.entries;
  }
}

void DraftIndex::evict_corpus(uint32_t slot) {
  Sequence& s = *seqs_[slot];
  const int ng = cfg_.ngram;
  const int32_t* out = s.out();
  for (size_t q = ng; q < s.out_len(); ++q) {
    const uint32_t e = s.out_entry[q];
    if (e == kNone) continue;
    Partition& p = parts_[s.part];  // entries exist only for partitioned sequences
    const size_t i = find_corpus(out + q - ng, partition_tag(ngram_tag(out + q - ng, ng), s.part), s.part);
    CorpusList* list = &corpus_.value(i);
    const Entry en = entries_[e];
    if (en.prev != kNone) {
      entries_[en.prev].next = en.next;
    } else {
      list->head = en.next;
    }
    if (en.next != kNone) {
      entries_[en.next].prev = en.prev;
    } else {
      list->tail = en.prev;
    }
    --p.entries;
    if (--list->size == 0) {
      corpus_.erase(i);
      --p.keys;
    }
    free_entries_.push_back(e);
  }
  std::vector<uint32_t>().swap(s.out_entry);
}

size_t DraftIndex::find_corpus(const int32_t* key, uint32_t tag, int32_t part) const {
  const int ng = cfg_.ngram;
  return corpus_.find(tag, [&](const CorpusList& l) {
    const Entry& newest = entries_[l.tail];
    const Sequence& other = *seqs_[newest.seq];
    return other.part == part && same_tokens(key, other.out() + newest.pos - ng, ng);
  });
}

void DraftIndex::finish(int64_t sid) {
  wait_upkeep();
  const uint32_t slot = running_slot(sid);
  if (slot == kNone) return;
  Sequence& s = *seqs_[slot];
  s.live = false;
  --num_live_;
  if (s.part == kPrivate) {  // nothing of it joined the corpus
    release(slot);
    return;
  }
  Partition& p = parts_[s.part];
  --p.live;
  s.own.clear();
  std::vector<uint32_t>().swap(s.own_prev);
  s.tokens.erase(s.tokens.begin(), s.tokens.begin() + s.prompt_len);  // keep the output only
  s.prompt_len = 0;
  s.tokens.shrink_to_fit();
  s.out_entry.shrink_to_fit();
  p.finished.push_back(slot);
  p.finished_charge += output_charge(s.out_len());
  ++num_finished_;
  finished_tokens_ += static_cast<int64_t>(s.out_len());
  finished_charge_ += output_charge(s.out_len());  // evictions over the cap: upkeep
}

void DraftIndex::rewind(int64_t sid, int64_t length) {
  settle();
  Sequence* s = live_seq(sid);
  if (length < 0) throw std::invalid_argument("length=" + std::to_string(length) + ": must be >= 0");
  const size_t keep = std::min(static_cast<size_t>(length), s->tokens.size());
  std::vector<int32_t> kept(s->tokens.begin(), s->tokens.begin() + keep);
  const uint32_t slot = running_slot(sid);
  evict_corpus(slot);
  s->prompt_len = static_cast<uint32_t>(std::min<int64_t>(s->prompt_len, length));
  s->tokens.clear();
  s->own_prev.clear();
  s->own.clear();
  s->own.reserve(keep);
  s->out_entry.reserve(keep - s->prompt_len);
  append(slot, kept.data(), keep);
}

// ---------------------------------------------------------------------- stats
size_t DraftIndex::num_live() {
  wait_upkeep();
  return num_live_;
}

size_t DraftIndex::num_sequences() {
  wait_upkeep();
  return by_sid_.size();
}

int64_t DraftIndex::corpus_tokens() {
  wait_upkeep();
  return finished_tokens_;
}

int64_t DraftIndex::corpus_bytes() {
  wait_upkeep();
  return charge();
}

int64_t DraftIndex::length(int64_t sid) {
  wait_upkeep();
  const uint32_t slot = running_slot(sid);
  return slot == kNone ? -1 : static_cast<int64_t>(seqs_[slot]->tokens.size());
}

size_t DraftIndex::memory_bytes() {
  wait_upkeep();
  size_t bytes = sizeof(*this) + seqs_.capacity() * sizeof(seqs_[0]) + free_slots_.capacity() * 4;
  bytes += by_sid_.memory_bytes();
  for (const auto& s : seqs_) {
    if (!s) continue;
    bytes += sizeof(Sequence) + s->tokens.capacity() * 4 + s->own_prev.capacity() * 4 + s->own.memory_bytes() +
             s->out_entry.capacity() * 4;
  }
  bytes += parts_.capacity() * sizeof(Partition) + num_finished_ * sizeof(uint32_t) + corpus_.memory_bytes() +
           entries_.capacity() * sizeof(Entry) +
           free_entries_.capacity() * 4 + pending_.capacity() * 8 + sync_slots_.capacity() * 4 +
           sync_keys_.capacity() * sizeof(sync_keys_[0]);
  bytes += scratch_.memory_bytes();
  for (const Scratch& s : pool_scratch_) bytes += s.memory_bytes();
  return bytes;
}

std::vector<std::vector<int32_t>> DraftIndex::corpus_sequences(int64_t part, bool all) {
  wait_upkeep();
  std::vector<std::vector<int32_t>> out;
  for (size_t p = 0; p < parts_.size(); ++p) {
    if (!all && static_cast<int64_t>(p) != part) continue;
    for (const uint32_t slot : parts_[p].finished) {
      out.emplace_back(seqs_[slot]->out(), seqs_[slot]->out() + seqs_[slot]->out_len());
    }
  }
  return out;
}

std::vector<std::pair<int64_t, int64_t>> DraftIndex::partition_bytes() {
  wait_upkeep();
  std::vector<std::pair<int64_t, int64_t>> out;
  for (size_t p = 0; p < parts_.size(); ++p) {
    if (parts_[p].live > 0 || !parts_[p].finished.empty()) out.emplace_back(p, parts_[p].charge());
  }
  return out;
}

// ------------------------------------------------------------------- drafting
int DraftIndex::match(const int32_t* src, int64_t pos, const int32_t* text, int64_t end) const {
  // How many tokens before src[pos] agree with those before text[end]; the
  // first ngram do (the key matched). Stops at either text's start.
  // Compared backwards, a block of kMatchBlock tokens at a time (one vector
  // compare) while whole blocks fit, then token by token.
  const int64_t limit = std::min<int64_t>({cfg_.max_match, pos, end});
  int64_t m = cfg_.ngram;
  for (; m + kMatchBlock <= limit; m += kMatchBlock) {
    const int32_t* a = src + pos - m - kMatchBlock;
    const int32_t* b = text + end - m - kMatchBlock;
    int32_t differ = 0;
    for (int64_t k = 0; k < kMatchBlock; ++k) differ |= a[k] ^ b[k];
    if (differ != 0) break;
  }
  while (m < limit && src[pos - m - 1] == text[end - m - 1]) ++m;
  return static_cast<int>(m);
}

void DraftIndex::prefetch_around(const int32_t* text, uint32_t pos, size_t len) const {
  // What matching and continuing an occurrence at `pos` read first: match's
  // first block before it, the tokens on either side, and its continuation
  // (as far as a draft of kPrefetchAhead tokens goes).
  __builtin_prefetch(text + pos - std::min<int64_t>(pos, cfg_.ngram + kMatchBlock));
  __builtin_prefetch(text + pos - 1);
  if (pos < len) __builtin_prefetch(text + std::min<size_t>(pos + kPrefetchAhead, len) - 1);
}

void DraftIndex::gather_occurrences(Scratch& s, const uint32_t* slots, int64_t n) const {
  // Each row's occurrences are two linked lists (own text: own_prev; corpus:
  // entries_' prev links), so walking one row's is a chain of dependent
  // misses. The rows' walks advance together, one link per row per round,
  // each link's next load started a round ahead: the rows' misses overlap.
  // Then the text around every occurrence (its match and continuation) and
  // each corpus source's record start loading, before any row matches.
  const int ng = cfg_.ngram;
  const int occ = cfg_.max_occurrences;
  s.occ.clear();
  s.rows.assign(static_cast<size_t>(n), Scratch::RowOccurrences{});
  s.own_cursor.assign(static_cast<size_t>(n), kNone);
  s.corpus_cursor.assign(static_cast<size_t>(n), kNone);
  for (int64_t i = 0; i < n; ++i) {
    if (slots[i] == kNone) continue;
    const Sequence& seq = *seqs_[slots[i]];
    const int64_t end = static_cast<int64_t>(seq.tokens.size());
    if (end < ng) continue;
    const int32_t* text = seq.tokens.data();
    const int32_t* key = text + end - ng;
    const uint32_t tag = ngram_tag(key, ng);
    const size_t own = seq.own.find(tag, [&](const OwnLast& v) { return same_tokens(key, text + v.pos - ng, ng); });
    if (own != seq.own.npos) {
      s.own_cursor[i] = seq.own.value(own).pos;
      __builtin_prefetch(seq.own_prev.data() + s.own_cursor[i]);
    }
    if (seq.part != kPrivate) {
      const size_t list = find_corpus(key, partition_tag(tag, seq.part), seq.part);
      if (list != corpus_.npos) {
        s.corpus_cursor[i] = corpus_.value(list).tail;
        __builtin_prefetch(&entries_[s.corpus_cursor[i]]);
      }
    }
  }
  // Round r: every row's r-th own occurrence (most recent first); its text
  // and its next link start loading.
  for (int r = 0; r < occ; ++r) {
    bool any = false;
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t p = s.own_cursor[i];
      if (p == kNone) continue;
      const Sequence& seq = *seqs_[slots[i]];
      s.occ.push_back(Scratch::Occurrence{slots[i], p, static_cast<uint32_t>(i)});
      prefetch_around(seq.tokens.data(), p, seq.tokens.size());
      const uint32_t next = r + 1 < occ ? seq.own_prev[p] : kNone;
      s.own_cursor[i] = next;
      if (next != kNone) {
        __builtin_prefetch(seq.own_prev.data() + next);
        any = true;
      }
    }
    if (!any) break;
  }
  const size_t own_count = s.occ.size();
  // The corpus lists hold at most max_occurrences entries (push_corpus), newest first.
  for (;;) {
    bool any = false;
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t e = s.corpus_cursor[i];
      if (e == kNone) continue;
      const Entry& en = entries_[e];
      if (en.seq != slots[i]) {
        s.occ.push_back(Scratch::Occurrence{en.seq, en.pos, static_cast<uint32_t>(i)});
        __builtin_prefetch(seqs_[en.seq].get());
      }
      s.corpus_cursor[i] = en.prev;
      if (en.prev != kNone) {
        __builtin_prefetch(&entries_[en.prev]);
        any = true;
      }
    }
    if (!any) break;
  }
  for (size_t k = own_count; k < s.occ.size(); ++k) {
    const Sequence& src = *seqs_[s.occ[k].seq];
    prefetch_around(src.out(), s.occ[k].pos, src.out_len());
  }
  // Each row's occurrences in visiting order: own (most recent first), then corpus (newest first).
  for (const Scratch::Occurrence& o : s.occ) ++s.rows[o.row].count;
  uint32_t at = 0;
  for (Scratch::RowOccurrences& r : s.rows) {
    r.begin = at;
    at += r.count;
    r.count = 0;
  }
  s.ordered.resize(s.occ.size());
  for (size_t k = 0; k < s.occ.size(); ++k) {
    Scratch::RowOccurrences& r = s.rows[s.occ[k].row];
    s.ordered[r.begin + r.count++] = s.occ[k];
    if (k < own_count) ++r.own;
  }
}

void DraftIndex::collect_candidates(Scratch& s, uint32_t slot, int64_t row) const {
  // Occurrences are visited in the ranking's tie order (own before corpus,
  // most recent first), so once max_candidates of them match the most a
  // match can (max_match), no later one can rank above them: stop there.
  s.cands.clear();
  const Sequence& seq = *seqs_[slot];
  const int64_t end = static_cast<int64_t>(seq.tokens.size());
  const int32_t* text = seq.tokens.data();
  const Scratch::RowOccurrences& r = s.rows[static_cast<size_t>(row)];
  int full = 0;
  for (uint32_t k = 0; k < r.count; ++k) {
    const Scratch::Occurrence& o = s.ordered[r.begin + k];
    const bool own = k < r.own;
    const int m = own ? match(text, o.pos, text, end) : match(seqs_[o.seq]->out(), o.pos, text, end);
    s.cands.push_back(Candidate{m, own ? kOwn : kCorpus, o.seq, o.pos});
    if ((full += m == cfg_.max_match) >= cfg_.max_candidates) break;  // the rest (and the corpus) skipped
  }
  // Stable, by match length (longest first), own before corpus: an insertion
  // sort for the usual few dozen (std::stable_sort allocates a buffer per call),
  // std::stable_sort past kInsertionSortMax (max_occurrences may be up to 1024).
  auto before = [](const Candidate& a, const Candidate& b) { return a.m != b.m ? a.m > b.m : a.scope < b.scope; };
  if (s.cands.size() > kInsertionSortMax) {
    std::stable_sort(s.cands.begin(), s.cands.end(), before);
  } else {
    for (size_t i = 1; i < s.cands.size(); ++i) {
      const Candidate c = s.cands[i];
      size_t j = i;
      for (; j > 0 && before(c, s.cands[j - 1]); --j) s.cands[j] = s.cands[j - 1];
      s.cands[j] = c;
    }
  }
  if (s.cands.size() > static_cast<size_t>(cfg_.max_candidates)) s.cands.resize(cfg_.max_candidates);
}

void DraftIndex::prefetch_drafts(const int64_t* sids, const int64_t* which, int64_t rows) const {
  const int ng = cfg_.ngram;
  auto key_of = [&](int64_t i, const Sequence*& seq) -> const int32_t* {
    const uint32_t slot = running_slot(sids[which != nullptr ? which[i] : i]);
    if (slot == kNone) return nullptr;
    seq = seqs_[slot].get();
    return seq->tokens.size() < static_cast<size_t>(ng) ? nullptr : seq->tokens.data() + seq->tokens.size() - ng;
  };
  const Sequence* seq = nullptr;
  for (int64_t i = 0; i < rows; ++i) {
    if (const int32_t* key = key_of(i, seq)) {
      const uint32_t tag = ngram_tag(key, ng);
      seq->own.prefetch(tag);
      if (seq->part != kPrivate) corpus_.prefetch(partition_tag(tag, seq->part));
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    const int32_t* key = key_of(i, seq);
    if (key == nullptr) continue;
    const uint32_t tag = ngram_tag(key, ng);
    if (const OwnLast* last = seq->own.home(tag)) {
      __builtin_prefetch(seq->tokens.data() + last->pos - ng);
      __builtin_prefetch(seq->own_prev.data() + last->pos);
    }
    if (seq->part == kPrivate) continue;
    if (const CorpusList* list = corpus_.home(partition_tag(tag, seq->part))) __builtin_prefetch(&entries_[list->tail]);
  }
}

void DraftIndex::merge(Scratch& s, uint32_t slot, int budget) const {
  s.nodes.clear();
  s.nodes.push_back(Node{-1, -1, 0, 0, 0});
  const Sequence& seq = *seqs_[slot];
  s.continuation.resize(static_cast<size_t>(std::max(budget, 0)));
  for (const Candidate& c : s.cands) {
    s.nodes[0].weight += c.m;
    int32_t at = 0;
    const int64_t n = continuation(seq, c, budget, s.continuation.data());
    for (int64_t j = 0; j < n; ++j) {
      const int32_t t = s.continuation[j];
      int32_t child = s.nodes[at].first_child;
      while (child >= 0 && s.nodes[child].token != t) child = s.nodes[child].next_sibling;
      if (child < 0) {
        child = static_cast<int32_t>(s.nodes.size());
        const int32_t depth = s.nodes[at].depth + 1;
        Node& node = s.nodes.emplace_back();  // built in place (a copied temporary stalls the copy's loads)
        node.token = t;
        node.parent = at;
        node.depth = depth;
        if (s.nodes[at].last_child >= 0) {
          s.nodes[s.nodes[at].last_child].next_sibling = child;
        } else {
          s.nodes[at].first_child = child;
        }
        s.nodes[at].last_child = child;
      }
      s.nodes[child].weight += c.m;
      s.nodes[child].max_m = std::max(s.nodes[child].max_m, c.m);
      at = child;
    }
  }
}

double DraftIndex::confidence(const Scratch& s, int32_t i) const {
  const Node& n = s.nodes[i];
  return path_confidence(n.weight, n.max_m, n.depth, s.nodes[0].weight);
}

int64_t DraftIndex::continuation(const Sequence& seq, const Candidate& c, int64_t n, int32_t* out) const {
  if (c.scope == kOwn) {  // the text from pos to its end, repeated
    const int32_t* from = seq.tokens.data() + c.pos;
    const int64_t period = static_cast<int64_t>(seq.tokens.size()) - c.pos;
    for (int64_t d = 0; d < n; d += period) std::copy_n(from, std::min(period, n - d), out + d);
    return std::max<int64_t>(n, 0);
  }
  const Sequence& src = *seqs_[c.seq];
  const int64_t len = std::clamp<int64_t>(static_cast<int64_t>(src.out_len()) - c.pos, 0, std::max<int64_t>(n, 0));
  std::copy_n(src.out() + c.pos, len, out);
  return len;
}

int DraftIndex::draft_chain(Scratch& s, uint32_t slot, int budget, double floor, DraftRow out) const {
  // At depth d the chain's node is shared by the `alive` candidates (those
  // whose continuations spelled the chain so far); its children group them
  // by their next token, in rank order of first appearance, which is the
  // merged tree's creation order. The heaviest child continues the chain
  // (ties: the earliest), as the reference's _select_chain walks the merged tree.
  // Every candidate's continuation is copied out first (candidate c's in
  // row c of `continuation`, `ends[c]` tokens long): the walk below reads
  // each token twice.
  const Sequence& seq = *seqs_[slot];
  const size_t width = static_cast<size_t>(budget);
  s.continuation.resize(s.cands.size() * width);
  s.ends.resize(s.cands.size());
  int64_t root_weight = 0;
  s.alive.clear();
  for (size_t c = 0; c < s.cands.size(); ++c) {
    root_weight += s.cands[c].m;
    s.alive.push_back(static_cast<int32_t>(c));
    s.ends[c] = continuation(seq, s.cands[c], budget, s.continuation.data() + c * width);
  }
  auto token_at = [&](int32_t c, int64_t d) -> int64_t {
    return d < s.ends[c] ? s.continuation[c * width + d] : -1;
  };
  int count = 0;
  auto emit = [&](int32_t token, double conf) {
    out.tokens[count] = token;
    out.parents[count] = count - 1;
    out.confidence[count] = conf;
    ++count;
  };
  for (int64_t d = 0; d < budget && !s.alive.empty(); ++d) {
    if (s.alive.size() == 1) {  // one candidate left: the rest of the chain is its continuation
      const int32_t c = s.alive[0];
      double conf = path_confidence(s.cands[c].m, s.cands[c].m, d + 1, root_weight);
      for (; d < s.ends[c] && d < budget && conf >= floor; ++d) {
        emit(s.continuation[c * width + d], conf);
        conf *= s.cands[c].m / (s.cands[c].m + 1.0);  // path_confidence's next factor
      }
      break;
    }
    s.children.clear();
    for (const int32_t c : s.alive) {
      const int64_t token = token_at(c, d);
      if (token < 0) continue;
      auto child = std::find_if(s.children.begin(), s.children.end(),
                                [token](const Scratch::Child& k) { return k.token == token; });
      if (child == s.children.end()) {
        s.children.push_back(Scratch::Child{static_cast<int32_t>(token), 0, 0});
        child = s.children.end() - 1;
      }
      child->weight += s.cands[c].m;
      child->max_m = std::max(child->max_m, s.cands[c].m);
    }
    if (s.children.empty()) break;
    const Scratch::Child* best = &s.children[0];
    for (const Scratch::Child& k : s.children) {
      if (k.weight > best->weight) best = &k;
    }
    const double conf = path_confidence(best->weight, best->max_m, d + 1, root_weight);
    if (conf < floor) break;
    emit(best->token, conf);
    s.next_alive.clear();  // the candidates through the chosen child
    for (const int32_t c : s.alive) {
      if (token_at(c, d) == best->token) s.next_alive.push_back(c);
    }
    s.alive.swap(s.next_alive);
  }
  return count;
}

void DraftIndex::sorted_picked_children(Scratch& s, int32_t node) const {
  // Picked children of `node`, least confident first (ties: later created first).
  s.kids.clear();
  for (int32_t c = s.nodes[node].first_child; c >= 0; c = s.nodes[c].next_sibling) {
    if (s.picked[c]) s.kids.push_back(c);
  }
  std::sort(s.kids.begin(), s.kids.end(),
            [&s](int32_t a, int32_t b) { return s.conf[a] != s.conf[b] ? s.conf[a] < s.conf[b] : a > b; });
}

int DraftIndex::select_tree(Scratch& s, int budget, double floor, DraftRow out) const {
  s.conf.assign(s.nodes.size(), 0.0);
  s.picked.assign(s.nodes.size(), 0);
  // Max-heap on (confidence, -index): the most confident frontier node, ties the earliest created.
  auto less = [&s](int32_t a, int32_t b) { return s.conf[a] != s.conf[b] ? s.conf[a] < s.conf[b] : a > b; };
  s.heap.clear();
  auto push_children = [&](int32_t node) {
    for (int32_t c = s.nodes[node].first_child; c >= 0; c = s.nodes[c].next_sibling) {
      s.conf[c] = confidence(s, c);
      s.heap.push_back(c);
      std::push_heap(s.heap.begin(), s.heap.end(), less);
    }
  };
  push_children(0);
  int num_picked = 0;
  while (!s.heap.empty() && num_picked < budget) {
    const int32_t best = s.heap.front();
    if (s.conf[best] < floor) break;
    std::pop_heap(s.heap.begin(), s.heap.end(), less);
    s.heap.pop_back();
    s.picked[best] = 1;
    ++num_picked;
    push_children(best);
  }
  // Depth-first, most confident child first: every parent precedes its children.
  s.stack.clear();
  sorted_picked_children(s, 0);
  for (int32_t c : s.kids) s.stack.emplace_back(c, -1);
  int count = 0;
  while (!s.stack.empty()) {
    const auto [node, parent] = s.stack.back();
    s.stack.pop_back();
    out.tokens[count] = s.nodes[node].token;
    out.parents[count] = parent;
    out.confidence[count] = s.conf[node];
    sorted_picked_children(s, node);
    for (int32_t c : s.kids) s.stack.emplace_back(c, count);
    ++count;
  }
  return count;
}

int DraftIndex::draft(int64_t sid, int budget, double floor, bool tree, DraftRow out) {
  wait_upkeep();
  bool found;
  return draft(scratch_, sid, budget, floor, tree, out, found);
}

int DraftIndex::draft(Scratch& s, int64_t sid, int budget, double floor, bool tree, DraftRow out,
                      bool& found) const {
  found = false;
  if (budget <= 0) return 0;
  const uint32_t slot = running_slot(sid);
  if (slot == kNone) return 0;
  gather_occurrences(s, &slot, 1);
  return draft_gathered(s, slot, 0, budget, floor, tree, out, found);
}

int DraftIndex::draft_gathered(Scratch& s, uint32_t slot, int64_t row, int budget, double floor, bool tree,
                               DraftRow out, bool& found) const {
  found = false;
  collect_candidates(s, slot, row);
  if (s.cands.empty()) return 0;
  found = true;
  if (!tree) return draft_chain(s, slot, budget, floor, out);
  merge(s, slot, budget);
  return select_tree(s, budget, floor, out);
}

void DraftIndex::draft_rows(const int64_t* sids, const int64_t* budgets, int64_t rows, int64_t width, double floor,
                            bool tree, DraftRow base, int32_t* lengths, int threads, DraftIndex* backoff) {
  wait_upkeep();
  if (backoff != nullptr) backoff->wait_upkeep();
  // Rows are independent and drafting only reads the indexes: `threads`
  // workers (each with its own scratch, used by both) take contiguous row ranges.
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(threads, rows / kRowsPerThread));
  if (static_cast<int64_t>(pool_scratch_.size()) < workers) pool_scratch_.resize(workers);
  prefetch_drafts(sids, nullptr, rows);
  auto run = [&](int64_t w) {
    const int64_t lo = rows * w / workers, hi = rows * (w + 1) / workers;
    Scratch& scratch = pool_scratch_[w];
    // Groups of rows gather their occurrences together (gather_occurrences), then draft one by one.
    // The back-off index then drafts, the same way, the rows the main one found no candidate for,
    // in full groups (`missed`: their misses overlap as the main pass's do).
    uint32_t group[kGatherRows];
    int64_t at[kGatherRows];  // the group's rows
    bool found[kGatherRows];
    std::vector<int64_t>& missed = scratch.missed;
    missed.clear();
    auto draft_group = [&](const DraftIndex& index, int64_t n) {
      index.gather_occurrences(scratch, group, n);
      for (int64_t i = 0; i < n; ++i) {
        if (group[i] == kNone) continue;
        const int64_t row = at[i];
        const DraftRow out{base.tokens + row * width, base.parents + row * width, base.confidence + row * width};
        lengths[row] = index.draft_gathered(scratch, group[i], i, static_cast<int>(budgets[row]), floor, tree, out,
                                            found[i]);
      }
    };
    for (int64_t g = lo; g < hi; g += kGatherRows) {
      const int64_t n = std::min<int64_t>(kGatherRows, hi - g);
      for (int64_t i = 0; i < n; ++i) {
        group[i] = budgets[g + i] > 0 ? running_slot(sids[g + i]) : kNone;
        at[i] = g + i;
        lengths[g + i] = 0;
      }
      draft_group(*this, n);
      for (int64_t i = 0; i < n && backoff != nullptr; ++i) {  // the rows with a budget and no candidate
        if (budgets[g + i] > 0 && (group[i] == kNone || !found[i])) missed.push_back(g + i);
      }
    }
    if (missed.empty()) return;
    backoff->prefetch_drafts(sids, missed.data(), static_cast<int64_t>(missed.size()));
    for (size_t g = 0; g < missed.size(); g += kGatherRows) {
      const int64_t n = std::min<int64_t>(kGatherRows, static_cast<int64_t>(missed.size() - g));
      for (int64_t i = 0; i < n; ++i) {
        at[i] = missed[g + i];
        group[i] = backoff->running_slot(sids[at[i]]);
      }
      draft_group(*backoff, n);
    }
  };
  std::vector<std::thread> pool;
  for (int64_t w = 1; w < workers; ++w) pool.emplace_back(run, w);
  run(0);
  for (auto& t : pool) t.join();
  start_upkeep();
  if (backoff != nullptr) backoff->start_upkeep();
}

}  // namespace lookahead
