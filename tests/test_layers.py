"""The package's shape: the protocol layer imports no torch, top-level names load
lazily, old import paths still work, no module imports one that imports it back,
and no module reads another's private names."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import replay_fsm

PACKAGE = Path(replay_fsm.__file__).resolve().parent

# Private names of other libraries we read, each with its reason.
ALLOWED_PRIVATE = {
    ("data/channel.py", "_semlock"): "multiprocessing exposes a semaphore's name only there",
    # A semaphore's creator holds multiprocessing's finalizer for its name, reachable
    # only through these: unlink runs it, or it reports the name gone at exit.
    ("data/channel.py", "_finalizer_registry"): "the creator's finalizers live only there",
    ("data/channel.py", "_cleanup"): "the finalizer's callback, to know it is a semaphore's",
    ("data/channel.py", "_callback"): "a finalizer's callback, to find the semaphore's",
    ("data/channel.py", "_args"): "a finalizer's arguments: the semaphore's name",
    ("data/channel.py", "_pid"): "a finalizer's process: a fork child inherits the parent's",
    ("data/buffer.py", "_semlock"): "the write lock's C context manager: a Ctrl-C cannot "
    "land between its acquire and the block (the RLock's own __enter__ is Python)",
    ("data/buffer.py", "_is_mine"): "whether this thread holds the write lock (a pause)",
    ("data/buffer.py", "_count"): "whether a thread of this process holds the write lock "
    "(an add waiting behind it waits for a live holder: add_waiting_s)",
    ("data/buffer.py", "_after_fork"): "an os.fork child holds none of its parent's "
    "write locks (multiprocessing resets them in its own children only)",
    ("signals.py", "_getframe"): "the caller's frame, to know it runs inside a step",
    ("runtime/pipeline.py", "_getframe"): "the learner call's frame, to know whether an "
    "interrupt behind an error came during the call (read only when one raises)",
    ("runtime/pipeline.py", "_is_owned"): "whether this thread holds the step lock (an "
    "RLock tells only there): a close inside a step must not wait for another close, "
    "which needs that lock",
    ("runtime/pipeline.py", "_stop_at_exit"): "the module's exit hook stops each open "
    "pipeline of its own module's class",
    ("runtime/links.py", "_children"): "multiprocessing's set of this process's "
    "children, which an os.fork child inherits and would SIGTERM at its exit",
    ("data/packer.py", "_exit"): "a collector whose learner died holding the write lock "
    "is ended from its watch thread (sys.exit there ends only that thread)",
    ("data/shared.py", "_new_shared"): "the shared-memory object share_memory_ makes, "
    "made without its private zeroed copy (twice the memory at its peak)",
    ("data/shared.py", "_new_shared_fd_cpu"): "the same object made from a descriptor "
    "unlinked before its pages are reserved (a process killed meanwhile leaves none)",
    ("distributed.py", "_start_workers"): "torch's launcher's start of the ranks, which "
    "ends once it has noted them all: a stop signal is raised after it, not inside",
}


def modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        out[".".join(["replay_fsm", *parts])] = ast.parse(path.read_text())
    return out


def _is_package(name: str) -> bool:
    return (PACKAGE / Path(*name.split(".")[1:]) / "__init__.py").exists() or name == (
        "replay_fsm")


def imports_of(name: str, tree: ast.Module) -> set[str]:
    """Package modules ``name`` imports anywhere (functions too), except under
    ``if TYPE_CHECKING:``."""
    base = name if _is_package(name) else name.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            return
        if isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                target = ".".join([*anchor, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if target.startswith("replay_fsm"):
                for alias in node.names:  # "from . import diagram" names a module
                    sub = f"{target}.{alias.name}"
                    found.add(sub if sub in ALL else target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("replay_fsm"))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    found.discard(name)
    return found


ALL = modules()


def test_spec_core_and_wire_import_without_torch() -> None:
    """The sans-IO core is importable alone, in a fresh interpreter."""
    code = ("import sys, replay_fsm, replay_fsm.spec, replay_fsm.core, replay_fsm.wire, "
            "replay_fsm.errors, replay_fsm.signals, replay_fsm.files; bad = [m for m in "
            "('torch', 'numpy', 'threading_', 'multiprocessing') if m in sys.modules]; "
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_top_level_names_load_lazily_and_all_resolve() -> None:
    assert set(replay_fsm.__all__) == set(replay_fsm._EXPORTS)
    for name in replay_fsm.__all__:
        assert getattr(replay_fsm, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        replay_fsm.Nope  # noqa: B018


def test_dir_lists_the_exports_not_the_modules_own_imports() -> None:
    import replay_fsm.core  # noqa: F401 - a loaded subpackage is an attribute too

    names = dir(replay_fsm)
    assert set(replay_fsm.__all__) <= set(names)
    assert {"core", "__version__"} <= set(names)
    public = {n for n in names if not n.startswith("_")}
    assert not {"importlib", "types", "Any", "TYPE_CHECKING", "annotations"} & public


@pytest.mark.parametrize("old,new", [
    ("replay_fsm.sampling", "replay_fsm.data.sampling"),
    ("replay_fsm.explore", "replay_fsm.verify.explore"),
    ("replay_fsm.conformance", "replay_fsm.verify.conformance"),
    ("replay_fsm.diagram", "replay_fsm.verify.diagram"),
])
def test_old_import_paths_are_the_moved_modules(old: str, new: str) -> None:
    assert importlib.import_module(old) is importlib.import_module(new)


def test_no_module_imports_one_that_imports_it_back() -> None:
    graph = {name: imports_of(name, tree) & set(ALL) for name, tree in ALL.items()}
    # The package's own __init__ and the old-path aliases are entry points, not layers.
    entry = {"replay_fsm"} | {n for n, t in ALL.items()
                              if "sys.modules[__name__]" in ast.unparse(t)}
    graph = {n: deps - entry for n, deps in graph.items() if n not in entry}
    cycles = []
    for start in graph:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for dep in graph.get(node, ()):
                if dep == start:
                    cycles.append(" -> ".join([*path, dep]))
                elif dep not in seen:
                    seen.add(dep)
                    stack.append((dep, [*path, dep]))
    assert not cycles, "\n".join(sorted(set(cycles)))


def test_no_module_reads_another_modules_private_names() -> None:
    offenders = []
    for name, tree in ALL.items():
        rel = str(Path(*name.split(".")[1:])) + ".py"
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                offenders += [f"{rel}:{node.lineno} imports {a.name}" for a in node.names
                              if a.name.startswith("_") and not a.name.startswith("__")]
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name)
                             and node.value.id in ("self", "cls"))
                    and ast.unparse(node.value) != "super()"  # as self's own
                    and (rel, node.attr) not in ALLOWED_PRIVATE):
                offenders.append(f"{rel}:{node.lineno} reads {ast.unparse(node)}")
    assert not offenders, "\n".join(offenders)


def test_layers_import_only_downwards() -> None:
    """protocol <- data <- transfer <- runtime <- verify/entry points: a lower layer
    never imports a higher one."""
    rank = {"replay_fsm.spec": 0, "replay_fsm.errors": 0, "replay_fsm.wire": 0,
            "replay_fsm.signals": 0, "replay_fsm.files": 0, "replay_fsm.looks": 0,
            "replay_fsm.core": 0, "replay_fsm.data": 1, "replay_fsm.transfer": 2,
            "replay_fsm.runtime": 3}

    def layer(module: str) -> int:
        for prefix, r in rank.items():
            if module == prefix or module.startswith(prefix + "."):
                return r
        return 9  # verify, demo, compat, testing, cli, distributed: the top

    upward = [f"{n} -> {d}" for n, t in ALL.items() for d in imports_of(n, t)
              if d in ALL and n != "replay_fsm" and layer(d) > layer(n)]
    assert not upward, "\n".join(upward)
