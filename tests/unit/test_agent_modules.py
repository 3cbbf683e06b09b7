"""The agent's modules, as the worker deploys them: flat, standard library only.

install_agent copies ``sandgate.agent.MODULES`` into one directory (main.py as
sandgate_agent.py) where they import one another by their bare names, ahead of the standard
library on sys.path: every module must be listed, and none may shadow a standard module.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from sandgate.agent import MODULES, PROGRAMS, deployed_name
from sandgate.worker.main import SANDBOX_PYTHON, install_agent

AGENT_DIR = Path(__file__).resolve().parents[2] / "src" / "sandgate" / "agent"


def test_every_module_is_deployed() -> None:
    files = sorted(p.stem for p in AGENT_DIR.glob("*.py") if p.name != "__init__.py")
    assert sorted(MODULES + PROGRAMS) == files
    assert len(set(MODULES + PROGRAMS)) == len(MODULES + PROGRAMS)


def test_no_module_shadows_the_standard_library() -> None:
    names = [deployed_name(m).removesuffix(".py") for m in MODULES] + ["agent", *PROGRAMS]
    assert [n for n in names if n in sys.stdlib_module_names] == []


def runtime_imports(path: Path) -> set[str]:
    """Top-level names the module imports when run (``if TYPE_CHECKING:`` bodies excluded)."""
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If):
                typing_only = isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
                if not typing_only:
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
            elif isinstance(node, ast.FunctionDef | ast.ClassDef | ast.Try | ast.With):
                visit(node.body)
                for extra in ("handlers", "orelse", "finalbody"):
                    for item in getattr(node, extra, []):
                        visit(item.body if isinstance(item, ast.ExceptHandler) else [item])

    visit(ast.parse(path.read_text(), str(path)).body)
    return found


def test_the_agent_imports_only_the_standard_library_and_itself() -> None:
    allowed = set(sys.stdlib_module_names) | set(MODULES) | {"__future__"}
    foreign = {
        module: sorted(runtime_imports(AGENT_DIR / f"{module}.py") - allowed) for module in MODULES
    }
    # siblings are imported by their deployed names, never as the sandgate package
    assert {m: names for m, names in foreign.items() if names} == {}


def test_the_agents_start_leaves_typing_out(tmp_path: Path) -> None:
    """Every sandbox start runs the agent on a fresh interpreter, and importing `typing`
    cost it ~6 ms of its ~28 (docs/benchmarks.md, "Session 17"): the modules it imports
    before its ready event use `TYPE_CHECKING = False` and keep typing's names for the type
    checker. Run as a sandbox runs it (`-I -S`, deployed flat), on the system Python."""
    install_agent(tmp_path)
    probe = (
        f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import sandgate_agent; "
        "print(' '.join(sorted(sys.modules)))"
    )
    python = SANDBOX_PYTHON if SANDBOX_PYTHON.exists() else Path(sys.executable)
    ran = subprocess.run(
        [str(python), "-I", "-S", "-c", probe], capture_output=True, text=True, check=True
    )
    loaded = set(ran.stdout.split())
    assert {"sandgate_agent", "frames", "execute", "files"} <= loaded  # it did import them
    assert "typing" not in loaded
