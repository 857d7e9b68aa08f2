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
  BlockOp op;
  op.kind = BlockOp::Kind::kRead;
  op.offset = offset;
  op.length = buf.size();
  op.read_into = buf;
  return RunOne(op);
}

Status BatchBackend::Write(uint64_t offset, std::span<const uint8_t> data, bool fua) {
  BlockOp op;
  op.kind = BlockOp::Kind::kWrite;
  op.fua = fua;
  op.offset = offset;
  op.length = data.size();
  op.data = data;
  return RunOne(op);
}

Status BatchBackend::Trim(uint64_t offset, uint64_t length, bool fua) {
  BlockOp op;
  op.kind = BlockOp::Kind::kTrim;
  op.fua = fua;
  op.offset = offset;
  op.length = length;
  return RunOne(op);
}

Status BatchBackend::WriteZeroes(uint64_t offset, uint64_t length, bool may_trim, bool fua) {
  BlockOp op;
  op.kind = BlockOp::Kind::kWriteZeroes;
  op.fua = fua;
  op.may_trim = may_trim;
  op.offset = offset;
  op.length = length;
  return RunOne(op);
}

}  // namespace farmem::blockdev
