#include "test_process.h"

#include <memory>

#include "nbd_test_client.h"
#include "support/wait.h"

namespace farmem::blockdev::testing {

bool WaitForUnixSocket(const std::string& path, std::chrono::milliseconds timeout) {
  return farmem::testing::WaitUntil([&] { return ConnectUnix(path).has_value(); }, timeout,
                                    std::chrono::milliseconds(10));
}

std::string FarmemNbdPath() { return farmem::testing::BinPath("farmem-nbd"); }

Result<std::unique_ptr<FarmemNbd>> FarmemNbd::Start(const std::string& size,
                                                    std::vector<std::string> extra_args) {
  std::vector<std::string> args = {"--backend", "memory", "--size", size};
  args.insert(args.end(), extra_args.begin(), extra_args.end());
  return Launch(std::move(args));
}

Result<std::unique_ptr<FarmemNbd>> FarmemNbd::Launch(std::vector<std::string> args) {
  auto dir = std::make_unique<TempDir>("farmem-nbd-test");
  if (!dir->ok()) return Err(dir->status());
  const std::string sock = dir->File("nbd.sock");
  std::vector<std::string> argv = {FarmemNbdPath(), "--unix", sock, "--no-swap-safe"};
  argv.insert(argv.end(), args.begin(), args.end());
  SpawnOptions opts;
  opts.stderr_path = dir->File("stderr.log");
  FARMEM_ASSIGN_OR_RETURN(ChildProcess p, ChildProcess::Spawn(argv, opts));
  if (!WaitForUnixSocket(sock, std::chrono::seconds(20))) {
    return Err(Unavailable("farmem-nbd did not start: " + ReadFile(dir->File("stderr.log"))));
  }
  return std::unique_ptr<FarmemNbd>(new FarmemNbd(std::move(dir), sock, std::move(p)));
}

}  // namespace farmem::blockdev::testing
