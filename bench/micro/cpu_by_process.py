"""CPU share of each busy process over a window (from /proc/PID/stat): where
the cores go while a run is in its steady state.

    python3 bench/micro/cpu_by_process.py DELAY_S WINDOW_S [TOP]
    e.g. (python3 bench/micro/cpu_by_process.py 16 8 &); tensorwire train ... --steps 90

Sleeps DELAY_S, then prints, for the TOP (default 8) processes that used the
most CPU during the next WINDOW_S seconds, their share of one core
(100% = one core busy the whole window) and command line. A probe, not a
benchmark of the suite.
"""
import os
import sys
import time


def snapshot() -> dict:
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline") as f:
                cmd = f.read().replace("\0", " ").strip()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[pid] = (int(fields[11]) + int(fields[12]), cmd or stat[stat.index("(") + 1:stat.rindex(")")])
    return out


def main() -> None:
    delay, window = float(sys.argv[1]), float(sys.argv[2])
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    time.sleep(delay)
    a, t0 = snapshot(), time.monotonic()
    time.sleep(window)
    b, dt = snapshot(), time.monotonic() - t0
    hz = os.sysconf("SC_CLK_TCK")
    used = sorted(((b[p][0] - a[p][0]) / hz / dt, p, b[p][1]) for p in b if p in a and b[p][0] > a[p][0])
    for share, pid, cmd in reversed(used[-top:]):
        print(f"{100 * share:6.1f}%  {pid:>7}  {cmd[:100]}")


if __name__ == "__main__":
    main()
