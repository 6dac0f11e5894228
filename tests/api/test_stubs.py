"""The stubs of the compiled core (mpilossy/_core.pyi) match the module
built from src_cython/: every function and constant the module exports is
typed there, every name the stubs declare exists, and every function and
method has the parameters the stubs give it (Cython embeds the signatures,
inspect reads them).  The engine's own classes (channels, algorithms) are
not part of the surface the Python layer uses and need no stubs."""

import ast
import inspect
import types
from pathlib import Path

import pytest

from mpilossy import _core

STUB_FILE = Path(__import__("mpilossy").__file__).resolve().parent / "_core.pyi"


def declared():
    """name -> ast node of every top-level declaration in the stubs."""
    tree = ast.parse(STUB_FILE.read_text())
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
    return out


def stub_parameters(fn: ast.FunctionDef):
    args = fn.args
    return [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]


def runtime_parameters(obj):
    return list(inspect.signature(obj).parameters)


def exported():
    """Functions and constants of the module (not the engine's classes, not
    what it imports)."""
    out = {}
    for name in dir(_core):
        if name.startswith("_"):
            continue
        value = getattr(_core, name)
        if isinstance(value, types.ModuleType) or value is getattr(__import__("collections"),
                                                                   "namedtuple"):
            continue
        if isinstance(value, (int, str, dict)) or (callable(value) and not isinstance(value, type)):
            out[name] = value
    return out


def test_every_function_and_constant_is_declared():
    missing = sorted(set(exported()) - set(declared()))
    assert not missing, f"in the module, not in _core.pyi: {missing}"


def test_every_declared_name_exists():
    absent = sorted(name for name in declared() if not hasattr(_core, name))
    assert not absent, f"in _core.pyi, not in the module: {absent}"


@pytest.mark.parametrize("name", sorted(n for n, node in declared().items()
                                        if isinstance(node, ast.FunctionDef)))
def test_functions_take_the_declared_parameters(name):
    assert runtime_parameters(getattr(_core, name)) == stub_parameters(declared()[name])


@pytest.mark.parametrize("name", sorted(n for n, node in declared().items()
                                        if isinstance(node, ast.ClassDef)
                                        and n != "CallResult"))
def test_classes_have_the_declared_methods(name):
    cls = getattr(_core, name)
    for node in declared()[name].body:
        if not isinstance(node, ast.FunctionDef):
            continue
        assert hasattr(cls, node.name), f"{name}.{node.name} is declared but absent"
        member = getattr(cls, node.name)
        if isinstance(member, property) or node.name == "__init__" or \
                any(isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list):
            continue
        assert runtime_parameters(member) == stub_parameters(node), f"{name}.{node.name}"


def test_the_call_result_has_the_declared_fields():
    node = declared()["CallResult"]
    fields = [s.target.id for s in node.body if isinstance(s, ast.AnnAssign)]
    assert list(_core.CallResult._fields) == fields
