#include <gtest/gtest.h>
#include "support.h"
using namespace kda;
using namespace kda::test;
TEST(PrefillSmoke, ChunkedMatchesReference) {
  PrefillCase c;
  c.seqlens = {130, 130};
  auto d = make_prefill(c);
  auto ref = widen(d);
  ref.out.fill(0);
  PrefillParams p = d.params();
  p.exec.backend = Backend::kCpu;
  ASSERT_TRUE(prefill(p).ok());
  PrefillParams pr = ref.params();
  pr.exec.backend = Backend::kCpuReference;
  ASSERT_TRUE(prefill(pr).ok());
  auto cmp = compare(d.out, ref.out, 1e-4);
  EXPECT_TRUE(cmp.ok(1e-4)) << cmp.rel_l2 << cmp.first_mismatches;
}
