// Linked into every test binary (farmem_add_test, cmake/FarmemTesting.cmake): a fatal failure
// (ASSERT_*, FAIL()) on the thread that runs the tests ends the test there, also when it happens
// in a helper the test called. Plain GoogleTest only returns from the function that asserted, so
// a fixture helper that failed (StartDaemons when a daemon was slow to answer AUTH under load) let
// the test go on with what it had not set up: it crashed on a null store, after the helper's
// message, and took the binary's other tests with it. GoogleTest's own way: a listener that
// throws testing::AssertionException, which the framework takes as "reported already".
// Other threads are left alone (an exception there would end the process).
#include <gtest/gtest.h>

#include <thread>

namespace {

const std::thread::id kTestThread = std::this_thread::get_id();  // static init: main's thread

class FatalFailureEndsTest final : public ::testing::EmptyTestEventListener {
 public:
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (result.fatally_failed() && std::this_thread::get_id() == kTestThread) {
      throw ::testing::AssertionException(result);
    }
  }
};

[[maybe_unused]] const bool kInstalled = [] {
  ::testing::UnitTest::GetInstance()->listeners().Append(new FatalFailureEndsTest);
  return true;
}();

}  // namespace
