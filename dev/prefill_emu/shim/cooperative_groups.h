// cooperative_groups.h (emulation shim): the grid barrier cannot be emulated (a grid's blocks run
// one after another), so the emulator runs a cooperative kernel's phases as separate launches and
// never calls this.
#pragma once
#include <cstdio>
#include <cstdlib>

namespace cooperative_groups {
struct grid_group {
  void sync() const {
    std::fprintf(stderr, "EMU: grid barrier not emulated (launch the kernel's phases instead)\n");
    std::abort();
  }
};
inline grid_group this_grid() { return {}; }
}  // namespace cooperative_groups
