// TokenTrie: the engine-wide n-gram trie of prompt and output windows,
// natively. No Python here (bindings.cpp).
//
// Semantics are those of the pure-Python reference
// lab/lookahead_lab/reference/trie.py (lookahead_vllm/core/trie.py's docstring
// defines windows, counts, weights, confidences, retrieval and pruning); tests hold the two to
// identical trees (weights and confidences bit for bit), node counts and
// snapshot tables. Layout:
//
//   nodes     one array, node 0 the (token-less) root; a dead node's slot is
//             reused by a later one, so whoever holds a node from one call to
//             the next (a request's cursors) holds a NodeRef, the node and
//             its creation serial, and finds it dead when either differs.
//             Children keep insertion order (the reference's dict order:
//             ties and snapshot order follow it); `edges_` finds a child by
//             (parent, token).
//   prompt    per node the prompt counts by request slot (few entries: only
//             the requests whose prompts hold that window) and their sum.
//   requests  by handle (the reference's slot serial, never reused): its
//             prompt (finishing walks its windows again to take its counts
//             back: 4 bytes a token, where a list of the nodes counted would
//             cost 20 bytes a window node), its open output windows (the last
//             branch_length - 1 tokens), the node each of them reached (its
//             cursors) and its context chain.
//
// Not thread-safe: callers serialize (the bindings hold a mutex).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ngram_map.h"
#include "token_source.h"

namespace lookahead {

struct TrieConfig {
  int branch_length = 12;
  int max_match_length = 6;
  int min_match_length = 1;
  int64_t min_retrieved_nodes = 4;
  int64_t capacity = 1 << 16;
  double prompt_weight = 1e4;
  bool insert_prompt = true;
  int context_match = 3;  // 0: no context chains
};

// Draft shapes (config draft_shape): a chain, a DFS-ordered tree, whole
// branches side by side.
enum class TrieShape : int { kOne = 0, kHier = 1, kPar = 2 };

// A DraftTree (lookahead_lab.reference.trees) as arrays: parents first, -1 the root.
struct FlatTree {
  std::vector<int32_t> tokens, parents;
  std::vector<double> weights, conf;
  std::size_t size() const { return tokens.size(); }
  void clear();
  void push(int32_t token, int32_t parent, double weight, double confidence);
};

// merged (lab reference planner.py): `self` plus `other`'s nodes (same root), shared prefixes
// merged, at most `budget` nodes; new nodes weigh their confidence, at most
// their merged parent's.
void merge_tree(FlatTree& self, const FlatTree& other, int64_t budget);

// The context chain of one request (lab reference trie.py ContextIndex): its
// tokens and, per `min_match`-gram, the most recent positions (at most
// kRecentOccurrences, ascending) of the token that followed it. An n-gram's
// group is found by a hash of its tokens (an NgramMap of group ids) and
// confirmed by comparing them (colliding n-grams stay apart); a group is one
// fixed record (no allocation of its own), so extending costs a probe and a
// record a token and memory_bytes() is O(1).
class ContextChain {
 public:
  static constexpr int kRecentOccurrences = 8;  // reference trie.py RECENT_OCCURRENCES
  static constexpr int kMaxMatch = 32;          // reference trie.py MAX_MATCH
  static constexpr double kWeight = 1e18;       // reference trie.py CONTEXT_WEIGHT

  explicit ContextChain(int min_match) : n_(min_match) {}
  std::size_t size() const { return seq_.size(); }
  int64_t memory_bytes() const;
  void extend(const int32_t* tokens, std::size_t k);
  // (position where the continuation starts, match length), or (-1, 0).
  std::pair<int64_t, int64_t> match() const;
  // The chain: at most `budget` nodes, confidence >= floor.
  void draft(int64_t budget, double floor, FlatTree& out) const;

 private:
  struct Group {
    uint32_t end;    // seq_[end - n, end) is the n-gram
    uint32_t count;  // positions held
    uint32_t follows[kRecentOccurrences];  // positions that followed it, ascending
  };
  struct GroupRef {
    uint32_t id = 0xFFFFFFFFu;
    bool empty() const { return id == 0xFFFFFFFFu; }
  };
  uint32_t tag(int64_t end) const;  // hash of the n-gram seq_[end - n, end)
  const Group* find(int64_t end) const;

  int n_;
  std::vector<int32_t> seq_;
  std::vector<Group> groups_;
  NgramMap<GroupRef> index_;
};

// A row's draft from its lead, the trie's tree and the Jacobi pool's
// branches (lab reference planner.py merge_rows): the lead (an index tree, or with
// `lead_is_context` the request's context chain) first, the trie's nodes
// merged after it (no lead: the trie's tree as it is), the pool's after
// those; every node's calibration kind (an index lead's nodes context on its
// leading chain and branch off it, a context chain's context, the pool's
// pool, the rest chain on the leading chain and branch off it); then, with
// `cut`, the best path alone (the heaviest child from the root on).
void merge_row(const FlatTree& lead, bool lead_is_context, const FlatTree& trie, const FlatTree& pool,
               int64_t budget, bool cut, FlatTree& out, std::vector<int8_t>& kinds);

class TokenTrie {
 public:
  explicit TokenTrie(const TrieConfig& config);

  const TrieConfig& config() const { return config_; }
  int64_t num_nodes() const { return num_nodes_; }
  int64_t num_prunes() const { return num_prunes_; }
  int64_t memory_bytes() const;
  bool has_request(int64_t handle) const { return requests_.count(handle) != 0; }
  // The request's context chain (nullptr: unknown handle, or context_match 0).
  const ContextChain* context(int64_t handle) const;

  // Admit a request (its prompt windows, its open output windows); its handle.
  int64_t add_request(const int32_t* prompt, std::size_t n);
  // Eliminate its prompt counts; unknown handles are ignored.
  void finish_request(int64_t handle);
  // Insert its newly generated tokens; false if the handle is unknown. The
  // first `uncounted` of them extend its windows without adding output counts
  // (tokens it counted before a rewind).
  bool extend(int64_t handle, const int32_t* tokens, std::size_t n, std::size_t uncounted = 0);
  // A whole text as output counts (warm start).
  void insert_output(const int32_t* tokens, std::size_t n);
  // The draft for the tokens after `context` (multi-stage matching); the
  // request `handle`'s own prompt counts weigh prompt_weight (-1 or an
  // unknown handle: none do).
  void retrieve(const int32_t* context, std::size_t n, int64_t budget, int64_t handle, TrieShape shape, double floor,
                FlatTree& out);
  // The engine's requests by the caller's slot (lab reference _TrieCore's
  // slot methods): each slot's record handle and the tokens it inserted.
  //
  // Brings the trie up to date with a step's rows, in row order: row i, slot
  // `sids[i]`, has committed table row `rows[i]`'s first `num[i]` tokens
  // (the first `prompt_lens[i]` of them its prompt). A slot of another
  // partition than `kDefault` is kept off the shared trie (known, never
  // inserted). An unknown slot is admitted (its prompt as of this step, then
  // the rest as output), a known one extended, or started over where the row
  // is shorter than what it inserted (a rewind), or where it inserted more
  // than the tokens before the last `sampled[i]` (null: none), which this
  // step sampled (maybe in place of tokens the runner dropped). Returns how
  // many were rewound.
  static constexpr int64_t kDefault = 0;
  int64_t sync(const int64_t* sids, const int64_t* rows, const int64_t* num, const int64_t* prompt_lens,
               const int64_t* parts, int64_t batch, const TokenSource& table, const int64_t* sampled = nullptr);
  // The slot's request finished or was aborted (unknown slots are ignored).
  void finish_slot(int64_t sid);
  // The slot's record handle: -1 for a slot never synced (it drafts from the
  // trie with no record of its own), kOffTrie for one kept off the trie.
  static constexpr int64_t kOffTrie = -2;
  int64_t slot_handle(int64_t sid) const;
  int64_t num_slots() const { return static_cast<int64_t>(slots_.size()); }
  // Context chains held by slots (0 with context_match 0).
  int64_t num_slot_contexts() const;
  // The output counts as a pre-order node table (the reference's output_counts).
  void output_counts(std::vector<int32_t>& parents, std::vector<int32_t>& tokens, std::vector<double>& counts) const;
  // Add such a table. Returns empty, or why it was refused (a parent not -1 or an
  // earlier row, a path deeper than branch_length, a count not finite and >= 0;
  // nothing changed then).
  std::string load_output_counts(const int32_t* parents, const int32_t* tokens, const double* counts, std::size_t n);
  void prune();

 private:
  struct Node {
    int32_t token = 0;
    int32_t parent = -1;
    int64_t serial = 0;
    double out = 0.0;
    int64_t ptotal = 0;
    bool alive = false;
    // Children in insertion order: a list through the siblings (unlinked in O(1)).
    int32_t first = -1, last = -1, prev = -1, next = -1;
    std::vector<std::pair<int64_t, int64_t>> prompt;  // request slot -> prompt count
  };
  // The children of a node, in insertion order: for (int32_t c : kids(id)).
  struct Kids {
    const std::vector<Node>* nodes;
    int32_t first;
    struct It {
      const std::vector<Node>* nodes;
      int32_t at;
      int32_t operator*() const { return at; }
      It& operator++() {
        at = (*nodes)[at].next;
        return *this;
      }
      bool operator!=(const It& o) const { return at != o.at; }
    };
    It begin() const { return {nodes, first}; }
    It end() const { return {nodes, -1}; }
  };
  Kids kids(int32_t id) const { return {&nodes_, nodes_[id].first}; }
  bool leaf(int32_t id) const { return nodes_[id].first < 0; }
  struct NodeRef {
    int32_t id;
    int64_t serial;
  };
  // edges_'s value: the child (its node holds the parent and token that
  // confirm a hash match).
  struct EdgeRef {
    int32_t child = -1;
    bool empty() const { return child < 0; }
  };
  struct Request {
    std::vector<int32_t> prompt;  // as inserted (insert_prompt): its windows hold its counts
    std::vector<int32_t> window;
    std::vector<NodeRef> cursors;
    std::unique_ptr<ContextChain> context;  // context_match > 0
  };

  bool live(const NodeRef& r) const { return nodes_[r.id].alive && nodes_[r.id].serial == r.serial; }
  NodeRef ref(int32_t id) const { return {id, nodes_[id].serial}; }
  double raw(int32_t id) const { return static_cast<double>(nodes_[id].ptotal) + nodes_[id].out; }
  double weight(int32_t id, int64_t slot) const;
  double children_total(int32_t id) const;
  bool is_empty(int32_t id) const;
  int depth(int32_t id) const;
  // The edge (id, token)'s hash tag in edges_, and whether `ref` is that edge.
  static uint32_t edge_tag(int32_t id, int32_t token);
  auto is_edge(int32_t id, int32_t token) const {
    return [this, id, token](const EdgeRef& r) { return nodes_[r.child].parent == id && nodes_[r.child].token == token; };
  }
  int32_t find_child(int32_t id, int32_t token) const;
  int32_t child(int32_t id, int32_t token);  // found or created
  int32_t walk(const int32_t* tokens, std::size_t n, bool create);
  void insert_prompt(int64_t slot, Request& req, const int32_t* prompt, std::size_t n);
  void extend_one(Request& req, int32_t token, double count = 1.0);
  void drop_if_empty(int32_t id);
  void detach(int32_t id);
  void maybe_prune();
  void drop_lightest_leaves(int64_t count);

  void select_chain(int32_t start, int64_t depth, int64_t slot, double floor, FlatTree& out) const;
  void best_first(int32_t start, int64_t budget, int64_t max_depth, int64_t slot, double floor);
  void flatten_dfs(int32_t start, FlatTree& out) const;
  void flatten_parallel(int32_t start, int64_t budget, FlatTree& out) const;
  void ranked(int32_t id, std::vector<int32_t>& out) const;

  TrieConfig config_;
  std::vector<Node> nodes_;
  std::vector<int32_t> free_;
  NgramMap<EdgeRef> edges_;  // (parent, token) -> child (open addressing on edge_tag)
  int64_t prompt_bytes_ = 0;  // the nodes' prompt-count vectors' capacity, in bytes
  std::vector<NodeRef> next_cursors_;  // extend_one's scratch (swapped with a request's cursors)
  std::unordered_map<int64_t, Request> requests_;
  // sync's slots: the record handle (kOffTrie: kept off the trie), the tokens
  // inserted, and the most it ever inserted (a rewind starts the slot over; its
  // tokens up to there are walked again without counting).
  struct SlotRecord {
    int64_t handle = kOffTrie;
    int64_t inserted = 0;
    int64_t counted = 0;
  };
  std::unordered_map<int64_t, SlotRecord> slots_;
  std::vector<int32_t> sync_tokens_;  // sync's scratch
  int64_t num_nodes_ = 0;  // root excluded
  int64_t num_prunes_ = 0;
  int64_t serial_ = 0;
  int64_t next_slot_ = 0;
  // best_first's results (scratch, reused): picked nodes in pick order; per
  // node, valid where taken_ holds this call's stamp_: its weight and depth;
  // its path confidence (every node visited this call).
  std::vector<int32_t> picked_;
  std::vector<uint64_t> taken_;
  std::vector<double> conf_, pick_w_;
  std::vector<int64_t> depth_;
  // best_first's working memory (reused across calls): its heap of
  // (-weight, token, push counter, node), a node's children, their weights
  // and order, and the children kept (weight known where `true`).
  std::vector<std::tuple<double, int32_t, int64_t, int32_t>> heap_;
  std::vector<int32_t> kids_;
  std::vector<double> kid_weight_;
  std::vector<size_t> kid_order_;
  std::vector<std::tuple<int32_t, double, bool>> kept_;
  uint64_t stamp_ = 0;
};

}  // namespace lookahead
