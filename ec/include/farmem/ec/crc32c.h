// CRC-32C (Castagnoli) on ISA-L: a checksum of cells that needs no key, so that a daemon can
// check bytes it moves for the client without being able to read them (far_ptr's compaction
// offload: docs/wire-protocol.md, GATHER_CELL's reply; docs/security.md). It finds accidental
// corruption (every 1-, 2- and 3-bit error, any burst up to 32 bits), not tampering: what a
// lender changes on purpose it can also make match. Any thread.
#pragma once

#include <cstdint>
#include <span>

namespace farmem::ec {

// The standard CRC-32C of `data` (initial value and final xor ~0: "123456789" -> 0xe3069283).
uint32_t Crc32c(std::span<const uint8_t> data);

}  // namespace farmem::ec
