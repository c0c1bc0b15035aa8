"""The architecture, checked on the import graph: no import cycle anywhere in tplab (imports inside
functions count), the engine never imports the teaching side, and the layers (the idea) never import the
kernels (how it is made fast); the layers' TP files name no kernel; and no .py file of the repository over
300 lines."""
import ast
import os
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "tplab"
ENGINE_SIDE = ("distributed", "layers", "kernels", "models", "engine")
TEACHING_SIDE = ("bugs", "exercises", "golden", "tolerance", "workbook", "plotting", "interactive")


def test_every_module_is_on_one_side():
    """tplab/ holds the engine's rooms and the teaching side's modules (tplab.TEACHING), nothing else."""
    import tplab
    assert TEACHING_SIDE == tplab.TEACHING
    tops = {p.stem for p in ROOT.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()} - {"__init__"}
    assert tops == set(ENGINE_SIDE) | set(TEACHING_SIDE), f"on neither side: {tops ^ (set(ENGINE_SIDE) | set(TEACHING_SIDE))}"


def teaching(module: str) -> bool:
    return any(module == f"tplab.{t}" or module.startswith(f"tplab.{t}.") for t in TEACHING_SIDE)
IGNORED = {"__pycache__", "build", "your_code", "profiles", "screenshots"}     # .gitignore's folders, hidden ones aside


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def tplab_imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """Every tplab module ``path`` imports, at any depth of its code, resolved to a module file."""
    me, found = module_name(path), set()
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != me:
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    edges = {m: tplab_imports(p, set(files)) for m, p in files.items()}
    # a package's own __init__ importing its children, and a child reaching its package, are not cycles
    return {m: {d for d in ds if not (d.startswith(m + ".") and files[m].name == "__init__.py")
                and not m.startswith(d + ".")} for m, ds in edges.items()}


def cycles(edges: dict[str, set[str]]) -> list[str]:
    """Every import cycle of a graph ``{module: the modules it imports}``, as ``a -> b -> a``."""
    state, found = {}, []

    def visit(m, path):
        state[m] = "open"
        for d in sorted(edges[m]):
            if state.get(d) == "open":
                found.append(" -> ".join(path[path.index(d):] + [d]))
            elif d not in state:
                visit(d, path + [d])
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    return found


def test_no_import_cycle():
    assert not cycles(graph()), f"import cycles: {cycles(graph())}"


def flat_imports(path: pathlib.Path, names: set[str]) -> set[str]:
    """The scripts among ``names`` that a script run from its own folder imports (``import common``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module)
    return (found & names) - {path.stem}


@pytest.mark.parametrize("folder", ["bench", "scripts", "scripts/tiny_stories", "scripts/tiny_moe"])
def test_no_import_cycle_among_the_scripts(folder):
    """The benchmarks and scripts import each other by file name (their folder on ``sys.path``): no cycle there
    either."""
    files = {p.stem: p for p in (ROOT.parent / folder).glob("*.py")}
    assert files, f"no scripts in {folder}"
    edges = {name: flat_imports(p, set(files)) for name, p in files.items()}
    assert not cycles(edges), f"import cycles in {folder}: {cycles(edges)}"


def test_the_cycle_finder_sees_a_cycle():
    assert cycles({"common": {"machines"}, "machines": {"common"}}) == ["common -> machines -> common"]
    assert cycles({"common": {"machines"}, "machines": set()}) == []


@pytest.mark.parametrize("side", ENGINE_SIDE)
def test_engine_side_never_imports_the_teaching_side(side):
    upward = sorted(f"{m} -> {d}" for m, ds in graph().items() if m.startswith(f"tplab.{side}")
                    for d in ds if teaching(d))
    assert not upward, f"the engine imports the teaching side: {upward}"


def dynamic_imports(path: pathlib.Path) -> list[str]:
    """The calls in ``path`` that import a module named by a value (``importlib.import_module``, ``__import__``):
    imports the graph above cannot see."""
    calls = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)]
    names = [getattr(c.func, "attr", None) or getattr(c.func, "id", None) for c in calls]
    return [f"{path.name}:{c.lineno}" for c, name in zip(calls, names) if name in ("import_module", "__import__")]


def test_the_engine_imports_by_import_statements_only():
    """The engine side imports nothing by name at run time, so the graph the checks above walk is all of it (the
    bug catalogue reaches the engine as a function that ``tplab/__init__.py`` hands it)."""
    found = [hit for side in ENGINE_SIDE for p in sorted((ROOT / side).rglob("*.py")) for hit in dynamic_imports(p)]
    assert not found, f"the engine imports a module named by a value (use an import statement): {found}"


def test_the_layers_never_import_the_kernels():
    """``tplab.layers`` holds the idea the notebooks teach; ``tplab.kernels`` is handed to it (``Parts.gemm``,
    ``Parts.attend``) and may import it, never the other way."""
    inward = sorted(f"{m} -> {d}" for m, ds in graph().items() if m.startswith("tplab.layers")
                    for d in ds if d == "tplab.kernels" or d.startswith("tplab.kernels."))
    assert not inward, f"the layers import the kernels: {inward}"


# A fast path's words: oneDNN/MKL, packed weights, vLLM's compiled kernels (vLLM's *design* may be named).
KERNEL_WORDS = re.compile(r"onednn|mkldnn|mkl|pack|vllm_|vllm-|vllmcpu", re.IGNORECASE)
TP_IDEA_FILES = ("layers/linear.py", "layers/embed_head.py", "layers/attention.py")


def kernel_words(path: pathlib.Path) -> list[str]:
    return [f"{path.name}:{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1)
            if KERNEL_WORDS.search(line)]


def test_the_tp_layers_name_no_kernel():
    """A learner reading the TP layers sees the TP idea only: how a product is made fast lives in kernels/."""
    found = [hit for f in TP_IDEA_FILES for hit in kernel_words(ROOT / f)]
    assert not found, f"kernel details in the TP layers (move them to tplab/kernels/): {found}"


def python_files() -> list[pathlib.Path]:
    """Every .py file of the repository that git tracks; without git (or outside a clone), every .py file
    outside hidden folders (.venv, .git, bench/.peers, ...) and the other ignored ones."""
    repo = ROOT.parent
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--", "*.py"], cwd=repo, capture_output=True, text=True,
                                check=True).stdout.split("\0")
        return [repo / f for f in listed if f and (repo / f).is_file()]     # (a tracked file deleted here: gone)
    except (OSError, subprocess.CalledProcessError):
        files = []
        for folder, dirs, names in os.walk(repo):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d not in IGNORED and not d.endswith(".egg-info")]
            files += [pathlib.Path(folder, n) for n in names if n.endswith(".py")]
        return files


def test_no_file_over_300_lines():
    long = {str(p.relative_to(ROOT.parent)): n for p in python_files() if (n := len(p.read_text().splitlines())) > 300}
    assert not long, f"files over 300 lines (split them): {long}"


def test_the_check_sees_a_cycle_and_an_upward_import(tmp_path, monkeypatch):
    """The checks above can fail: a fake package with both faults."""
    fake = tmp_path / "tplab"
    (fake / "engine").mkdir(parents=True)
    for f in ("__init__.py", "engine/__init__.py"):
        (fake / f).write_text("")
    (fake / "engine" / "a.py").write_text("def f():\n    from tplab.engine import b\n")
    (fake / "engine" / "b.py").write_text("from tplab.engine.a import f\nfrom tplab import bugs\n")
    (fake / "engine" / "c.py").write_text("import importlib\n\nBUGS = importlib.import_module('tplab.bugs')\n")
    (fake / "bugs.py").write_text("")
    monkeypatch.setattr(__import__(__name__), "ROOT", fake)
    with pytest.raises(AssertionError, match="tplab.engine.a -> tplab.engine.b -> tplab.engine.a"):
        test_no_import_cycle()
    with pytest.raises(AssertionError, match="tplab.engine.b -> tplab.bugs"):
        test_engine_side_never_imports_the_teaching_side("engine")
    with pytest.raises(AssertionError, match=r"c.py:3"):
        test_the_engine_imports_by_import_statements_only()


def test_the_check_sees_layers_importing_kernels_and_naming_them(tmp_path, monkeypatch):
    """The two checks of the layers can fail: a fake package whose linear layer imports a kernel by name."""
    fake = tmp_path / "tplab"
    for folder in ("layers", "kernels"):
        (fake / folder).mkdir(parents=True)
        (fake / folder / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "kernels" / "gemm.py").write_text("")
    (fake / "layers" / "linear.py").write_text("from tplab.kernels.gemm import packed  # oneDNN\n")
    for name in ("embed_head.py", "attention.py"):
        (fake / "layers" / name).write_text("")
    monkeypatch.setattr(__import__(__name__), "ROOT", fake)
    with pytest.raises(AssertionError, match="tplab.layers.linear -> tplab.kernels.gemm"):
        test_the_layers_never_import_the_kernels()
    with pytest.raises(AssertionError, match="linear.py:1: from tplab.kernels.gemm import packed"):
        test_the_tp_layers_name_no_kernel()
