#include "farmem/ec/crc32c.h"

#include <isa-l/crc.h>

#include <algorithm>
#include <limits>

namespace farmem::ec {

uint32_t Crc32c(std::span<const uint8_t> data) {
  // crc32_iscsi takes an int length: feed larger inputs in pieces.
  uint32_t crc = ~0u;
  const uint8_t* p = data.data();
  size_t left = data.size();
  while (left > 0) {
    const int n = static_cast<int>(std::min<size_t>(left, std::numeric_limits<int>::max() / 2));
    crc = crc32_iscsi(const_cast<uint8_t*>(p), n, crc);
    p += n;
    left -= static_cast<size_t>(n);
  }
  return ~crc;
}

}  // namespace farmem::ec
