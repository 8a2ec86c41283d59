"""The Python tool's calls per second, isolated by the kernel vs by the audit hook alone.

  python -m april_jax.bench --mode=python_tool [--repeats=3]

Each side runs the same calls, one at a time as an episode's turn does: typical tool
code (arithmetic, fractions, an exception's traceback, numpy, sympy) through
`run_python(code, isolation=...)`: "kernel" (a bwrap sandbox: namespaces, seccomp, the
audit hook as a second layer) and "none" (no namespaces: the audit hook, rlimits and the
filter). It prints seconds per call for each code and calls per second over the mix.
"""

from __future__ import annotations

import time

from april_jax.benchmarks import common
from april_jax.envs import kernel_isolation
from april_jax.envs.python_tool import ISOLATIONS, run_python

CODES = {
    "arithmetic": "print(sum(i * i for i in range(1000)))",
    "fractions": "from fractions import Fraction\nprint(Fraction(1, 3) + Fraction(1, 6))",
    "traceback": "def f(x):\n  return 1 / x\nf(0)",
    "numpy": "import numpy as np\nprint(np.linalg.solve([[2, 1], [1, 3]], [3, 5]))",
    "sympy": "import sympy\nx = sympy.symbols('x')\nprint(sympy.solve(x**2 - 5*x + 6, x))",
}


def run(repeats: int = 3) -> dict:
  sides = [s for s in ISOLATIONS if s != "kernel" or kernel_isolation.problem() is None]
  result = {"mode": "python_tool", "repeats": repeats, "machine": common.machine()}
  if "kernel" not in sides:
    result["kernel_unavailable"] = kernel_isolation.problem()
    print(f"kernel isolation is not available here: {kernel_isolation.problem()}")
  for side in sides:  # warm the page cache for both
    for code in CODES.values():
      run_python(code, isolation=side)
  print(f"seconds per call, best of {repeats}")
  print(f"{'code':<12}" + "".join(f"{side:>10}" for side in sides))
  per_code = {side: {} for side in sides}
  for name, code in CODES.items():
    for side in sides:
      best = float("inf")
      for _ in range(repeats):
        began = time.perf_counter()
        run_python(code, isolation=side)
        best = min(best, time.perf_counter() - began)
      per_code[side][name] = best
    print(f"{name:<12}" + "".join(f"{per_code[side][name]:>10.3f}" for side in sides))
  print(
      f"{'calls/s':<12}"
      + "".join(f"{len(CODES) / sum(per_code[s].values()):>10.2f}" for s in sides)
  )
  for side in sides:
    result[side] = {
        "seconds_per_call": per_code[side],
        "calls_per_s": len(CODES) / sum(per_code[side].values()),
    }
  return result
