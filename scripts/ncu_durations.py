#!/usr/bin/env python3
"""Kernel durations from an `ncu --csv --metrics gpu__time_duration.sum,launch__grid_size,...` log.

  ncu_durations.py LOG [--last-part N]   the launches of the last 1/N of the log, one line each
                                         (loraprof: the third of three identical layer launches)
  ncu_durations.py LOG --by-name L       every kernel name with its launches, total and per-block
                                         time (L blocks in the profiled range: dev_attention_block)
ncu serialises kernels, so each duration is the kernel alone (no overlap, no PDL).
"""
import csv
import sys

# Optional metric: when the log has it, --by-name prints each kernel's time-weighted DRAM throughput.
DRAM = "dram__throughput.avg.pct_of_peak_sustained_elapsed"


def launches(path):
    rows = [r for r in csv.reader(l for l in open(path) if l.startswith('"'))]
    if not rows:
        sys.exit(f"{path}: no ncu rows")
    head, rows = rows[0], rows[1:]
    ki, mi, vi, ii = head.index("Kernel Name"), head.index("Metric Name"), head.index("Metric Value"), head.index("ID")
    per = {}
    for r in rows:
        per.setdefault(int(r[ii]), {"name": r[ki][:70]})[r[mi]] = r[vi]
    out = []
    for i in sorted(per):
        p = per[i]
        p["us"] = float(p.get("gpu__time_duration.sum", "0").replace(",", "")) / 1000.0
        out.append(p)
    return out


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    ks = launches(sys.argv[1])
    if len(sys.argv) == 4 and sys.argv[2] == "--by-name":
        blocks = int(sys.argv[3])
        names = {}
        for k in ks:
            n = names.setdefault(k["name"], [0, 0.0, k.get("launch__grid_size", "?"), 0.0])
            n[0] += 1
            n[1] += k["us"]
            n[3] += k["us"] * float(k.get(DRAM, "0").replace(",", ""))
        total = sum(k["us"] for k in ks)
        for name, (count, us, grid, dram) in sorted(names.items(), key=lambda kv: -kv[1][1]):
            pct = f"  dram {dram / us:5.1f} %" if us > 0 and dram > 0 else ""
            print(f"  {us / blocks:8.2f} us per block  {count:4d} launches  grid {grid:>6}{pct}  {name}")
        print(f"  {total / blocks:8.2f} us per block in {len(ks)} launches over {blocks} blocks")
        return
    part = int(sys.argv[3]) if len(sys.argv) == 4 and sys.argv[2] == "--last-part" else 1
    last = ks[len(ks) - len(ks) // part:] if part > 1 else ks
    for k in last:
        print(f"  {k['us']:8.2f} us  grid {k.get('launch__grid_size', '?'):>6} block {k.get('launch__block_size', '?'):>4} "
              f"regs {k.get('launch__registers_per_thread', '?'):>4}  {k['name']}")
    print(f"  {sum(k['us'] for k in last):8.2f} us in {len(last)} kernels")


main()
