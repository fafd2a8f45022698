// TokenTrie (token_trie.h): the reference lab/lookahead_lab/reference/trie.py,
// natively. Each function names the reference's it follows; where the order
// of floating-point sums or of ties matters, it is the reference's.
#include "token_trie.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <queue>
#include <tuple>

namespace lookahead {

namespace {

constexpr double kPruneTarget = 0.75;  // trie.PRUNE_TARGET

uint64_t edge_key(int32_t parent, int32_t token) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(parent)) << 32) | static_cast<uint32_t>(token);
}

}  // namespace

void FlatTree::clear() {
  tokens.clear();
  parents.clear();
  weights.clear();
  conf.clear();
}

void FlatTree::push(int32_t token, int32_t parent, double weight, double confidence) {
  tokens.push_back(token);
  parents.push_back(parent);
  weights.push_back(weight);
  conf.push_back(confidence);
}

void merge_tree(FlatTree& self, const FlatTree& other, int64_t budget) {
  // (parent, token) -> node; a repeated pair keeps its last node, as the
  // reference's dict does. Small trees (drafts are a few dozen nodes) scan
  // from the newest node back, which finds the same node with no allocation.
  constexpr size_t kScanUpTo = 64;
  const bool scan = self.size() + other.size() <= kScanUpTo;
  std::unordered_map<uint64_t, int32_t> index;
  if (!scan) {
    for (size_t i = 0; i < self.size(); ++i) index[edge_key(self.parents[i], self.tokens[i])] = static_cast<int32_t>(i);
  }
  auto find = [&](int32_t at, int32_t token) -> int32_t {
    if (!scan) {
      const auto it = index.find(edge_key(at, token));
      return it == index.end() ? -1 : it->second;
    }
    for (size_t i = self.size(); i-- > 0;) {
      if (self.parents[i] == at && self.tokens[i] == token) return static_cast<int32_t>(i);
    }
    return -1;
  };
  constexpr int32_t kUnmapped = INT32_MIN;
  std::vector<int32_t> mapped(other.size(), kUnmapped);
  for (size_t j = 0; j < other.size(); ++j) {
    const int32_t parent = other.parents[j];
    const int32_t at = parent < 0 ? -1 : mapped[parent];
    if (at == kUnmapped) continue;  // its parent did not fit
    int32_t node = find(at, other.tokens[j]);
    if (node < 0) {
      if (static_cast<int64_t>(self.size()) >= budget) continue;
      node = static_cast<int32_t>(self.size());
      if (!scan) index.emplace(edge_key(at, other.tokens[j]), node);
      // No more confident than its parent in the merged tree (a path is
      // accepted no more often than its prefix).
      const double conf = at < 0 ? other.conf[j] : std::min(other.conf[j], self.conf[at]);
      self.push(other.tokens[j], at, conf, conf);
    }
    mapped[j] = node;
  }
}

int64_t ContextChain::memory_bytes() const {
  return static_cast<int64_t>(sizeof(ContextChain) + seq_.capacity() * sizeof(int32_t) +
                              groups_.capacity() * sizeof(Group) + index_.memory_bytes());
}

uint32_t ContextChain::tag(int64_t end) const {
  uint64_t h = 0x9E3779B97F4A7C15ull;
  for (int64_t i = end - n_; i < end; ++i) {
    h ^= static_cast<uint32_t>(seq_[i]);
    h *= 0xFF51AFD7ED558CCDull;
    h ^= h >> 33;
  }
  return static_cast<uint32_t>(h ^ (h >> 32));
}

const ContextChain::Group* ContextChain::find(int64_t end) const {
  const int32_t* gram = seq_.data() + (end - n_);
  const size_t slot = index_.find(tag(end), [&](const GroupRef& r) {
    return std::equal(gram, gram + n_, seq_.data() + (groups_[r.id].end - n_));
  });
  return slot == NgramMap<GroupRef>::npos ? nullptr : &groups_[index_.value(slot).id];
}

// ContextIndex.extend
void ContextChain::extend(const int32_t* tokens, std::size_t k) {
  const int64_t start = std::max<int64_t>(n_, static_cast<int64_t>(seq_.size()));
  seq_.insert(seq_.end(), tokens, tokens + k);
  const int64_t size = static_cast<int64_t>(seq_.size());
  for (int64_t p = start; p < size; ++p) index_.prefetch(tag(p));  // a hint: the probes below overlap
  for (int64_t p = start; p < size; ++p) {
    const int32_t* gram = seq_.data() + (p - n_);
    const size_t slot = index_.find_or_insert(tag(p), [&](const GroupRef& r) {
      return std::equal(gram, gram + n_, seq_.data() + (groups_[r.id].end - n_));
    });
    GroupRef& ref = index_.value(slot);
    if (ref.empty()) {
      ref.id = static_cast<uint32_t>(groups_.size());
      groups_.push_back(Group{static_cast<uint32_t>(p), 0, {}});
    }
    Group& g = groups_[ref.id];
    if (g.count == kRecentOccurrences) {  // the oldest goes
      std::copy(g.follows + 1, g.follows + kRecentOccurrences, g.follows);
      --g.count;
    }
    g.follows[g.count++] = static_cast<uint32_t>(p);
  }
}

// ContextIndex.match: among the occurrences, latest first, the one whose
// match extends furthest backwards.
std::pair<int64_t, int64_t> ContextChain::match() const {
  const int64_t end = static_cast<int64_t>(seq_.size());
  if (end <= n_) return {-1, 0};
  const Group* g = find(end);
  if (g == nullptr) return {-1, 0};
  int64_t best = -1, best_len = 0;
  for (uint32_t i = g->count; i-- > 0;) {
    const int64_t p = g->follows[i];
    int64_t length = n_;
    while (length < kMaxMatch && p - length - 1 >= 0 && seq_[p - length - 1] == seq_[end - length - 1]) ++length;
    if (length > best_len) {
      best = p;
      best_len = length;
    }
  }
  return {best, best_len};
}

// ContextIndex.draft
void ContextChain::draft(int64_t budget, double floor, FlatTree& out) const {
  out.clear();
  const auto [start, length] = match();
  if (start < 0 || budget <= 0) return;
  const int64_t end = static_cast<int64_t>(seq_.size());
  const int64_t period = end - start;
  std::vector<int32_t> tokens(seq_.begin() + start, seq_.begin() + std::min(end, start + budget));
  while (static_cast<int64_t>(tokens.size()) < budget) tokens.push_back(tokens[tokens.size() - period]);
  const double rate = static_cast<double>(length) / static_cast<double>(length + 1);
  for (int64_t d = 1; d <= budget; ++d) {
    const double c = std::pow(rate, static_cast<double>(d));
    if (!(c >= floor)) break;  // the confidences fall with depth: the rest are below too
    out.push(tokens[d - 1], static_cast<int32_t>(d) - 2, kWeight, c);
  }
}

void merge_row(const FlatTree& lead, bool lead_is_context, const FlatTree& trie, const FlatTree& pool,
               int64_t budget, bool cut, FlatTree& out, std::vector<int8_t>& kinds) {
  constexpr int8_t kChain = 0, kBranch = 1, kPool = 2, kContext = 3;  // core/calibration.py KIND_*
  out = lead.size() ? lead : trie;
  if (lead.size() && trie.size()) merge_tree(out, trie, budget);
  const size_t pool_from = out.size(), n_lead = lead.size();
  if (pool.size()) merge_tree(out, pool, budget);
  const size_t n = out.size();
  kinds.resize(n);
  bool chain = true;
  for (size_t i = 0; i < n; ++i) {
    chain = chain && out.parents[i] == static_cast<int32_t>(i) - 1;
    const int8_t kind = chain ? kChain : kBranch;
    kinds[i] = i >= pool_from ? kPool : i >= n_lead ? kind : lead_is_context ? kContext : chain ? kContext : kBranch;
  }
  bool is_chain = true;
  for (size_t i = 0; i < n; ++i) is_chain = is_chain && out.parents[i] == static_cast<int32_t>(i) - 1;
  if (!cut || is_chain) return;
  // planner.best_path (lookahead_lab.reference): from the root, the first heaviest child at every depth.
  FlatTree path;
  std::vector<int8_t> path_kinds;
  for (int32_t node = -1;;) {
    int32_t best = -1;
    for (size_t j = 0; j < n; ++j) {
      if (out.parents[j] == node && (best < 0 || out.weights[j] > out.weights[best])) best = static_cast<int32_t>(j);
    }
    if (best < 0) break;
    path.push(out.tokens[best], static_cast<int32_t>(path.size()) - 1, out.weights[best], out.conf[best]);
    path_kinds.push_back(kinds[best]);
    node = best;
  }
  out = std::move(path);
  kinds = std::move(path_kinds);
}

TokenTrie::TokenTrie(const TrieConfig& config) : config_(config) {
  nodes_.emplace_back();
  nodes_[0].token = -1;
  nodes_[0].alive = true;
}

int64_t TokenTrie::memory_bytes() const {
  int64_t total = static_cast<int64_t>(nodes_.capacity() * sizeof(Node) + free_.capacity() * sizeof(int32_t) +
                                       taken_.capacity() * 32 + edges_.memory_bytes()) +
                  prompt_bytes_;
  // Hash nodes (key, record, next pointer, cached hash) and buckets.
  total += static_cast<int64_t>((requests_.size() + slots_.size()) * 32 +
                                (requests_.bucket_count() + slots_.bucket_count()) * sizeof(void*) +
                                slots_.size() * sizeof(SlotRecord));
  for (const auto& [handle, req] : requests_) {
    total += static_cast<int64_t>(sizeof(Request) + req.prompt.capacity() * sizeof(int32_t) +
                                  req.window.capacity() * sizeof(int32_t) + req.cursors.capacity() * sizeof(NodeRef));
    if (req.context) total += req.context->memory_bytes();
  }
  return total;
}

const ContextChain* TokenTrie::context(int64_t handle) const {
  const auto it = requests_.find(handle);
  return it == requests_.end() ? nullptr : it->second.context.get();
}

// _Node.weight
double TokenTrie::weight(int32_t id, int64_t slot) const {
  const Node& n = nodes_[id];
  // Entries are in admission order, so by slot (finishing one keeps the order).
  const auto it = std::lower_bound(n.prompt.begin(), n.prompt.end(), slot,
                                   [](const std::pair<int64_t, int64_t>& e, int64_t s) { return e.first < s; });
  const int64_t own = it != n.prompt.end() && it->first == slot ? it->second : 0;
  return config_.prompt_weight * static_cast<double>(own) + static_cast<double>(n.ptotal - own) + n.out;
}

// _children_total: summed in insertion order, as the reference's sum() does.
double TokenTrie::children_total(int32_t id) const {
  double total = 0.0;
  for (int32_t c : kids(id)) total += raw(c);
  return total;
}

// _is_empty
bool TokenTrie::is_empty(int32_t id) const {
  const Node& n = nodes_[id];
  return n.first < 0 && n.ptotal == 0 && n.out < 1;
}

int TokenTrie::depth(int32_t id) const {
  int d = 0;
  while (nodes_[id].parent >= 0) {
    id = nodes_[id].parent;
    ++d;
  }
  return d;
}

uint32_t TokenTrie::edge_tag(int32_t id, int32_t token) {
  return static_cast<uint32_t>(mix64(edge_key(id, token)));
}

int32_t TokenTrie::find_child(int32_t id, int32_t token) const {
  const size_t slot = edges_.find(edge_tag(id, token), is_edge(id, token));
  return slot == NgramMap<EdgeRef>::npos ? -1 : edges_.value(slot).child;
}

// _child
int32_t TokenTrie::child(int32_t id, int32_t token) {
  const int32_t found = find_child(id, token);
  if (found >= 0) return found;
  int32_t fresh;
  if (!free_.empty()) {
    fresh = free_.back();
    free_.pop_back();
  } else {
    fresh = static_cast<int32_t>(nodes_.size());
    nodes_.emplace_back();
  }
  Node& n = nodes_[fresh];
  n.token = token;
  n.parent = id;
  n.serial = ++serial_;
  n.out = 0.0;
  n.ptotal = 0;
  n.alive = true;
  n.prompt.clear();
  n.first = n.last = n.next = -1;
  Node& p = nodes_[id];
  n.prev = p.last;
  if (p.last >= 0) {
    nodes_[p.last].next = fresh;
  } else {
    p.first = fresh;
  }
  p.last = fresh;
  edges_.value(edges_.find_or_insert(edge_tag(id, token), is_edge(id, token))).child = fresh;
  ++num_nodes_;
  return fresh;
}

// _walk: the node the path reaches, or -1 (create=false and a token is missing).
int32_t TokenTrie::walk(const int32_t* tokens, size_t n, bool create) {
  int32_t node = 0;
  for (size_t i = 0; i < n; ++i) {
    const int32_t next = find_child(node, tokens[i]);
    if (next < 0) {
      if (!create) return -1;
      node = child(node, tokens[i]);
    } else {
      node = next;
    }
  }
  return node;
}

// add_request
int64_t TokenTrie::add_request(const int32_t* prompt, size_t n) {
  const int64_t slot = next_slot_++;
  Request& req = requests_[slot];
  if (config_.insert_prompt) insert_prompt(slot, req, prompt, n);
  if (config_.context_match > 0) {
    req.context = std::make_unique<ContextChain>(config_.context_match);
    req.context->extend(prompt, n);
  }
  const size_t open = std::min(n, static_cast<size_t>(config_.branch_length - 1));
  req.window.assign(prompt + n - open, prompt + n);
  for (size_t j = 0; j < open; ++j) req.cursors.push_back(ref(walk(req.window.data() + j, open - j, true)));
  maybe_prune();
  return slot;
}

// _insert_prompt. The request keeps its prompt, not the nodes it counted:
// finish_request walks the same windows again to find them.
void TokenTrie::insert_prompt(int64_t slot, Request& req, const int32_t* prompt, size_t n) {
  const size_t lb = static_cast<size_t>(config_.branch_length);
  req.prompt.assign(prompt, prompt + n);
  for (size_t i = 0; i < n; ++i) {
    int32_t node = 0;
    for (size_t k = i; k < std::min(n, i + lb); ++k) {
      node = child(node, prompt[k]);
      Node& nd = nodes_[node];
      if (!nd.prompt.empty() && nd.prompt.back().first == slot) {
        ++nd.prompt.back().second;  // this request counted here last: its entry is the last one
      } else {
        const size_t capacity = nd.prompt.capacity();
        nd.prompt.emplace_back(slot, 1);
        prompt_bytes_ += static_cast<int64_t>((nd.prompt.capacity() - capacity) * sizeof(nd.prompt[0]));
      }
      ++nd.ptotal;
    }
  }
}

// finish_request. The nodes still holding the request's prompt counts are
// on its prompt windows' paths (a node dies with its subtree, and one
// created later on such a path holds no count of it), met in the order the
// insertion counted them first: each gives up its count at the first
// meeting; then the emptied ones go, deepest first (stable, as the
// reference's sorted(..., reverse=True)).
void TokenTrie::finish_request(int64_t handle) {
  auto it = requests_.find(handle);
  if (it == requests_.end()) return;
  Request req = std::move(it->second);
  requests_.erase(it);
  const size_t n = req.prompt.size(), lb = static_cast<size_t>(config_.branch_length);
  std::vector<std::pair<int, int32_t>> counted;  // (depth, node)
  for (size_t i = 0; i < n; ++i) {
    int32_t node = 0;
    for (size_t k = i; k < std::min(n, i + lb); ++k) {
      node = find_child(node, req.prompt[k]);
      if (node < 0) break;
      Node& nd = nodes_[node];
      const auto e = std::lower_bound(nd.prompt.begin(), nd.prompt.end(), handle,
                                      [](const std::pair<int64_t, int64_t>& x, int64_t s) { return x.first < s; });
      if (e == nd.prompt.end() || e->first != handle) continue;
      nd.ptotal -= e->second;
      nd.prompt.erase(e);
      counted.emplace_back(static_cast<int>(k - i + 1), node);
    }
  }
  std::stable_sort(counted.begin(), counted.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<int64_t> serials;
  for (const auto& [d, id] : counted) serials.push_back(nodes_[id].serial);
  for (size_t i = 0; i < counted.size(); ++i) {
    const int32_t id = counted[i].second;
    if (live({id, serials[i]})) drop_if_empty(id);
  }
}

bool TokenTrie::extend(int64_t handle, const int32_t* tokens, size_t n, size_t uncounted) {
  auto it = requests_.find(handle);
  if (it == requests_.end()) return false;
  for (size_t i = 0; i < n; ++i) extend_one(it->second, tokens[i], i < uncounted ? 0.0 : 1.0);
  if (it->second.context) it->second.context->extend(tokens, n);
  maybe_prune();
  return true;
}

void TokenTrie::insert_output(const int32_t* tokens, size_t n) {
  Request req;
  for (size_t i = 0; i < n; ++i) extend_one(req, tokens[i]);
  maybe_prune();
}

// _extend_one. The cursors' nodes and the edge slots their children are
// found through are fetched for all of them first (hints only: one cache
// miss latency for the token rather than one per cursor); the updates then
// run in the reference's order.
void TokenTrie::extend_one(Request& req, int32_t token, double count) {
  const size_t m = req.cursors.size();
  for (size_t j = 0; j < m; ++j) {
    __builtin_prefetch(&nodes_[req.cursors[j].id]);
    edges_.prefetch(edge_tag(req.cursors[j].id, token));
  }
  edges_.prefetch(edge_tag(0, token));
  for (size_t j = 0; j < m; ++j) {
    if (const EdgeRef* e = edges_.home(edge_tag(req.cursors[j].id, token))) __builtin_prefetch(&nodes_[e->child]);
  }
  std::vector<NodeRef>& cursors = next_cursors_;
  cursors.clear();
  for (size_t j = 0; j < m; ++j) {
    int32_t node = req.cursors[j].id;
    if (!live(req.cursors[j])) node = walk(req.window.data() + j, req.window.size() - j, true);
    const int32_t c = child(node, token);
    nodes_[c].out += count;
    cursors.push_back(ref(c));
  }
  const int32_t first = child(0, token);
  nodes_[first].out += count;
  cursors.push_back(ref(first));
  req.window.push_back(token);
  if (req.window.size() >= static_cast<size_t>(config_.branch_length)) {
    req.window.erase(req.window.begin());
    cursors.erase(cursors.begin());
  }
  req.cursors.swap(cursors);  // the old cursors' memory is the next call's scratch
}

// _drop_if_empty
void TokenTrie::drop_if_empty(int32_t id) {
  while (id != 0 && nodes_[id].alive && is_empty(id)) {
    const int32_t parent = nodes_[id].parent;
    detach(id);
    id = parent;
  }
}

// _detach: the node and its subtree go; their slots are reused.
void TokenTrie::detach(int32_t id) {
  Node& d = nodes_[id];
  Node& p = nodes_[d.parent];
  (d.prev >= 0 ? nodes_[d.prev].next : p.first) = d.next;
  (d.next >= 0 ? nodes_[d.next].prev : p.last) = d.prev;
  std::vector<int32_t> stack{id};
  while (!stack.empty()) {
    const int32_t n = stack.back();
    stack.pop_back();
    for (int32_t c : kids(n)) stack.push_back(c);
    Node& nd = nodes_[n];
    nd.alive = false;
    edges_.erase(edges_.find(edge_tag(nd.parent, nd.token), is_edge(nd.parent, nd.token)));
    nd.first = nd.last = -1;
    prompt_bytes_ -= static_cast<int64_t>(nd.prompt.capacity() * sizeof(std::pair<int64_t, int64_t>));
    std::vector<std::pair<int64_t, int64_t>>().swap(nd.prompt);  // a reused slot starts with no memory held
    free_.push_back(n);
    --num_nodes_;
  }
}

void TokenTrie::maybe_prune() {
  if (num_nodes_ > config_.capacity) prune();
}

// prune. The reference walks the tree; this scans the node array (cache
// friendly), which removes the same nodes: a node goes in the first pass iff
// its whole subtree is empty after the halving (the reference, bottom-up,
// asks each node once its subtree went; here each empty leaf goes and takes
// its parents that it leaves empty), and the lightest leaves are ranked by
// (count, creation serial), which no order of discovery changes.
void TokenTrie::prune() {
  const int64_t target = static_cast<int64_t>(static_cast<double>(config_.capacity) * kPruneTarget);
  const int32_t size = static_cast<int32_t>(nodes_.size());
  for (int32_t n = 1; n < size; ++n) {
    if (nodes_[n].alive) nodes_[n].out *= 0.5;
  }
  for (int32_t n = 1; n < size; ++n) {
    if (nodes_[n].alive && is_empty(n)) drop_if_empty(n);
  }
  if (num_nodes_ > target) drop_lightest_leaves(num_nodes_ - target);
  ++num_prunes_;
}

// _drop_lightest_leaves: lightest raw count first, ties by creation.
void TokenTrie::drop_lightest_leaves(int64_t count) {
  using Entry = std::tuple<double, int64_t, int32_t>;
  std::vector<Entry> leaves;
  for (int32_t n = 1; n < static_cast<int32_t>(nodes_.size()); ++n) {
    if (nodes_[n].alive && leaf(n)) leaves.emplace_back(raw(n), nodes_[n].serial, n);
  }
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap(std::greater<Entry>(), std::move(leaves));
  while (!heap.empty() && count > 0) {
    const int32_t n = std::get<2>(heap.top());
    heap.pop();
    const int32_t parent = nodes_[n].parent;
    detach(n);
    --count;
    if (parent != 0 && leaf(parent)) heap.emplace(raw(parent), nodes_[parent].serial, parent);
  }
}

// ------------------------------------------------------------- retrieval

// retrieve
void TokenTrie::retrieve(const int32_t* context, size_t n, int64_t budget, int64_t handle, TrieShape shape,
                         double floor, FlatTree& out) {
  out.clear();
  if (budget <= 0 || n == 0) return;
  const int64_t slot = requests_.count(handle) ? handle : -1;
  FlatTree tree;
  const int64_t longest = std::min<int64_t>(config_.max_match_length, static_cast<int64_t>(n));
  for (int64_t m = longest; m >= config_.min_match_length; --m) {
    const int32_t node = walk(context + n - m, static_cast<size_t>(m), false);
    if (node < 0 || leaf(node)) continue;
    const int64_t max_depth = config_.branch_length - m;
    tree.clear();
    if (shape == TrieShape::kOne) {
      select_chain(node, std::min(budget, max_depth), slot, floor, tree);
      if (tree.size() > out.size()) out = tree;
      if (static_cast<int64_t>(tree.size()) >= std::min(config_.min_retrieved_nodes, budget)) break;
    } else {
      best_first(node, budget, max_depth, slot, floor);
      if (shape == TrieShape::kHier) {
        flatten_dfs(node, tree);
      } else {
        flatten_parallel(node, budget, tree);
      }
      if (out.size()) {
        merge_tree(out, tree, budget);
      } else {
        out = tree;
      }
      if (static_cast<int64_t>(out.size()) >= budget) break;
    }
  }
}

// _select_chain: the heaviest child at every depth (ties: the lower token).
void TokenTrie::select_chain(int32_t node, int64_t depth, int64_t slot, double floor, FlatTree& out) const {
  double confidence = 1.0;
  while (!leaf(node) && static_cast<int64_t>(out.size()) < depth) {
    const int32_t parent = node;
    int32_t best = -1;
    double best_w = 0.0;
    for (int32_t c : kids(parent)) {
      const double w = weight(c, slot);
      if (best < 0 || w > best_w || (w == best_w && nodes_[c].token < nodes_[best].token)) {
        best = c;
        best_w = w;
      }
    }
    node = best;
    confidence *= raw(node) / (children_total(parent) + 1.0);
    if (confidence <= 0 || confidence < floor) break;
    out.push(nodes_[node].token, static_cast<int32_t>(out.size()) - 1, best_w, confidence);
  }
}

// _best_first: up to `budget` heaviest nodes below `start`, connected.
void TokenTrie::best_first(int32_t start, int64_t budget, int64_t max_depth, int64_t slot, double floor) {
  picked_.clear();
  ++stamp_;
  if (taken_.size() < nodes_.size()) {
    taken_.resize(nodes_.size(), 0);
    conf_.resize(nodes_.size());
    pick_w_.resize(nodes_.size());
    depth_.resize(nodes_.size());
  }
  conf_[start] = 1.0;
  depth_[start] = 0;
  // The reference's heap (heapq: the least entry first), as a binary heap in heap_.
  using Entry = std::tuple<double, int32_t, int64_t, int32_t>;
  const std::greater<Entry> later;
  heap_.clear();
  int64_t counter = 0;
  auto push = [&](int32_t parent, int64_t depth) {
    if (depth > max_depth) return;
    const double scale = conf_[parent] / (children_total(parent) + 1.0);
    kids_.clear();
    for (int32_t c : kids(parent)) kids_.push_back(c);
    kept_.clear();
    if (static_cast<int64_t>(kids_.size()) > budget) {  // heapq.nlargest: heaviest first, ties in order
      kid_weight_.clear();
      for (int32_t c : kids_) kid_weight_.push_back(weight(c, slot));
      kid_order_.resize(kids_.size());
      for (size_t i = 0; i < kid_order_.size(); ++i) kid_order_[i] = i;
      // The `budget` heaviest, ties in insertion order (a stable sort's first `budget`).
      std::partial_sort(kid_order_.begin(), kid_order_.begin() + budget, kid_order_.end(), [&](size_t a, size_t b) {
        return kid_weight_[a] > kid_weight_[b] || (kid_weight_[a] == kid_weight_[b] && a < b);
      });
      for (int64_t i = 0; i < budget; ++i) kept_.emplace_back(kids_[kid_order_[i]], kid_weight_[kid_order_[i]], true);
    } else {
      for (int32_t c : kids_) kept_.emplace_back(c, 0.0, false);  // weighed below, where it passes the floor
    }
    for (const auto& [c, w, known] : kept_) {
      const double conf = scale * raw(c);
      conf_[c] = conf;
      if (conf <= 0 || conf < floor) continue;
      heap_.emplace_back(-(known ? w : weight(c, slot)), nodes_[c].token, ++counter, c);
      std::push_heap(heap_.begin(), heap_.end(), later);
    }
  };
  push(start, 1);
  while (!heap_.empty() && static_cast<int64_t>(picked_.size()) < budget) {
    std::pop_heap(heap_.begin(), heap_.end(), later);
    const auto [neg_w, token, count, node] = heap_.back();
    heap_.pop_back();
    picked_.push_back(node);
    taken_[node] = stamp_;
    pick_w_[node] = -neg_w;
    const int64_t d = depth_[nodes_[node].parent] + 1;
    depth_[node] = d;
    push(node, d + 1);
  }
}

// _ranked: the node's picked children, heaviest first (ties: lower token, then insertion order).
void TokenTrie::ranked(int32_t id, std::vector<int32_t>& out) const {
  out.clear();
  for (int32_t c : kids(id)) {
    if (taken_[c] == stamp_) out.push_back(c);
  }
  std::stable_sort(out.begin(), out.end(), [&](int32_t a, int32_t b) {
    const double wa = pick_w_[a], wb = pick_w_[b];
    if (wa != wb) return wa > wb;
    return nodes_[a].token < nodes_[b].token;
  });
}

// _flatten_dfs
void TokenTrie::flatten_dfs(int32_t start, FlatTree& out) const {
  std::vector<std::pair<int32_t, int32_t>> stack;  // (node, parent entry)
  std::vector<int32_t> picked;
  ranked(start, picked);
  for (auto it = picked.rbegin(); it != picked.rend(); ++it) stack.emplace_back(*it, -1);
  while (!stack.empty()) {
    const auto [node, parent] = stack.back();
    stack.pop_back();
    const int32_t idx = static_cast<int32_t>(out.size());
    out.push(nodes_[node].token, parent, pick_w_[node], conf_[node]);
    ranked(node, picked);
    for (auto it = picked.rbegin(); it != picked.rend(); ++it) stack.emplace_back(*it, idx);
  }
}

// _flatten_parallel: whole root-to-leaf branches, heaviest leaf first.
void TokenTrie::flatten_parallel(int32_t start, int64_t budget, FlatTree& out) const {
  std::vector<int32_t> leaves;
  for (int32_t n : picked_) {
    bool is_leaf = true;
    for (int32_t c : kids(n)) is_leaf = is_leaf && taken_[c] != stamp_;
    if (is_leaf) leaves.push_back(n);
  }
  std::stable_sort(leaves.begin(), leaves.end(), [&](int32_t a, int32_t b) {
    const double wa = pick_w_[a], wb = pick_w_[b];
    if (wa != wb) return wa > wb;
    return nodes_[a].token < nodes_[b].token;
  });
  std::vector<int32_t> path;
  for (int32_t leaf : leaves) {
    path.clear();
    for (int32_t n = leaf; n != start; n = nodes_[n].parent) path.push_back(n);
    const int64_t room = budget - static_cast<int64_t>(out.size());
    int64_t j = 0;
    for (auto it = path.rbegin(); it != path.rend() && j < room; ++it, ++j) {
      out.push(nodes_[*it].token, j == 0 ? -1 : static_cast<int32_t>(out.size()) - 1, pick_w_[*it], conf_[*it]);
    }
  }
}

// ------------------------------------------------------------- slots

// _TrieCore.sync
int64_t TokenTrie::sync(const int64_t* sids, const int64_t* rows, const int64_t* num, const int64_t* prompt_lens,
                        const int64_t* parts, int64_t batch, const TokenSource& table, const int64_t* sampled) {
  int64_t rewound = 0;
  std::vector<int32_t>& tokens = sync_tokens_;
  for (int64_t i = 0; i < batch; ++i) {
    if (parts[i] != kDefault) {  // the trie is shared: only the default partition's requests use it
      slots_.try_emplace(sids[i]);
      continue;
    }
    auto it = slots_.find(sids[i]);
    int64_t counted = 0;
    const int64_t kept = sampled != nullptr ? num[i] - sampled[i] : num[i];  // tokens from before this step
    if (it != slots_.end() && kept < it->second.inserted) {  // the runner rewound tokens: start over
      ++rewound;
      counted = std::max(it->second.counted, it->second.inserted);
      finish_request(it->second.handle);
      slots_.erase(it);
      it = slots_.end();
    }
    if (it == slots_.end()) {
      const int64_t prompt = std::min(prompt_lens[i], num[i]);
      table.read(rows[i], 0, prompt, tokens);
      it = slots_.emplace(sids[i], SlotRecord{add_request(tokens.data(), tokens.size()), prompt, counted}).first;
    }
    SlotRecord& rec = it->second;
    if (num[i] > rec.inserted) {
      table.read(rows[i], rec.inserted, num[i], tokens);
      // Positions it counted before a rewind are not counted again.
      extend(rec.handle, tokens.data(), tokens.size(),
             static_cast<size_t>(std::clamp<int64_t>(rec.counted - rec.inserted, 0, num[i] - rec.inserted)));
      rec.inserted = num[i];
    }
  }
  return rewound;
}

void TokenTrie::finish_slot(int64_t sid) {
  const auto it = slots_.find(sid);
  if (it == slots_.end()) return;
  if (it->second.handle >= 0) finish_request(it->second.handle);
  slots_.erase(it);
}

int64_t TokenTrie::num_slot_contexts() const {
  if (config_.context_match <= 0) return 0;
  int64_t n = 0;
  for (const auto& [sid, rec] : slots_) n += rec.handle >= 0;
  return n;
}

int64_t TokenTrie::slot_handle(int64_t sid) const {
  const auto it = slots_.find(sid);
  return it == slots_.end() ? -1 : it->second.handle;
}

// ------------------------------------------------------------- snapshots

// output_counts: pre-order, children in insertion order, subtrees holding no
// output count left out.
void TokenTrie::output_counts(std::vector<int32_t>& parents, std::vector<int32_t>& tokens,
                              std::vector<double>& counts) const {
  parents.clear();
  tokens.clear();
  counts.clear();
  std::function<bool(int32_t, int32_t)> visit = [&](int32_t node, int32_t parent) {
    const size_t row = tokens.size();
    parents.push_back(parent);
    tokens.push_back(nodes_[node].token);
    counts.push_back(nodes_[node].out);
    bool kept = false;
    for (int32_t c : kids(node)) kept = visit(c, static_cast<int32_t>(row)) || kept;
    if (kept || nodes_[node].out > 0) return true;
    parents.resize(row);
    tokens.resize(row);
    counts.resize(row);
    return false;
  };
  for (int32_t c : kids(0)) visit(c, -1);
}

std::string TokenTrie::load_output_counts(const int32_t* parents, const int32_t* tokens, const double* counts,
                                          size_t n) {
  // Every check before any change: a table this trie could not have written
  // (output_counts recurses as deep as a path, at most branch_length) is refused whole.
  std::vector<int32_t> depth(n);
  for (size_t i = 0; i < n; ++i) {
    if (parents[i] < -1 || parents[i] >= static_cast<int64_t>(i)) {
      return "parents: every row's parent must be -1 or an earlier row";
    }
    depth[i] = parents[i] < 0 ? 1 : depth[parents[i]] + 1;
    if (depth[i] > config_.branch_length) {
      return "row " + std::to_string(i) + " is " + std::to_string(depth[i]) + " nodes deep: must be at most " +
             "branch_length=" + std::to_string(config_.branch_length);
    }
    if (!std::isfinite(counts[i]) || counts[i] < 0.0) {
      return "counts: row " + std::to_string(i) + " has " + std::to_string(counts[i]) + ": must be finite and >= 0";
    }
  }
  std::vector<int32_t> rows;
  rows.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const int32_t node = child(parents[i] < 0 ? 0 : rows[parents[i]], tokens[i]);
    nodes_[node].out += counts[i];
    rows.push_back(node);
  }
  maybe_prune();
  return {};
}

}  // namespace lookahead
