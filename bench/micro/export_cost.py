"""What exporting memory to a peer costs (issue: registration of a slot or a
published region under 100 us), with two devices in one process.

Per transport, the median over N fresh objects of:
  * exact registration: the first LOOKUP of a newly published block from a
    peer that gets an exact key (tcp: every peer; shm: none, it maps the slab),
    minus a LOOKUP of the same block again (cached key): the registration alone;
  * static slot: creating a receiver slot (allocation, publish, handler);
  * attach: creating its sender (the attach call, a channel back, exact keys);
  * export: the export call a dynamic sender makes for a new source region.

    python3 bench/micro/export_cost.py [N]

Results of 2026-11-25: §5 of isolation_perf_raw.txt, in git history
(git show f381701:bench/results/isolation_perf_raw.txt).
"""
import statistics
import sys
import time


import tensorwire as tw


def us(f):
    t = time.perf_counter()
    f()
    return (time.perf_counter() - t) * 1e6


def run(transport: str, n: int) -> dict:
    with tw.Device(transport=transport) as server, tw.Device(transport=transport) as client:
        ch = client.connect(server.address)
        first, again, slot, attach, export = [], [], [], [], []
        for i in range(n):
            block = server.empty((1024,), "float32", alignment=4096)
            server.publish(f"r{i}", block)
            first.append(us(lambda: ch.lookup(f"r{i}")))
            again.append(us(lambda: ch.lookup(f"r{i}")))
            s = []
            slot.append(us(lambda: s.append(server.static_slot(f"s{i}", (1024,), "float32", depth=2))))
            attach.append(us(lambda: ch.static_sender(f"s{i}")))
            src = client.empty((1024,), "float32", alignment=4096)
            export.append(us(lambda: ch.export_region(src)))
        med = statistics.median
        return {"transport": transport, "lookup_first_us": med(first), "lookup_again_us": med(again),
                "registration_us": med(first) - med(again), "static_slot_us": med(slot),
                "attach_us": med(attach), "export_call_us": med(export)}


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    print(f"# python3 bench/micro/export_cost.py {n}  (median of {n} fresh objects each)")
    print(f"{'transport':>9} {'lookup 1st':>11} {'lookup again':>13} {'registration':>13} "
          f"{'static_slot':>12} {'attach':>9} {'export call':>12}   (us)")
    for transport in ("tcp", "shm"):
        r = run(transport, n)
        print(f"{r['transport']:>9} {r['lookup_first_us']:11.1f} {r['lookup_again_us']:13.1f} "
              f"{r['registration_us']:13.1f} {r['static_slot_us']:12.1f} {r['attach_us']:9.1f} "
              f"{r['export_call_us']:12.1f}")


if __name__ == "__main__":
    main()
