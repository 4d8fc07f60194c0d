// Op-level sharding checks: the row-parallel projection with multi-adapter LoRA, expert
// parallelism's masking (pairs routed to another rank's experts give exactly zero there, never
// another expert's or adapter's weights), and the vocabulary-parallel ends. Each against the
// single-device CPU reference on the same inputs.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <limits>

#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/cpu_ops.h"
#include "parallel/parallel_ops.h"
#include "tests/parallel/test_ranks.h"

namespace moelora {
namespace {

using testing_parallel::columns;
using testing_parallel::random_f32;
using testing_parallel::row_rel_diff;
using testing_parallel::run_ranks;

// Row-parallel sums of float32 partials vs one float64 sum rounded once: a few ulp.
constexpr double kReduceTol = 1e-6;

StepBatch batch_with_slots(const std::vector<int32_t>& slots) {
  StepBatch b;
  for (size_t t = 0; t < slots.size(); ++t) {
    b.token_ids.push_back(static_cast<int32_t>(t));
    b.positions.push_back(0);
    b.token_seq.push_back(0);
    b.token_slot.push_back(slots[t]);
  }
  b.seq_pages = {{0}};
  return b;
}

LinearWeight f32_linear(const Tensor& w) {
  LinearWeight lw;
  lw.w = w;
  lw.out = static_cast<int>(w.dim(0));
  lw.in = static_cast<int>(w.dim(1));
  return lw;
}

class RowParallel : public ::testing::TestWithParam<int> {};

// o_proj / down_proj: x, W and LoRA A cut by input columns, B whole. Slots of ranks 1, 4 and 16,
// a slot with rank 0 and base-only tokens (-1) in one batch.
TEST_P(RowParallel, LoraWithMixedRanksAndBaseTokensMatchesUnsharded) {
  const int tp = GetParam(), in = 24, out = 10;
  const std::vector<int> ranks = {1, 4, 16, 0};
  const std::vector<int32_t> slots = {-1, 0, 1, 2, 3, -1, 1, 2, 0};
  const int T = static_cast<int>(slots.size()), S = static_cast<int>(ranks.size());
  const StepBatch batch = batch_with_slots(slots);
  Tensor x = random_f32({T, in}, 1), w = random_f32({out, in}, 2);
  std::vector<Tensor> a(S), bm(S);
  for (int s = 0; s < S; ++s) {
    a[s] = random_f32({std::max(ranks[s], 1), in}, 10 + s);
    bm[s] = random_f32({out, std::max(ranks[s], 1)}, 20 + s);
  }
  CpuBackend full;
  full.begin_step(batch);
  LoraModuleTable table = full.alloc_lora_table(S, in, out);
  for (int s = 0; s < S; ++s) full.set_lora_slot(table, s, a[s], bm[s], ranks[s]);
  Tensor want = Tensor::empty_host(DType::kF32, {T, out}), base = Tensor::empty_host(DType::kF32, {T, out});
  full.linear(x, f32_linear(w), &table, want);
  full.linear(x, f32_linear(w), nullptr, base);

  std::vector<Tensor> got(tp);
  run_ranks(tp, [&](int r, Communicator& comm) {
    const int cols = in / tp, begin = r * cols;
    CpuBackend b;
    b.begin_step(batch);
    LoraModuleTable t = b.alloc_lora_table(S, cols, out);
    std::vector<Tensor> a_cut(S);
    for (int s = 0; s < S; ++s) {
      a_cut[s] = columns(a[s], begin, cols);
      b.set_lora_slot(t, s, a_cut[s], bm[s], ranks[s]);
    }
    got[r] = Tensor::empty_host(DType::kF32, {T, out});
    row_parallel_linear(b, comm, columns(x, begin, cols), f32_linear(columns(w, begin, cols)), &t,
                        batch.token_slot.data(), got[r]);
  });
  for (int r = 1; r < tp; ++r)
    EXPECT_EQ(std::memcmp(got[r].data(), got[0].data(), got[0].nbytes()), 0) << "rank " << r << " differs from rank 0";
  for (int t = 0; t < T; ++t) {
    EXPECT_LE(row_rel_diff(got[0], want, t), kReduceTol) << "token " << t << " slot " << slots[t];
    const bool has_delta = slots[t] >= 0 && ranks[slots[t]] > 0;
    // The comparison can fail: LoRA rows differ from the base by far more than the tolerance.
    if (has_delta) EXPECT_GT(row_rel_diff(base, want, t), 100 * kReduceTol) << "token " << t;
    else EXPECT_LE(row_rel_diff(got[0], base, t), kReduceTol) << "token " << t << " got a LoRA delta";
  }
  EXPECT_EQ(row_parallel_lora_width(&table), 16);  // the largest rank, whatever the batch holds
  EXPECT_EQ(row_parallel_lora_width(nullptr), 0);
}

INSTANTIATE_TEST_SUITE_P(Tp, RowParallel, ::testing::Values(2, 3, 4),
                         [](const auto& info) { return "tp" + std::to_string(info.param); });

// ---- Expert parallelism.
// A routed-expert layer with per-expert LoRA in three slots, laid out as the CPU backend holds it.
struct MoeLayer {
  static constexpr int E = 8, H = 16, I = 8, k = 2, S = 3;
  const int ranks[S] = {4, 2, 8};
  Tensor gate_up = random_f32({E * 2 * I, H}, 100, 0.3f), down = random_f32({E * H, I}, 101, 0.3f);
  std::vector<Tensor> gu_a, gu_b, d_a, d_b;  // per slot: [E, r, H], [E, 2I, r], [E, r, I], [E, H, r]
  MoeLayer() {
    for (int s = 0; s < S; ++s) {
      const int r = ranks[s];
      gu_a.push_back(random_f32({E, r, H}, 200 + s));
      gu_b.push_back(random_f32({E, 2 * I, r}, 210 + s));
      d_a.push_back(random_f32({E, r, I}, 220 + s));
      d_b.push_back(random_f32({E, H, r}, 230 + s));
    }
  }
  // The factors of experts [eb, eb + ne) of every slot in a table (views into the full factors).
  MoeLoraTable table(CpuBackend& b, int eb, int ne) const {
    MoeLoraTable t = b.alloc_moe_lora_table(S, ne, H, I);
    for (int s = 0; s < S; ++s) {
      const int r = ranks[s];
      Backend::MoeLoraSlot ms;
      auto view = [&](const Tensor& f, int64_t per_expert) {
        return Tensor(f.ptr<float>() + eb * per_expert, DType::kF32, {ne * per_expert});
      };
      ms.gu_a = view(gu_a[s], int64_t{r} * H), ms.gu_a_stride = int64_t{r} * H;
      ms.gu_b = view(gu_b[s], int64_t{2} * I * r), ms.gu_b_stride = int64_t{2} * I * r;
      ms.d_a = view(d_a[s], int64_t{r} * I), ms.d_a_stride = int64_t{r} * I;
      ms.d_b = view(d_b[s], int64_t{H} * r), ms.d_b_stride = int64_t{H} * r;
      ms.gu_rank = ms.d_rank = r;
      b.set_moe_lora_slot(t, s, ms);
    }
    return t;
  }
  ExpertWeights experts(int eb, int ne) const {
    ExpertWeights w;
    w.num_experts = ne, w.hidden = H, w.intermediate = I;
    w.gate_up.w = gate_up.slice_rows(int64_t{eb} * 2 * I, int64_t{ne} * 2 * I);
    w.down.w = down.slice_rows(int64_t{eb} * H, int64_t{ne} * H);
    return w;
  }
};

struct Routing {
  Tensor ids, weights;
};
Routing fixed_routing(const std::vector<std::array<int, 2>>& pairs) {
  Routing r{Tensor::empty_host(DType::kI32, {static_cast<int64_t>(pairs.size()), 2}),
            Tensor::empty_host(DType::kF32, {static_cast<int64_t>(pairs.size()), 2})};
  for (size_t t = 0; t < pairs.size(); ++t)
    for (int j = 0; j < 2; ++j) {
      r.ids.ptr<int32_t>()[t * 2 + j] = pairs[t][j];
      r.weights.ptr<float>()[t * 2 + j] = j == 0 ? 0.7f : 0.3f;
    }
  return r;
}

// The whole layer on one device.
Tensor unsharded_moe(const MoeLayer& m, const Tensor& x, const Routing& routing, const std::vector<int32_t>& slots) {
  CpuBackend b;
  MoeLoraTable t = m.table(b, 0, MoeLayer::E);
  Tensor out = Tensor::empty_host(DType::kF32, {x.rows(), MoeLayer::H});
  expert_parallel_moe(x, routing.ids, routing.weights, slots.data(), m.experts(0, MoeLayer::E), &t, 0, MoeLayer::E, out);
  return out;
}

// Rank r's partial with experts [r*E/ep, (r+1)*E/ep); `table` replaces the rank's own LoRA table.
Tensor rank_moe(const MoeLayer& m, int ep, int r, const Tensor& x, const Routing& routing,
                const std::vector<int32_t>& slots, MoeLoraTable* table = nullptr) {
  const int eb = r * MoeLayer::E / ep, ne = (r + 1) * MoeLayer::E / ep - eb;
  CpuBackend b;
  MoeLoraTable own = m.table(b, eb, ne);
  Tensor out = Tensor::empty_host(DType::kF32, {x.rows(), MoeLayer::H});
  expert_parallel_moe(x, routing.ids, routing.weights, slots.data(), m.experts(eb, ne), table ? table : &own, eb,
                      MoeLayer::E, out);
  return out;
}

bool row_is_exact_zero(const Tensor& t, int64_t r) {
  for (int64_t c = 0; c < t.cols(); ++c) {
    const float v = t.ptr<float>()[r * t.ld() + c];
    if (v != 0.0f || std::signbit(v)) return false;
  }
  return true;
}

bool rows_equal(const Tensor& a, const Tensor& b, int64_t r) {
  return std::memcmp(a.ptr<float>() + r * a.ld(), b.ptr<float>() + r * b.ld(), a.cols() * sizeof(float)) == 0;
}

// Every token routed to one rank's experts (ep 2 and 4, each owner in turn): the owner reproduces
// the single-device output bit for bit, every other rank gives exact zeros.
TEST(ExpertParallel, AllTokensOnOneRanksExpertsOthersGiveExactZero) {
  MoeLayer m;
  const std::vector<int32_t> slots = {-1, 0, 1, 2, 0, -1};
  const int T = static_cast<int>(slots.size());
  Tensor x = random_f32({T, MoeLayer::H}, 7);
  for (int ep : {2, 4}) {
    for (int owner = 0; owner < ep; ++owner) {
      const int eb = owner * MoeLayer::E / ep, ne = (owner + 1) * MoeLayer::E / ep - eb;
      std::vector<std::array<int, 2>> pairs;
      for (int t = 0; t < T; ++t) pairs.push_back({eb + t % ne, eb + (t + 1) % ne});
      const Routing routing = fixed_routing(pairs);
      const Tensor want = unsharded_moe(m, x, routing, slots);
      for (int r = 0; r < ep; ++r) {
        const Tensor got = rank_moe(m, ep, r, x, routing, slots);
        for (int t = 0; t < T; ++t) {
          if (r == owner) EXPECT_TRUE(rows_equal(got, want, t)) << "ep " << ep << " owner " << r << " token " << t;
          else EXPECT_TRUE(row_is_exact_zero(got, t)) << "ep " << ep << " rank " << r << " token " << t;
        }
      }
    }
  }
}

// Slot 2's tokens go to experts 6 and 7 (rank 1 of 2), slot 0's to 0 and 1 (rank 0). On rank 0
// the slot-2 rows must be exactly zero: rank 0 holds slot 2's factors for experts 0..3 and other
// adapters' factors, and a pair mapped onto any of them (the sentinel bug of the peer, where
// -1 + slot * E lands on the previous adapter's last expert) would show up. To make such a read
// visible even where it would add little, every factor rank 0 must never read here is NaN.
TEST(ExpertParallel, AdapterWhoseExpertsLiveOnAnotherRankGivesExactZeroThere) {
  MoeLayer m;
  const std::vector<int32_t> slots = {2, 0, 2, 0, 2};
  const int T = static_cast<int>(slots.size());
  std::vector<std::array<int, 2>> pairs;
  for (int t = 0; t < T; ++t) pairs.push_back(slots[t] == 2 ? std::array<int, 2>{6, 7} : std::array<int, 2>{1, 0});
  const Routing routing = fixed_routing(pairs);
  Tensor x = random_f32({T, MoeLayer::H}, 8);
  const Tensor want = unsharded_moe(m, x, routing, slots);

  MoeLayer poisoned;  // same weights; rank 0's copies of slot 1 and slot 2 factors are NaN
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int s : {1, 2})
    for (Tensor* f : {&poisoned.gu_a[s], &poisoned.gu_b[s], &poisoned.d_a[s], &poisoned.d_b[s]})
      for (int64_t i = 0; i < f->numel() / 2; ++i) f->ptr<float>()[i] = nan;  // experts 0..3
  CpuBackend b;
  MoeLoraTable rank0_table = poisoned.table(b, 0, 4);
  const Tensor rank0 = rank_moe(m, 2, 0, x, routing, slots, &rank0_table);
  const Tensor rank1 = rank_moe(m, 2, 1, x, routing, slots);
  for (int t = 0; t < T; ++t) {
    if (slots[t] == 2) {
      EXPECT_TRUE(row_is_exact_zero(rank0, t)) << "token " << t << ": rank 0 read weights for a pair it does not own";
      EXPECT_TRUE(rows_equal(rank1, want, t)) << "token " << t;
    } else {
      EXPECT_TRUE(rows_equal(rank0, want, t)) << "token " << t;
      EXPECT_TRUE(row_is_exact_zero(rank1, t)) << "token " << t;
    }
  }
}

// Random top-2 routing over all experts, every slot and the base model mixed: the partials of the
// EP ranks (even and uneven expert counts), summed by the fake all-reduce, give the unsharded layer.
TEST(ExpertParallel, MixedRoutingSummedOverRanksMatchesUnsharded) {
  MoeLayer m;
  const std::vector<int32_t> slots = {-1, 0, 1, 2, 2, 1, 0, -1, 0, 2, 1};
  const int T = static_cast<int>(slots.size()), E = MoeLayer::E;
  Tensor x = random_f32({T, MoeLayer::H}, 9);
  Tensor logits = random_f32({T, E}, 10, 2.0f);
  Routing routing{Tensor::empty_host(DType::kI32, {T, 2}), Tensor::empty_host(DType::kF32, {T, 2})};
  cpu::topk_softmax(logits.ptr<float>(), T, E, 2, true, routing.ids.ptr<int32_t>(), routing.weights.ptr<float>());
  const Tensor want = unsharded_moe(m, x, routing, slots);
  for (int ep : {2, 3, 4, 8}) {
    std::vector<Tensor> got(ep);
    run_ranks(ep, [&](int r, Communicator& comm) {
      got[r] = rank_moe(m, ep, r, x, routing, slots);
      comm.all_reduce_sum(got[r].ptr<float>(), static_cast<size_t>(got[r].numel()));
    });
    for (int t = 0; t < T; ++t) {
      EXPECT_LE(row_rel_diff(got[0], want, t), kReduceTol) << "ep " << ep << " token " << t;
      for (int r = 1; r < ep; ++r) EXPECT_TRUE(rows_equal(got[r], got[0], t)) << "ep " << ep << " rank " << r;
    }
  }
}

// ---- Vocabulary-parallel ends: 10 rows over 4 ranks (chunks of 3, the last one padded).
TEST(VocabParallel, EmbeddingAndLogitsMatchUnshardedExactly) {
  const int V = 10, H = 6, tp = 4, chunk = 3;
  Tensor table = random_f32({V, H}, 11);
  const std::vector<int32_t> ids = {0, 9, 3, 3, 7, 2, 5};
  const int T = static_cast<int>(ids.size());
  Tensor x = random_f32({T, H}, 12);
  CpuBackend full;
  Tensor want_logits = Tensor::empty_host(DType::kF32, {T, V});
  full.linear(x, f32_linear(table), nullptr, want_logits);
  std::vector<Tensor> emb(tp), logits(tp);
  run_ranks(tp, [&](int r, Communicator& comm) {
    Tensor shard = Tensor::empty_host(DType::kF32, {chunk, H});  // rows past V stay zero
    for (int i = 0; i < chunk && r * chunk + i < V; ++i)
      std::memcpy(shard.ptr<float>() + i * H, table.ptr<float>() + (r * chunk + i) * H, H * sizeof(float));
    emb[r] = Tensor::empty_host(DType::kF32, {T, H});
    vocab_parallel_embed(shard, r * chunk, ids, comm, emb[r]);
    CpuBackend b;
    logits[r] = Tensor::empty_host(DType::kF32, {T, V});
    vocab_parallel_logits(b, comm, x, f32_linear(shard), V, logits[r]);
  });
  for (int r = 0; r < tp; ++r) {
    for (int t = 0; t < T; ++t)
      EXPECT_EQ(std::memcmp(emb[r].ptr<float>() + t * H, table.ptr<float>() + ids[t] * H, H * sizeof(float)), 0)
          << "rank " << r << " token " << t;
    EXPECT_EQ(std::memcmp(logits[r].data(), want_logits.data(), want_logits.nbytes()), 0) << "rank " << r;
  }
}

}  // namespace
}  // namespace moelora
