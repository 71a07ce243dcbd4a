"""Import rules of the package, checked by `make lint` (parses sources, runs nothing).

1. No import cycle among cas_bank's modules, counting every import: at module level,
   inside functions and under `if TYPE_CHECKING:` (a cycle there is still a circle
   a reader has to follow).
2. Layers, from the bottom: plain values (`errors`, `config`, `arrays`, `native`,
   `_version`), then `cas_bank.blocks` (stores, hashing, codecs), then
   `cas_bank.index` (records and lookups) with the spec and the counters (`spec`,
   `stats`), then the paths a reader follows
   (`cas_bank.write`, `cas_bank.evict`, `cas_bank.restore`, the shared tier
   `cas_bank.remote`, and `cas_bank.owner`, the protocols that join them to the bank),
   then the API (`cas_bank.bank` and its format `cas_bank.bank_format`,
   `cas_bank.namespace`, the package itself, the maintenance tools
   `cas_bank.maintenance`, the store conformance suite `cas_bank.testing`, the
   runtime and the command line). Every module is in one
   layer and imports nothing of a layer above its own.
   Code below the API takes the narrow collaborators it uses (a store, counters, an
   access log), or `cas_bank.owner`'s protocols, never the `Bank`.

Usage: python scripts/check_imports.py [repository root]; exit status 1 on a violation.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

# Package name -> directory, as pyproject.toml maps them.
PACKAGES = {"cas_bank": "cas_bank", "cas_bank.runtime": "runtime", "cas_bank.tools": "tools"}
# The layers, bottom first: a module imports nothing of a later one.
LAYERS = (
    (
        "cas_bank.errors",
        "cas_bank.config",
        "cas_bank.arrays",
        "cas_bank.native",
        "cas_bank._version",
    ),
    ("cas_bank.blocks",),
    ("cas_bank.index", "cas_bank.spec", "cas_bank.stats"),
    ("cas_bank.write", "cas_bank.evict", "cas_bank.restore", "cas_bank.remote", "cas_bank.owner"),
    (
        "cas_bank.bank",
        "cas_bank.bank_format",
        "cas_bank.namespace",
        "cas_bank.maintenance",
        "cas_bank.testing",
        "cas_bank.runtime",
        "cas_bank.tools",
    ),
)
PACKAGE_ITSELF = "cas_bank"  # its __init__: the API's top


def modules(root: Path) -> dict[str, Path]:
    """Every module of the package by dotted name."""
    out: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def imports(name: str, path: Path, known: set[str], native: set[str]) -> set[str]:
    """The package's modules `name` imports, anywhere in its source (compiled ones,
    `native`, depend on nothing of ours and are left out)."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known or sub in native:  # `from package import module`
                    found.add(sub)
                elif base in known:  # a name defined in module `base`
                    found.add(base)
    found.discard(name)
    return found - native


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def layer(name: str) -> int | None:
    """The layer of module `name` (0 at the bottom); None for one in none, which
    `violations` reports."""
    if name == PACKAGE_ITSELF:
        return len(LAYERS) - 1
    for i, prefixes in enumerate(LAYERS):
        if within(name, prefixes):
            return i
    return None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules of each strongly connected component of more than one (Tarjan):
    every module in one imports, through the others, every other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def violations(root: Path) -> list[str]:
    mods = modules(root)
    known = set(mods)
    native = {f"cas_bank.{p.name.split('.')[0]}" for p in (root / "cas_bank").glob("*.pyi")}
    # Importing `a.b.c` runs `a.b`'s __init__ first; only the module named counts here.
    graph = {n: imports(n, p, known, native) for n, p in mods.items()}
    problems = [f"import cycle among: {', '.join(c)}" for c in cycles(graph)]
    for name, targets in sorted(graph.items()):
        own = layer(name)
        if own is None:
            problems.append(f"{name} is in no layer: add it to LAYERS")
            continue
        for t in sorted(targets):
            above = layer(t)
            if above is not None and above > own:
                problems.append(f"{name} imports {t}: a lower layer must not import a higher one")
    return problems


def main() -> int:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent
    problems = violations(root)
    for p in problems:
        print(p)
    if problems:
        return 1
    print(f"imports: {len(modules(root))} modules, no cycle, layers respected")
    return 0


if __name__ == "__main__":
    sys.exit(main())
