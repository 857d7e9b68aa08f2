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

}  // namespace farmem::blockdev
