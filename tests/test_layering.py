"""The package reads one way: every import of every module under bie_trt/ (top-level, inside a function,
under `if TYPE_CHECKING:`, relative or absolute) points down the stack below, and no modules import each
other in a circle. A module nobody placed in the stack fails too, so a new one is placed on purpose.

The runtime stack, lowest first: a module may import its own layer and the layers below it.
The builder (checkpoint reading, quantising, key centering, the engine directory's README and CI) and
the evaluation (`bie-trt eval`) sit beside the runtime: they may use the runtime up to the executor (the
build compiles its kernels by running a warm-up step), and only the CLI imports them; nothing in the
runtime imports the builder. `eval --reference` reads a GGUF checkpoint, so its reference model lives in
the builder and the CLI hands it to the evaluation.
"""
from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Layer -> the modules in it (a name stands for the module or the package and everything under it).
RUNTIME: list[tuple[str, tuple[str, ...]]] = [
    # the contract between builder and runtime: errors, configs, request parameters, GPU profiles,
    # the engine directory's format and its integrity ledger, the settings a run resolves against it
    ("contract", ("errors", "jsonio", "devices", "user_cache", "families", "config", "config_gemma3",
                  "config_qwen35", "config_gemma4", "config_text", "sampling_params", "profiles", "engine_format", "integrity", "resolve")),
    ("kv", ("kv",)),                    # cache pools and quantisers
    ("plan", ("plan",)),                # the memory plan, sized by the KV pools' byte layout
    ("kernels", ("kernels",)),          # reference twins, Triton kernels, what a step hands them
    ("model", ("model",)),              # the forward pass, rope, CUDA-graph steps
    ("chat", ("chat",)),                # tokenizer, chat templates, tool calls, reasoning: text only
    ("decoding", ("sampling", "logits_constraint", "closed_schema")),   # sampler and output constraints
    ("spec_decode", ("spec_decode",)),
    # the loop (executor) and the cache tiers it drives (block manager, prefix cache, host and disk tiers)
    ("executor", ("executor", "cache_tiers")),
    ("sdk", ("",)),                     # bie_trt/__init__.py: the public API
    ("server", ("server",)),
    ("scale_out", ("scale_out",)),
    ("cli", ("cli",)),
]
# Rooms beside the runtime: (their modules, the highest runtime layer they may import, the one layer that
# may import them).
BESIDE: dict[str, tuple[tuple[str, ...], str, str]] = {
    "builder": (("builder",), "executor", "cli"),
    "evaluation": (("evaluate", "eval_texts"), "executor", "cli"),
}
RANK = {name: i for i, (name, _) in enumerate(RUNTIME)}


@dataclass(frozen=True)
class Import:
    source: str     # importing module, dotted without the `bie_trt.` prefix ("" for bie_trt/__init__)
    target: str
    path: Path
    line: int


def module_names(pkg: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted name (without `bie_trt.`) -> (file, is a package's __init__)."""
    out = {}
    for path in sorted(pkg.rglob("*.py")):
        parts = list(path.relative_to(pkg).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


@functools.lru_cache(maxsize=None)   # parsed once for all the checks
def imports(pkg: Path) -> list[Import]:
    """Every import of a bie_trt module by a bie_trt module, resolved to the module it loads."""
    modules = module_names(pkg)

    def owner(name: str) -> str:      # the longest existing module a dotted name starts with
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    found: list[Import] = []
    for name, (path, is_pkg) in modules.items():
        here = name.split(".") if name else []
        base = here if is_pkg else here[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):   # walk: nested and TYPE_CHECKING too
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name == "bie_trt" or a.name.startswith("bie_trt.")]
                targets = [owner(t.removeprefix("bie_trt").lstrip(".")) for t in targets]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    up = base[:len(base) - (node.level - 1)]
                    parent = ".".join(up + ([node.module] if node.module else []))
                elif node.module == "bie_trt" or (node.module or "").startswith("bie_trt."):
                    parent = node.module.removeprefix("bie_trt").lstrip(".")
                else:
                    continue
                for alias in node.names:   # `from . import x` loads module x when x is one
                    sub = f"{parent}.{alias.name}".lstrip(".")
                    targets.append(sub if sub in modules else owner(parent))
            found += [Import(name, t, path, node.lineno) for t in targets if t != name]
    return found


def layer_of(module: str) -> str | None:
    best, best_len = None, -1
    for layer, names in RUNTIME + [(k, v[0]) for k, v in BESIDE.items()]:
        for n in names:
            if (module == n or module.startswith(n + ".") or n == "") and len(n) > best_len:
                if n == "" and module != "":
                    continue
                best, best_len = layer, len(n)
    return best


def allowed(src: str, dst: str) -> bool:
    if src == dst:
        return True
    if src in BESIDE:
        return dst in RANK and RANK[dst] <= RANK[BESIDE[src][1]]
    if dst in BESIDE:
        return RANK[src] >= RANK[BESIDE[dst][2]]
    return RANK[dst] < RANK[src]


def upward(pkg: Path) -> list[str]:
    bad = []
    for imp in imports(pkg):
        src, dst = layer_of(imp.source), layer_of(imp.target)
        if src is not None and dst is not None and not allowed(src, dst):   # unplaced: its own test
            bad.append(f"{imp.path.relative_to(pkg.parent)}:{imp.line} imports bie_trt.{imp.target}: "
                       f"layer {src} may not import layer {dst}")
    return list(dict.fromkeys(bad))   # one line per import, however many names it takes


def cycles(pkg: Path) -> list[list[str]]:
    """Strongly connected groups of two or more modules (Tarjan)."""
    graph: dict[str, set[str]] = {m: set() for m in module_names(pkg)}
    for imp in imports(pkg):
        graph[imp.source].add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def unplaced(pkg: Path) -> list[str]:
    return [f"bie_trt.{m}".rstrip(".") for m in module_names(pkg) if layer_of(m) is None]


def test_every_module_has_a_layer():
    assert unplaced(ROOT / "bie_trt") == [], "place these modules in a layer of tests/test_layering.py"


def test_no_import_runs_up_the_stack():
    bad = upward(ROOT / "bie_trt")
    assert not bad, "imports running up the stack:\n" + "\n".join(bad)


def test_no_import_cycles():
    groups = cycles(ROOT / "bie_trt")
    assert not groups, "modules importing each other in a circle:\n" + "\n".join(" <-> ".join(g) for g in groups)


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root / "bie_trt"


def test_the_checks_see_every_form_of_import(tmp_path):
    """Each form the real tree could hide an upward import in, and a circle through a package's __init__."""
    pkg = _write(tmp_path, {
        "bie_trt/__init__.py": "",
        "bie_trt/errors.py": "",
        "bie_trt/kv/__init__.py": "",
        "bie_trt/kv/pool.py": ("from typing import TYPE_CHECKING\n"
                               "if TYPE_CHECKING:\n    from ..executor.engine import X\n"
                               "def f():\n    import bie_trt.model.llama\n"),
        "bie_trt/kernels/__init__.py": "from bie_trt.builder import build\n",
        "bie_trt/model/__init__.py": "",
        "bie_trt/model/llama.py": "from ..kv import K\nfrom ..errors import E\n",
        "bie_trt/executor/__init__.py": "",
        "bie_trt/executor/engine.py": "from . import streams\n",
        "bie_trt/executor/streams.py": "from .engine import Engine\n",
        "bie_trt/builder/__init__.py": "",
        "bie_trt/builder/build.py": "from ..executor.engine import Engine\nfrom ..server import app\n",
        "bie_trt/server/__init__.py": "",
        "bie_trt/server/app.py": "",
        "bie_trt/cli/__init__.py": "from ..builder import build\nfrom .. import BieEngine\n",
        "bie_trt/stray.py": "",
    })
    bad = upward(pkg)
    assert [b.split(" imports ")[0] for b in bad] == [
        "bie_trt/builder/build.py:2", "bie_trt/kernels/__init__.py:1", "bie_trt/kv/pool.py:3",
        "bie_trt/kv/pool.py:5"], bad
    assert "layer kv may not import layer executor" in bad[2]
    assert cycles(pkg) == [["executor.engine", "executor.streams"]]
    assert unplaced(pkg) == ["bie_trt.stray"]


# -- the engine's facade, and model families declared by their configs ------------------------------
# callers that hold a BieEngine and must use only its public API
ABOVE_THE_ENGINE = ("server", "scale_out", "cli")


def engine_api(engine_py: Path) -> tuple[set[str], set[str], set[str]]:
    """BieEngine's public API read from its source: (its PUBLIC_ATTRIBUTES, its public methods, the
    attributes its __init__ assigns)."""
    cls = next(n for n in ast.walk(ast.parse(engine_py.read_text())) if isinstance(n, ast.ClassDef)
               and n.name == "BieEngine")
    methods = {f.name for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
               and not f.name.startswith("_")}
    attributes: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "PUBLIC_ATTRIBUTES" for t in node.targets):
            attributes = set(ast.literal_eval(node.value))
    init = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    assigned = {t.attr for n in ast.walk(init) if isinstance(n, ast.Assign) for t in n.targets
                for t in (t.elts if isinstance(t, ast.Tuple) else [t])
                if isinstance(t, ast.Attribute) and getattr(t.value, "id", None) == "self"}
    return attributes, methods, assigned


def facade_mirrors(engine_py: Path) -> list[str]:
    """What BieEngine holds beyond its public attributes and its own parts (FACADE_PARTS: the core, the prompt
    encoder, the loop thread): an attribute any method sets, a property, or a __getattr__ passing reads on,
    each a copy of the core's inside that callers would read instead of `core`."""
    cls = next(n for n in ast.walk(ast.parse(engine_py.read_text())) if isinstance(n, ast.ClassDef)
               and n.name == "BieEngine")
    own: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) in ("PUBLIC_ATTRIBUTES", "FACADE_PARTS")
                                                for t in node.targets):
            own |= set(ast.literal_eval(node.value))
    bad = []
    for f in cls.body:
        if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if f.name == "__getattr__" or any(getattr(d, "id", getattr(d, "attr", None)) in ("property", "cached_property")
                                          for d in f.decorator_list):
            bad.append(f"BieEngine.{f.name}:{f.lineno} passes reads on to the core")
        for n in ast.walk(f):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(
                n, (ast.AugAssign, ast.AnnAssign)) else []
            for t in (e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])):
                if isinstance(t, ast.Attribute) and getattr(t.value, "id", None) == "self" and t.attr not in own:
                    bad.append(f"BieEngine.{f.name}:{t.lineno} sets self.{t.attr}")
    return bad


def engine_names(tree: ast.AST) -> set[str]:
    """The names a module calls an engine by: `engine`, and every name it binds to a `BieEngine(...)`."""
    return {"engine"} | {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                         and getattr(n.value.func, "id", None) == "BieEngine" for t in n.targets
                         if isinstance(t, ast.Name)}


def facade_leaks(pkg: Path) -> list[str]:
    """Every read of `engine.X` (or `something.engine.X`, or X on a name bound to a `BieEngine(...)`) above the
    engine whose X is not BieEngine's public API."""
    attributes, methods, _ = engine_api(pkg / "executor" / "engine.py")
    api, bad = attributes | methods, []
    for package in ABOVE_THE_ENGINE:
        for path in sorted((pkg / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            names = engine_names(tree)
            for node in ast.walk(tree):
                if not isinstance(node, ast.Attribute) or node.attr in api:
                    continue
                holder = node.value
                if getattr(holder, "id", None) in names or getattr(holder, "attr", None) == "engine":
                    bad.append(f"{path.relative_to(pkg.parent)}:{node.lineno} reads engine.{node.attr}")
    return bad


def family_knowledge(pkg: Path) -> list[str]:
    """Executor modules that know a model family by name: importing a family's config module (config_gemma3,
    config_qwen35; config_text is the shared reader) or branching on a config's `.family`."""
    bad = [f"{imp.path.relative_to(pkg.parent)}:{imp.line} imports bie_trt.{imp.target}" for imp in imports(pkg)
           if imp.source.startswith("executor") and imp.target.startswith("config_") and imp.target != "config_text"]
    for path in sorted((pkg / "executor").rglob("*.py")):
        bad += [f"{path.relative_to(pkg.parent)}:{n.lineno} reads .family"
                for n in ast.walk(ast.parse(path.read_text(), str(path)))
                if isinstance(n, ast.Attribute) and n.attr == "family"]
    return bad


def test_the_server_uses_only_the_engines_public_api():
    leaks = facade_leaks(ROOT / "bie_trt")
    assert not leaks, "reads of the engine's inside above it (add an accessor to BieEngine):\n" + "\n".join(leaks)
    attributes, _, assigned = engine_api(ROOT / "bie_trt" / "executor" / "engine.py")
    assert attributes and attributes <= assigned, f"PUBLIC_ATTRIBUTES names what __init__ never sets: " \
                                                  f"{attributes - assigned}"


def test_the_facade_holds_no_copy_of_the_cores_inside():
    """Tests and benchmarks reach the runner, scheduler, blocks, ... through `BieEngine.core`; a mirror of one
    on the facade would be read by callers above the engine as if it were its API."""
    bad = facade_mirrors(ROOT / "bie_trt" / "executor" / "engine.py")
    assert not bad, "BieEngine mirrors its core (read it through engine.core instead):\n" + "\n".join(bad)


def test_model_families_are_declared_by_their_configs_not_known_to_the_executor():
    bad = family_knowledge(ROOT / "bie_trt")
    assert not bad, "model-family knowledge in the executor (declare it on ModelConfig):\n" + "\n".join(bad)


def test_the_facade_and_family_checks_see_their_faults(tmp_path):
    pkg = _write(tmp_path, {
        "bie_trt/__init__.py": "",
        "bie_trt/config_gemma3.py": "STOP = ()\n",
        "bie_trt/config_text.py": "",
        "bie_trt/executor/__init__.py": "",
        "bie_trt/executor/engine.py": ("class BieEngine:\n    PUBLIC_ATTRIBUTES = ('tokenizer',)\n"
                                       "    def __init__(self):\n        self.tokenizer = self.runner = None\n"
                                       "    def stream(self):\n        pass\n    def _on_loop(self):\n        pass\n"),
        "bie_trt/executor/builder.py": ("from ..config_gemma3 import STOP\nfrom ..config_text import x\n"
                                        "def f(cfg):\n    return cfg.family == 'gemma3'\n"),
        "bie_trt/server/__init__.py": "",
        "bie_trt/server/state.py": ("def f(state, engine):\n    engine.tokenizer.decode\n    engine.stream()\n"
                                    "    state.engine.runner.model_config\n    engine._on_loop()\n"),
        "bie_trt/scale_out/__init__.py": "",
        "bie_trt/cli/__init__.py": "",
        "bie_trt/cli/serve.py": "def f(BieEngine):\n    bie = BieEngine('e')\n    bie.stream()\n    bie.runner\n",
    })
    assert facade_leaks(pkg) == ["bie_trt/server/state.py:4 reads engine.runner",
                                 "bie_trt/server/state.py:5 reads engine._on_loop",
                                 "bie_trt/cli/serve.py:4 reads engine.runner"]
    assert engine_api(pkg / "executor" / "engine.py") == ({"tokenizer"}, {"stream"}, {"tokenizer", "runner"})
    assert family_knowledge(pkg) == ["bie_trt/executor/builder.py:1 imports bie_trt.config_gemma3",
                                     "bie_trt/executor/builder.py:4 reads .family"]
    assert facade_mirrors(pkg / "executor" / "engine.py") == ["BieEngine.__init__:4 sets self.runner"]
    (pkg / "executor" / "engine.py").write_text(
        "import functools\nclass BieEngine:\n    PUBLIC_ATTRIBUTES = ('tokenizer',)\n    FACADE_PARTS = ('core',)\n"
        "    def __init__(self):\n        self.core, self.tokenizer = None, None\n"
        "    def warm(self):\n        self.core.blocks, self.eos_ids = None, ()\n        self.steps += 1\n"
        "    @property\n    def scheduler(self):\n        return self.core.scheduler\n"
        "    @functools.cached_property\n    def disk(self):\n        return self.core.disk\n"
        "    def __getattr__(self, name):\n        return getattr(self.core, name)\n")
    assert facade_mirrors(pkg / "executor" / "engine.py") == [
        "BieEngine.warm:8 sets self.eos_ids", "BieEngine.warm:9 sets self.steps",
        "BieEngine.scheduler:11 passes reads on to the core", "BieEngine.disk:14 passes reads on to the core",
        "BieEngine.__getattr__:16 passes reads on to the core"]
