"""Every piece of in-process state has its row in the one table, `sandgate state-table`'s.

The rows live with their packages (`control/state.py`, `worker/state.py`, `local_state.py`)
and `sandgate.cli.state_table.STATE_TABLE` puts them together. Walks the package with `ast`:
module-level and class-level mutable containers, locks and futures are refused outright (they
belong in a registry, `ServerLocalState` or `WorkerLocalState`; the tables of rows are
read-only mappings); mutable containers that an object keeps on `self` must be named in the
table, with what happens under N instances.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from sandgate.cli.state_table import (
    STATE_PARTS,
    STATE_TABLE,
    registered_fields,
    state_doc,
    state_table_markdown,
)
from sandgate.local_state import AGENT_GROWTH
from sandgate.store.schema import metadata
from sandgate.store.sql.retention import STORE_GROWTH

SRC = Path(__file__).resolve().parents[2] / "src" / "sandgate"
# The in-sandbox agent is its own process per sandbox (standard library only, it cannot import
# local_state); its state is one row, "agent", and AGENT_GROWTH names its collections. It keeps
# no module-level state either: all of it is one AgentState (agent/state.py).
AGENT_DIR = SRC / "agent"
AGENT_PROCESS = tuple(p for p in sorted(AGENT_DIR.glob("*.py")) if p.name != "frames.py")


def sources(*, agent: bool = False) -> list[Path]:
    """The package's modules; with ``agent``, the agent's own modules too."""
    return [p for p in SRC.rglob("*.py") if agent or p not in AGENT_PROCESS]


MUTABLE_CALLS = {
    "dict",
    "list",
    "set",
    "bytearray",
    "defaultdict",
    "OrderedDict",
    "Counter",
    "deque",
    "Lock",
    "RLock",
    "Event",
    "Semaphore",
    "BoundedSemaphore",
    "Condition",
    "Queue",
    "WeakValueDictionary",
    "WeakKeyDictionary",
    "WeakSet",
    "create_future",
    "Future",
    "field",
    "CollectorRegistry",  # Prometheus series (api/metrics.py)
}


def is_mutable(node: ast.expr | None) -> bool:
    if node is None:
        return False
    if isinstance(node, ast.Dict | ast.List | ast.Set | ast.DictComp | ast.ListComp | ast.SetComp):
        return True
    if isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return name in MUTABLE_CALLS
    return False


def module_and_class_state() -> list[str]:
    found = []
    for path in sources(agent=True):
        tree = ast.parse(path.read_text(), str(path))
        scopes: list[tuple[str, list[ast.stmt]]] = [("", tree.body)]
        scopes += [(f"{n.name}.", n.body) for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
        for prefix, body in scopes:
            for stmt in body:
                value = stmt.value if isinstance(stmt, ast.Assign | ast.AnnAssign) else None
                if is_mutable(value):
                    line = getattr(stmt, "lineno", 0)
                    found.append(f"{path.relative_to(SRC)}:{line} {prefix}")
    return found


def instance_state() -> set[str]:
    found = set()
    for path in sources():
        tree = ast.parse(path.read_text(), str(path))
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for node in ast.walk(cls):
                if not isinstance(node, ast.Assign | ast.AnnAssign):
                    continue
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if (
                        isinstance(target, ast.Attribute)
                        and isinstance(target.value, ast.Name)
                        and target.value.id == "self"
                        and is_mutable(node.value)
                    ):
                        found.add(f"{cls.name}.{target.attr}")
    return found


def test_no_module_or_class_level_mutable_state() -> None:
    dataclass_fields_ok = {"sandgate/local_state.py"}
    offenders = [f for f in module_and_class_state() if f.split(":")[0] not in dataclass_fields_ok]
    # dataclass `field(default_factory=...)` on frozen records is per-object, not shared state
    offenders = [f for f in offenders if not _is_dataclass_field(f)]
    assert offenders == [], f"mutable module/class state outside the registries: {offenders}"


def _is_dataclass_field(location: str) -> bool:
    path, rest = location.split(":", 1)
    line = int(rest.split()[0])
    source = (SRC / path).read_text().splitlines()[line - 1]
    return "field(default_factory=" in source


def test_every_instance_state_has_a_row() -> None:
    missing = sorted(instance_state() - set(STATE_TABLE))
    assert missing == [], f"add a STATE_TABLE row (what, bound, under N instances) for: {missing}"


def test_every_registered_field_has_a_row() -> None:
    assert set(registered_fields()) <= set(STATE_TABLE)


def test_the_table_lists_every_package_row_once() -> None:
    """The one table is the packages' rows, none shadowing another's."""
    assert sum(len(part) for part in STATE_PARTS) == len(STATE_TABLE)
    assert [name for part in STATE_PARTS for name in part] == list(STATE_TABLE)


def test_no_stale_rows() -> None:
    known = instance_state() | set(registered_fields()) | {"agent"}
    assert sorted(set(STATE_TABLE) - known) == []


def test_table_renders() -> None:
    table = state_table_markdown()
    for name in STATE_TABLE:
        assert f"`{name}`" in table


def test_docs_carry_the_generated_table() -> None:
    doc = SRC.parents[1] / "docs" / "state.md"
    assert doc.read_text() == state_doc(), "regenerate: sandgate state-table > docs/state.md"


def test_every_store_table_says_what_bounds_it() -> None:
    rows = [name for name, _, _ in STORE_GROWTH]
    assert len(rows) == len(set(rows))
    assert sorted(rows) == sorted(metadata.tables), (
        "add a STORE_GROWTH row (grows by, bounded by) in sandgate/store/sql_retention.py"
    )


def test_every_row_says_how_it_behaves_under_n_instances() -> None:
    kinds = ("exact via store", "exact", "per-process by nature")
    vague = [k for k, row in STATE_TABLE.items() if not row.under_n_instances.startswith(kinds)]
    assert vague == [], f"say exact, exact via store or per-process by nature (and why): {vague}"


def test_the_agent_keeps_its_state_in_one_object() -> None:
    """No ``global`` in the agent: with no module-level containers, its modules hold constants."""
    assert AGENT_PROCESS, "the agent's modules moved"
    rebinds = [
        f"{path.relative_to(SRC)}:{node.lineno}"
        for path in AGENT_PROCESS
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Global | ast.Nonlocal)
    ]
    assert rebinds == [], f"keep agent state in agent/state.py's AgentState: {rebinds}"


def agent_names() -> tuple[set[str], set[str]]:
    """(module-level names, ``Class.attribute`` names) defined in the agent's modules."""
    module_names: set[str] = set()
    attributes: set[str] = set()
    for path in AGENT_PROCESS:
        tree = ast.parse(path.read_text(), str(path))
        for stmt in tree.body:
            if isinstance(stmt, ast.Assign | ast.AnnAssign):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                module_names |= {t.id for t in targets if isinstance(t, ast.Name)}
            elif isinstance(stmt, ast.ClassDef | ast.FunctionDef):
                module_names.add(stmt.name)
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for node in ast.walk(cls):
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "self"
                    and isinstance(node.ctx, ast.Store)
                ):
                    attributes.add(f"{cls.name}.{node.attr}")
    return module_names, attributes


def test_agent_growth_names_what_the_agent_has() -> None:
    module_names, attributes = agent_names()
    missing = []
    for what, _grows, bound in AGENT_GROWTH:
        for name in re.findall(r"`([A-Za-z_][\w.]*)`", what):
            if name not in (attributes if "." in name else module_names):
                missing.append(name)
        for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", bound):  # the agent's constants
            if name not in module_names:
                missing.append(name)
    assert missing == [], f"AGENT_GROWTH (local_state.py) names what the agent lacks: {missing}"
