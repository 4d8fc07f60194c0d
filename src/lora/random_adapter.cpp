#include "lora/random_adapter.h"

#include <thread>

#include "model/archs.h"

namespace moelora {

namespace {

// splitmix64: fast, and good enough for benchmark weights.
uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

Tensor random_host(const std::vector<int64_t>& shape, uint64_t seed, float scale) {
  Tensor t = Tensor::empty_host(DType::kF32, shape);
  float* p = t.ptr<float>();
  const int64_t n = t.numel();
  uint64_t s = mix(seed);
  for (int64_t i = 0; i < n; ++i) {
    s = mix(s);
    p[i] = (static_cast<float>(s >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f) * scale;
  }
  return t;
}

}  // namespace

std::shared_ptr<const LoraAdapter> make_random_adapter(const ModelConfig& cfg, const std::string& name, int rank,
                                                       uint64_t seed, float scale) {
  auto a = std::make_shared<LoraAdapter>();
  a->name = name;
  a->path = "";
  a->max_rank = rank;
  a->dense.resize(cfg.num_layers);
  a->experts.resize(cfg.num_layers);
  // One thread per layer group: an adapter of a 48-layer MoE is gigabytes of floats.
  const int threads = static_cast<int>(std::max(1u, std::min(16u, std::thread::hardware_concurrency())));
  std::vector<std::thread> pool;
  for (int w = 0; w < threads; ++w)
    pool.emplace_back([&, w] {
      for (int l = w; l < cfg.num_layers; l += threads) {
        const uint64_t base = seed * 1000003ull + static_cast<uint64_t>(l) * 64;
        for (int t = 0; t < kNumLoraTargets; ++t) {
          auto [in, out] = lora_target_shape(cfg, l, static_cast<LoraTarget>(t));
          if (in == 0) continue;
          LoraFactor& f = a->dense[l][t];
          f.a = random_host({rank, in}, base + 2 * t, scale);
          f.b = random_host({out, rank}, base + 2 * t + 1, scale);
          f.rank = rank;
        }
        if (l < static_cast<int>(cfg.layer_is_moe.size()) && cfg.layer_is_moe[l]) {
          const int64_t E = cfg.num_experts, H = cfg.hidden_size, I = cfg.moe_intermediate_size;
          ExpertLora& x = a->experts[l];
          x.gu_a = random_host({E, rank, H}, base + 60, scale);
          x.gu_b = random_host({E, 2 * I, rank}, base + 61, scale);
          x.d_a = random_host({E, rank, I}, base + 62, scale);
          x.d_b = random_host({E, H, rank}, base + 63, scale);
          x.gu_rank = x.d_rank = rank;
        }
      }
    });
  for (auto& t : pool) t.join();
  size_t bytes = 0;
  for (const auto& layer : a->dense)
    for (const LoraFactor& f : layer)
      if (f.rank) bytes += f.a.nbytes() + f.b.nbytes();
  for (const ExpertLora& x : a->experts)
    if (x.any()) bytes += x.gu_a.nbytes() + x.gu_b.nbytes() + x.d_a.nbytes() + x.d_b.nbytes();
  a->bytes = bytes;
  return a;
}

DeviceRandomAdapters make_device_random_adapters(const ModelConfig& c, Backend& b, int slots, int rank, uint64_t seed,
                                                 float scale) {
  DeviceRandomAdapters r;
  r.tables.resize(c.num_layers);
  const DType dt = b.lora_dtype();
  auto rnd = [&](std::vector<int64_t> shape) {
    Tensor t = b.random_tensor(dt, shape, ++seed, scale);
    r.keep.push_back(t);
    return t;
  };
  for (int l = 0; l < c.num_layers; ++l) {
    for (int t = 0; t < kNumLoraTargets; ++t) {
      auto [in, out] = lora_target_shape(c, l, static_cast<LoraTarget>(t));
      if (in == 0) continue;
      r.dense.push_back(std::make_unique<LoraModuleTable>(b.alloc_lora_table(slots, in, out)));
      for (int s = 0; s < slots; ++s) b.set_lora_slot(*r.dense.back(), s, rnd({rank, in}), rnd({out, rank}), rank);
      r.tables[l].dense[t] = r.dense.back().get();
    }
    if (!c.layer_is_moe[l]) continue;
    const int64_t E = c.num_experts, H = c.hidden_size, I = c.moe_intermediate_size;
    r.experts.push_back(std::make_unique<MoeLoraTable>(b.alloc_moe_lora_table(slots, c.num_experts, c.hidden_size,
                                                                              c.moe_intermediate_size)));
    for (int s = 0; s < slots; ++s) {
      Backend::MoeLoraSlot m;
      m.gu_a = rnd({E, rank, H});
      m.gu_b = rnd({E, 2 * I, rank});
      m.d_a = rnd({E, rank, I});
      m.d_b = rnd({E, H, rank});
      m.gu_rank = m.d_rank = rank;
      m.gu_a_stride = rank * H;
      m.gu_b_stride = 2 * I * rank;
      m.d_a_stride = rank * I;
      m.d_b_stride = H * rank;
      b.set_moe_lora_slot(*r.experts.back(), s, m);
    }
    r.tables[l].experts = r.experts.back().get();
  }
  return r;
}

}  // namespace moelora
