// Test hooks of far_ptr's budget gate (farptr/src/scope.cc: a thread entering its outermost
// DerefScope while a runtime is over its local budget reclaims memory or waits). Not a public API:
// only tests include this header.
#pragma once

namespace farmem::farptr_internal {

struct ObjectEntry;

// Whether the runtime that holds `e` has its over-budget flag set (the gate holds threads).
bool OverBudgetForTest(ObjectEntry* e);
// Sets that flag whatever the frames in use, as a GetFrame crossing the budget does.
void SetOverBudgetForTest(ObjectEntry* e);

}  // namespace farmem::farptr_internal
