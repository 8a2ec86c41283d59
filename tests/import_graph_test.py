"""The package's import graph: no cycles, and every arrow points down the layers."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "april_jax"

# Lowest first. A component may import its own modules and those of lower layers only.
LAYERS = [
    {"errors", "cli"},
    {"runtime"},  # processes: workers, interrupts, SIGTERM, the workdir lock, several hosts
    {"registry", "sharding", "metrics", "checkpoint", "tokenizer", "buckets"},
    {"settings"},  # every setting, typed, with its default; the ConfigDict made from them
    {"models"},
    {"rewards", "data"},
    {"tasks"},  # the built-in task, and a run's task from its config
    {"envs"},
    {"sampler"},
    {"rollout"},  # the scheduler, the rollout behind one interface, its process
    {"rl"},
    {"validation"},  # a run's settings checked at start-up
    {"planning"},  # what fits: memory, the split, every program compiled
    {"run"},  # one run: the trainer, its parts, resume
    {"main", "bench", "benchmarks", "export", "replay", "plan"},  # the commands
]
# Modules placed apart from their package's layer (none today).
COMMANDS: dict[str, str] = {}
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _module_name(path: Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
  """Every april_jax module `path` imports, at any depth (function-level included)."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      # `from april_jax.x import y`: y is a module, or a name defined in x.
      names = [
          f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
          for a in node.names
      ]
    else:
      continue
    for name in names:
      while name and name not in modules:
        name = name.rpartition(".")[0]
      if name.startswith("april_jax."):
        out.add(name)
  return out


def _graph() -> dict[str, set[str]]:
  paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
  modules = set(paths)
  return {m: _imports(p, modules) - {m} for m, p in paths.items()}


def _component(module: str) -> str:
  return COMMANDS.get(module) or module.split(".")[1]


def test_every_component_is_placed_in_a_layer():
  assert {_component(m) for m in _graph() if m != "april_jax"} <= set(RANK)


def test_imports_point_down_the_layers():
  uphill = sorted(
      f"{m} -> {d}"
      for m, deps in _graph().items()
      if m != "april_jax"
      for d in deps
      if _component(d) != _component(m) and RANK[_component(d)] > RANK[_component(m)]
  )
  assert not uphill, uphill


def test_no_import_cycles():
  graph = _graph()
  # Package __init__ files re-export their submodules; an edge into a package is an edge
  # into what it re-exports, so cycles through them are real cycles.
  state: dict[str, int] = {}
  cycles = []

  def visit(node, path):
    state[node] = 1
    for dep in sorted(graph[node]):
      if state.get(dep) == 1:
        cycles.append(path[path.index(dep) :] + [dep])
      elif dep not in state:
        visit(dep, path + [dep])
    state[node] = 2

  for module in sorted(graph):
    if module not in state:
      visit(module, [module])
  assert not cycles, cycles
