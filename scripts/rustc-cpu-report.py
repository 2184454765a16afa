#!/usr/bin/env python3
"""Compares two logs of scripts/rustc-cpu.sh: rustc CPU seconds (user + system) of the
workspace's own crates (kvpool*) one by one, of the dependencies in total, and the
dependencies that only one side builds. With --lines, counts a tree's production lines
instead: non-blank, non-comment lines of the workspace crates' src/ folders before
`#[cfg(test)]`, test files (tests.rs, *_tests.rs, tests folders) and the Python extension
left out.
Usage: rustc-cpu-report.py OLD.log NEW.log | rustc-cpu-report.py --lines TREE"""
import collections
import os
import sys

SOURCE_DIRS = ("src", "agent/src", "operator/src", "crates")


def production_lines(tree):
    total = 0
    for top in SOURCE_DIRS:
        for folder, _, files in os.walk(os.path.join(tree, top)):
            relative = "/" + os.path.relpath(folder, tree)
            if "/tests" in relative or relative.startswith("/crates/python"):
                continue  # test folders, the Python extension
            if top == "crates" and "/src" not in relative:
                continue
            for name in files:
                if not name.endswith(".rs") or name == "tests.rs" or name.endswith("_tests.rs"):
                    continue
                with open(os.path.join(folder, name), errors="replace") as source:
                    for line in source:
                        text = line.strip()
                        if text.startswith("#[cfg(test)]"):
                            break
                        if text and not text.startswith("//"):
                            total += 1
    return total


def load(path):
    cpu = collections.Counter()
    with open(path) as log:
        for line in log:
            parts = line.split()
            if len(parts) < 4 or parts[0] in ("___", "unknown"):
                continue  # rustc's target probes, not crates
            cpu[parts[0]] += float(parts[-2]) + float(parts[-1])
    return cpu


def ours(name):
    return name.startswith("kvpool")


def main(old_path, new_path):
    old, new = load(old_path), load(new_path)
    total = lambda cpu, keep: sum(v for k, v in cpu.items() if keep(k))
    print(f"{'':28} {'old':>8} {'new':>8}")
    print(f"{'all rustc':28} {sum(old.values()):8.1f} {sum(new.values()):8.1f}")
    print(f"{'workspace crates':28} {total(old, ours):8.1f} {total(new, ours):8.1f}")
    theirs = lambda k: not ours(k)
    print(f"{'dependencies':28} {total(old, theirs):8.1f} {total(new, theirs):8.1f}")
    for name in sorted(k for k in set(old) | set(new) if ours(k)):
        print(f"  {name:26} {old.get(name, 0):8.1f} {new.get(name, 0):8.1f}")
    for label, mine, other in (("only new", new, old), ("only old", old, new)):
        only = sorted(((v, k) for k, v in mine.items() if theirs(k) and k not in other), reverse=True)
        listed = ", ".join(f"{k} {v:.1f}" for v, k in only if v >= 0.5)
        print(f"dependencies {label}: {sum(v for v, _ in only):.1f} s ({listed})")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--lines":
        print(production_lines(sys.argv[2]))
    elif len(sys.argv) == 3:
        main(sys.argv[1], sys.argv[2])
    else:
        sys.exit(__doc__)
