"""The trainer's wings import downward only (docs/ARCHITECTURE.md): entry points -> run/ ->
parallel/ and data/ -> model/ -> config.py. Read from every import statement of the code,
those inside functions included."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

TRAINER = Path(__file__).resolve().parents[2] / "trainer"
# Floor of each wing: a module may import its own wing and any wing on a lower floor.
FLOORS = {"config": 0, "model": 1, "data": 2, "parallel": 2, "run": 3}
ENTRY_FLOOR = 4


def wing_of(module: str) -> str:
    """'trainer.run.train' -> 'run'; 'trainer.config' -> 'config'; 'trainer.cli' -> 'top' (the entry
    points, one wing); 'trainer' -> ''."""
    parts = module.split(".")
    if len(parts) < 2:
        return ""
    return parts[1] if parts[1] in FLOORS else "top"


def floor(wing: str) -> int:
    return FLOORS.get(wing, ENTRY_FLOOR)


def module_name(path: Path) -> str:
    parts = path.relative_to(TRAINER.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def trainer_imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import of the trainer package in one file."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "trainer" or target.startswith("trainer."):
                # `from .run import runrecord` imports trainer.run.runrecord
                names = [f"{target}.{alias.name}" for alias in node.names]
                found += [(node.lineno, n if wing_of(target) == "" else target) for n in names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("trainer.")]
    return found


def test_every_import_points_to_the_same_or_a_lower_wing():
    modules = sorted(TRAINER.rglob("*.py"))
    assert len(modules) > 20, "the trainer's modules were not found"
    upward = []
    for path in modules:
        own = wing_of(module_name(path))
        for line, target in trainer_imports(path):
            other = wing_of(target)
            if other in ("", own):
                continue
            if floor(other) >= floor(own):
                upward.append(f"{path.relative_to(TRAINER.parent)}:{line} imports {target}")
    assert not upward, "imports that point up or sideways:\n" + "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path):
    """The rule itself: a model module importing the run wing is caught."""
    (tmp_path / "trainer" / "model").mkdir(parents=True)
    bad = tmp_path / "trainer" / "model" / "bad.py"
    bad.write_text("from ..run.train import train\nfrom . import drafter\n")
    global TRAINER
    saved, TRAINER = TRAINER, tmp_path / "trainer"
    try:
        imports = trainer_imports(bad)
    finally:
        TRAINER = saved
    assert (1, "trainer.run.train") in imports
    assert floor(wing_of("trainer.run.train")) > floor(wing_of("trainer.model.bad"))


def test_each_wing_says_what_it_is_for():
    for wing in ("data", "model", "parallel", "run"):
        init = TRAINER / wing / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc.splitlines()) >= 2, f"{init} needs a docstring saying what the wing holds"
