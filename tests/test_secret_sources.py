"""Which secret is read is the user's choice alone, never a workflow's: a structural check of the whole package.

An environment variable is read by a name that is not written in the code in one function only,
runtime/net/key_source.py's user_named_variable, and the names it reads come from two places only: the CLI's --api-key-env flags
(Credentials.bound_to, called from runtime/cli/) and an "env" entry of the user's own keys file
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


def environment_reads_by_computed_name(tree: ast.AST) -> list[str]:
    reads = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
            key = node.slice
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("os.environ.get", "os.getenv") and node.args:
            key = node.args[0]
        if key is not None and not isinstance(key, ast.Constant) and ast.unparse(key) != "KEYS_FILE_ENV":
            reads.append(ast.unparse(key))
    return reads


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
