#include "farmem/blockdev/block_backend.h"

namespace farmem::blockdev {

void BlockBackend::ExecuteBatch(std::span<BlockOp> ops, BatchListener* /*listener*/) {
  for (BlockOp& op : ops) {
    switch (op.kind) {
      case BlockOp::Kind::kRead:
        op.status = Read(op.offset, op.read_into);
        break;
      case BlockOp::Kind::kWrite:
        op.status = Write(op.offset, op.data, op.fua);
        break;
      case BlockOp::Kind::kFlush:
        op.status = Flush();
        break;
      case BlockOp::Kind::kTrim:
        op.status = Trim(op.offset, op.length, op.fua);
        break;
      case BlockOp::Kind::kWriteZeroes:
        op.status = WriteZeroes(op.offset, op.length, op.may_trim, op.fua);
        break;
    }
  }
}

Status BatchBackend::RunOne(BlockOp op) {
  ExecuteBatch({&op, 1});
  return op.status;
}

Status BatchBackend::Read(uint64_t offset, std::span<uint8_t> buf) {
  return RunOne(
      {.kind = BlockOp::Kind::kRead, .offset = offset, .length = buf.size(), .read_into = buf});
}

Status BatchBackend::Write(uint64_t offset, std::span<const uint8_t> data, bool fua) {
  return RunOne({.kind = BlockOp::Kind::kWrite,
                 .fua = fua,
                 .offset = offset,
                 .length = data.size(),
                 .data = data});
}

Status BatchBackend::Trim(uint64_t offset, uint64_t length, bool fua) {
  return RunOne({.kind = BlockOp::Kind::kTrim, .fua = fua, .offset = offset, .length = length});
}

Status BatchBackend::WriteZeroes(uint64_t offset, uint64_t length, bool may_trim, bool fua) {
  return RunOne({.kind = BlockOp::Kind::kWriteZeroes,
                 .fua = fua,
                 .may_trim = may_trim,
                 .offset = offset,
                 .length = length});
}

}  // namespace farmem::blockdev
