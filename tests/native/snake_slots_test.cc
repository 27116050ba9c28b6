// Host check of snake_slots (cuda/single/snake_slots.cuh), the backward tile kernel's deal of a
// batch's groups to slots: for random, tied and skewed group sizes and every row width S
// the kernel can have, ord is a permutation of the batch's groups; rows hold size ranks in
// order (row j: ranks j*S .. j*S + S - 1, every other full row reversed); with two full
// rows, the largest pair a thread takes is the smallest any pairing can give. Build and run
// (repository root):
//   g++ -std=c++17 -O2 -Icuda tests/native/snake_slots_test.cc -o snake_slots_test &&
//   ./snake_slots_test
// Prints PASS/FAIL lines; exit status 1 on any failure.
#include "single/snake_slots.cuh"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) ++failures;
  std::printf("%s %s\n", ok ? "PASS" : "FAIL", what.c_str());
}

// ord as warp 0 writes it: every lane calls snake_slots (lanes are independent).
std::vector<int> deal(const std::vector<int>& sizes, int S) {
  const int nB = (int)sizes.size();
  std::vector<int> ord(64, -1);  // slots past the batch must stay unwritten
  for (int lane = 0; lane < 32; ++lane)
    flowtt::snake_slots(nB, S, lane, ord.data(), [&](int k) { return sizes[k]; });
  return ord;
}

// The largest sum of sizes one thread takes (thread = slot column s: slots s, s + S, ...).
int largest_column(const std::vector<int>& sizes, const std::vector<int>& ord, int S) {
  int worst = 0;
  for (int s = 0; s < S; ++s) {
    int sum = 0;
    for (int p = s; p < (int)ord.size(); p += S) sum += sizes[ord[p]];
    worst = std::max(worst, sum);
  }
  return worst;
}

std::string check_case(const std::vector<int>& sizes, int S) {
  const int nB = (int)sizes.size();
  std::vector<int> ord = deal(sizes, S);
  if (std::any_of(ord.begin() + nB, ord.end(), [](int g) { return g != -1; }))
    return "slot past the batch written";
  ord.resize(nB);
  std::vector<int> seen(nB, 0);
  for (int g : ord) {
    if (g < 0 || g >= nB) return "slot without a group";
    if (seen[g]++) return "group in two slots";
  }
  // rank of each group: larger first, ties by index
  std::vector<int> by_rank(nB);
  for (int k = 0; k < nB; ++k) by_rank[k] = k;
  std::stable_sort(by_rank.begin(), by_rank.end(),
                   [&](int a, int b) { return sizes[a] > sizes[b]; });
  for (int p = 0; p < nB; ++p) {
    const int j = p / S, s = p % S;
    const bool rev = (j & 1) && (j + 1) * S <= nB;
    if (ord[p] != by_rank[j * S + (rev ? S - 1 - s : s)]) return "slot " + std::to_string(p);
  }
  if (nB == 2 * S) {  // pairs: largest with smallest is the best any pairing can do
    std::vector<int> desc(sizes);
    std::sort(desc.rbegin(), desc.rend());
    int best = 0;
    for (int s = 0; s < S; ++s) best = std::max(best, desc[s] + desc[2 * S - 1 - s]);
    if (largest_column(sizes, ord, S) != best) return "pairs not optimal";
  }
  return "";
}

}  // namespace

int main() {
  std::mt19937 rng(20261204);
  const std::vector<std::pair<std::string, std::function<int()>>> draws = {
      {"uniform 1..30", [&] { return (int)(rng() % 30) + 1; }},
      {"ties 3..4", [&] { return 3 + (int)(rng() % 2); }},
      {"all equal", [] { return 7; }},
      {"skewed (one in 8 is 200..999)",
       [&] { return rng() % 8 == 0 ? 200 + (int)(rng() % 800) : 1 + (int)(rng() % 12); }},
  };
  for (const auto& draw : draws)
    for (int S : {1, 2, 4, 8, 16, 32})
      for (int nB = 1; nB <= 32; ++nB) {
        std::string err;
        for (int rep = 0; rep < 20 && err.empty(); ++rep) {
          std::vector<int> sizes(nB);
          for (int& x : sizes) x = draw.second();
          err = check_case(sizes, S);
        }
        if (!err.empty() || nB == 32)
          check(err.empty(), draw.first + " S=" + std::to_string(S) + " nB<=" + std::to_string(nB) +
                                 (err.empty() ? "" : ": " + err));
      }
  // the kernel's D128 r64 case: 16 groups on 512 threads (S = 8), a hot group first
  std::vector<int> sizes = {90, 12, 11, 13, 12, 14, 10, 12, 13, 11, 12, 15, 9, 12, 13, 12};
  std::vector<int> ord = deal(sizes, 8);
  ord.resize(16);
  std::vector<int> identity(16);
  for (int k = 0; k < 16; ++k) identity[k] = k;
  check(largest_column(sizes, ord, 8) == 99 && largest_column(sizes, identity, 8) == 103,
        "D128 batch with a hot group: largest pair 103 -> 99");
  std::printf("%s: %d failure(s)\n", failures ? "FAIL" : "PASS", failures);
  return failures ? 1 : 0;
}
