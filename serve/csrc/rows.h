// Row counts as compile-time constants: a kernel templated on its number of activation rows (its
// accumulators live in registers only when the count is known at compile time) is called once
// through `with_rows<Max>(rows, f)`, which runs f(std::integral_constant<int, R>{}) with R = rows,
// clamped to [1, Max].
#pragma once

#include <type_traits>
#include <utility>

namespace warsha {

template <int Max, int R = 1, typename F>
inline void with_rows(int rows, F&& f) {
  if constexpr (R >= Max) {
    f(std::integral_constant<int, Max>{});
  } else {
    if (rows <= R) return f(std::integral_constant<int, R>{});
    with_rows<Max, R + 1>(rows, std::forward<F>(f));
  }
}

}  // namespace warsha
