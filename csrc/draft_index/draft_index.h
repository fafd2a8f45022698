// DraftIndex: the drafting core, natively. No Python here (bindings.cpp).
//
// Semantics are those of the pure-Python reference
// lab/lookahead_lab/reference/draft_index.py (docs/how-it-works.md, "The draft
// index", defines sequence, key, candidate, continuation, draft and
// confidence); tests hold the two to identical drafts. Layout:
//
//   Sequence  one per sequence id, in `seqs_` (slots reused). `tokens` is the
//             whole text while it runs and only its output once finished
//             (`prompt_len` is then 0); the output is always
//             tokens[prompt_len:].
//   own       per running sequence: an NgramMap key -> latest position that
//             followed the key, and `own_prev[p]`, the previous position with
//             the same key. The occurrence list of a key is that chain, cut
//             after max_occurrences links (the most recent ones).
//   corpus    one NgramMap key -> doubly linked list (oldest .. newest) of
//             entries in `entries_`, an entry being (sequence slot, output
//             position); `out_entry[q]` finds a sequence's entry again on
//             eviction. A list never holds more than max_occurrences entries:
//             a push past that drops the oldest.
//   partition every sequence has one (`part`, the caller's int; kPrivate =
//             none): a corpus key is (partition, n-gram), its hash tag the
//             n-gram's mixed with the partition's (partition 0's is the
//             n-gram's own), and a lookup confirms the partition too. A
//             private sequence's outputs never join the corpus. `parts_[p]`
//             holds partition p's finished outputs (oldest first) and its
//             charge; eviction takes the oldest output of the partition
//             charged the most (ties: the lowest id), as the reference does.
//   upkeep    the corpus work a step can do after its drafts: the pushes of
//             the output n-grams appended since (`pending_`, in order), then
//             the eviction of the oldest finished outputs while the corpus's
//             charge (corpus_bytes(), priced as below) is over the cap.
//             draft_rows drafts first and then runs it, on the upkeep thread
//             when there is one (while the forward runs); settle() runs what
//             is pending at once. Where it runs never changes a result:
//             every public method first waits for the thread.
//
// Not thread-safe: callers serialize (the bindings hold a mutex). Drafting
// only reads the index, so draft_rows spreads one call's rows over threads,
// each with its own scratch; the drafts do not depend on the thread count.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ngram_map.h"
#include "token_source.h"

namespace lookahead {

constexpr uint32_t kNone = 0xFFFFFFFFu;
// Partitions (the reference's DEFAULT, PRIVATE and MAX_PARTITION).
constexpr int32_t kDefaultPartition = 0;
constexpr int32_t kPrivate = -1;
constexpr int32_t kMaxPartition = (1 << 24) - 1;

// The corpus tag of an n-gram with tag `tag` in partition `part`.
inline uint32_t partition_tag(uint32_t tag, int32_t part) {
  return part == kDefaultPartition ? tag
                                   : tag ^ static_cast<uint32_t>(mix64(static_cast<uint64_t>(part) * 0x9e3779b97f4a7c15ULL));
}

// Own index value: the latest position that followed the n-gram.
struct OwnLast {
  uint32_t pos = kNone;
  bool empty() const { return pos == kNone; }
};

// Corpus index value: the n-gram's entries, oldest to newest.
struct CorpusList {
  uint32_t head = kNone;  // oldest entry
  uint32_t tail = kNone;  // newest entry
  uint32_t size = 0;
  bool empty() const { return head == kNone; }
};

// A duplicate or unknown sequence id (KeyError in Python).
class SequenceKeyError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct DraftIndexConfig {
  int ngram = 3;
  int max_match = 64;
  int max_occurrences = 16;
  int max_candidates = 8;
  int64_t corpus_bytes = int64_t{32} << 20;
};

// The corpus's charge, what its cap bounds (the reference prices the same):
// a finished output held, kSequenceCharge plus kTokenCharge per token (its
// text and entry links, exactly, once finish() shrinks them); a corpus entry
// (any output's n-gram occurrence, running or finished) kEntryCharge: 16
// bytes and a 4-byte free-list slot, the arrays at most twice their live
// count; a corpus key kKeyCharge: a 16-byte slot in a table at least 3/8
// full. So the corpus's memory stays within its charge, short of the tables'
// high-water capacity (they never shrink).
constexpr int64_t kSequenceCharge = 256;
constexpr int64_t kTokenCharge = 8;
constexpr int64_t kEntryCharge = 40;
constexpr int64_t kKeyCharge = 48;

// One draft written into caller-owned rows of at least `budget` elements.
struct DraftRow {
  int32_t* tokens;
  int32_t* parents;
  double* confidence;
};

class DraftIndex {
 public:
  // `upkeep_thread`: run draft_rows' upkeep on a thread of its own (the
  // results are the same either way).
  explicit DraftIndex(const DraftIndexConfig& config, bool upkeep_thread = false);
  ~DraftIndex();
  DraftIndex(const DraftIndex&) = delete;
  DraftIndex& operator=(const DraftIndex&) = delete;

  // add, extend and finish leave the upkeep they cause pending; rewind
  // settles first. The reference's methods that settle call settle() first.
  // `part`: the sequence's partition (kPrivate .. kMaxPartition).
  void add(int64_t sid, const int32_t* tokens, size_t n, int64_t prompt_len, int64_t part = kDefaultPartition);
  void extend(int64_t sid, const int32_t* tokens, size_t n);
  void finish(int64_t sid);
  void rewind(int64_t sid, int64_t length);
  // Waits for the upkeep thread, then runs the pending upkeep.
  void settle();
  bool upkeep_thread() const { return upkeep_thread_; }

  size_t num_live();
  size_t num_sequences();
  int64_t corpus_tokens();  // finished output tokens held
  int64_t corpus_bytes();   // the corpus's charge (see kSequenceCharge)
  int64_t length(int64_t sid);  // -1 if not running
  // Brings the index up to date with a step's rows, in row order: row i,
  // sequence `sids[i]`, has committed table row `rows[i]`'s first `num[i]`
  // tokens (the first `prompt_lens[i]` of them its prompt). An unknown
  // sequence is added (into partition `parts[i]`; all kDefaultPartition if
  // `parts` is null), a known one extended, or rewound if the row is
  // shorter. `sampled[i]` (null: none): how many of row i's last tokens
  // this step sampled; a sequence holding more than the tokens before them
  // is rewound to those (a runner that dropped tokens, as after a failed KV
  // load, may have sampled others in their place, even as many). Returns
  // how many were rewound. Settles first. The sequences' memory is fetched
  // for all rows ahead of the updates (one cache miss latency for the batch
  // rather than a few per row).
  int64_t sync(const int64_t* sids, const int64_t* rows, const int64_t* num, const int64_t* prompt_lens,
               int64_t batch, const TokenSource& table, const int64_t* parts = nullptr,
               const int64_t* sampled = nullptr);
  size_t memory_bytes();
  // Finished outputs held in the corpus of partition `part` (all: by
  // partition), oldest first (what a snapshot stores).
  std::vector<std::vector<int32_t>> corpus_sequences(int64_t part, bool all);
  // (partition, charge) of the partitions holding a running sequence or a finished output, by id.
  std::vector<std::pair<int64_t, int64_t>> partition_bytes();

  // Writes sequence `sid`'s draft (at most `budget` nodes) into `out`; returns its length.
  int draft(int64_t sid, int budget, double floor, bool tree, DraftRow out);
  // Drafts of `rows` sequences into row i of `base` (rows of `width`
  // elements), their lengths into `lengths`, on up to `threads` threads.
  // `backoff` (another index, usually keyed by fewer tokens; may be null)
  // drafts the rows for which this index finds no candidate at all. Then
  // both indexes' upkeep runs (the drafts do not see it).
  void draft_rows(const int64_t* sids, const int64_t* budgets, int64_t rows, int64_t width, double floor, bool tree,
                  DraftRow base, int32_t* lengths, int threads, DraftIndex* backoff = nullptr);

  const DraftIndexConfig& config() const { return cfg_; }

 private:
  struct Sequence {
    int64_t sid = 0;
    bool live = false;
    int32_t part = kDefaultPartition;
    uint32_t prompt_len = 0;
    std::vector<int32_t> tokens;
    std::vector<uint32_t> own_prev;
    NgramMap<OwnLast> own;
    std::vector<uint32_t> out_entry;
    size_t out_len() const { return tokens.size() - prompt_len; }
    const int32_t* out() const { return tokens.data() + prompt_len; }
  };
  struct Entry {
    uint32_t seq;   // sequence slot
    uint32_t pos;   // position in its output
    uint32_t prev;  // older entry of the same key
    uint32_t next;  // newer entry of the same key
  };
  // One partition's finished outputs and charge (see kSequenceCharge).
  struct Partition {
    std::deque<uint32_t> finished;  // finished slots, oldest first
    int64_t finished_charge = 0;    // kSequenceCharge + kTokenCharge * tokens, over `finished`
    int64_t entries = 0;            // corpus entries of its keys
    int64_t keys = 0;               // its corpus keys
    int64_t live = 0;               // its running sequences
    int64_t charge() const { return finished_charge + kEntryCharge * entries + kKeyCharge * keys; }
  };
  struct Candidate {
    int m;
    int scope;  // 0 own, 1 corpus
    uint32_t seq;
    uint32_t pos;
  };
  struct Node {
    int32_t token;
    int32_t parent;
    int64_t weight;  // W: sum of m over the candidates through the node
    int32_t max_m;   // M
    int32_t depth;
    int32_t first_child = -1;
    int32_t last_child = -1;
    int32_t next_sibling = -1;
  };

  struct SlotRef {
    uint32_t slot = kNone;
    bool empty() const { return slot == kNone; }
  };
  static uint32_t sid_tag(int64_t sid) { return static_cast<uint32_t>(mix64(static_cast<uint64_t>(sid))); }
  // by_sid_'s test that an entry is id `sid`'s (its record holds the id).
  auto is_sid(int64_t sid) const {
    return [this, sid](const SlotRef& r) { return seqs_[r.slot]->sid == sid; };
  }
  uint32_t slot_of(int64_t sid) const;  // the id's slot, running or finished (kNone: unknown)
  Sequence* live_seq(int64_t sid);
  // The slot of running sequence `sid`, or kNone (no wait for the upkeep).
  uint32_t running_slot(int64_t sid) const;
  uint32_t new_slot(int64_t sid, uint32_t prompt_len, int32_t part);
  // Partition `part`'s record (created on first use).
  Partition& partition(int32_t part);
  // The partition whose oldest finished output the upkeep evicts next.
  int32_t fullest_partition() const;
  void append(uint32_t slot, const int32_t* tokens, size_t n);
  void push_corpus(uint32_t slot, uint32_t q);
  // The corpus tag of a pending push (slot, q): its sequence's output n-gram ending before q.
  uint32_t push_tag(const std::pair<uint32_t, uint32_t>& push) const;
  void evict_corpus(uint32_t slot);
  // The corpus slot of the n-gram tokens[0:ngram] in partition `part`
  // (`tag`: its partition_tag; NgramMap::npos if absent).
  size_t find_corpus(const int32_t* tokens, uint32_t tag, int32_t part) const;
  void release(uint32_t slot);
  // Upkeep (see the layout): the pending pushes, then the evictions.
  void upkeep();
  int64_t charge() const {
    return finished_charge_ + kEntryCharge * static_cast<int64_t>(entries_.size() - free_entries_.size()) +
           kKeyCharge * static_cast<int64_t>(corpus_.size());
  }
  bool over_cap() const { return num_finished_ > 0 && charge() > cfg_.corpus_bytes; }
  bool upkeep_due() const { return !pending_.empty() || over_cap(); }
  // Starts the upkeep on the thread, or runs it here without one.
  void start_upkeep();
  // Waits until the upkeep thread is idle; rethrows what it threw.
  void wait_upkeep();
  void upkeep_loop();
  int match(const int32_t* src, int64_t pos, const int32_t* text, int64_t end) const;
  // Working memory of one draft (one per thread in draft_rows).
  struct Scratch {
    std::vector<Candidate> cands;
    std::vector<Node> nodes;
    std::vector<double> conf;
    std::vector<int32_t> heap;
    std::vector<int32_t> kids;
    std::vector<std::pair<int32_t, int32_t>> stack;
    std::vector<char> picked;
    // Chains: the candidates through the current node, and its children.
    std::vector<int32_t> alive, next_alive;
    struct Child {
      int32_t token;
      int64_t weight;
      int32_t max_m;
    };
    std::vector<Child> children;
    // Trees: one candidate's continuation (merge).
    std::vector<int32_t> continuation;
    std::vector<int64_t> ends;  // draft_chain: each candidate's continuation length
    // gather_occurrences: a group's occurrences (own: seq is the row's own
    // slot), in gathering order and then by row (each row's own ones first).
    struct Occurrence {
      uint32_t seq;
      uint32_t pos;
      uint32_t row;
    };
    struct RowOccurrences {
      uint32_t begin = 0;  // into `ordered`
      uint32_t count = 0;
      uint32_t own = 0;  // the first `own` are in the row's own text
    };
    std::vector<Occurrence> occ, ordered;
    std::vector<RowOccurrences> rows;
    std::vector<uint32_t> own_cursor, corpus_cursor;
    std::vector<int64_t> missed;  // draft_rows: rows the main index found no candidate for
    size_t memory_bytes() const {
      return cands.capacity() * sizeof(Candidate) + nodes.capacity() * sizeof(Node) + conf.capacity() * 8 +
             heap.capacity() * 4 + kids.capacity() * 4 + stack.capacity() * 8 + picked.capacity() +
             (alive.capacity() + next_alive.capacity() + continuation.capacity()) * 4 + ends.capacity() * 8 +
             children.capacity() * sizeof(Child) + (occ.capacity() + ordered.capacity()) * sizeof(Occurrence) +
             rows.capacity() * sizeof(RowOccurrences) + (own_cursor.capacity() + corpus_cursor.capacity()) * 4 +
             missed.capacity() * 8;
    }
  };
  // Fewer rows than this per thread are not worth a thread.
  static constexpr int64_t kRowsPerThread = 32;
  // Sets `found` to whether the sequence had any candidate (false: no
  // draft, and a back-off index may try).
  int draft(Scratch& s, int64_t sid, int budget, double floor, bool tree, DraftRow out, bool& found) const;
  // Rows gathered together by draft_rows (their occurrence walks overlap).
  static constexpr int64_t kGatherRows = 64;
  void gather_occurrences(Scratch& s, const uint32_t* slots, int64_t n) const;
  void prefetch_around(const int32_t* text, uint32_t pos, size_t len) const;
  void collect_candidates(Scratch& s, uint32_t slot, int64_t row) const;
  int draft_gathered(Scratch& s, uint32_t slot, int64_t row, int budget, double floor, bool tree, DraftRow out,
                     bool& found) const;
  // Starts loading what drafting rows [0, rows) (rows which[0:rows] if
  // `which` is given) reads first, for all of them ahead of drafting: each
  // key's table slots, then the newest occurrence's text and the corpus
  // list's newest entry (see sync).
  void prefetch_drafts(const int64_t* sids, const int64_t* which, int64_t rows) const;
  void merge(Scratch& s, uint32_t slot, int budget) const;
  double confidence(const Scratch& s, int32_t i) const;
  // The first (at most) `n` tokens of candidate c's continuation in sequence
  // `seq`'s draft into `out`; returns how many. Own text repeats its period
  // (end - pos) past its end; a corpus output's stops at the output's end.
  int64_t continuation(const Sequence& seq, const Candidate& c, int64_t n, int32_t* out) const;
  // The chain of the merged tree's heaviest children, walked over the
  // candidates directly (no tree is built): the same nodes as the
  // reference's _merge + _select_chain, at the cost of the candidates that
  // stay on the chain.
  int draft_chain(Scratch& s, uint32_t slot, int budget, double floor, DraftRow out) const;
  int select_tree(Scratch& s, int budget, double floor, DraftRow out) const;
  void sorted_picked_children(Scratch& s, int32_t node) const;

  DraftIndexConfig cfg_;
  std::vector<std::unique_ptr<Sequence>> seqs_;  // slot -> sequence (nullptr: free)
  std::vector<uint32_t> free_slots_;
  // Running and finished-in-corpus ids -> their slots (open addressing on
  // the id's hash; an entry is confirmed by its record's id).
  NgramMap<SlotRef> by_sid_;
  size_t num_live_ = 0;
  std::vector<Partition> parts_;  // partition id -> its record
  int64_t num_finished_ = 0;      // finished outputs held, over all partitions
  int64_t finished_tokens_ = 0;
  int64_t finished_charge_ = 0;  // kSequenceCharge + kTokenCharge * tokens, over all finished outputs
  NgramMap<CorpusList> corpus_;
  std::vector<Entry> entries_;
  std::vector<uint32_t> free_entries_;
  // Output n-grams waiting to join the corpus: (sequence slot, output position).
  std::vector<std::pair<uint32_t, uint32_t>> pending_;
  // The upkeep thread (started on first use) and its hand-off.
  bool upkeep_thread_;
  std::thread worker_;
  std::mutex worker_mu_;
  std::condition_variable worker_cv_;
  bool worker_busy_ = false;
  bool worker_stop_ = false;
  std::exception_ptr worker_error_;
  // sync's per-row slots (kept to reuse their memory).
  std::vector<uint32_t> sync_slots_;
  std::vector<std::pair<uint32_t, uint32_t>> sync_keys_;  // sync: (slot, tag) of the keys its appends insert
  // Scratch of single drafts, and of draft_rows' threads.
  Scratch scratch_;
  std::vector<Scratch> pool_scratch_;
};

}  // namespace lookahead
