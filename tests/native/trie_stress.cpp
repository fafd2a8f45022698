// Stress driver for the native trie under sanitizers (no Python).
//
// Random operations on a TokenTrie with a small capacity, so that prunes
// reuse node slots all the time: admissions (prompt windows, context
// chains), extensions, finishes (some twice), warm texts, explicit prunes,
// retrievals in every shape for live, finished and unknown requests, context
// chains, the engine's per-slot sync (admit, extend, rewind, partitions kept
// off) and finish_slot, merges of chains and trees (merge_row, cut and not), and snapshot
// tables written and loaded into a fresh trie. Checks every tree against its
// bounds (parents first, at most the budget, confidences in (0, 1] and at
// least the floor, kinds in range) and the node count against the capacity;
// exits 1 on the first violation. Built with -fsanitize=address,undefined,
// any memory error or undefined behaviour fails it. Usage: trie_stress SEED STEPS
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <vector>

#include "token_trie.h"

using lookahead::FlatTree;
using lookahead::TokenTrie;
using lookahead::TrieShape;

namespace {

int fail(const char* what, int64_t step) {
  std::printf("FAIL at step %lld: %s\n", static_cast<long long>(step), what);
  return 1;
}

// A token table of fixed rows (sync's TokenSource).
struct Table final : lookahead::TokenSource {
  std::vector<std::vector<int32_t>> rows;
  void read(int64_t row, int64_t begin, int64_t end, std::vector<int32_t>& out) const override {
    out.assign(rows[row].begin() + begin, rows[row].begin() + end);
  }
  const void* address(int64_t row, int64_t col) const override { return rows[row].data() + col; }
};

bool valid(const FlatTree& t, int64_t budget, double floor) {
  if (static_cast<int64_t>(t.size()) > budget) return false;
  for (size_t i = 0; i < t.size(); ++i) {
    if (t.parents[i] < -1 || t.parents[i] >= static_cast<int32_t>(i)) return false;
    if (!(t.conf[i] > 0.0 && t.conf[i] <= 1.0 && t.conf[i] >= floor)) return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::printf("usage: trie_stress SEED STEPS\n");
    return 2;
  }
  std::mt19937_64 rng(std::strtoull(argv[1], nullptr, 10));
  const int64_t steps = std::strtoll(argv[2], nullptr, 10);
  auto pick = [&](int64_t n) { return static_cast<int64_t>(rng() % static_cast<uint64_t>(n)); };
  lookahead::TrieConfig config;
  config.branch_length = 5;
  config.max_match_length = 3;
  config.capacity = 200;
  config.context_match = 2;
  TokenTrie trie(config);
  std::map<int64_t, std::vector<int32_t>> live;  // handle -> its text
  std::vector<int64_t> finished;
  const TrieShape shapes[] = {TrieShape::kOne, TrieShape::kHier, TrieShape::kPar};
  FlatTree tree, chain, merged;
  std::vector<int8_t> kinds;
  Table table;  // slot s's text is row s
  for (int s = 0; s < 6; ++s) {
    table.rows.emplace_back(64);
    for (int32_t& t : table.rows.back()) t = static_cast<int32_t>(pick(12));
  }
  std::map<int64_t, int64_t> slot_len;  // synced slot -> committed tokens
  for (int64_t step = 0; step < steps; ++step) {
    std::vector<int32_t> tokens(pick(24));
    for (int32_t& t : tokens) t = static_cast<int32_t>(pick(12));
    const int op = static_cast<int>(pick(10));
    if (op <= 1 && live.size() < 12) {
      live[trie.add_request(tokens.data(), tokens.size())] = tokens;
    } else if (op <= 4 && !live.empty()) {
      auto it = std::next(live.begin(), pick(static_cast<int64_t>(live.size())));
      if (!trie.extend(it->first, tokens.data(), tokens.size())) return fail("extend of a live request refused", step);
      it->second.insert(it->second.end(), tokens.begin(), tokens.end());
    } else if (op == 5 && !live.empty()) {
      auto it = std::next(live.begin(), pick(static_cast<int64_t>(live.size())));
      trie.finish_request(it->first);
      trie.finish_request(it->first);  // idempotent
      finished.push_back(it->first);
      live.erase(it);
    } else if (op == 6) {
      trie.insert_output(tokens.data(), tokens.size());
    } else if (op == 7) {
      trie.prune();
    } else if (op == 8) {  // a step: every held slot and maybe a new one, grown or rewound
      slot_len[pick(6)];
      std::vector<int64_t> sids, num, plens, parts;
      for (auto& [sid, n] : slot_len) {
        n = pick(4) == 0 ? pick(n + 1) : std::min<int64_t>(64, n + pick(6));
        sids.push_back(sid);
        num.push_back(n);
        plens.push_back(pick(20));
        parts.push_back(sid == 5 ? 3 : 0);
      }
      const int64_t rewound = trie.sync(sids.data(), sids.data(), num.data(), plens.data(), parts.data(),
                                        static_cast<int64_t>(sids.size()), table);
      if (rewound < 0 || rewound > static_cast<int64_t>(sids.size())) return fail("rewound count", step);
      if (trie.num_slots() != static_cast<int64_t>(slot_len.size())) return fail("slot count", step);
      if ((trie.slot_handle(5) == TokenTrie::kOffTrie) != (slot_len.count(5) == 1)) {
        return fail("another partition on the trie", step);
      }
    } else if (op == 9 && !slot_len.empty()) {
      const int64_t sid = std::next(slot_len.begin(), pick(static_cast<int64_t>(slot_len.size())))->first;
      trie.finish_slot(sid);
      trie.finish_slot(sid);  // unknown slots are ignored
      slot_len.erase(sid);
    }
    // Retrieve for a live request, a finished one and none, every shape.
    const int64_t budget = pick(10);
    const double floor = pick(2) ? 0.0 : 0.05;
    for (int who = 0; who < 3; ++who) {
      int64_t handle = -1;
      std::vector<int32_t> context = tokens;
      if (who == 0 && !live.empty()) {
        auto it = std::next(live.begin(), pick(static_cast<int64_t>(live.size())));
        handle = it->first;
        context = it->second;
      } else if (who == 1 && !finished.empty()) {
        handle = finished[pick(static_cast<int64_t>(finished.size()))];
      } else if (who == 2 && !slot_len.empty()) {  // a synced slot's record, its committed text as context
        const auto it = std::next(slot_len.begin(), pick(static_cast<int64_t>(slot_len.size())));
        handle = trie.slot_handle(it->first);
        if (handle >= 0) context.assign(table.rows[it->first].begin(), table.rows[it->first].begin() + it->second);
      }
      for (TrieShape shape : shapes) {
        trie.retrieve(context.data(), context.size(), budget, handle, shape, floor, tree);
        if (!valid(tree, budget, floor)) return fail("retrieved tree out of bounds", step);
        chain.clear();
        if (const lookahead::ContextChain* c = trie.context(handle)) {
          if (c->size() != context.size()) return fail("context chain length", step);
          c->draft(budget, floor, chain);
          if (!valid(chain, budget, floor)) return fail("context chain out of bounds", step);
        }
        const FlatTree none;
        lookahead::merge_row(chain, true, tree, pick(3) == 0 ? chain : none, budget, pick(2) == 0, merged, kinds);
        if (!valid(merged, budget, floor) || kinds.size() != merged.size()) return fail("merged row", step);
        for (int8_t k : kinds) {
          if (k < 0 || k > 3) return fail("kind out of range", step);
        }
      }
    }
    if (trie.num_nodes() > config.capacity) return fail("node count over capacity", step);
    if (step % 97 == 0) {  // a snapshot table, loaded into a fresh trie
      std::vector<int32_t> parents, toks;
      std::vector<double> counts;
      trie.output_counts(parents, toks, counts);
      TokenTrie fresh(config);
      if (!fresh.load_output_counts(parents.data(), toks.data(), counts.data(), toks.size()).empty()) {
        return fail("a written table refused", step);
      }
      std::vector<int32_t> again_parents, again_toks;
      std::vector<double> again_counts;
      fresh.output_counts(again_parents, again_toks, again_counts);
      if (static_cast<int64_t>(toks.size()) <= config.capacity &&
          (again_toks != toks || again_parents != parents || again_counts != counts)) {
        return fail("snapshot table did not round-trip", step);
      }
    }
  }
  std::printf("ok: %lld steps, %lld nodes, %lld prunes\n", static_cast<long long>(steps),
              static_cast<long long>(trie.num_nodes()), static_cast<long long>(trie.num_prunes()));
  return 0;
}
