// libFuzzer target: arbitrary bytes as a safetensors file. Must never crash, hang or allocate
// per the header's claims; reading every accepted tensor must stay inside the buffer (ASan).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto buf = std::make_shared<const std::string>(reinterpret_cast<const char*>(data), size);
  auto f = moelora::SafetensorsFile::parse(buf, "fuzz.safetensors");
  if (!f.ok()) return 0;
  volatile uint64_t sum = 0;
  for (const auto& [name, e] : (*f)->entries()) {
    auto t = (*f)->tensor(name);
    if (!t.ok()) continue;
    const auto* p = static_cast<const uint8_t*>(t->data());
    for (size_t i = 0; i < t->nbytes(); ++i) sum += p[i];
  }
  return 0;
}
