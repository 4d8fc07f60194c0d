#!/usr/bin/env python3
"""The hottest source lines of an `ncu --page source --csv --print-source cuda` export.

Usage: ncu_source_top.py FILE.csv [N]. Prints the header it found, then the N lines (default 40)
with the most warp stall samples and the N with the most instructions executed, each with its
share of the kernel's total. The CSV's column names vary between ncu versions, so the columns are
found by substring ("Source", "Warp Stall Sampling (All", "Instructions Executed")."""
import csv
import sys


def main():
    path = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    lines = [l for l in open(path, errors="replace")]
    start = next((i for i, l in enumerate(lines) if l.startswith('"') and "Source" in l), None)
    if start is None:
        print("no CSV header with a Source column; the export began:")
        print("".join(lines[:20]))
        return 1
    rows = list(csv.reader(lines[start:]))
    head, rows = rows[0], rows[1:]
    print("columns:", head)

    def col(*keys):
        for k in keys:
            for i, h in enumerate(head):
                if k in h:
                    return i
        return None

    src, line_no = col("Source"), col("# ", "Line")
    stall, inst = col("Warp Stall Sampling (All", "Sampling Samples"), col("Instructions Executed")

    def num(r, i):
        if i is None or i >= len(r):
            return 0.0
        try:
            return float(r[i].replace(",", ""))
        except ValueError:
            return 0.0

    for name, i in (("warp stall samples", stall), ("instructions executed", inst)):
        if i is None:
            print(f"no {name} column")
            continue
        total = sum(num(r, i) for r in rows) or 1.0
        print(f"\n== top {n} lines by {name} (total {total:.0f})")
        for r in sorted(rows, key=lambda r: -num(r, i))[:n]:
            where = r[line_no] if line_no is not None and line_no < len(r) else "?"
            text = r[src].strip()[:110] if src is not None and src < len(r) else ""
            print(f"{100 * num(r, i) / total:6.2f} %  {where:>6}  {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
