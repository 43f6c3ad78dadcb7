#!/usr/bin/env python3
"""Apply (or check) the megatron_overlap patch to a Megatron-LM checkout.

    python patches/apply.py MEGATRON_LM_DIR [--check] [--reverse]

Picks the patch in this folder whose Target-Version matches the checkout's
megatron/core/package_info.py (the others are tried after it), runs
`git apply --check`, then `git apply` unless --check is given. Standard library
only; needs `git` on PATH (the checkout itself need not be a git repository).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def header(patch: Path) -> dict[str, str]:
    """The `Key: value` lines before the first `diff --git`."""
    fields = {}
    for line in patch.read_text().splitlines():
        if line.startswith("diff --git "):
            break
        m = re.match(r"^([A-Za-z-]+):\s*(.+?)\s*$", line)
        if m:
            fields.setdefault(m.group(1), m.group(2))
    return fields


def target(patch: Path) -> str:
    h = header(patch)
    return (f"{h.get('Target-Version', '?')} (Megatron-LM tag {h.get('Target-Tag', '?')}, "
            f"commit {h.get('Target-Commit', '?')})")


def checkout_version(root: Path) -> str | None:
    info = root / "megatron" / "core" / "package_info.py"
    if not info.is_file():
        return None
    text = info.read_text()
    parts = [re.search(rf"^{k}\s*=\s*['\"]?(\w*)", text, re.M) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(p.group(1) for p in parts) if all(parts) else None


def git_apply(root: Path, patch: Path, *flags: str) -> subprocess.CompletedProcess:
    """`git apply` with the patch's paths relative to `root`, also when `root` sits
    below the top of some other git work tree."""
    cwd, extra = root, []
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root,
                         capture_output=True, text=True)
    if top.returncode == 0 and Path(top.stdout.strip()).resolve() != root.resolve():
        cwd = Path(top.stdout.strip())
        extra = [f"--directory={root.resolve().relative_to(cwd.resolve()).as_posix()}"]
    return subprocess.run(["git", "apply", *extra, *flags, str(patch)], cwd=cwd,
                          capture_output=True, text=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("megatron_lm_dir", type=Path)
    ap.add_argument("--check", action="store_true", help="only check that the patch applies")
    ap.add_argument("--reverse", action="store_true", help="undo a patch applied before")
    args = ap.parse_args(argv)

    root = args.megatron_lm_dir
    if not (root / "megatron" / "training" / "arguments.py").is_file():
        print(f"error: {root} is not a Megatron-LM checkout "
              "(no megatron/training/arguments.py)", file=sys.stderr)
        return 2
    patches = sorted(HERE.glob("megatron-lm-*.patch"))
    if not patches:
        print(f"error: no megatron-lm-*.patch in {HERE}", file=sys.stderr)
        return 2
    have = checkout_version(root)
    patches.sort(key=lambda p: header(p).get("Target-Version", "").split()[-1:] != [have])
    rev = ["--reverse"] if args.reverse else []
    undo = ["--reverse"] if not args.reverse else []

    errors = []
    for patch in patches:
        check = git_apply(root, patch, "--check", *rev)
        if check.returncode != 0:
            if git_apply(root, patch, "--check", *undo).returncode == 0:
                state = "not applied" if args.reverse else "already applied"
                print(f"{patch.name}: {state} to {root}; nothing to do")
                return 0
            errors.append((patch, check.stderr.strip()))
            continue
        if args.check:
            print(f"{patch.name}: {'can be reversed in' if rev else 'applies cleanly to'} {root}")
            return 0
        done = git_apply(root, patch, *rev)
        if done.returncode != 0:
            print(f"error: {patch.name}: git apply failed:\n{done.stderr}", file=sys.stderr)
            return 1
        print(f"{patch.name}: {'reversed in' if rev else 'applied to'} {root} "
              f"(targets {target(patch)})")
        return 0

    print(f"error: no patch applies to {root} (its megatron-core version: {have or 'unknown'}).",
          file=sys.stderr)
    for patch, err in errors:
        print(f"  {patch.name} targets {target(patch)}; git apply says:\n    "
              + err.replace("\n", "\n    "), file=sys.stderr)
    print("Check out the targeted tag, or port the patch by hand (see patches/README.md).",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
