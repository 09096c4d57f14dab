"""Which secret is read is the user's choice alone, never a workflow's: a structural check of the whole package.

An environment variable is read by a name that is not written in the code in one function only,
runtime/net/key_source.py's user_named_variable, and the names it reads come from two places only: the CLI's
--api-key-env flags (Credentials.bound_to, called from runtime/cli/) and an "env" entry of the user's own keys file
(credentials.py, which refuses a keys file that others can write). No node, route or remote module builds a key
source; what a workflow gives is a credential's label, looked up in that file and bound to its server's origin
(tests/test_secrets_attacks.py tries the behaviour; this test keeps the boundary where it is).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_FILES = sorted(p for folder in ("runtime", "nodes") for p in (ROOT / folder).rglob("*.py"))


def name_of(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


CONSTANT_KEYS = ("KEYS_FILE_ENV",)  # module constants naming a variable, written in the code


def _key_is_written(key: ast.AST | None) -> bool:
    return isinstance(key, ast.Constant) or (key is not None and ast.unparse(key) in CONSTANT_KEYS)


def environment_reads_by_computed_name(tree: ast.AST) -> list[str]:
    """Every use of the environment (`os.environ`, `environ`, `os.getenv`, `getenv`, however imported) other than
    reading or setting a variable whose name is written in the code, by what it reads (or how it is used)."""
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    reads = []
    for node in ast.walk(tree):
        name = ast.unparse(node) if isinstance(node, (ast.Name, ast.Attribute)) else ""
        if name not in ("os.environ", "environ", "os.getenv", "getenv"):
            continue
        parent = parents.get(node)
        if name.endswith("getenv"):
            call = parent if isinstance(parent, ast.Call) and parent.func is node else None
            key = (call.args[0] if call is not None and call.args else
                   next((kw.value for kw in call.keywords if kw.arg == "key"), None) if call is not None else None)
            if not _key_is_written(key):
                reads.append(ast.unparse(key) if key is not None else name)
            continue
        if isinstance(parent, ast.Subscript) and parent.value is node:
            key = parent.slice
        elif isinstance(parent, ast.Attribute) and parent.value is node and isinstance(parents.get(parent), ast.Call):
            call = parents[parent]
            key = call.args[0] if call.args else None
            if parent.attr in ("setdefault", "pop", "get") and _key_is_written(key):
                continue
        else:  # the whole environment handed on (copied, iterated, passed): any variable could be read from it
            key = None
        if not _key_is_written(key):
            reads.append(ast.unparse(key) if key is not None else ast.unparse(parent or node))
    return reads


def test_the_scan_sees_every_way_to_read_a_variable_by_a_computed_name():
    code = """
import os
from os import environ, getenv
os.environ.get(name); os.getenv(key=name); environ[name]; getenv(name); dict(os.environ)[name]
os.environ.copy(); os.environ.get("WRITTEN"); os.environ["WRITTEN"]; os.getenv("WRITTEN"); os.environ.get(KEYS_FILE_ENV)
"""
    assert environment_reads_by_computed_name(ast.parse(code)) == [
        "name", "name", "name", "name", "dict(os.environ)", "os.environ.copy"]


def test_only_the_key_source_reads_a_variable_whose_name_is_not_in_the_code():
    reads = {name_of(path): environment_reads_by_computed_name(ast.parse(path.read_text())) for path in PACKAGE_FILES}
    assert {path: names for path, names in reads.items() if names} == {
        "runtime/net/key_source.py": ["name"]}


def test_that_read_is_one_function_and_only_the_key_source_calls_it():
    tree = ast.parse((ROOT / "runtime/net/key_source.py").read_text())
    readers = [node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
               and environment_reads_by_computed_name(node)]
    assert readers == ["user_named_variable"]
    callers = {name_of(path) for path in PACKAGE_FILES if "user_named_variable" in path.read_text()}
    assert callers == {"runtime/net/key_source.py"}


def test_key_sources_are_built_only_from_the_keys_file_and_the_cli_flags():
    builders, bound = set(), set()
    for path in PACKAGE_FILES:
        text = path.read_text()
        if "ApiKeySource" in text:
            builders.add(name_of(path))
        if ".bound_to(" in text:
            bound.add(name_of(path))
    assert builders == {"runtime/net/key_source.py", "runtime/net/credentials.py"}
    assert bound == {"runtime/cli/remote_args.py"}
