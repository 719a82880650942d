"""One private-filesystem layer (issue #19 item 3): grep finds no second implementation.

Every private-path check, directory creation, no-follow open and atomic write of the
package is in ``slurm_elastic/privatefs/`` (``SafeDir``, ``ensure_private_dir``, the file
primitives). Elsewhere, the calls and flags that build one by hand are refused, except
for the few listed below with their reason. A new module that opens ``O_NOFOLLOW`` or
renames into place by itself fails here: use the layer instead.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "slurm_elastic"
LAYER = PACKAGE / "privatefs"

# What only the layer may use: the flags of safe opens, and the calls that create,
# re-mode, move or link files and directories.
FLAGS = {"O_NOFOLLOW", "O_EXCL", "O_DIRECTORY", "O_NONBLOCK"}
OS_CALLS = {"mkdir", "makedirs", "fchmod", "chmod", "rename", "replace", "link", "symlink"}
ANY_CALLS = {"write_text", "write_bytes"}  # pathlib's, which follow links

# (module, call) pairs outside the layer, each with why it is not a private-path operation.
ALLOWED = {
    # the read-only CLI opens the root a user named (links there are the user's choice);
    # below it, no-follow through the layer's flags
    ("cli/untrusted.py", "O_DIRECTORY"),
    # torch's DCP writes the shard files with the umask's mode into our private temporary
    ("checkpoint/sharded.py", "chmod"),
    # a test seam's marker file in a test's directory (SLURM_ELASTIC_STARTUP_SEAM_DIR)
    ("_startup_seam.py", "write_text"),
}


def _uses(tree: ast.AST) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in FLAGS:
            found.add(node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name, owner = node.func.attr, node.func.value
            on_os = isinstance(owner, ast.Name) and owner.id == "os"
            pathlib_mkdir = name == "mkdir" and any(k.arg == "parents" for k in node.keywords)
            if (on_os and name in OS_CALLS) or name in ANY_CALLS or pathlib_mkdir:
                found.add(name)
    return found


def test_no_module_outside_the_layer_builds_its_own_private_path_handling() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if LAYER in path.parents:
            continue
        where = str(path.relative_to(PACKAGE))
        for use in sorted(_uses(ast.parse(path.read_text(encoding="utf-8")))):
            if (where, use) not in ALLOWED:
                offenders.append(f"{where}: {use}")
    assert not offenders, (
        "private-path handling outside slurm_elastic/privatefs (use SafeDir, "
        "ensure_private_dir or the file primitives): " + "; ".join(offenders)
    )


def test_the_check_finds_a_hand_made_no_follow_open() -> None:
    # the scan itself can fail: a module that opens with O_NOFOLLOW by hand is found
    tree = ast.parse("import os\nfd = os.open('x', os.O_RDONLY | os.O_NOFOLLOW)\n")
    assert _uses(tree) == {"O_NOFOLLOW"}
    tree = ast.parse("from pathlib import Path\nPath('x').write_text('y')\n")
    assert _uses(tree) == {"write_text"}
    tree = ast.parse("import os\nos.replace('a', 'b')\nPath('d').mkdir(parents=True)\n")
    assert _uses(tree) == {"replace", "mkdir"}
    assert _uses(ast.parse("'a'.replace('a', 'b')\nheld.rename('a', 'b')\n")) == set()
